"""Bad input, every command and the Python runtime API: a clear one-line refusal, nothing else.

For each case: a non-zero exit (or the documented exception), exactly one line naming what was
wrong, no traceback, no file outside the command's output changed (the workspace, the exports it
reads), and no temporary file or directory left behind.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from edgemem.cli import main
from edgemem.errors import ConfigError, EdgememError
from edgemem.manifest import load as load_manifest
from edgemem.runtime import Engine
from edgemem.runtime.errors import BatchError, StateFileError, TokenError
from edgemem.runtime.state import encode_checkpoint

BIG = 2**64


@pytest.fixture(scope="session")
def workspace(small_exports, tmp_path_factory) -> Path:
    """A user's folder: a source tree, a plain file, an export of their own, a checkpoint, broken copies."""
    from edgemem.models import build, save_checkpoint

    root = tmp_path_factory.mktemp("workspace")
    (root / "src").mkdir()
    (root / "src" / "main.py").write_text("print('precious')\n")
    (root / "afile").write_text("not a directory\n")
    (root / "adir").mkdir()
    shutil.copytree(small_exports["linear"], root / "work" / "e")
    save_checkpoint(build("linear", seed=0, d_model=16, n_layers=1), root / "model.safetensors")
    data = (root / "model.safetensors").read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    header["__metadata__"]["config"] = "{not json"
    raw = json.dumps(header).encode().ljust(size)
    (root / "notjson.safetensors").write_bytes(data[:8] + raw + data[8 + size :])
    (root / "garbage.safetensors").write_bytes(b"\x00" * 5)
    for name, edit in {
        "novocab": lambda m: m["config"].pop("vocab_size"),
        "baddtype": lambda m: m["state"][0].update(dtype="complex7"),
        "badshape": lambda m: m["state"][0].update(shape=["batch", -3]),
        "notjson": None,
    }.items():
        target = root / "broken" / name
        shutil.copytree(small_exports["linear"], target)
        if edit is None:
            (target / "edgemem.json").write_text("{ not json")
            continue
        manifest = json.loads((target / "edgemem.json").read_text())
        edit(manifest)
        (target / "edgemem.json").write_text(json.dumps(manifest))
    manifest = load_manifest(small_exports["linear"])
    engine = Engine.load(small_exports["linear"], threads=1)
    state = engine.new_stream().state_dict()
    nan_state = {k: np.full_like(v, np.nan) for k, v in state.items()}
    (root / "nan.state").write_bytes(encode_checkpoint(manifest, nan_state, 3, None))  # checksum re-recorded
    (root / "nanlogits.state").write_bytes(
        encode_checkpoint(manifest, state, 3, np.full(manifest.vocab_size, np.inf, np.float32))
    )
    (root / "neg.state").write_bytes(
        encode_checkpoint(manifest, state, 0, None).replace(b'"position":"0"', b'"position":"-1"')
    )
    other = Engine.load(small_exports["deltanet"], threads=1).new_stream()
    other.save(root / "other.state")
    good = engine.new_stream()
    good.prefill(b"abc")
    flipped = bytearray(encode_checkpoint(manifest, good.state_dict(), 3, good.logits))
    flipped[-5] ^= 0xFF
    (root / "flipped.state").write_bytes(bytes(flipped))
    return root


def _snapshot(*roots: Path) -> dict[str, tuple[int, int]]:
    files = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                path = Path(dirpath, name)
                st = path.lstat()
                files[str(path)] = (st.st_size, st.st_mtime_ns if path.is_file() else 0)
    return files


def _leftovers(*roots: Path) -> list[str]:
    marks = (".tmp-", ".old-", ".edgemem-probe-", ".tmp")
    return [str(p) for root in roots for p in root.rglob(".*") if any(m in p.name for m in marks)]


# (id, argv, what the one error line must say). In argv: {e}: the workspace's own export; {X}: the small
# export of preset X (read only); {ws}: the workspace.
S = "--set"
SET_CASES = [
    ("norm_eps", "nan", "norm_eps must be a finite number"),
    ("norm_eps", "inf", "norm_eps must be a finite"),
    ("norm_eps", "-1", "norm_eps must be positive"),
    ("norm_eps", "0", "norm_eps must be positive"),
    ("d_model", "0", "d_model must be positive"),
    ("d_model", "-4", "d_model must be positive"),
    ("d_model", "1000000", "would need about .* of memory"),
    ("d_model", "1.5", "d_model must be of type int"),
    ("d_model", "wide", "d_model must be of type int"),
    ("n_layers", "0", "n_layers must be positive"),
    ("n_layers", "1000000000", "would need about .* of memory"),
    ("mlp_hidden", "-1", "mlp_hidden must be ≥ 0"),
    ("vocab_size", "0", "vocab_size must be positive"),
    ("num_heads", "0", "num_heads must be positive"),
    ("num_heads", "-4", "num_heads must be positive"),
    ("conv_size", "-1", "conv_size must be ≥ 0"),
    ("bogus", "1", "unknown override 'bogus'"),
    ("nokey", None, "--set expects key=value"),
]
TITANS_SET_CASES = [
    ("max_lr", "inf", "max_lr must be a finite"),
    ("max_lr", "nan", "max_lr must be a finite"),
    ("max_lr", "-1", "max_lr must be positive"),
    ("chunk_size", "0", "chunk_size must be positive"),
    ("depth", "0", "depth must be positive"),
]


def _set(key: str, value: str | None) -> list[str]:
    return [S, key if value is None else f"{key}={value}"]


CLI_CASES: list[tuple[str, list[str], str]] = []
for arch, sets in (("deltanet", SET_CASES), ("titans-mac", TITANS_SET_CASES)):
    for key, value, message in sets:
        CLI_CASES.append(
            (
                f"export-set-{arch}-{key}={value}",
                ["export", "--arch", arch, *_set(key, value), "--out", "{ws}/new"],
                message,
            )
        )
        CLI_CASES.append(
            (
                f"train-set-{arch}-{key}={value}",
                [
                    "train",
                    "--arch",
                    arch,
                    "--task",
                    "mqar",
                    "--steps",
                    "1",
                    *_set(key, value),
                    "--out",
                    "{ws}/new.safetensors",
                ],
                message,
            )
        )
CLI_CASES += [
    # --force and --out: nothing but an earlier export is ever replaced
    (
        "export-force-source-tree",
        ["export", "--arch", "linear", "--out", "{ws}/src", "--force"],
        "edgemem did not write",
    ),
    ("export-nonempty-no-force", ["export", "--arch", "linear", "--out", "{ws}/work/e"], "not empty; pass --force"),
    ("export-out-dot", ["export", "--arch", "linear", "--out", ".", "--force"], "current directory"),
    ("export-out-parent-of-cwd", ["export", "--arch", "linear", "--out", "..", "--force"], "current directory"),
    ("export-out-file", ["export", "--arch", "linear", "--out", "{ws}/afile"], "is a file|not a directory"),
    ("export-out-under-file", ["export", "--arch", "linear", "--out", "{ws}/afile/sub"], "is a file, not a directory"),
    ("export-out-proc", ["export", "--arch", "linear", "--out", "/proc/x"], "cannot write in /proc"),
    (
        "export-force-holds-checkpoint",
        ["export", "--checkpoint", "{ws}/model.safetensors", "--out", "{ws}", "--force"],
        "current directory|own input",
    ),
    (
        "export-out-is-checkpoint-folder",
        ["export", "--checkpoint", "{ws}/work/e/edgemem.json", "--out", "{ws}/work", "--force"],
        "own input|edgemem did not write",
    ),
    (
        "export-target-twice",
        ["export", "--arch", "linear", "--target", "ort,ort", "--out", "{ws}/new"],
        "targets repeat",
    ),
    ("export-target-unknown", ["export", "--arch", "linear", "--target", "tpu", "--out", "{ws}/new"], "unknown target"),
    ("export-target-empty", ["export", "--arch", "linear", "--target", ",", "--out", "{ws}/new"], "unknown target"),
    (
        "export-seed-64bit",
        ["export", "--arch", "linear", "--seed", str(BIG), "--out", "{ws}/new"],
        "--seed must be an integer",
    ),
    (
        "export-seed-negative",
        ["export", "--arch", "linear", "--seed", "-1", "--out", "{ws}/new"],
        "--seed must be an integer",
    ),
    (
        "export-seed-text",
        ["export", "--arch", "linear", "--seed", "x", "--out", "{ws}/new"],
        "'x' is not a valid integer",
    ),
    ("export-no-arch", ["export", "--out", "{ws}/new"], "give --arch"),
    ("export-unknown-arch", ["export", "--arch", "mamba", "--out", "{ws}/new"], "unknown arch 'mamba'"),
    ("export-missing-recipe", ["export", "--arch", "{ws}/none.toml", "--out", "{ws}/new"], "does not exist"),
    (
        "export-bad-dtype",
        ["export", "--arch", "linear", "--dtype", "int8", "--out", "{ws}/new"],
        "'int8' is not one of",
    ),
    (
        "export-bf16-onnxruntime",
        ["export", "--arch", "linear", "--dtype", "bf16", "--out", "{ws}/new"],
        "dtype bf16 exports the trt target only",
    ),
    (
        "export-checkpoint-missing",
        ["export", "--checkpoint", "{ws}/none.safetensors", "--out", "{ws}/new"],
        "cannot read checkpoint",
    ),
    (
        "export-checkpoint-garbage",
        ["export", "--checkpoint", "{ws}/garbage.safetensors", "--out", "{ws}/new"],
        "cannot read checkpoint",
    ),
    (
        "export-checkpoint-config-not-json",
        ["export", "--checkpoint", "{ws}/notjson.safetensors", "--out", "{ws}/new"],
        "does not fit its own config",
    ),
    (
        "export-checkpoint-with-set",
        ["export", "--checkpoint", "{ws}/model.safetensors", "--set", "d_model=8", "--out", "{ws}/new"],
        "--set cannot change",
    ),
    (
        "export-checkpoint-other-arch",
        ["export", "--checkpoint", "{ws}/model.safetensors", "--arch", "deltanet", "--out", "{ws}/new"],
        "is a checkpoint of 'linear'",
    ),
    ("export-no-out", ["export", "--arch", "linear"], "Missing option '--out'"),
    # calibrate: never its own input
    ("calibrate-out-is-input", ["calibrate", "{ws}/work/e", "--out", "{ws}/work/e", "--force"], "own input"),
    ("calibrate-out-holds-input", ["calibrate", "{ws}/work/e", "--out", "{ws}/work", "--force"], "own input"),
    ("calibrate-out-inside-input", ["calibrate", "{ws}/work/e", "--out", "{ws}/work/e/q"], "own input"),
    (
        "calibrate-force-source-tree",
        ["calibrate", "{ws}/work/e", "--out", "{ws}/src", "--force"],
        "edgemem did not write",
    ),
    ("calibrate-out-proc", ["calibrate", "{ws}/work/e", "--out", "/proc/x"], "cannot write in /proc"),
    (
        "calibrate-report-proc",
        ["calibrate", "{ws}/work/e", "--out", "{ws}/q", "--report", "/proc/x.json"],
        "--report /proc/x.json: cannot write",
    ),
    (
        "calibrate-report-under-file",
        ["calibrate", "{ws}/work/e", "--out", "{ws}/q", "--report", "{ws}/afile/r.json"],
        "is a file, not a directory",
    ),
    (
        "calibrate-report-is-dir",
        ["calibrate", "{ws}/work/e", "--out", "{ws}/q", "--report", "{ws}/adir"],
        "is a directory",
    ),
    ("calibrate-plot-proc", ["calibrate", "{ws}/work/e", "--out", "{ws}/q", "--plot", "/proc/x.png"], "cannot write"),
    ("calibrate-method", ["calibrate", "{ws}/work/e", "--method", "int3", "--out", "{ws}/q"], "'int3' is not one of"),
    ("calibrate-recipe", ["calibrate", "{ws}/work/e", "--recipe", "nosuch", "--out", "{ws}/q"], "nosuch"),
    ("calibrate-threads-0", ["calibrate", "{ws}/work/e", "--threads", "0", "--out", "{ws}/q"], "0 is not in the range"),
    ("calibrate-not-export", ["calibrate", "{ws}/src", "--out", "{ws}/q"], "not an edgemem export"),
    ("calibrate-missing", ["calibrate", "{ws}/none", "--out", "{ws}/q"], "not an edgemem export"),
    # verify
    ("verify-threads-negative", ["verify", "{linear}", "--threads", "-1"], "-1 is not in the range"),
    ("verify-threads-0", ["verify", "{linear}", "--threads", "0"], "0 is not in the range"),
    ("verify-not-export", ["verify", "{ws}/src"], "not an edgemem export"),
    ("verify-manifest-no-vocab", ["verify", "{ws}/broken/novocab"], "vocab_size must be a positive integer"),
    ("verify-manifest-bad-dtype", ["verify", "{ws}/broken/baddtype"], "dtype 'complex7'"),
    ("verify-manifest-bad-shape", ["verify", "{ws}/broken/badshape"], "non-negative sizes"),
    ("verify-manifest-not-json", ["verify", "{ws}/broken/notjson"], "not a valid edgemem manifest"),
    (
        "verify-checkpoint-garbage",
        ["verify", "{linear}", "--checkpoint", "{ws}/garbage.safetensors"],
        "cannot read checkpoint",
    ),
    # run
    (
        "run-temperature-inf",
        ["run", "{linear}", "--prompt", "a", "--temperature", "inf"],
        "--temperature must be a finite",
    ),
    ("run-temperature-nan", ["run", "{linear}", "--prompt", "a", "--temperature", "nan"], "temperature"),
    ("run-temperature-negative", ["run", "{linear}", "--prompt", "a", "--temperature", "-1"], "not in the range"),
    ("run-top-p-0", ["run", "{linear}", "--prompt", "a", "--top-p", "0"], "not in the range"),
    ("run-top-p-1.5", ["run", "{linear}", "--prompt", "a", "--top-p", "1.5"], "not in the range"),
    ("run-top-p-nan", ["run", "{linear}", "--prompt", "a", "--top-p", "nan"], "top"),
    ("run-top-k-0", ["run", "{linear}", "--prompt", "a", "--top-k", "0"], "not in the range"),
    ("run-seed-negative", ["run", "{linear}", "--prompt", "a", "--seed", "-1"], "--seed must be an integer"),
    ("run-seed-64bit", ["run", "{linear}", "--prompt", "a", "--seed", str(BIG)], "--seed must be an integer"),
    ("run-max-new-negative", ["run", "{linear}", "--prompt", "a", "--max-new-tokens", "-1"], "not in the range"),
    ("run-threads-0", ["run", "{linear}", "--prompt", "a", "--threads", "0"], "not in the range"),
    ("run-target-unknown", ["run", "{linear}", "--prompt", "a", "--target", "tpu"], "tpu"),
    ("run-backend-unknown", ["run", "{linear}", "--prompt", "a", "--backend", "tpu"], "'tpu' is not one of"),
    ("run-not-export", ["run", "{ws}/src", "--prompt", "a"], "not an edgemem export"),
    ("run-bidirectional", ["run", "{longformer-encoder}", "--prompt", "a"], "has no step graph"),
    ("run-fresh-no-prompt", ["run", "{linear}", "--max-new-tokens", "2"], "nothing to continue from"),
    ("run-load-missing", ["run", "{linear}", "--load-state", "{ws}/none.state"], "no such state file"),
    ("run-load-garbage", ["run", "{linear}", "--load-state", "{ws}/garbage.safetensors"], "not a valid edgemem state"),
    ("run-load-nan-state", ["run", "{linear}", "--load-state", "{ws}/nan.state"], "NaN or infinite"),
    ("run-load-inf-logits", ["run", "{linear}", "--load-state", "{ws}/nanlogits.state"], "NaN or infinite"),
    ("run-load-negative-position", ["run", "{linear}", "--load-state", "{ws}/neg.state"], "corrupt|invalid position"),
    ("run-load-other-model", ["run", "{linear}", "--load-state", "{ws}/other.state"], "saved from another model"),
    ("run-load-flipped", ["run", "{linear}", "--load-state", "{ws}/flipped.state"], "corrupt"),
    ("run-load-export-dir", ["run", "{linear}", "--load-state", "{ws}/adir"], "(?i)is a directory"),
    (
        "run-save-proc",
        ["run", "{linear}", "--prompt", "a", "--save-state", "/proc/x.state"],
        "--save-state /proc/x.state",
    ),
    ("run-save-under-file", ["run", "{linear}", "--prompt", "a", "--save-state", "{ws}/afile/x"], "is a file, not"),
    ("run-save-dir", ["run", "{linear}", "--prompt", "a", "--save-state", "{ws}/adir"], "is a directory"),
    # bench
    ("bench-positions-huge", ["bench", "{linear}", "--positions", "1000000000000", "--no-eager"], "would need about"),
    ("bench-positions-negative", ["bench", "{linear}", "--positions", "-1", "--no-eager"], "non-negative integers"),
    ("bench-positions-text", ["bench", "{linear}", "--positions", "lots", "--no-eager"], "comma-separated integers"),
    ("bench-positions-float", ["bench", "{linear}", "--positions", "1e12", "--no-eager"], "comma-separated integers"),
    ("bench-positions-empty", ["bench", "{linear}", "--positions", ",", "--no-eager"], "non-negative integers"),
    ("bench-batch-0", ["bench", "{linear}", "--batch", "0", "--no-eager"], "at least 1"),
    ("bench-steps-1", ["bench", "{linear}", "--steps", "1", "--no-eager"], "not in the range"),
    (
        "bench-time-limit-inf",
        ["bench", "{linear}", "--time-limit", "inf", "--no-eager"],
        "--time-limit must be a finite",
    ),
    ("bench-time-limit-0", ["bench", "{linear}", "--time-limit", "0", "--no-eager"], "--time-limit must be positive"),
    (
        "bench-time-limit-nan",
        ["bench", "{linear}", "--time-limit", "nan", "--no-eager"],
        "--time-limit must be a finite",
    ),
    ("bench-threads-0", ["bench", "{linear}", "--threads", "0", "--no-eager"], "not in the range"),
    ("bench-chunk-0", ["bench", "{linear}", "--chunk-size", "0", "--no-eager"], "not in the range"),
    ("bench-json-proc", ["bench", "{linear}", "--json", "/proc/x.json", "--no-eager"], "--json /proc/x.json"),
    ("bench-json-under-file", ["bench", "{linear}", "--json", "{ws}/afile/x.json", "--no-eager"], "is a file, not"),
    ("bench-json-dir", ["bench", "{linear}", "--json", "{ws}/adir", "--no-eager"], "is a directory"),
    ("bench-plot-proc", ["bench", "{linear}", "--plot", "/proc/x.png", "--no-eager"], "matplotlib|--plot /proc/x.png"),
    (
        "bench-not-export",
        ["bench", "{ws}/src", "--no-eager", "--positions", "10", "--batch", "1"],
        "not an edgemem export",
    ),
    # train
    (
        "train-bidirectional-on-bytes",
        ["train", "--arch", "longformer-encoder", "--task", "bytes", "--steps", "1", "--out", "{ws}/new.safetensors"],
        "bidirectional",
    ),
    (
        "train-bidirectional-on-mqar",
        ["train", "--arch", "longformer-encoder", "--task", "mqar", "--steps", "1", "--out", "{ws}/new.safetensors"],
        "bidirectional",
    ),
    (
        "train-unknown-task",
        ["train", "--arch", "linear", "--task", "chess", "--out", "{ws}/new.safetensors"],
        "unknown task",
    ),
    (
        "train-unknown-arch",
        ["train", "--arch", "mamba", "--task", "mqar", "--out", "{ws}/new.safetensors"],
        "unknown arch",
    ),
    ("train-steps-0", ["train", "--arch", "linear", "--task", "mqar", "--steps", "0"], "not in the range"),
    ("train-batch-0", ["train", "--arch", "linear", "--task", "mqar", "--batch", "0"], "not in the range"),
    ("train-lr-inf", ["train", "--arch", "linear", "--task", "mqar", "--lr", "inf"], "--lr must be a finite"),
    ("train-lr-nan", ["train", "--arch", "linear", "--task", "mqar", "--lr", "nan"], "--lr must be a finite"),
    ("train-lr-0", ["train", "--arch", "linear", "--task", "mqar", "--lr", "0"], "--lr must be positive"),
    ("train-lr-negative", ["train", "--arch", "linear", "--task", "mqar", "--lr", "-1"], "--lr must be positive"),
    ("train-threads-0", ["train", "--arch", "linear", "--task", "mqar", "--threads", "0"], "not in the range"),
    (
        "train-seed-64bit",
        ["train", "--arch", "linear", "--task", "mqar", "--seed", str(BIG)],
        "--seed must be an integer",
    ),
    (
        "train-seed-huge",
        ["train", "--arch", "linear", "--task", "mqar", "--seed", str(2**80)],
        "--seed must be an integer",
    ),
    (
        "train-out-dir",
        ["train", "--arch", "linear", "--task", "mqar", "--steps", "1", "--out", "{ws}/adir"],
        "is a directory",
    ),
    (
        "train-out-under-file",
        ["train", "--arch", "linear", "--task", "mqar", "--steps", "1", "--out", "{ws}/afile/x"],
        "is a file, not",
    ),
    (
        "train-out-proc",
        ["train", "--arch", "linear", "--task", "mqar", "--steps", "1", "--out", "/proc/x.safetensors"],
        "cannot write in /proc",
    ),
    (
        "train-task-set-length-0",
        ["train", "--arch", "linear", "--task", "bytes", "--task-set", "length=0", "--out", "{ws}/new.safetensors"],
        "length must be positive",
    ),
    (
        "train-task-set-pairs-0",
        ["train", "--arch", "linear", "--task", "mqar", "--task-set", "pairs=0", "--out", "{ws}/new.safetensors"],
        "pairs must be in",
    ),
    (
        "train-task-set-unknown",
        ["train", "--arch", "linear", "--task", "mqar", "--task-set", "depth=1", "--out", "{ws}/new.safetensors"],
        "unknown parameter 'depth'",
    ),
    (
        "train-task-set-float",
        ["train", "--arch", "linear", "--task", "mqar", "--task-set", "pairs=1.5", "--out", "{ws}/new.safetensors"],
        "must be an integer",
    ),
    (
        "train-task-set-malformed",
        ["train", "--arch", "linear", "--task", "mqar", "--task-set", "pairs", "--out", "{ws}/new.safetensors"],
        "--task-set expects key=value",
    ),
    (
        "train-device",
        [
            "train",
            "--arch",
            "linear",
            "--task",
            "mqar",
            "--steps",
            "1",
            "--device",
            "tpu",
            "--out",
            "{ws}/new.safetensors",
        ],
        "cannot train on device",
    ),
    # eval
    (
        "eval-length-huge",
        ["eval", "--checkpoint", "{ws}/model.safetensors", "--task", "bytes", "--length", "1000000000"],
        "would need about",
    ),
    (
        "eval-length-0",
        ["eval", "--checkpoint", "{ws}/model.safetensors", "--task", "bytes", "--length", "0"],
        "not in the range",
    ),
    (
        "eval-batch-0",
        ["eval", "--checkpoint", "{ws}/model.safetensors", "--task", "mqar", "--batch", "0"],
        "not in the range",
    ),
    (
        "eval-seed-negative",
        ["eval", "--checkpoint", "{ws}/model.safetensors", "--task", "mqar", "--seed", "-1"],
        "--seed must be an integer",
    ),
    (
        "eval-threads-0",
        ["eval", "--checkpoint", "{ws}/model.safetensors", "--task", "mqar", "--threads", "0"],
        "not in the range",
    ),
    ("eval-unknown-task", ["eval", "--checkpoint", "{ws}/model.safetensors", "--task", "chess"], "unknown task"),
    ("eval-checkpoint-missing", ["eval", "--checkpoint", "{ws}/none.safetensors", "--task", "mqar"], "cannot read"),
    ("eval-checkpoint-garbage", ["eval", "--checkpoint", "{ws}/garbage.safetensors", "--task", "mqar"], "cannot read"),
    (
        "eval-checkpoint-not-json",
        ["eval", "--checkpoint", "{ws}/notjson.safetensors", "--task", "mqar"],
        "does not fit its own config",
    ),
    (
        "eval-checkpoint-is-state",
        ["eval", "--checkpoint", "{ws}/other.state", "--task", "mqar"],
        "not an edgemem checkpoint",
    ),
    (
        "eval-task-set-unknown",
        ["eval", "--checkpoint", "{ws}/model.safetensors", "--task", "copy", "--task-set", "pairs=2"],
        "unknown parameter 'pairs'",
    ),
    # build, triton, serve, archs
    ("build-missing-dir", ["build", "{ws}/none"], "does not exist"),
    ("build-max-batch-0", ["build", "{linear}", "--max-batch", "0"], "not in the range"),
    ("build-max-sequence-0", ["build", "{linear}", "--max-sequence", "0"], "not in the range"),
    ("triton-max-live-0", ["triton", "{linear}", "--out", "{ws}/repo", "--max-live", "0"], "not in the range"),
    ("triton-idle-inf", ["triton", "{linear}", "--out", "{ws}/repo", "--idle-seconds", "inf"], "must be a finite"),
    ("triton-idle-nan", ["triton", "{linear}", "--out", "{ws}/repo", "--idle-seconds", "nan"], "must be a finite"),
    ("triton-idle-0", ["triton", "{linear}", "--out", "{ws}/repo", "--idle-seconds", "0"], "must be positive"),
    ("triton-threads-0", ["triton", "{linear}", "--out", "{ws}/repo", "--threads", "0"], "not in the range"),
    ("triton-batch-0", ["triton", "{linear}", "--out", "{ws}/repo", "--max-batch-size", "0"], "not in the range"),
    ("triton-missing-dir", ["triton", "{ws}/none", "--out", "{ws}/repo"], "does not exist"),
    ("triton-nonempty-out", ["triton", "{linear}", "--out", "{ws}/src"], "not empty"),
    ("triton-force-source-tree", ["triton", "{linear}", "--out", "{ws}/src", "--force"], "edgemem did not write"),
    ("triton-force-own-input", ["triton", "{ws}/work/e", "--out", "{ws}/work", "--force"], "own input"),
    ("triton-out-proc", ["triton", "{linear}", "--out", "/proc/x"], "cannot write in /proc"),
    ("serve-missing-repo", ["serve", "{ws}/none"], "does not exist"),
    ("serve-port-0", ["serve", "{ws}/adir", "--http-port", "0"], "not in the range"),
    ("serve-port-huge", ["serve", "{ws}/adir", "--grpc-port", "70000"], "not in the range"),
    ("serve-timeout-inf", ["serve", "{ws}/adir", "--timeout", "inf"], "--timeout must be a finite"),
    ("serve-timeout-negative", ["serve", "{ws}/adir", "--timeout", "-5"], "--timeout must be positive"),
    ("archs-unknown-option", ["archs", "--yaml"], "No such option"),
    ("unknown-command", ["frobnicate"], "No such command"),
]


@pytest.mark.parametrize("argv, message", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_command_refuses_bad_input(workspace, small_exports, monkeypatch, argv, message):
    import re

    names = {k: str(v) for k, v in small_exports.items()}
    argv = [a.replace("{ws}", str(workspace)).format(**names) if "{" in a else a for a in argv]
    watched = [workspace, *{p.parent for p in small_exports.values()}]
    before = _snapshot(*watched)
    monkeypatch.chdir(workspace / "adir")
    result = CliRunner().invoke(main, argv)
    assert result.exit_code not in (0, None), result.output
    assert isinstance(result.exception, SystemExit), f"{type(result.exception).__name__}: {result.exception}"
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.lower().startswith("error")]
    assert len(errors) == 1, result.output
    assert re.search(message, errors[0]), result.output
    assert _snapshot(*watched) == before
    assert not _leftovers(*watched)


def _state(engine: Engine) -> dict[str, np.ndarray]:
    return engine.new_stream().state_dict()


def _nan(engine: Engine) -> dict[str, np.ndarray]:
    return {k: np.full_like(v, np.nan) for k, v in _state(engine).items()}


def _inf(engine: Engine) -> dict[str, np.ndarray]:
    return {k: np.full_like(v, np.inf) for k, v in _state(engine).items()}


def _missing(engine: Engine) -> dict[str, np.ndarray]:
    return dict(list(_state(engine).items())[1:])


def _lists(engine: Engine) -> dict:
    return {k: v.tolist() for k, v in _state(engine).items()}


def _wrong_dtype(engine: Engine) -> dict:
    return {k: v.astype(np.float64) for k, v in _state(engine).items()}


def _gen(**kw):
    return lambda e, ws: e.new_stream().generate(b"a", **{"max_new_tokens": 2, **kw})


API_CASES = [
    (
        "from-state-position-negative",
        lambda e, ws: e.stream_from_state(_state(e), position=-1),
        ConfigError,
        "position",
    ),
    ("from-state-position-float", lambda e, ws: e.stream_from_state(_state(e), position=1.5), ConfigError, "position"),
    ("from-state-position-bool", lambda e, ws: e.stream_from_state(_state(e), position=True), ConfigError, "position"),
    ("from-state-nan", lambda e, ws: e.stream_from_state(_nan(e)), StateFileError, "NaN or infinite"),
    ("from-state-inf", lambda e, ws: e.stream_from_state(_inf(e)), StateFileError, "NaN or infinite"),
    ("from-state-missing", lambda e, ws: e.stream_from_state(_missing(e)), StateFileError, "missing"),
    ("from-state-lists", lambda e, ws: e.stream_from_state(_lists(e)), StateFileError, "numpy array"),
    ("from-state-float64", lambda e, ws: e.stream_from_state(_wrong_dtype(e)), StateFileError, "expected float32"),
    (
        "from-state-nan-logits",
        lambda e, ws: e.stream_from_state(_state(e), logits=np.full(e.vocab_size, np.nan)),
        StateFileError,
        "finite",
    ),
    (
        "from-state-short-logits",
        lambda e, ws: e.stream_from_state(_state(e), logits=np.zeros(3)),
        StateFileError,
        "logits",
    ),
    ("prefill-chunk-0", lambda e, ws: e.new_stream().prefill(b"abc", chunk_size=0), ConfigError, "chunk_size"),
    ("prefill-chunk-negative", lambda e, ws: e.new_stream().prefill(b"abc", chunk_size=-2), ConfigError, "chunk_size"),
    ("prefill-chunk-float", lambda e, ws: e.new_stream().prefill(b"abc", chunk_size=2.0), ConfigError, "chunk_size"),
    ("prefill-empty", lambda e, ws: e.new_stream().prefill(b""), TokenError, "empty"),
    ("prefill-text", lambda e, ws: e.new_stream().prefill("abc"), TokenError, "text"),
    ("prefill-out-of-vocab", lambda e, ws: e.new_stream().prefill([1, 256]), TokenError, "outside the vocabulary"),
    ("prefill-negative-token", lambda e, ws: e.new_stream().prefill([-1]), TokenError, "outside the vocabulary"),
    ("prefill-2d", lambda e, ws: e.new_stream().prefill([[1, 2]]), TokenError, "1-D"),
    ("prefill-floats", lambda e, ws: e.new_stream().prefill([1.5]), TokenError, "integer"),
    ("step-out-of-vocab", lambda e, ws: e.new_stream().step(256), TokenError, "outside the vocabulary"),
    ("step-negative", lambda e, ws: e.new_stream().step(-1), TokenError, "outside the vocabulary"),
    ("step-float", lambda e, ws: e.new_stream().step(1.5), TokenError, "integer"),
    ("step-bool", lambda e, ws: e.new_stream().step(True), TokenError, "integer"),
    ("generate-temperature-inf", _gen(temperature=math.inf), ConfigError, "temperature"),
    ("generate-temperature-nan", _gen(temperature=math.nan), ConfigError, "temperature"),
    ("generate-temperature-negative", _gen(temperature=-1.0), ConfigError, "temperature"),
    ("generate-seed-negative", _gen(temperature=1.0, seed=-1), ConfigError, "seed"),
    ("generate-seed-64bit", _gen(temperature=1.0, seed=BIG), ConfigError, "seed"),
    ("generate-top-p-0", _gen(temperature=1.0, top_p=0.0), ConfigError, "top_p"),
    ("generate-top-k-0", _gen(temperature=1.0, top_k=0), ConfigError, "top_k"),
    ("generate-max-new-negative", _gen(max_new_tokens=-1), ConfigError, "max_new_tokens"),
    ("generate-fresh-empty", lambda e, ws: e.new_stream().generate(b"", 2), TokenError, "nothing to continue"),
    ("load-backend", lambda e, ws: Engine.load(e.directory, backend="tpu"), EdgememError, "unknown backend"),
    ("load-chunk-0", lambda e, ws: Engine.load(e.directory, chunk_size=0), ConfigError, "chunk_size"),
    ("load-target", lambda e, ws: Engine.load(e.directory, target="tpu"), EdgememError, "tpu"),
    ("load-engines-on-ort", lambda e, ws: Engine.load(e.directory, engines=ws), ConfigError, "backend 'trt'"),
    ("load-missing", lambda e, ws: Engine.load(ws / "none"), EdgememError, "not an edgemem export"),
    ("load-no-vocab", lambda e, ws: Engine.load(ws / "broken" / "novocab"), EdgememError, "vocab_size"),
    ("load-bad-dtype", lambda e, ws: Engine.load(ws / "broken" / "baddtype"), EdgememError, "complex7"),
    ("load-stream-missing", lambda e, ws: e.load_stream(ws / "none.state"), StateFileError, "no such state file"),
    ("load-stream-dir", lambda e, ws: e.load_stream(ws / "adir"), StateFileError, "cannot read"),
    ("load-stream-nan", lambda e, ws: e.load_stream(ws / "nan.state"), StateFileError, "NaN or infinite"),
    ("load-stream-inf-logits", lambda e, ws: e.load_stream(ws / "nanlogits.state"), StateFileError, "NaN or infinite"),
    ("load-stream-other", lambda e, ws: e.load_stream(ws / "other.state"), StateFileError, "another model"),
    ("load-stream-flipped", lambda e, ws: e.load_stream(ws / "flipped.state"), StateFileError, "corrupt"),
    ("load-stream-garbage", lambda e, ws: e.load_stream(ws / "garbage.safetensors"), StateFileError, "not a valid"),
    ("save-to-dir", lambda e, ws: e.new_stream().save(ws / "adir"), StateFileError, "is a directory"),
    ("save-under-file", lambda e, ws: e.new_stream().save(ws / "afile" / "x.state"), EdgememError, "afile"),
    ("batch-empty", lambda e, ws: e.step_batch([], []), BatchError, "at least one stream"),
    (
        "batch-twice",
        lambda e, ws: (lambda s: e.step_batch([s, s], [1, 2]))(e.new_stream()),
        BatchError,
        "more than once",
    ),
    ("batch-count", lambda e, ws: e.step_batch([e.new_stream()], [1, 2]), BatchError, "1 streams but 2"),
    ("batch-foreign", lambda e, ws: e.step_batch([object()], [1]), BatchError, "from this engine"),
    ("batch-out-of-vocab", lambda e, ws: e.step_batch([e.new_stream()], [999]), TokenError, "outside the vocabulary"),
]


@pytest.fixture(scope="module")
def engine(small_exports) -> Engine:
    return Engine.load(small_exports["linear"], threads=1)


@pytest.mark.parametrize("call, error, message", [c[1:] for c in API_CASES], ids=[c[0] for c in API_CASES])
def test_runtime_api_refuses_bad_input(engine, workspace, call, error, message):
    before = _snapshot(workspace)
    with pytest.raises(error, match=message) as caught:
        call(engine, workspace)
    assert "\n" not in str(caught.value)
    assert _snapshot(workspace) == before
    assert not _leftovers(workspace)


def test_corpus_is_large():
    assert len(CLI_CASES) + len(API_CASES) >= 150

"""Nothing silent (issue 29, the classes after data loss): sizes that cannot fit, broken or hand-edited exports,
NaN and foreign tokenizers, missing extras, unbounded options, waits without end, and the commands added since
(export --hf, --max-length, linearize, train --init, calibrate --method int4, triton, serve, build, the runtime API).
Each case: one error line naming the problem, nothing written, no traceback."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from edgemem.cli import main
from edgemem.errors import ConfigError, EdgememError

SMALL = ["--set", "d_model=16", "--set", "n_layers=1"]


def run(*args) -> object:
    return CliRunner().invoke(main, [str(a) for a in args])


def refused(result, *words: str) -> str:
    """A non-zero exit and one error line (the last) naming the problem, no traceback."""
    assert result.exit_code not in (0, None), result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    lines = result.output.strip().splitlines()
    errors = [line for line in lines if line.lower().startswith("error")]
    assert errors == lines[-1:] and "Traceback" not in result.output, result.output
    for word in words:
        assert word in lines[-1], lines[-1]
    return lines[-1]


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def export_dir(small_exports) -> Path:
    """The linear preset (width 64, one layer, all targets, its seed recorded: verify rebuilds it); read only."""
    return small_exports["linear"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3.5 `save_pretrained` directory."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        linear_conv_kernel_dim=3,
        linear_key_head_dim=4,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        layer_types=["linear_attention", "full_attention"],
    )
    out = tmp_path_factory.mktemp("hf") / "qwen"
    Qwen3_5ForCausalLM(config).eval().save_pretrained(out)
    return out


def edited(source: Path, target: Path, edit) -> Path:
    """A copy of the export `source` whose edgemem.json went through `edit(manifest)`."""
    shutil.copytree(source, target)
    manifest = json.loads((target / "edgemem.json").read_text())
    edit(manifest)
    (target / "edgemem.json").write_text(json.dumps(manifest))
    return target


def edit_config(folder: Path, **values) -> Path:
    config = json.loads((folder / "config.json").read_text())
    config.update(values)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def checkpoint_with(tmp_path: Path, edit) -> Path:
    """A linear checkpoint whose config metadata went through `edit(config)` (weights unchanged)."""
    from edgemem.models import build, save_checkpoint

    path = tmp_path / "c.safetensors"
    save_checkpoint(build("linear", seed=0, d_model=16, n_layers=1, mlp_hidden=16), path)
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    config = json.loads(header["__metadata__"]["config"])
    edit(config)
    header["__metadata__"]["config"] = json.dumps(config)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + size :])
    return path


# ------------------------------------------------------------------ sizes that cannot fit: refused before allocation
def test_an_hf_vocabulary_that_cannot_fit_is_refused(hf_dir, tmp_path):
    big = edit_config(shutil.copytree(hf_dir, tmp_path / "big"), vocab_size=10**12)
    refused(
        run("export", "--hf", big, "--out", tmp_path / "out", "--target", "ort"),
        "vocab_size=1000000000000",
        "would need about",
        "this machine has",
    )
    refused(run("linearize", "--hf", big, "--out", tmp_path / "l.safetensors"), "would need about")
    assert not (tmp_path / "out").exists() and not (tmp_path / "l.safetensors").exists()


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda c: c["mixer_options"].update(num_heads=0), ["num_heads must be positive"]),
        (lambda c: c.update(n_layers=1_000_000), ["n_layers=1000000", "weights of 1 layer"]),
        (lambda c: c.update(d_model=10**7), ["would need about"]),
    ],
    ids=["num_heads-0", "n_layers-1e6", "d_model-1e7"],
)
def test_a_checkpoint_whose_metadata_cannot_be_built_is_refused(tmp_path, edit, words):
    from edgemem.models import load_checkpoint

    path = checkpoint_with(tmp_path, edit)
    start = time.monotonic()
    refused(run("export", "--checkpoint", path, "--out", tmp_path / "out", "--target", "generic"), *words)
    refused(run("train", "--init", path, "--task", "copy", "--steps", 1, "--out", tmp_path / "t.safetensors"), *words)
    with pytest.raises(EdgememError, match="does not fit its own config"):
        load_checkpoint(path)
    assert time.monotonic() - start < 10 and not (tmp_path / "out").exists()


# ------------------------------------------------------------------ exports that are broken or edited by hand
def test_verify_refuses_a_truncated_graph_whose_sha256_was_rerecorded(export_dir, tmp_path):
    def truncate(manifest):  # the graph `run` loads on the CPU (its steps too)
        graph = tmp_path / "t" / "ort" / "prefill_last.onnx"
        data = graph.read_bytes()[:1000]
        graph.write_bytes(data)
        manifest["files"]["ort/prefill_last.onnx"] = hashlib.sha256(data).hexdigest()

    target = edited(export_dir, tmp_path / "t", truncate)
    refused(run("verify", target), "ort/prefill_last.onnx is not a readable ONNX graph")
    refused(run("run", target, "--prompt", "a"), "onnxruntime cannot load")


@pytest.mark.parametrize(
    "name, edit, commands, words",
    [
        ("dtype", lambda m: m["config"].update(dtype="bf17"), ["verify", "run"], "config.dtype is 'bf17'"),
        ("width", lambda m: m["config"].update(d_model=32), ["verify"], "does not describe these graphs"),
        ("arch", lambda m: m.update(arch="deltanet"), ["verify", "run"], "config.arch is 'linear'"),
        (
            "arch-and-config",
            lambda m: (m.update(arch="deltanet"), m["config"].update(arch="deltanet", mixer="deltanet")),
            ["verify"],
            "does not describe these graphs",
        ),
        ("opset", lambda m: m.update(opset=21), ["verify"], "opset 20, edgemem.json says 21"),
        ("opset-out-of-range", lambda m: m.update(opset=99), ["verify", "run"], "opset is 99"),
        ("vocab", lambda m: m["config"].update(vocab_size=512), ["run"], "logits are 256 wide"),
        ("state-width", lambda m: m["state"][0]["shape"].__setitem__(3, 7), ["verify", "run"], "in the graph"),
        ("target", lambda m: m.update(targets=["tpu"]), ["run"], "targets ['tpu']"),
    ],
)
def test_a_hand_edited_manifest_is_checked_against_the_graphs(export_dir, tmp_path, name, edit, commands, words):
    target = edited(export_dir, tmp_path / name, edit)
    before = snapshot(tmp_path)
    for command in commands:
        args = ["--prompt", "a", "--max-new-tokens", "1"] if command == "run" else []
        refused(run(command, target, *args), words)
    assert snapshot(tmp_path) == before


def test_build_checks_the_export_and_its_output_before_tensorrt(export_dir, tmp_path):
    library = tmp_path / "libedgemem_trt_plugins.so"
    library.write_bytes(b"plugins")
    refused(
        run("build", export_dir, "--plugins", library, "--out", "/proc/engines"), "--out /proc/engines", "cannot write"
    )
    for rtx in ([], ["--rtx"]):
        refused(
            run("build", export_dir, "--plugins", library, "--max-sequence", 10**11, *rtx),
            "2**31 elements",
            "--max-sequence 8,388,607",
        )
    stale = edited(export_dir, tmp_path / "edited", lambda m: m["state"][0]["shape"].__setitem__(2, 9))
    refused(run("build", stale, "--plugins", library), "does not match edgemem.json")
    assert not (export_dir / "engines").exists()


def test_build_refuses_a_growing_cache_and_a_sequence_past_the_cache(export_dir, tmp_path):
    library = tmp_path / "libedgemem_trt_plugins.so"
    library.write_bytes(b"plugins")
    name = json.loads((export_dir / "edgemem.json").read_text())["state"][0]["input"]
    growing = edited(export_dir, tmp_path / "growing", lambda m: m["state"][0]["shape"].__setitem__(2, "past_sequence"))
    refused(run("build", growing, "--plugins", library), "KV cache grows", "--max-length")
    cache = {"max_length": 64, "overflow": "error", "sinks": 0, "states": [name], "in_place": []}
    fixed = edited(export_dir, tmp_path / "fixed", lambda m: m.update(kv_cache=cache))
    refused(
        run("build", fixed, "--plugins", library, "--max-sequence", 65), "--max-length 64", "--max-sequence 64 or less"
    )
    assert not (growing / "engines").exists() and not (fixed / "engines").exists()


def test_sinks_past_the_cache_name_the_options(tmp_path):
    refused(
        run("export", "--arch", "softmax", *SMALL, "--max-length", 64, "--sinks", 100, "--out", tmp_path / "o"),
        "--sinks",
        "[0, --max-length)",
        "got --sinks 100, --max-length 64",
    )


# ------------------------------------------------------------------ NaN, foreign tokenizers
def test_nan_in_an_hf_config_or_its_weights_is_refused_with_the_name(hf_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    nan_config = edit_config(shutil.copytree(hf_dir, tmp_path / "c"), rms_norm_eps=math.nan)
    refused(run("export", "--hf", nan_config, "--out", tmp_path / "o1", "--target", "ort"), "norm_eps", "finite number")
    weights = shutil.copytree(hf_dir, tmp_path / "w")
    tensors = load_file(weights / "model.safetensors")
    tensors["model.layers.0.linear_attn.A_log"][0] = math.inf
    save_file(tensors, weights / "model.safetensors", metadata={"format": "pt"})
    refused(
        run("export", "--hf", weights, "--out", tmp_path / "o2", "--target", "ort"),
        "model.layers.0.linear_attn.A_log holds NaN or infinite",
    )
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_nan_weights_and_float16_overflow_are_refused_at_export(tmp_path):
    import torch

    from edgemem.export import export
    from edgemem.models import build

    model = build("linear", seed=0, d_model=16, n_layers=1, mlp_hidden=16)
    with torch.no_grad():
        model.blocks[0].mlp.up.weight[0, 0] = 1e6
    with pytest.raises(EdgememError, match=r"blocks.0.mlp.up.weight holds 1 NaN or infinite value in float16"):
        export(model, tmp_path / "half", targets=["generic"], dtype="fp16")
    with torch.no_grad():
        model.blocks[0].mlp.up.weight[0, 0] = math.nan
    with pytest.raises(EdgememError, match=r"weight blocks.0.mlp.up.weight holds 1 NaN"):
        export(model, tmp_path / "nan", targets=["generic"])
    assert not any(tmp_path.iterdir())


def test_a_tokenizer_larger_than_the_vocabulary_or_corrupt_is_refused(hf_dir, tmp_path):
    from tokenizers import Tokenizer, models

    large = shutil.copytree(hf_dir, tmp_path / "large")
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(100)}, unk_token="t0")).save(str(large / "tokenizer.json"))
    refused(
        run("export", "--hf", large, "--out", tmp_path / "o1", "--target", "ort"), "token ids up to 99", "vocab_size 40"
    )
    corrupt = shutil.copytree(hf_dir, tmp_path / "corrupt")
    (corrupt / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 3}}')
    refused(run("export", "--hf", corrupt, "--out", tmp_path / "o2", "--target", "ort"), "not a valid tokenizer file")
    (corrupt / "tokenizer.json").write_text('{"model": ')
    refused(run("export", "--hf", corrupt, "--out", tmp_path / "o2", "--target", "ort"), "not a valid tokenizer file")


def test_run_prompt_refuses_a_corrupt_tokenizer_in_an_export(export_dir, tmp_path):
    def corrupt(manifest):
        path = tmp_path / "e" / "tokenizer" / "tokenizer.json"
        path.parent.mkdir()
        path.write_text('{"model": ')
        manifest["files"]["tokenizer/tokenizer.json"] = hashlib.sha256(path.read_bytes()).hexdigest()
        manifest["config"]["tokenizer"] = "tokenizer/tokenizer.json"

    refused(
        run("run", edited(export_dir, tmp_path / "e", corrupt), "--prompt", "hello"), "not a readable tokenizer.json"
    )


# ------------------------------------------------------------------ a missing extra is one line naming it
BLOCKER = textwrap.dedent("""
    import sys
    blocked = sys.argv[1]
    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] == blocked:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    sys.meta_path.insert(0, Blocker())
    from edgemem.cli import main
    sys.argv = ["edgemem", *sys.argv[2:]]
    main()
""")


@pytest.mark.parametrize("module, extra", [("onnx", "export")])
def test_export_without_the_export_extra_names_it(tmp_path, module, extra):
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            BLOCKER,
            module,
            "export",
            "--arch",
            "linear",
            *SMALL,
            "--target",
            "generic",
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == (
        f"error: `edgemem export` needs {module}, which is not installed: pip install 'edgemem-toolkit[{extra}]'"
    ), result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


# ------------------------------------------------------------------ options without an upper bound
@pytest.mark.parametrize(
    "argv",
    [
        ["run", "{e}", "--prompt", "a", "--threads", "2048"],
        ["bench", "{e}", "--no-eager", "--threads", "100000"],
        ["verify", "{e}", "--threads", "4096"],
        ["calibrate", "{e}", "--out", "{tmp}/q", "--threads", "1000000"],
        [
            "train",
            "--arch",
            "linear",
            "--task",
            "copy",
            "--steps",
            "1",
            "--threads",
            "999",
            "--out",
            "{tmp}/c.safetensors",
        ],
        ["triton", "{e}", "--out", "{tmp}/repo", "--threads", "1000000"],
    ],
    ids=lambda a: a[0],
)
def test_threads_are_bounded(export_dir, tmp_path, argv):
    result = run(*[a.format(e=export_dir, tmp=tmp_path) for a in argv])
    assert result.exit_code == 2 and "--threads must be an integer from 1 to" in result.output, result.output
    assert not any(tmp_path.iterdir())


def test_the_runtime_api_refuses_unbounded_threads_and_positions(export_dir, tmp_path):
    from edgemem.runtime import Engine
    from edgemem.runtime.errors import StateFileError
    from edgemem.runtime.state import encode_checkpoint

    with pytest.raises(ConfigError, match="threads must be an integer from 1 to"):
        Engine.load(export_dir, threads=10**6)
    engine = Engine.load(export_dir, threads=1)
    state = engine.new_stream().state_dict()
    for position in (2**70, 2**62):
        with pytest.raises(ConfigError, match=r"position must be an integer in \[0, 2\*\*62\)"):
            engine.stream_from_state(state, position=position)
    (tmp_path / "far.state").write_bytes(encode_checkpoint(engine.manifest, state, 2**70, None))
    with pytest.raises(StateFileError, match="invalid position"):
        engine.load_stream(tmp_path / "far.state")


def test_triton_refuses_what_cannot_be_served(export_dir, tmp_path):
    refused(
        run("triton", export_dir, "--out", tmp_path / "r", "--max-batch-size", 10**12),
        "--max-batch-size",
        "Triton's limit",
    )
    refused(run("triton", export_dir, "--out", tmp_path / "r", "--max-batch-size", 10**8), "would need about")
    refused(run("triton", export_dir, "--out", tmp_path / "r", "--max-live", 10**14), "--max-live", "would need about")
    trt_only = edited(export_dir, tmp_path / "trt-only", lambda m: m.update(targets=["trt"]))
    refused(run("triton", trt_only, "--out", tmp_path / "r"), "only the trt target")
    encoder = edited(export_dir, tmp_path / "encoder", lambda m: m["graphs"].update(step=False))
    refused(run("triton", encoder, "--out", tmp_path / "r"), "no step graph")
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------ calibration recipes
@pytest.mark.parametrize(
    "recipe, method, words",
    [
        ('[quantize]\nexclude = ["*"]\n', "dynamic", "nothing to quantize"),
        ('[quantize]\nexclude = ["*"]\n', "int4", "nothing to quantize"),
        ("[data]\nstreams = 1000000000\n", "static", "1,000,000,000 calibration streams"),
        ("[drift]\nstreams = 1000000000\n", "dynamic", "1,000,000,000 drift streams"),
    ],
    ids=["exclude-all", "exclude-all-int4", "streams-1e9", "drift-streams-1e9"],
)
def test_calibration_recipes_that_quantize_nothing_or_cannot_fit_are_refused(
    export_dir, tmp_path, recipe, method, words
):
    path = tmp_path / "recipe.toml"
    path.write_text(recipe)
    no_drift = [] if "drift" in recipe else ["--no-drift"]
    refused(
        run("calibrate", export_dir, "--method", method, "--recipe", path, "--out", tmp_path / "q", *no_drift), words
    )
    assert not (tmp_path / "q").exists()


def test_an_export_whose_weight_file_is_hard_linked_elsewhere_is_refused_before_onnx_reads_it(export_dir, tmp_path):
    """onnx will not read external data from a file with more than one hard link (as `cp -al` leaves): calibrate
    and triton say so in one line naming the file, and write nothing."""
    import os

    copy = tmp_path / "copy"
    shutil.copytree(export_dir, copy)
    for i, data in enumerate(copy.glob("*/weights.data")):
        os.link(data, tmp_path / f"elsewhere-{i}.data")
    refused(run("calibrate", copy, "--method", "dynamic", "--no-drift", "--out", tmp_path / "q"), "hard links")
    refused(run("triton", copy, "--out", tmp_path / "repo"), "hard links", "weights.data")
    assert not (tmp_path / "q").exists() and not (tmp_path / "repo").exists()


# ------------------------------------------------------------------ no silent waits
def test_a_long_prefill_reports_progress_as_log_lines(export_dir, caplog):
    from edgemem.runtime import Engine
    from edgemem.runtime.base import LONG_PREFILL

    stream = Engine.load(export_dir, threads=1).new_stream()
    with caplog.at_level(logging.INFO, logger="edgemem.progress"):
        stream.prefill(np.zeros(4 * LONG_PREFILL, np.int64), chunk_size=4)
        assert not caplog.records  # a short prefill says nothing
        stream.prefill(np.zeros(4 * LONG_PREFILL + 1, np.int64), chunk_size=4)
    lines = [r.getMessage() for r in caplog.records]
    assert lines and lines[-1].startswith(f"prefill of {4 * LONG_PREFILL + 1} tokens, {4 * LONG_PREFILL + 1}/"), lines


def test_serve_stops_waiting_when_a_model_fails_to_load(tmp_path, monkeypatch):
    from edgemem.serve import server as serve

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text('backend: "python"\n')
    log_file, started, real = tmp_path / "triton.log", [], subprocess.Popen
    crash = "E1126 model_lifecycle.cc:654] failed to load 'm' version 1: Internal: Stub process 'm_0_0' is not healthy."

    def popen(*args, **kwargs):  # a server whose Python backend crashed: it logs the failure and keeps running
        started.append(
            real(
                [sys.executable, "-c", f"import time; print({crash!r}, flush=True); time.sleep(60)"],
                start_new_session=True,
                stdout=kwargs["stdout"],
            )
        )
        return started[-1]

    monkeypatch.setattr(serve.subprocess, "Popen", popen)
    monkeypatch.setattr(serve.TritonServer, "_backends", lambda self, workdir: workdir)
    monkeypatch.setattr(serve.TritonServer, "command", lambda self, backends: [])
    monkeypatch.setattr(serve.TritonServer, "environment", lambda self: {})
    monkeypatch.setattr(serve.TritonServer, "_ready", lambda self, path: False)
    start = time.monotonic()
    with pytest.raises(serve.ServerError, match=r"model 'm' failed to load: Stub process 'm_0_0' is not healthy"):
        serve.TritonServer(tmp_path, log_file=log_file).start(timeout=60)
    assert time.monotonic() - start < 20 and started[0].poll() is not None


# ------------------------------------------------------------------ INT8 inside the MAC prefill's segment loop
def test_quantization_reaches_the_projections_inside_the_prefill_loop(small_exports, tmp_path):
    import onnx

    from edgemem.quant import calibrate
    from edgemem.quant.graph import quantized_projections

    def counts(directory: Path) -> list[int]:
        return [
            quantized_projections(onnx.load(str(directory / "ort" / f"{kind}.onnx"), load_external_data=False))
            for kind in ("prefill", "step")
        ]

    source = small_exports["titans-mac"]
    assert counts(source) == [0, 0]
    for method in ("dynamic", "int4"):
        manifest = calibrate(source, method, out=tmp_path / method)
        prefill, step = counts(tmp_path / method)
        assert prefill == step > 0, (method, prefill, step)  # the prefill's projections all sit in its segment Loop
        assert "loop_projections_kept_float" not in manifest.quantization["excluded"]

"""Fixtures shared by the test modules: every preset exported once per session, small.

`small_exports` is each preset at one layer of width 64 (MLP width 64 where it has one; every other
setting as shipped; an encoder-decoder: one encoder and one decoder layer), in all four targets, exported in two processes side by side. It is kept in pytest's cache (when enabled) under a key
of everything an export depends on, so only the first run after a change pays for it.
"""  # noqa: E501

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

from edgemem.models import archs, load_config

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"d_model": 64, "n_layers": 1, "mlp_hidden": 64}  # mlp_hidden only where the preset has an MLP
SMALL_SEQ2SEQ = {  # an untied head: with start token = end token, a random tied one ends at once
    "d_model": 64,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "windows": [16],
    "encoder_ffn": 64,
    "decoder_ffn": 64,
    "tie_embeddings": False,
}
TARGETS = ["generic", "ort", "onnx27", "trt"]

_EXPORT = textwrap.dedent("""
    import json, sys
    from edgemem.export import export
    from edgemem.models import build
    for arch, out, overrides, targets in json.loads(sys.argv[1]):
        export(build(arch, seed=0, **overrides), out, targets=targets, extra_config={"seed": 0})
""")


def _sources_key(*extra: object) -> str:
    """A digest of edgemem's export-side sources, its presets, the exporters' versions and `extra`."""
    versions = [metadata.version(p) for p in ("torch", "onnx", "onnxscript", "onnxruntime")]
    digest = hashlib.sha256(json.dumps([versions, *extra], default=str).encode())
    files = [p for p in (ROOT / "edgemem").rglob("*") if p.suffix in (".py", ".toml") and "runtime" not in p.parts]
    for path in sorted(files):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def export_presets(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    jobs: dict[str, tuple[dict, list[str]]],
) -> dict[str, Path]:
    """{arch: directory} of `jobs` ({arch: (overrides, targets)}) exported in two processes, cached under `name`;
    parallel test workers (pytest-xdist) wait for the one that exports."""
    cache = getattr(request.config, "cache", None)
    if cache is None:
        return _export(tmp_path_factory.mktemp(name), jobs)
    folder = cache.mkdir(f"edgemem-{name}")
    with open(folder.parent / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _cached(folder, _sources_key(name, jobs), tmp_path_factory.mktemp(name), jobs)


def _cached(folder: Path, key: str, root: Path, jobs: dict[str, tuple[dict, list[str]]]) -> dict[str, Path]:
    cached = folder / key
    if not (cached / "complete").is_file():
        _export(root, jobs)
        (root / "complete").touch()
        for old in folder.iterdir():  # one key at a time
            shutil.rmtree(old, ignore_errors=True)
        staging = folder / f".{key}-{os.getpid()}"
        shutil.copytree(root, staging)
        staging.rename(cached)
    return {arch: cached / arch for arch in jobs}


def _export(root: Path, jobs: dict[str, tuple[dict, list[str]]]) -> dict[str, Path]:
    work = [[arch, str(root / arch), overrides, targets] for arch, (overrides, targets) in jobs.items()]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _EXPORT, json.dumps(work[i::2])],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    for p in procs:
        output, _ = p.communicate(timeout=1200)
        assert p.returncode == 0, output[-3000:]
    return {arch: root / arch for arch in jobs}


@pytest.fixture(scope="session")
def small_exports(request, tmp_path_factory) -> dict[str, Path]:
    """{arch: directory}: every preset (the `led` encoder-decoder included), one layer of width 64, exported to
    all four targets."""
    jobs = {arch: (small(arch), TARGETS) for arch in archs()}
    return export_presets(request, tmp_path_factory, "small-exports", jobs)


def small(arch: str) -> dict:
    """The overrides `small_exports` builds `arch` with (an encoder-decoder: one encoder and one decoder
    layer of width 64, FFNs 64, a window of 16, an untied head)."""
    config = load_config(arch)
    if not hasattr(config, "n_layers"):
        return SMALL_SEQ2SEQ
    return {k: v for k, v in SMALL.items() if k != "mlp_hidden" or config.mlp_hidden}


def genai_greedy(directory: Path, prompt: list[int], n: int, eos: int) -> list[int]:
    """`n` greedy tokens from onnxruntime-genai on the export in `directory` after `prompt`. `eos` overrides
    the end token (genai needs one; byte-level presets name byte 0): pass one the reference never emits, so
    that all `n` tokens are compared."""
    import numpy as np
    import onnxruntime_genai as og

    config = og.Config(str(directory))
    config.overlay(json.dumps({"model": {"eos_token_id": eos}}))
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + n, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], dtype=np.int32))
    tokens = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    return tokens

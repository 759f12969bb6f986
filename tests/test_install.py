"""Packaging: the default install is the torch-free runtime, and it runs an export made elsewhere."""

import json
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _run(*args: str | Path, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, errors="replace", timeout=600, **kwargs
    )
    assert result.returncode == 0, f"{args}:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", out, ROOT)
    (path,) = out.glob("edgemem_toolkit-*.whl")
    return path


def test_wheel_ships_every_module_preset_and_recipe(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "edgemem").rglob("*")
        if p.suffix in (".py", ".toml") and "__pycache__" not in p.parts
    }
    assert sources <= names, sorted(sources - names)
    assert {
        "edgemem/presets/titans-mag.toml",
        "edgemem/presets/sizes.json",
        "edgemem/quant/calib/default.toml",
    } <= names
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "Name: edgemem-toolkit" in text
    required = [line for line in text.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert required and not any(dep in line for line in required for dep in ("torch", "onnx ", "onnx>", "onnxscript"))


@pytest.mark.slow
def test_default_install_has_no_torch_and_runs_an_export(wheel, tmp_path):
    """`pip install edgemem-toolkit` (no extras) in a fresh venv: no torch, no onnx; `edgemem run`,
    `Engine.load` and `edgemem bench --no-eager` work on an export made by the full install."""
    from edgemem.export import export
    from edgemem.models import build

    model_dir = tmp_path / "gdn"
    export(
        build("gated-deltanet", seed=0, d_model=64, n_layers=1, num_heads=2, mlp_hidden=64), model_dir, targets=["ort"]
    )
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    _run(bin_dir / "pip", "install", "-q", wheel)
    listed = _run(bin_dir / "pip", "list", "--format=freeze").stdout.lower()
    assert not {"torch", "onnx", "onnxscript"} & {line.split("==")[0] for line in listed.splitlines()}, listed

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    edgemem = bin_dir / "edgemem"
    out = _run(edgemem, "run", model_dir, "--prompt", "Hello", "--max-new-tokens", "8", env=env).stdout
    assert out
    assert "gated-deltanet" in _run(edgemem, "archs", env=env).stdout  # the presets' sizes, without torch
    code = (
        "import sys; from edgemem.runtime import Engine\n"
        f"engine = Engine.load({str(model_dir)!r}, threads=1)\n"
        "stream = engine.new_stream(); logits = stream.prefill(b'Hello'); stream.step(int(logits[-1].argmax()))\n"
        "assert stream.position == 6, stream.position\n"
        "heavy = {'torch', 'onnx', 'onnxscript'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    _run(bin_dir / "python", "-c", code, env=env)
    report = tmp_path / "bench.json"
    _run(
        edgemem,
        "bench",
        model_dir,
        "--no-eager",
        "--positions",
        "16",
        "--batch",
        "1",
        "--steps",
        "5",
        "--threads",
        "1",
        "--json",
        report,
        env=env,
    )
    (row,) = json.loads(report.read_text())["rows"]
    assert (row["position"], row["batch"]) == (16, 1) and row["us_per_token"] > 0

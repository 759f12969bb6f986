"""Nothing lost (issue 29): no command writes into its input or outside its output, --force replaces only
what edgemem wrote, an interrupted or concurrent writer leaves the output as it was; and the quick
tracebacks of that round (a non-path, a report folder that does not exist, a state too large to trace)."""

from __future__ import annotations

import json
import os
import shutil
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgemem.cli import main
from edgemem.errors import EdgememError
from edgemem.files import OutputError, check_output_dir, staged_directory


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A two-target export (generic, trt) of a one-layer linear model of width 16."""
    from edgemem.export import export
    from edgemem.models import build

    out = tmp_path_factory.mktemp("tiny") / "e"
    export(build("linear", seed=0, d_model=16, n_layers=1, mlp_hidden=16), out, targets=["generic", "trt"])
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from edgemem.models import build, save_checkpoint

    path = tmp_path_factory.mktemp("ckpt") / "linear-copy.safetensors"
    save_checkpoint(build("linear", seed=0, d_model=16, n_layers=1, mlp_hidden=16), path)
    return path


def snapshot(*roots: Path) -> dict[str, bytes]:
    """Every file (and folder, as None) under `roots`, with its bytes."""
    found = {}
    for root in roots:
        for path in sorted(root.rglob("*")):
            found[str(path)] = path.read_bytes() if path.is_file() else None
    return found


def refused(result, *words: str) -> str:
    """Exit code 2 and one error line naming the problem (after a command's notes, if any), no traceback."""
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == lines[-1:] and "Traceback" not in result.output, result.output
    for word in words:
        assert word in lines[-1], lines[-1]
    return lines[-1]


def run(*args) -> object:
    return CliRunner().invoke(main, [str(a) for a in args])


# ------------------------------------------------------------------ never the input
def test_linearize_never_writes_into_its_hf_input(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"the user's weights")
    before = snapshot(tmp_path)
    refused(run("linearize", "--hf", hf, "--out", hf / "model.safetensors"), "own input")
    refused(run("linearize", "--hf", hf, "--out", hf / "sub" / "new.safetensors"), "own input")
    assert snapshot(tmp_path) == before


def test_train_never_overwrites_its_init_checkpoint(tmp_path, checkpoint, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(checkpoint, work / checkpoint.name)
    os.link(work / checkpoint.name, work / "link.safetensors")
    monkeypatch.chdir(work)
    before = snapshot(work)
    common = ["--task", "copy", "--steps", 1, "--batch", 2, "--task-set", "tokens=4"]
    refused(run("train", "--init", checkpoint.name, "--out", checkpoint.name, *common), "own input")
    refused(run("train", "--init", checkpoint.name, "--out", "link.safetensors", *common), "own input")  # a hard link
    refused(run("train", "--init", checkpoint.name, *common), "own input")  # the default out: linear-copy.safetensors
    assert snapshot(work) == before


# ------------------------------------------------------------------ triton: one name, inside the repository
@pytest.mark.parametrize("name", ["..", ".", "a/b", "../x", ""])
def test_triton_model_name_is_one_path_component(tiny, tmp_path, name):
    (tmp_path / "config.pbtxt").write_text("the user's file")
    before = snapshot(tmp_path)
    refused(run("triton", tiny, "--out", tmp_path / "repo", "--name", name), "--name")
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------ --force: only what edgemem wrote
def test_export_force_refuses_files_edgemem_did_not_write(tiny, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(tiny, out)
    (out / "notes.txt").write_text("mine")
    (out / "generic" / "mine.onnx").write_text("mine too")
    before = snapshot(tmp_path)
    args = [
        "export",
        "--arch",
        "linear",
        "--set",
        "d_model=16",
        "--set",
        "n_layers=1",
        "--target",
        "generic",
        "--out",
        out,
        "--force",
    ]
    line = refused(run(*args), "edgemem did not write")
    assert "generic/mine.onnx" in line and "notes.txt" in line
    assert snapshot(tmp_path) == before


def test_force_accepts_an_export_with_its_engines_and_temporary_files(tiny, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(tiny, out)
    (out / "engines").mkdir()
    (out / "engines" / "step.engine").write_bytes(b"e")
    (out / "engines" / "engines.json").write_text(json.dumps({"engines": {"step": {"file": "step.engine"}}}))
    (out / ".edgemem.json.123.abc.tmp").write_text("left by a killed writer")
    assert check_output_dir(out, force=True) == out.resolve()
    (out / "engines" / "old.engine").write_bytes(b"not listed")
    with pytest.raises(OutputError, match="engines/old.engine"):
        check_output_dir(out, force=True)


def test_triton_force_replaces_a_repository_and_its_checkpoints_only(tiny, tmp_path):
    from edgemem.serve.repository import write_repository

    repo = write_repository(tiny, tmp_path / "repo", name="m").path
    (repo / "m" / "checkpoints").mkdir()
    (repo / "m" / "checkpoints" / "7.safetensors").write_bytes(b"a sequence")
    write_repository(tiny, repo, name="m", force=True)
    (repo / "m" / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    with pytest.raises(OutputError, match="m/notes.txt"):
        write_repository(tiny, repo, name="m", force=True)
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------ build: a staged engine set, its own directory
@pytest.fixture
def fake_trt(monkeypatch, tmp_path):
    """TensorRT stood in for: `_build_graphs` writes an engine file per graph (and can be interrupted after one)."""
    import edgemem.trt_build as build
    from edgemem.runtime import engines

    monkeypatch.setattr(build, "_import_library", lambda module: types.SimpleNamespace(__version__="10.0.0"))
    state = {"interrupt": False, "builds": 0}

    def fake(module, directory, graphs, library, out_dir, max_batch, max_sequence, sm):
        state["builds"] += 1
        records = {}
        for graph in graphs:
            path = out_dir / f"{graph.stem}.engine"
            path.write_bytes(f"engine {graph.stem} #{state['builds']}".encode())
            records[graph.stem] = engines.entry(path, 0, {}, [], [])
            if state["interrupt"]:
                raise KeyboardInterrupt
        return records

    monkeypatch.setattr(build, "_build_graphs", fake)
    library = tmp_path / "libedgemem_trt_plugins.so"
    library.write_bytes(b"plugins")
    return library, state


def test_build_replaces_only_its_own_engine_set(tiny, tmp_path, fake_trt):
    from edgemem.manifest import load
    from edgemem.runtime import engines

    library, state = fake_trt
    out = tmp_path / "engines"
    out.mkdir()
    (out / "step.engine").write_text("the user's file")
    before = snapshot(tmp_path)
    refused(run("build", tiny, "--plugins", library, "--out", out), "not empty", "--force")
    line = refused(run("build", tiny, "--plugins", library, "--out", out, "--force"), "edgemem did not write")
    assert "step.engine" in line and snapshot(tmp_path) == before
    (out / "step.engine").unlink()
    assert run("build", tiny, "--plugins", library, "--out", out).exit_code == 0
    refused(run("build", tiny, "--plugins", library, "--out", out), "--force")
    assert run("build", tiny, "--plugins", library, "--out", out, "--force").exit_code == 0
    folder, info = engines.read(tiny, load(tiny), out)
    assert (out / "step.engine").read_bytes().endswith(b"#2")
    for where in (tiny, tiny / "trt"):  # the export itself is its input
        refused(run("build", tiny, "--plugins", library, "--out", where, "--force"), "own input")


def test_interrupted_build_keeps_the_engine_set_it_replaces(tiny, tmp_path, fake_trt):
    from edgemem.manifest import load
    from edgemem.runtime import engines
    from edgemem.trt_build import build_engines

    library, state = fake_trt
    first = tmp_path / "first"
    state["interrupt"] = True
    with pytest.raises(KeyboardInterrupt):
        build_engines(tiny, plugins=library, out=first)
    assert not first.exists()  # no engines without engines.json
    state["interrupt"] = False
    out = tmp_path / "out"
    build_engines(tiny, plugins=library, out=out)
    before = snapshot(tmp_path)
    state["interrupt"] = True
    with pytest.raises(KeyboardInterrupt):
        build_engines(tiny, plugins=library, out=out, force=True)
    assert snapshot(tmp_path) == before  # nothing left behind either
    engines.read(tiny, load(tiny), out)


# ------------------------------------------------------------------ two writers of one output
def test_a_directory_that_appears_meanwhile_is_not_replaced(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(OutputError, match="appeared or changed"):
        with staged_directory(out) as tmp:
            (tmp / "mine").write_text("late")
            out.mkdir()
            (out / "theirs").write_text("first")
    assert [p.name for p in out.iterdir()] == ["theirs"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_an_empty_output_filled_meanwhile_is_not_replaced(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(OutputError, match="appeared or changed"):
        with staged_directory(out) as tmp:
            (tmp / "mine").write_text("late")
            (out / "theirs").write_text("first")
    assert [p.name for p in out.iterdir()] == ["theirs"]


def test_a_replaced_output_is_not_replaced_again(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("checked")
    with pytest.raises(OutputError, match="appeared or changed"):
        with staged_directory(out) as tmp:
            (tmp / "mine").write_text("late")
            out.rename(tmp_path / "aside")  # as another writer does: its own directory made before the old one goes
            out.mkdir()
            (out / "theirs").write_text("first")
    assert [p.name for p in out.iterdir()] == ["theirs"]


def test_two_exports_into_one_empty_output_one_fails(tmp_path):
    from edgemem.export import export
    from edgemem.manifest import load
    from edgemem.models import build

    out = tmp_path / "out"
    out.mkdir()
    model = build("linear", seed=0, d_model=16, n_layers=1, mlp_hidden=16)
    with pytest.raises(OutputError, match="appeared or changed"):
        with staged_directory(out) as tmp:  # the slower export: it started first, it finishes last
            (tmp / "edgemem.json").write_text("{}")
            export(model, out, targets=["generic"])
    load(out)  # the faster one's export, whole


# ------------------------------------------------------------------ tracebacks
def test_a_path_that_is_not_a_path_is_refused():
    from edgemem.models import load_checkpoint
    from edgemem.runtime import Engine

    for call in (lambda: Engine.load(12345), lambda: load_checkpoint(None), lambda: check_output_dir(3, force=False)):
        with pytest.raises(EdgememError, match="must be a path"):
            call()


def test_bench_json_into_a_new_folder(tiny, tmp_path):
    report = tmp_path / "new" / "deeper" / "bench.json"
    result = run(
        "bench",
        tiny,
        "--positions",
        "1",
        "--batch",
        "1",
        "--steps",
        "3",
        "--time-limit",
        "0.05",
        "--no-eager",
        "--json",
        report,
    )
    assert result.exit_code == 0, result.output
    assert json.loads(report.read_text())["rows"]
    before = snapshot(tiny)
    refused(run("bench", tiny, "--json", tiny / "edgemem.json"), "own input")
    assert snapshot(tiny) == before


def test_a_state_too_large_to_trace_is_refused_before_work(tmp_path):
    refused(
        run(
            "export",
            "--arch",
            "softmax",
            "--set",
            "d_model=16",
            "--set",
            "n_layers=1",
            "--max-length",
            10**11,
            "--target",
            "generic",
            "--out",
            tmp_path / "out",
        ),
        "per stream",
        "this machine has",
    )
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ serve: Ctrl-C while tritonserver starts
def test_ctrl_c_while_starting_stops_the_server_and_removes_its_directory(tmp_path, monkeypatch):
    import subprocess
    import sys

    from edgemem.serve import server as serve

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text('backend: "python"\n')
    started, workdirs, real = [], [], subprocess.Popen

    def popen(*args, **kwargs):  # a stand-in for tritonserver that never becomes ready
        started.append(
            real([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True, stdout=kwargs["stdout"])
        )
        return started[-1]

    def ctrl_c(self, path):
        raise KeyboardInterrupt

    monkeypatch.setattr(serve.subprocess, "Popen", popen)
    monkeypatch.setattr(serve.TritonServer, "_backends", lambda self, workdir: workdirs.append(workdir))
    monkeypatch.setattr(serve.TritonServer, "command", lambda self, backends: [])
    monkeypatch.setattr(serve.TritonServer, "environment", lambda self: {})
    monkeypatch.setattr(serve.TritonServer, "_ready", ctrl_c)
    server = serve.TritonServer(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        server.start(5)
    assert started and started[0].poll() is not None  # no server left running
    assert workdirs and not workdirs[0].exists()

"""Interruptions and what writers leave behind.

SIGKILL at random moments while export, calibrate, Stream.save and train write: the artifact written
before still loads and verifies, no partial one passes for a complete one, and the next run clears
what the killed one left. Ctrl-C in train saves the last completed step; a non-finite loss stops
training and leaves the previous checkpoint; written files and directories follow the umask."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from edgemem.manifest import load as load_manifest

KILLS = 8  # per writer; 32 in all

# One process per writer imports everything and writes twice (the complete artifact each kill must leave
# whole; the second write is timed). Then, on each "fork" line, it forks a child that writes again and again
# until the test kills it with SIGKILL, and reaps it on "reap", saying which signal ended it. A forked writer
# starts at once, so the random moment of the kill, within the time of one write, falls within its writes
# rather than a fresh interpreter's imports. On "write" it writes once more: the next run, which clears what
# the killed ones left.
_WRITER = textwrap.dedent("""
    import itertools, os, sys, time
    import torch
    torch.set_num_threads(1)  # no thread pool in the parent: a forked child runs its own work inline
    mode, source, out = sys.argv[1:4]
    if mode == "export":
        from edgemem.export import export
        from edgemem.models import build
        def write(i):
            export(build("linear", seed=i, d_model=16, n_layers=1), out, targets=["generic"], force=True)
    elif mode == "calibrate":
        from edgemem.quant import calibrate
        def write(i):
            calibrate(source, "dynamic", None, out, force=True)
    elif mode == "save":
        from edgemem.runtime import Engine
        stream = Engine.load(source, threads=1).new_stream()
        def write(i):
            stream.step(i % 256)
            stream.save(out)
    else:
        from edgemem.train import train
        def write(i):
            train("linear", "mqar", 1, out, seed=i, overrides={"d_model": 16, "n_layers": 1}, batch=2, progress=False)
    write(0)  # the first write also loads what is loaded lazily: the second one is timed
    start = time.perf_counter()
    write(1)
    print(time.perf_counter() - start, flush=True)
    for line in sys.stdin:
        if line.strip() == "fork":
            child = os.fork()
            if child == 0:
                for i in itertools.count(2):
                    write(i)
            print(child, flush=True)
        elif line.strip() == "reap":
            _, status = os.waitpid(child, 0)
            print(os.WTERMSIG(status) if os.WIFSIGNALED(status) else "exited", flush=True)
        else:
            write(0)
            print("written", flush=True)
""")


def _loads(mode: str, source: Path, out: Path) -> None:
    """The artifact at `out` is complete: it loads, and every file matches its recorded sha256."""
    if mode in ("export", "calibrate"):
        load_manifest(out, check_files=True)
    elif mode == "save":
        from edgemem.runtime import Engine

        Engine.load(source, threads=1).load_stream(out)
    else:
        from edgemem.models import load_checkpoint

        load_checkpoint(out)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["export", "calibrate", "save", "train"])
def test_sigkill_leaves_the_previous_artifact_whole(mode, small_exports, tmp_path):
    source = small_exports["linear"]
    out = tmp_path / ("out" if mode in ("export", "calibrate") else "artifact.safetensors")
    log = tempfile.TemporaryFile("w+")  # the writer's stderr, for a failure's message; not a pipe that can fill
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, mode, str(source), str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )

    def answer(line: str | None = None) -> str:
        if line is not None:
            writer.stdin.write(line + "\n")
            writer.stdin.flush()
        said = writer.stdout.readline().strip()
        log.seek(0)
        assert said, log.read()[-3000:]
        return said

    child = None
    try:
        one_write = float(answer())
        _loads(mode, source, out)
        rng = random.Random(mode)
        for _ in range(KILLS):  # a moment anywhere within one whole write
            child = int(answer("fork"))
            time.sleep(rng.uniform(0.0, one_write))
            os.kill(child, signal.SIGKILL)
            assert answer("reap") == str(int(signal.SIGKILL)), "the writer ended before it was killed"
            child = None
            _loads(mode, source, out)
        assert answer("write") == "written"  # the next run clears what the killed ones left
        _loads(mode, source, out)
    finally:
        if child is not None:  # a failure between fork and reap: no writer outlives the test
            os.kill(child, signal.SIGKILL)
        writer.kill()
        writer.communicate()
        log.close()
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


def test_ctrl_c_in_train_saves_the_last_completed_step(tmp_path):
    import signal as signals

    import torch

    from edgemem.models import build, load_checkpoint
    from edgemem.tasks import get_task
    from edgemem.train import Interrupted, train

    task = get_task("mqar")
    batches = 0
    real_batch = task.batch

    def batch(*args):
        nonlocal batches
        batches += 1
        if batches == 3:  # Ctrl-C while the third step is under way: it completes, then training stops
            signals.raise_signal(signals.SIGINT)
        return real_batch(*args)

    task.batch = batch
    out = tmp_path / "m.safetensors"
    before = signals.getsignal(signals.SIGINT)  # the default, or SIG_IGN in a job started in the background
    with pytest.raises(Interrupted) as stop:
        train("linear", task, 50, out, overrides={"d_model": 16, "n_layers": 1}, batch=2, progress=False)
    assert stop.value.steps == 3 and stop.value.out == out
    trained, initial = load_checkpoint(out).state_dict(), build("linear", seed=0, d_model=16, n_layers=1).state_dict()
    assert all(torch.isfinite(v).all() for v in trained.values())
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)
    assert signals.getsignal(signals.SIGINT) is before  # the handler is put back


def test_non_finite_loss_stops_training_and_keeps_the_previous_checkpoint(tmp_path):
    from edgemem.train import TrainingError, train

    out = tmp_path / "m.safetensors"
    out.write_bytes(b"the previous checkpoint")
    with pytest.raises(TrainingError, match=r"the loss is nan at step \d+ of 20: training diverged"):
        train("linear", "mqar", 20, out, overrides={"d_model": 16, "n_layers": 1}, batch=2, lr=1e6, progress=False)
    assert out.read_bytes() == b"the previous checkpoint"
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("mask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_files_and_directories_get_the_users_umask(tmp_path, mask, file_mode, dir_mode):
    from edgemem.files import staged_directory, write_atomic

    old = os.umask(mask)
    try:
        write_atomic(tmp_path / "f.bin", b"x")
        with staged_directory(tmp_path / "d") as tmp:
            write_atomic(tmp / "inner.bin", b"y")
    finally:
        os.umask(old)
    assert (tmp_path / "f.bin").stat().st_mode & 0o777 == file_mode
    assert (tmp_path / "d").stat().st_mode & 0o777 == dir_mode
    assert (tmp_path / "d" / "inner.bin").stat().st_mode & 0o777 == file_mode


def test_leftovers_of_a_killed_writer_are_cleared_and_a_directory_moved_aside_is_put_back(tmp_path):
    from edgemem.files import staged_directory, write_atomic

    dead, alive = _dead_pid(), os.getppid()
    (tmp_path / f".f.bin.{dead}.abc.tmp").write_bytes(b"half")
    (tmp_path / f".f.bin.{alive}.abc.tmp").write_bytes(b"another writer's, still running")
    write_atomic(tmp_path / "f.bin", b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".f.bin.{alive}.abc.tmp", "f.bin"]

    (tmp_path / f".f.bin.{alive}.abc.tmp").unlink()
    (tmp_path / f".out.tmp-{dead}-xyz").mkdir()  # a half-written export
    moved = tmp_path / f".out.old-{dead}-xyz"  # killed after moving the old export aside
    moved.mkdir()
    (moved / "edgemem.json").write_text("{}")
    with staged_directory(tmp_path / "other") as tmp:  # another output leaves them alone
        (tmp / "a").write_text("a")
    assert moved.exists() and (tmp_path / f".out.tmp-{dead}-xyz").exists()
    with pytest.raises(RuntimeError):
        with staged_directory(tmp_path / "out"):  # the next writer of `out` puts it back, then fails
            raise RuntimeError
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin", "other", "out"]
    assert (tmp_path / "out" / "edgemem.json").read_text() == "{}"

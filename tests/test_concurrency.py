"""Streams under concurrent use: one lock per stream, no lost or torn step, a clear error for a stream
that two batches want at once."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from edgemem.runtime import Engine
from edgemem.runtime.errors import BatchError

ARCH = "deltanet"  # a nonlinear state update: a lost, doubled or mixed-up step shows in the state
TOKENS = [11, 42, 97, 200]  # stream i is only ever fed TOKENS[i]: its state depends on its step count alone


@pytest.fixture(scope="module")
def engine(small_exports) -> Engine:
    return Engine.load(small_exports[ARCH], threads=1)


def _replay(engine: Engine, token: int, steps: int) -> list[dict[str, np.ndarray]]:
    """The state after 0..steps steps of `token`, stepped serially on one stream."""
    stream = engine.new_stream()
    states = [stream.state_dict()]
    for _ in range(steps):
        stream.step(token)
        states.append(stream.state_dict())
    return states


def _close(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.allclose(a[k], b[k], rtol=1e-5, atol=1e-5) for k in a)


def test_eight_threads_hammering_four_streams_equal_a_serial_replay(engine, tmp_path):
    streams = [engine.new_stream() for _ in TOKENS]
    ops_per_thread, threads = 400, 8
    accepted = [[0] * len(streams) for _ in range(threads)]  # steps each thread got into each stream
    seen: list[list[tuple[int, int, dict]]] = [[] for _ in range(threads)]  # (stream, position, state) read back
    refused = [0] * threads
    failures: list[BaseException] = []

    def work(t: int) -> None:
        rng = random.Random(t)
        path = tmp_path / f"thread{t}.state"
        try:
            for _ in range(ops_per_thread):
                i = rng.randrange(len(streams))
                op = rng.choices(["step", "batch", "fork", "save"], weights=[4, 3, 2, 1])[0]
                if op == "step":
                    streams[i].step(TOKENS[i])
                    accepted[t][i] += 1
                elif op == "batch":
                    group = rng.sample(range(len(streams)), rng.randint(2, len(streams)))
                    try:
                        engine.step_batch([streams[j] for j in group], [TOKENS[j] for j in group])
                    except BatchError:
                        refused[t] += 1
                        continue
                    for j in group:
                        accepted[t][j] += 1
                elif op == "fork":
                    fork = streams[i].fork()
                    seen[t].append((i, fork.position, fork.state_dict()))
                else:
                    streams[i].save(path)
                    loaded = engine.load_stream(path)
                    seen[t].append((i, loaded.position, loaded.state_dict()))
        except BaseException as e:  # reported by the main thread
            failures.append(e)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not failures, failures
    totals = [sum(a[i] for a in accepted) for i in range(len(streams))]
    assert sum(totals) + sum(refused) >= 2000  # a few thousand operations in all
    for i, stream in enumerate(streams):
        replay = _replay(engine, TOKENS[i], totals[i])
        assert stream.position == totals[i]
        assert _close(stream.state_dict(), replay[-1]), f"stream {i}"
        reads = [(p, s) for t in range(threads) for j, p, s in seen[t] if j == i]
        assert reads
        for position, state in reads:  # every fork and saved checkpoint is a whole state of one moment
            assert 0 <= position <= totals[i]
            assert _close(state, replay[position]), f"stream {i} at {position}"


def test_a_stream_in_one_batch_is_refused_by_another_and_waited_for_by_a_single_step(engine, monkeypatch):
    a, b, c = (engine.new_stream() for _ in range(3))
    running, release = threading.Event(), threading.Event()
    run_batch = engine._run_batch

    def slow(slot, streams, tokens):
        running.set()
        assert release.wait(10)
        return run_batch(slot, streams, tokens)

    monkeypatch.setattr(engine, "_run_batch", slow)
    batch = threading.Thread(target=engine.step_batch, args=([a, b], [1, 2]))
    batch.start()
    assert running.wait(10)
    with pytest.raises(BatchError, match="being stepped in another batch"):
        engine.step_batch([c, b], [3, 4])
    single = threading.Thread(target=a.step, args=(5,))
    single.start()
    single.join(0.2)
    assert single.is_alive()  # waits for the batch that holds `a`
    release.set()
    batch.join(10)
    single.join(10)
    monkeypatch.undo()
    assert (a.position, b.position, c.position) == (2, 1, 0)
    twin = engine.new_stream()
    twin.step(1)
    twin.step(5)
    assert _close(a.state_dict(), twin.state_dict())

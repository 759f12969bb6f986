"""The streaming runtime: engines, streams, checkpoints, batching, constant memory, CLI `run`/`bench`.

Small presets are exported once (tests/conftest.py: two export processes side by side, since tracing
dominates the cost, cached across runs); every test then runs onnxruntime only, with one thread.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import export_presets, small
from safetensors import safe_open

from edgemem import EdgememError
from edgemem.cli import main
from edgemem.errors import ConfigError
from edgemem.manifest import load as load_manifest
from edgemem.runtime import BackendError, BatchError, Engine, StateFileError, TokenError, initial_state
from edgemem.runtime.bench import rss_bytes
from edgemem.runtime.state import FORMAT, encode_checkpoint

# arch → build overrides (one layer keeps the export, which dominates this file's time, short;
# softmax has two so that several growing caches are tracked); gated-deltanet (d_model 32,
# 1 layer) and softmax are the pair of the memory test
PRESETS = {
    "deltanet": {"d_model": 64, "mlp_hidden": 64, "n_layers": 1},
    "titans-mag": {"d_model": 64, "mlp_hidden": 64, "n_layers": 1},  # non-zero initial state (state_init.safetensors)
    "softmax": {"d_model": 32, "mlp_hidden": 32, "n_layers": 2},  # growing state (KV caches of 2 layers)
    "gated-deltanet": {"d_model": 32, "mlp_hidden": 32, "n_layers": 1, "conv_size": 0},  # recurrent state only
    "longformer": {"d_model": 64, "mlp_hidden": 64, "n_layers": 1},
    "titans-mac": {"d_model": 64, "mlp_hidden": 64, "n_layers": 1},  # prefill graph: a Loop over segments
}
TARGETS = {"deltanet": ["generic", "ort"]}
RECURRENT = ["deltanet", "gated-deltanet", "titans-mag", "longformer", "titans-mac"]
ALL = [*RECURRENT, "softmax"]


@pytest.fixture(scope="module")
def exports(request, tmp_path_factory, small_exports):
    """The presets above, exported once (tests/conftest.py: two processes, cached across runs); those
    whose settings are the session's small ones come from `small_exports`."""
    shared = {
        arch: small_exports[arch]
        for arch, overrides in PRESETS.items()
        if overrides == small(arch) and arch not in TARGETS
    }
    jobs = {arch: (o, TARGETS.get(arch, ["ort"])) for arch, o in PRESETS.items() if arch not in shared}
    return {**shared, **export_presets(request, tmp_path_factory, "runtime-exports", jobs)}


@pytest.fixture(scope="module")
def engines(exports):
    return {arch: Engine.load(directory, threads=1) for arch, directory in exports.items()}


def _ids(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n)


def _close(a, b, rtol=1e-4):
    scale = max(float(np.abs(b).max()), 1e-6)
    return float(np.abs(a.astype(np.float64) - b).max()) / scale <= rtol


# ---------------------------------------------------------------- layering


RUNTIME_MODULES = [
    "edgemem.runtime",
    "edgemem.runtime.base",
    "edgemem.runtime.ort",
    "edgemem.runtime.trt",
    "edgemem.runtime.engines",
    "edgemem.runtime.bench",
    "edgemem.runtime.state",
    "edgemem.runtime.sampling",
]
# what the runtime package may import of edgemem itself (the manifest, file helpers, errors)
RUNTIME_MAY_USE = {"edgemem", "edgemem.config", "edgemem.errors", "edgemem.files", "edgemem.kinds", "edgemem.manifest"}


def test_runtime_imports_nothing_of_export_models_layers_ops_torch_or_onnx():
    code = textwrap.dedent(f"""
        import sys
        for name in {RUNTIME_MODULES!r}:
            __import__(name)
        loaded = set(sys.modules)
        heavy = {{"torch", "onnx", "onnxscript", "tensorrt", "cuda"}} & {{m.split(".")[0] for m in loaded}}
        assert not heavy, heavy
        outside = {{m for m in loaded if m.split(".")[0] == "edgemem" and m.split(".")[:2] != ["edgemem", "runtime"]}}
        outside -= {RUNTIME_MAY_USE!r}
        assert not outside, sorted(outside)
    """)
    subprocess.run([sys.executable, "-c", code], check=True)


def test_engine_runs_with_torch_and_onnx_unimportable(exports, tmp_path):
    """What an app on a device has: numpy, onnxruntime, safetensors — torch and onnx cannot even be imported."""
    code = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('torch', 'onnx', 'onnxscript'):
                    raise ImportError('blocked: ' + name)
        sys.meta_path.insert(0, Block())
        from edgemem.runtime import Engine
        engine = Engine.load({str(exports["titans-mag"])!r}, threads=1)
        stream = engine.new_stream()
        stream.prefill(b'hello')
        stream.step(1)
        stream.save({str(tmp_path / "s.safetensors")!r})
        assert engine.load_stream({str(tmp_path / "s.safetensors")!r}).position == 6
        print(engine.generate(b'ab', max_new_tokens=3))
        from edgemem.cli import main  # `edgemem run` and `edgemem bench --no-eager` too
        main(['run', {str(exports["titans-mag"])!r}, '--prompt', 'ab', '--max-new-tokens', '3'], standalone_mode=False)
        main(['bench', {str(exports["titans-mag"])!r}, '--no-eager', '--positions', '0,8', '--batch', '1,2',
              '--steps', '3', '--time-limit', '0.01', '--json', {str(tmp_path / "bench.json")!r}], standalone_mode=False)
        assert not {{'torch', 'onnx', 'onnxscript'}} & set(sys.modules)
    """)  # noqa: E501
    subprocess.run([sys.executable, "-c", code], check=True)
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [(r["position"], r["batch"]) for r in rows] == [(0, 1), (0, 2), (8, 1), (8, 2)]
    assert all(r["us_per_token"] > 0 and "eager_us_per_token" not in r for r in rows)


def test_verify_uses_the_runtime_initial_state():
    from edgemem.export import verify

    assert verify.initial_state is initial_state


# ---------------------------------------------------------------- numerics


@pytest.mark.parametrize("arch", ALL)
def test_prefill_then_steps_equals_whole_prefill(engines, arch):
    engine = engines[arch]
    assert engine.has_prefill
    ids = _ids(40)
    whole = engine.new_stream()
    expected = whole.prefill(ids)
    assert expected.shape == (40, engine.vocab_size)
    stream = engine.new_stream()
    first = stream.prefill(ids[:25], chunk_size=7)  # chunked prefill, then steps
    rows = [stream.step(int(t)) for t in ids[25:]]
    got = np.concatenate([first, np.stack(rows)])
    assert _close(got, expected)
    assert stream.position == whole.position == 40
    for name, value in whole.state_dict().items():
        assert _close(stream.state_dict()[name], value, 1e-4), name
    last = engine.new_stream().prefill(ids, chunk_size=7, all_logits=False)  # the last row of the last chunk
    assert last.shape == (engine.vocab_size,) and _close(last, expected[-1])


@pytest.mark.parametrize("arch", ["titans-mag", "softmax"])
def test_runtime_matches_pytorch(exports, engines, arch):
    import torch

    from edgemem.export.verify import rebuild

    engine = engines[arch]
    state = engine.new_stream().state_dict()
    if arch == "titans-mag":  # learned memory: the fresh stream starts from state_init.safetensors
        assert any(s.init == "file" for s in engine.manifest.state)
        assert any(np.abs(v).sum() > 0 for v in state.values())
    model = rebuild(load_manifest(exports[arch]))
    ids = _ids(30, seed=3)
    with torch.no_grad():
        expected, _ = model.prefill(torch.from_numpy(ids)[None], model.init_state(1))
    stream = engine.new_stream()
    got = np.concatenate([stream.prefill(ids[:20]), np.stack([stream.step(int(t)) for t in ids[20:]])])
    assert _close(got, expected[0].numpy())


def test_targets(engines, exports):
    assert engines["deltanet"].target == "ort"  # the default when exported
    generic = Engine.load(exports["deltanet"], target="generic", threads=1)
    ids = _ids(12)
    assert _close(generic.new_stream().prefill(ids), engines["deltanet"].new_stream().prefill(ids))
    with pytest.raises(BackendError, match=r"has no 'onnx27' target \(it has generic, ort\)"):
        Engine.load(exports["deltanet"], target="onnx27")
    with pytest.raises(ConfigError, match="threads"):
        Engine.load(exports["deltanet"], threads=0)


def test_ort_cuda_names_what_is_missing(exports):
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has CUDA")
    with pytest.raises(BackendError, match=r"CUDAExecutionProvider.*onnxruntime-gpu"):
        Engine.load(exports["deltanet"], backend="ort-cuda")


def test_fixed_state_ping_pongs_between_two_preallocated_buffers(engines):
    stream = engines["gated-deltanet"].new_stream()
    sides = [{k: v.data_ptr() for k, v in side.items()} for side in stream._bufs]
    for i in range(6):
        stream.step(i)
        current = {k: v.data_ptr() for k, v in stream._bufs[stream._side].items()}
        assert current == sides[(i + 1) % 2]  # A→B, B→A: the same two buffers, no new allocation
    assert sides == [{k: v.data_ptr() for k, v in side.items()} for side in stream._bufs]


# ---------------------------------------------------------------- stream lifecycle


@pytest.mark.parametrize("arch", ["deltanet", "titans-mag", "titans-mac", "softmax"])
def test_save_load_continue_is_bit_identical(engines, arch, tmp_path):
    engine = engines[arch]
    stream = engine.new_stream()
    stream.prefill(_ids(21))
    path = tmp_path / "s.safetensors"
    stream.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]  # no temp file left behind
    restored = engine.load_stream(path)
    assert restored.position == 21 and restored.state_bytes == stream.state_bytes
    assert np.array_equal(restored.logits, stream.logits)
    for token in _ids(8, seed=1):
        assert np.array_equal(restored.step(int(token)), stream.step(int(token)))


def test_checkpoint_is_safetensors_with_identity_and_position(engines, tmp_path):
    engine = engines["titans-mag"]
    stream = engine.new_stream()
    stream.prefill(b"abc")
    stream.save(tmp_path / "s.safetensors")
    with safe_open(tmp_path / "s.safetensors", "np") as f:
        meta = f.metadata()
        names = set(f.keys())
    assert meta["format"] == FORMAT and meta["identity"] == engine.manifest.identity() and meta["position"] == "3"
    assert names == {s.input for s in engine.manifest.state} | {"logits"}


def test_fork_is_independent(engines):
    engine = engines["titans-mag"]
    original = engine.new_stream()
    original.prefill(_ids(10))
    twin = engine.new_stream()  # the same history, never forked
    twin.prefill(_ids(10))
    fork = original.fork()
    assert fork.position == 10 and np.array_equal(fork.logits, original.logits)
    for t in _ids(5, seed=7):  # the fork goes elsewhere
        fork.step(int(t))
    for t in _ids(5, seed=8):
        assert np.array_equal(original.step(int(t)), twin.step(int(t)))
    assert fork.position == 15 and original.position == 15
    assert not np.array_equal(fork.logits, original.logits)


@pytest.mark.parametrize("arch", ["titans-mag", "softmax"])
def test_reset_is_a_fresh_stream(engines, arch):
    engine = engines[arch]
    stream = engine.new_stream()
    stream.prefill(_ids(9))
    stream.reset()
    assert stream.position == 0 and stream.logits is None
    for name, value in engine.new_stream().state_dict().items():
        assert np.array_equal(stream.state_dict()[name], value)
    assert np.array_equal(stream.step(5), engine.new_stream().step(5))


# ---------------------------------------------------------------- batching


@pytest.mark.parametrize("arch", RECURRENT)
def test_step_batch_equals_individual_steps(engines, arch):
    engine = engines[arch]
    streams = []
    for length in (3, 10, 17):  # different positions in one batch
        s = engine.new_stream()
        s.prefill(_ids(length, seed=length))
        streams.append(s)
    alone = [s.fork() for s in streams]
    tokens = _ids(3, seed=5)
    for _ in range(3):
        batched = engine.step_batch(streams, tokens)
        single = np.stack([s.step(int(t)) for s, t in zip(alone, tokens)])
        assert batched.shape == (3, engine.vocab_size)
        assert np.allclose(batched, single, rtol=1e-5, atol=1e-5)
        tokens = batched.argmax(-1)
    assert [s.position for s in streams] == [6, 13, 20]
    for s, a in zip(streams, alone):
        for name, value in a.state_dict().items():
            assert np.allclose(s.state_dict()[name], value, rtol=1e-5, atol=1e-5), name
        assert np.allclose(s.logits, a.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["longformer", "softmax"])
def test_batches_single_steps_forks_checkpoints_and_resets_mix_freely(engines, arch, tmp_path):
    """Random interleavings of step_batch (the same group again — no copy —, reordered groups, subsets),
    single steps, save/load, fork and reset: every stream equals a twin that is only ever stepped alone."""
    engine, rng = engines[arch], np.random.default_rng(1)
    grows = engine.grows  # softmax: batches need equal cache lengths, so every op keeps them equal
    streams = [engine.new_stream() for _ in range(4)]
    for i, s in enumerate(streams):
        s.prefill(_ids(6 if grows else 3 + 4 * i, seed=i))
    twins = [s.fork() for s in streams]

    def check(got, who, tokens):
        want = np.stack([twins[i].step(int(t)) for i, t in zip(who, tokens)])
        assert np.allclose(got, want, rtol=1e-5, atol=1e-5)

    for _ in range(40):
        op = int(rng.integers(6))
        tokens = rng.integers(0, 256, 4)
        if op <= 1:  # the whole group in order (op 0), or a reordered group or subset
            who = list(range(4)) if op == 0 else list(rng.permutation(4)[: 4 if grows else int(rng.integers(1, 5))])
            check(engine.step_batch([streams[i] for i in who], tokens[: len(who)]), who, tokens)
        elif op == 2:  # alone
            for i in range(4) if grows else [int(rng.integers(4))]:
                check(streams[i].step(int(tokens[i]))[None], [i], tokens[i : i + 1])
        elif op == 3:  # through a checkpoint
            i = int(rng.integers(4))
            streams[i].save(tmp_path / "s.safetensors")
            streams[i] = engine.load_stream(tmp_path / "s.safetensors")
        elif op == 4:  # through a fork; the original goes on elsewhere
            i = int(rng.integers(4))
            original, streams[i] = streams[i], streams[i].fork()
            original.step(7)
        elif not grows:  # reset
            i = int(rng.integers(4))
            streams[i].reset()
            twins[i].reset()
    for s, t in zip(streams, twins):
        assert s.position == t.position
        for name, value in t.state_dict().items():
            assert np.allclose(s.state_dict()[name], value, rtol=1e-5, atol=1e-5), name


def test_step_batch_of_growing_state_needs_equal_lengths(engines, tmp_path):
    engine = engines["softmax"]
    streams = [engine.new_stream() for _ in range(3)]
    for i, s in enumerate(streams):
        s.prefill(_ids(8, seed=i))
    alone = [s.fork() for s in streams]
    for k in range(3):  # the first batch gathers the caches; the next ones reuse the batch's output as is
        batched = engine.step_batch(streams, [1, 2, k])
        single = np.stack([s.step(t) for s, t in zip(alone, [1, 2, k])])
        assert np.allclose(batched, single, rtol=1e-5, atol=1e-5)
    assert all(s.state_bytes == 11 * engine.state_bytes_per_token for s in streams)
    streams[1].save(tmp_path / "s.safetensors")  # a stream whose cache is a row of the batch's
    assert np.array_equal(engine.load_stream(tmp_path / "s.safetensors").step(4), streams[1].fork().step(4))
    assert np.allclose(streams[0].step(4), alone[0].step(4), rtol=1e-5, atol=1e-5)  # steps alone from its row
    with pytest.raises(BatchError, match=r"caches of equal length, got lengths 11, 12.*max_length=N"):
        engine.step_batch(streams, [1, 2, 3])
    tail = engine.step_batch(streams[1:], [5, 6])  # the others still batch, in a new grouping
    assert np.allclose(tail, np.stack([alone[1].step(5), alone[2].step(6)]), rtol=1e-5, atol=1e-5)


def test_step_batch_refuses_bad_batches(engines):
    engine, other = engines["deltanet"], engines["gated-deltanet"]
    a, b = engine.new_stream(), engine.new_stream()
    with pytest.raises(BatchError, match="more than once"):
        engine.step_batch([a, a], [1, 2])
    with pytest.raises(BatchError, match="from this engine"):
        engine.step_batch([a, other.new_stream()], [1, 2])
    with pytest.raises(BatchError, match="2 streams but 3 token ids"):
        engine.step_batch([a, b], [1, 2, 3])
    with pytest.raises(TokenError, match="token id 256"):
        engine.step_batch([a, b], [1, 256])
    assert a.position == b.position == 0


# ---------------------------------------------------------------- refusals


def test_out_of_range_tokens_are_refused(engines):
    stream = engines["deltanet"].new_stream()
    stream.prefill([1, 2, 3])
    before = stream.state_dict()
    for bad in (-1, 256, 10**12):
        with pytest.raises(TokenError, match=rf"token id {bad} is outside the vocabulary \[0, 256\)"):
            stream.step(bad)
    for bad in (1.0, "a", None, True):
        with pytest.raises(TokenError, match="must be an integer"):
            stream.step(bad)
    with pytest.raises(TokenError, match=r"token id 300 at index 1 of the prompt is outside"):
        stream.prefill([5, 300, 7])
    with pytest.raises(TokenError, match="empty"):
        stream.prefill([])
    with pytest.raises(TokenError, match="integer token ids"):
        stream.prefill(np.array([1.5, 2.0]))
    with pytest.raises(TokenError, match="text"):
        stream.prefill("hello")
    assert stream.position == 3
    assert all(np.array_equal(v, stream.state_dict()[k]) for k, v in before.items())
    assert isinstance(TokenError("x"), EdgememError)


@pytest.fixture()
def saved(engines, tmp_path):
    stream = engines["deltanet"].new_stream()
    stream.prefill(_ids(5))
    path = tmp_path / "s.safetensors"
    stream.save(path)
    return path


def test_flipped_byte_is_refused(engines, saved):
    data = saved.read_bytes()
    header = int.from_bytes(data[:8], "little")
    for offset in (8 + header + 100, len(data) - 1, 8 + header // 2, 20):  # tensor data, last byte, header
        corrupt = bytearray(data)
        corrupt[offset] ^= 0x01
        saved.write_bytes(bytes(corrupt))
        with pytest.raises(StateFileError, match=r"corrupt|not a valid edgemem state file") as info:
            engines["deltanet"].load_stream(saved)
        assert str(saved) in str(info.value)


def test_truncated_file_is_refused(engines, saved):
    data = saved.read_bytes()
    for size in (0, 4, 40, len(data) // 2, len(data) - 1):
        saved.write_bytes(data[:size])
        with pytest.raises(StateFileError, match=r"truncated"):
            engines["deltanet"].load_stream(saved)


def test_state_of_another_model_is_refused(engines, saved):
    with pytest.raises(
        StateFileError, match=r"saved from another model \(arch deltanet.*this export is gated-deltanet"
    ):
        engines["gated-deltanet"].load_stream(saved)


def test_checkpoints_with_wrong_tensors_or_format_are_refused(engines, tmp_path):
    from safetensors.numpy import save_file

    engine = engines["deltanet"]
    state = engine.new_stream().state_dict()
    first = next(iter(state))
    path = tmp_path / "s.safetensors"
    path.write_bytes(encode_checkpoint(engine.manifest, {k: v for k, v in state.items() if k != first}, 0, None))
    with pytest.raises(StateFileError, match=rf"missing {first}"):
        engine.load_stream(path)
    path.write_bytes(encode_checkpoint(engine.manifest, {**state, first: state[first][..., :1]}, 0, None))
    with pytest.raises(StateFileError, match=rf"{first} has shape"):
        engine.load_stream(path)
    path.write_bytes(encode_checkpoint(engine.manifest, {**state, first: state[first].astype(np.float64)}, 0, None))
    with pytest.raises(StateFileError, match=rf"{first} is float64, expected float32"):
        engine.load_stream(path)
    save_file(state, path)  # a safetensors file, but not a checkpoint
    with pytest.raises(StateFileError, match="not an edgemem state checkpoint"):
        engine.load_stream(path)
    with pytest.raises(StateFileError, match="no such state file"):
        engine.load_stream(tmp_path / "missing.safetensors")


# ---------------------------------------------------------------- constant memory


def test_recurrent_state_and_rss_are_flat_over_20k_steps_while_softmax_grows(engines):
    """gated-deltanet (d_model 32, 1 layer): 20k steps in fixed memory; softmax's KV caches grow.

    RSS tolerance 1 MiB over the 20k measured steps (after 1k warm-up steps that let onnxruntime's
    arena and numpy's/Python's allocators settle): any per-step leak of 64 bytes or more, or any
    copy of the state kept per step (1.5 KiB here), would exceed it; below that is allocator noise.
    """
    engine = engines["gated-deltanet"]
    stream = engine.new_stream()
    start_bytes = stream.state_bytes
    for i in range(1000):
        stream.step(i % 256)
    rss = [rss_bytes()]
    for chunk in range(4):
        for i in range(5000):
            stream.step((i * 7 + chunk) % 256)
        rss.append(rss_bytes())
        assert stream.state_bytes == start_bytes
    assert stream.position == 21000
    assert max(rss) - min(rss) <= 1 << 20, [r - rss[0] for r in rss]

    softmax = engines["softmax"]
    grows = softmax.new_stream()
    before = rss_bytes()
    grows.prefill(_ids(10000), all_logits=False)  # prefill: 10k steps would copy the growing cache 10k times
    per_token = softmax.state_bytes_per_token
    assert per_token == 2 * 2 * 32 * 4  # key + value, d_model 32, 2 layers, fp32
    assert grows.state_bytes == 10000 * per_token == softmax.state_bytes(10000)
    for i in range(10):
        grows.step(i)
    assert grows.state_bytes == 10010 * per_token
    assert rss_bytes() - before >= 0.8 * grows.state_bytes  # the 5 MB of cache are really resident


def test_a_growing_cache_step_reuses_memory_instead_of_faulting_in_a_new_cache(engines):
    """softmax at 300k positions (37 MB per cache tensor, above glibc's 32 MB mmap ceiling): once
    warm, a step faults in fewer new pages than half its cache. Its new caches and temporaries come
    from onnxruntime's arena (measured: 0 or 0.25 cache per step) instead of fresh pages (1.6 caches
    per step with the arena off; at 16k positions of a 0.75B hybrid, 1.2 GB of them per step)."""
    import resource

    engine = engines["softmax"]
    position = 300_000
    state = {
        name: np.zeros([position if d == "past_sequence" else d for d in (1, *spec.shape[1:])], np.float32)
        for name, spec in ((s.input, s) for s in engine.manifest.state)
    }
    stream = engine.stream_from_state(state, position)
    del state
    cache_pages = stream.state_bytes // 4096
    faults = []
    for i in range(8):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        stream.step(i)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    assert stream.position == position + 8
    assert np.median(faults[3:]) < 0.5 * cache_pages, (faults, cache_pages)


# ---------------------------------------------------------------- generation and CLI


def test_generate_is_greedy_at_temperature_zero_and_reproducible_with_a_seed(engines):
    engine = engines["deltanet"]
    out = engine.generate(b"Hi", max_new_tokens=6)
    assert isinstance(out, bytes) and len(out) == 6
    reference = engine.new_stream()
    logits = reference.prefill(b"Hi")[-1]
    greedy = []
    for _ in range(6):
        greedy.append(int(logits.argmax()))
        logits = reference.step(greedy[-1])
    assert out == bytes(greedy)
    sampled = [engine.generate("Hi", 8, temperature=1.0, top_k=20, top_p=0.9, seed=s) for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]
    assert engine.generate(b"Hi", 6, temperature=0.7, top_k=1, seed=3) == out
    stream = engine.new_stream()
    first = stream.generate(b"Hi", 3)
    assert stream.position == 5 and first + stream.generate(b"", 3) == out  # continues where it stopped
    with pytest.raises(ConfigError, match="top_p"):
        engine.generate(b"Hi", 2, temperature=1.0, top_p=1.5)
    with pytest.raises(TokenError, match="nothing to continue from"):
        engine.new_stream().generate(b"", 2)


def test_cli_run_streams_bytes_and_continues_from_a_checkpoint(exports, engines, tmp_path):
    directory, state = str(exports["deltanet"]), str(tmp_path / "s.safetensors")
    runner = CliRunner()
    first = runner.invoke(main, ["run", directory, "--prompt", "ab", "--max-new-tokens", "10", "--save-state", state])
    assert first.exit_code == 0, first.output
    second = runner.invoke(main, ["run", directory, "--load-state", state, "--max-new-tokens", "5"])
    assert second.exit_code == 0, second.output
    assert first.stdout_bytes + second.stdout_bytes == engines["deltanet"].generate(b"ab", 15)
    assert "position 17" in second.stderr


def test_cli_errors_are_one_line(exports, tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 3)
    runner = CliRunner()
    for args in (
        ["run", str(exports["deltanet"]), "--load-state", str(bad)],
        ["run", str(exports["deltanet"]), "--load-state", str(tmp_path / "nope")],
        ["run", str(tmp_path), "--prompt", "x"],
        ["run", str(exports["deltanet"]), "--prompt", "x", "--backend", "ort-cuda"],
    ):
        result = runner.invoke(main, args)
        if "ort-cuda" in args and result.exit_code == 0:
            continue  # a machine with CUDA
        assert result.exit_code == 2, result.output
        assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
        assert "Traceback" not in result.output


def test_cli_bench_reports_runtime_eager_and_kv_baseline(exports, tmp_path):
    out = tmp_path / "bench.json"
    args = [
        "bench",
        str(exports["gated-deltanet"]),
        "--positions",
        "0,300",
        "--batch",
        "1,4",
        "--steps",
        "5",
        "--time-limit",
        "0.05",
        "--json",
        str(out),
    ]
    plot = tmp_path / "bench.png"
    try:
        import matplotlib  # noqa: F401

        args += ["--plot", str(plot)]
    except ImportError:
        plot = None
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["position"], r["batch"]) for r in rows] == [(0, 1), (0, 4), (300, 1), (300, 4)]
    for r in rows:
        assert r["us_per_token"] > 0 and r["tokens_per_s"] > 0 and r["eager_us_per_token"] > 0
        assert r["state_bytes"] == data["model"]["state_bytes_at_0"] and r["rss_bytes"] > 0
        assert r["softmax_kv_bytes"] == r["position"] * data["model"]["softmax_baseline"]["kv_bytes_per_token"]
    assert data["model"]["softmax_baseline"]["kv_bytes_per_token"] == 2 * 32 * 4
    assert data["environment"]["threads"] == 1
    target = data["model"]["target"]
    files = sum(f.stat().st_size for f in (exports["gated-deltanet"] / target).iterdir())
    # a 300 KB export may load into pages the worker already holds, so its load can add nothing
    assert data["model"]["file_bytes"] == files and isinstance(data["model"]["load_rss_bytes"], int)
    assert data["model"]["peak_rss_bytes"] >= max(data["model"]["load_rss_bytes"], 0)
    if plot is not None:
        assert plot.stat().st_size > 0
    printed = " ".join(result.stdout.split())  # the table's caption wraps at the terminal's width
    assert "gated-deltanet" in printed and "resident after load +" in printed and "peak +" in printed


def test_cli_bench_without_torch_says_to_pass_no_eager(exports, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # what `import torch` sees when torch is not installed
    result = CliRunner().invoke(main, ["bench", str(exports["gated-deltanet"]), "--positions", "0", "--batch", "1"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.strip() == (
        "error: the PyTorch eager baseline needs torch, which is not installed: pass "
        "--no-eager for the runtime alone, or install PyTorch"
    )


def test_sample_script_runs(exports, tmp_path):
    sample = Path(__file__).resolve().parents[1] / "samples" / "stream_decode.py"
    for resumed in (False, True):  # the second run resumes from the checkpoint of the first
        result = subprocess.run(
            [sys.executable, str(sample), str(exports["deltanet"]), "--state", str(tmp_path / "s.st")],
            check=False,
            capture_output=True,
        )  # generated bytes are not necessarily UTF-8
        assert result.returncode == 0, result.stderr.decode(errors="replace")
        assert (b"[resumed at position 96]" in result.stdout) == resumed  # 16-byte prompt + 64 + 16 bytes
        assert b"[restored" in result.stdout and (tmp_path / "s.st").is_file()

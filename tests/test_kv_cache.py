"""Preallocated KV cache (`max_length`): per-row positions, in-place writes, the max_length error,
the sliding window with attention sinks, and checkpoints of the filled part only."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from safetensors.numpy import load_file
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from edgemem.cli import main
from edgemem.errors import CacheFullError, ConfigError
from edgemem.export import export
from edgemem.layers import SoftmaxAttention
from edgemem.layers.common import rope
from edgemem.models import from_hf
from edgemem.models.lm import LM, LMConfig, set_kv_cache
from edgemem.runtime import Engine
from edgemem.runtime.errors import StateFileError
from edgemem.runtime.state import encode_checkpoint

VOCAB, LENGTH, SINKS = 61, 32, 3
POSITIONS = (10, 17, 24)


def _ids(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, n)


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _lm(layer_types: list[str], seed: int = 0) -> LM:
    softmax = dict(num_heads=4, num_kv_heads=2, qk_norm=True, output_gate=True, rotary_dim=4)
    config = LMConfig(
        arch="kv-" + "-".join(t[:3] for t in layer_types),
        mixer=layer_types[0],
        d_model=32,
        n_layers=len(layer_types),
        mlp_hidden=48,
        vocab_size=VOCAB,
        layer_types=layer_types,
        mixer_options=softmax if layer_types[0] == "softmax" else dict(num_heads=2),
        layer_type_options={"softmax": softmax},
    )
    torch.manual_seed(seed)
    return LM(config).eval()


def _qwen(path) -> LM:
    """A tiny random Qwen3.5 hybrid saved with transformers and imported (partial RoPE, q/k norms, gate, GQA)."""
    config = Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        rms_norm_eps=1e-6,
        eos_token_id=None,
        pad_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(3)
    hf = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn(p.shape) * 0.2 + (1.0 if "linear_attn.norm" in name else 0.0))
    hf.save_pretrained(path)
    return from_hf(path)


MODELS = {
    "softmax": lambda path: _lm(["softmax", "softmax"]),
    "hybrid": lambda path: _lm(["gated_deltanet", "softmax", "gated_deltanet"]),
    "qwen3.5": _qwen,
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{name: (eager model, export directory)}: each model with max_length 32 (error past it), and
    `window`: the softmax model with a 32-slot sliding window keeping 3 sinks. The exports take ~100 s
    on a contended 2-core CPU: the tests that use them are marked slow."""
    root = tmp_path_factory.mktemp("kv")
    out = {}
    for name, make in MODELS.items():
        model = make(root / f"{name}-hf")
        set_kv_cache(model, LENGTH)
        targets = ("generic", "ort", "onnx27", "trt") if name == "softmax" else ("generic", "ort")
        export(model, root / name, targets=targets)
        out[name] = (model, root / name)
    model = _lm(["softmax", "softmax"])
    set_kv_cache(model, LENGTH, SINKS)
    export(model, root / "window", targets=("generic", "ort"))
    out["window"] = (model, root / "window")
    return out


# ---------------------------------------------------------------- the layer


@pytest.mark.parametrize(
    "options", [{}, dict(num_kv_heads=2, qk_norm=True, output_gate=True, rotary_dim=4, head_dim=8)]
)
def test_preallocated_layer_equals_the_growing_one_at_random_splits(options):
    torch.manual_seed(0)
    growing = SoftmaxAttention(32, 4, **options).double()
    cached = SoftmaxAttention(32, 4, max_length=40, **options).double()
    cached.load_state_dict(growing.state_dict())
    x = torch.randn(3, 30, 32, dtype=torch.float64)
    reference = growing(x)
    assert (cached(x) - reference).abs().max() <= 1e-9
    for seed in range(3):
        cuts = sorted(torch.randperm(29, generator=torch.Generator().manual_seed(seed))[:3].add(1).tolist())
        state, outs = cached.init_state(3, dtype=torch.float64), []
        for a, b in zip([0, *cuts], [*cuts, 30]):
            if b - a == 1:
                y, state = cached.step(x[:, a], state)
                outs.append(y[:, None])
            else:
                y, state = cached.prefill(x[:, a:b], state)
                outs.append(y)
        assert (torch.cat(outs, 1) - reference).abs().max() <= 1e-9
        assert (
            state["key"].shape == (3, cached.num_kv_heads, 40, cached.head_dim)
            and state["position"].tolist() == [30] * 3
        )


def _streaming_llm(layer: SoftmaxAttention, x: torch.Tensor, length: int, sinks: int) -> torch.Tensor:
    """StreamingLLM token by token: a list of unrotated keys; when full, the oldest token after the sinks
    goes; keys and the query are rotated at their positions inside the cache (0 … n − 1)."""
    h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    rows = []
    for b in range(x.shape[0]):
        cache, outs = [], []
        for t in range(x.shape[1]):
            q, k, v = layer.qkv(x[b, t]).split(layer.split)
            gate = None
            if layer.output_gate:
                q, gate = q.view(h, 2, d).unbind(1)
            q, k, v = q.view(h, d), k.view(hkv, d), v.view(hkv, d)
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            cache.append((k, v))
            if len(cache) > length:
                del cache[sinks]
            n = len(cache)
            keys = torch.stack(
                [
                    rope(kk[None, :, None], torch.tensor([i]), layer.rope_theta, layer.rotary_dim)[0, :, 0]
                    for i, (kk, _) in enumerate(cache)
                ]
            )  # [n, H_kv, D]
            values = torch.stack([vv for _, vv in cache])
            qr = rope(q[None, :, None], torch.tensor([n - 1]), layer.rope_theta, layer.rotary_dim)[0, :, 0]
            y = []
            for head in range(h):
                g = head // (h // hkv)
                w = torch.softmax(keys[:, g] @ qr[head] / d**0.5, 0)
                y.append(w @ values[:, g])
            y = torch.cat(y)
            if gate is not None:
                y = y * torch.sigmoid(gate.reshape(-1))
            outs.append(layer.out(y))
        rows.append(torch.stack(outs))
    return torch.stack(rows)


@pytest.mark.parametrize("sinks", [0, 3])
def test_sink_window_equals_a_float64_streaming_llm_loop(sinks):
    torch.manual_seed(1)
    layer = SoftmaxAttention(
        32, 4, num_kv_heads=2, qk_norm=True, output_gate=True, rotary_dim=6, head_dim=8, max_length=12, sinks=sinks
    ).double()
    x = torch.randn(2, 40, 32, dtype=torch.float64)
    reference = _streaming_llm(layer, x, 12, sinks)
    assert (layer(x) - reference).abs().max() <= 1e-9  # a 40-token prefill: the ring wraps inside the block
    state, outs = layer.init_state(2, dtype=torch.float64), []
    for a, b in ((0, 5), (5, 6), (6, 25), (25, 26), (26, 40)):  # blocks longer than the ring and single steps
        y, state = layer.prefill(x[:, a:b], state)
        outs.append(y)
    assert (torch.cat(outs, 1) - reference).abs().max() <= 1e-9


def test_the_layer_refuses_tokens_past_max_length():
    layer = SoftmaxAttention(16, 2, max_length=8)
    _, state = layer.prefill(torch.randn(1, 6, 16), layer.init_state(1))
    with pytest.raises(CacheFullError, match=r"max_length=8.*position 6 cannot take 3"):
        layer.prefill(torch.randn(1, 3, 16), state)
    with pytest.raises(ConfigError, match="sinks"):
        SoftmaxAttention(16, 2, max_length=8, sinks=8)
    with pytest.raises(ConfigError, match="no softmax-attention layer"):
        set_kv_cache(_lm(["gated_deltanet"]), 8)


# ---------------------------------------------------------------- exports and the runtime


@pytest.mark.slow
def test_manifest_says_which_layout_and_the_targets_lower_as_documented(exported):
    manifest = Engine.load(exported["hybrid"][1]).manifest
    assert manifest.kv_cache == {
        "max_length": LENGTH,
        "overflow": "error",
        "sinks": 0,
        "in_place": ["ort"],
        "states": ["past_key_values.1.key", "past_key_values.1.value"],
    }
    shapes = {s.input: s.shape for s in manifest.state}
    assert shapes["past_key_values.1.key"] == ["batch", 2, LENGTH, 8] and shapes["past_key_values.1.position"] == [
        "batch"
    ]
    assert not manifest.genai["fits"] and any("position" in r for r in manifest.genai["reasons"])
    window = Engine.load(exported["window"][1]).manifest.kv_cache
    assert (window["overflow"], window["sinks"], window["in_place"]) == ("sink_window", SINKS, [])
    graphs = {t: onnx.load(exported["softmax"][1] / t / "step.onnx").graph for t in ("generic", "ort", "onnx27", "trt")}
    ops = {t: {(n.domain, n.op_type) for n in _nodes(g)} for t, g in graphs.items()}
    assert ("edgemem", "CacheAttention") in ops["generic"] and ("edgemem", "CacheAttention") in ops["onnx27"]
    assert ("com.microsoft", "GroupQueryAttention") in ops["ort"] and not any(d == "edgemem" for d, _ in ops["ort"])
    assert not any(d for d, _ in ops["trt"])  # no plugin for it: the function body, inlined
    # 4 query heads on 2 KV heads: a batch-1 step folds them into 2 heads of 2 tokens, else the plain op
    choices = [n for n in graphs["ort"].node if n.op_type == "If"]
    assert len(choices) == 2  # one per softmax layer
    heads = {
        a.name: [
            onnx.helper.get_attribute_value(x)
            for n in a.g.node
            if n.op_type == "GroupQueryAttention"
            for x in n.attribute
            if x.name == "num_heads"
        ]
        for a in choices[0].attribute
    }
    assert heads == {"then_branch": [2], "else_branch": [4]}


def _nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """Every node of `graph`, those of its subgraphs (If branches) included."""
    return [
        m
        for n in graph.node
        for m in (n, *(m for a in n.attribute if a.type == onnx.AttributeProto.GRAPH for m in _nodes(a.g)))
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["softmax", "hybrid", "qwen3.5", "window"])
@pytest.mark.parametrize("target", ["ort", "generic"])
def test_step_batch_at_positions_10_17_24_equals_each_stream_alone(exported, name, target):
    directory = exported[name][1]
    engine = Engine.load(directory, target=target, threads=1)
    tokens = _ids(50, seed=1)
    positions = (10, 30, 41) if name == "window" else POSITIONS  # the window: before, at and past the wrap
    streams = []
    for p in positions:
        s = engine.new_stream()
        s.prefill(tokens[:p], chunk_size=7)
        streams.append(s)
    alone = [s.fork() for s in streams]
    step = tokens[list(positions)]
    for _ in range(4):
        batched = engine.step_batch(streams, step)
        single = np.stack([s.step(int(t)) for s, t in zip(alone, step)])
        assert _rel(batched, single) <= 1e-5
        step = batched.argmax(-1)
    caches = engine.manifest.kv_cache["states"]
    for s, a in zip(streams, alone):
        assert s.position == a.position
        filled = min(s.position, LENGTH)  # slots past the position are unspecified (runtime.base)
        for n, value in a.state_dict().items():
            got = s.state_dict()[n]
            if n in caches:
                got, value = got[:, :, :filled], value[:, :, :filled]
            assert np.allclose(got, value, rtol=1e-5, atol=1e-6), n


@pytest.mark.slow
@pytest.mark.parametrize("name", ["softmax", "hybrid", "qwen3.5", "window"])
def test_runtime_equals_pytorch_at_random_splits(exported, name):
    model, directory = exported[name]
    n = 44 if name == "window" else LENGTH
    tokens = _ids(n, seed=2)
    with torch.no_grad():
        reference = model(torch.tensor(tokens[None]))[0].numpy()
    for target in ("ort", "generic"):
        s = Engine.load(directory, target=target, threads=1).new_stream()
        got = np.concatenate(
            [
                s.prefill(tokens[:9], chunk_size=4),
                np.stack([s.step(int(t)) for t in tokens[9:12]]),
                s.prefill(tokens[12:n], chunk_size=13),
            ]
        )
        assert _rel(got, reference) <= 1e-4, target


@pytest.mark.slow
def test_onnx27_and_trt_graphs_run_the_same_cache(exported):
    """The standard-op forms: onnx27's ai.onnx graph and the trt graph with the body inlined (onnxruntime runs both)."""
    import onnxruntime as ort

    model, directory = exported["softmax"]
    tokens = _ids(20, seed=3)
    with torch.no_grad():
        state = {f"past_key_values.{k}": v.numpy() for k, v in model.init_state(1).items()}
        reference = model(torch.tensor(tokens[None]))[0].numpy()
    for target in ("onnx27", "trt"):
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        prefill = ort.InferenceSession(str(directory / target / "prefill.onnx"), options)
        step = ort.InferenceSession(str(directory / target / "step.onnx"), options)
        names = [o.name for o in prefill.get_outputs()]
        out = dict(zip(names, prefill.run(None, {"input_ids": tokens[None, :15], **state})))
        logits = [out["logits"][0]]
        for t in tokens[15:]:
            feed = {k: out["present." + k[len("past_key_values.") :]] for k in state}
            out = dict(zip(names, step.run(None, {"input_ids": np.array([[t]]), **feed})))
            logits.append(out["logits"][0])
        assert _rel(np.concatenate(logits), reference) <= 1e-4, target


@pytest.mark.slow
def test_ort_writes_the_cache_in_place_at_fixed_addresses(exported):
    engine = Engine.load(exported["hybrid"][1], target="ort", threads=1)
    caches = engine.manifest.kv_cache["states"]
    s = engine.new_stream()
    s.prefill(_ids(5))
    one = {n: s._bufs[0][n].data_ptr() for n in caches}
    assert one == {n: s._bufs[1][n].data_ptr() for n in caches}  # one buffer, input and output
    before = s.state_dict()
    for i in range(6):
        s.step(i)
        assert {n: s._bufs[s._side][n].data_ptr() for n in caches} == one
        assert all(np.shares_memory(s._read(n), s._bufs[0][n].numpy()) for n in caches)
    after = s.state_dict()
    for n in caches:  # rows 0..4 untouched, 5..10 written; the folded batch-1 step (2 query heads per KV head)
        # writes its token twice, at 10 and 11 (the next token overwrites 11); the rest still empty
        assert np.array_equal(after[n][:, :, :5], before[n][:, :, :5])
        assert np.abs(after[n][:, :, 5:11]).sum(axis=(0, 1, 3)).all()
        assert np.array_equal(after[n][:, :, 11], after[n][:, :, 10])
        assert not after[n][:, :, 12:].any()
    streams = [engine.new_stream() for _ in range(3)]
    engine.step_batch(streams, [1, 2, 3])
    slot = engine._slots[3]
    fixed = {n: slot.bufs[0][n].data_ptr() for n in caches}
    assert fixed == {n: slot.bufs[1][n].data_ptr() for n in caches}
    for i in range(4):
        engine.step_batch(streams, [i, i, i])
        assert {n: slot.bufs[slot.side][n].data_ptr() for n in caches} == fixed
    generic = Engine.load(exported["hybrid"][1], target="generic", threads=1).new_stream()
    assert generic._bufs[0][caches[0]].data_ptr() != generic._bufs[1][caches[0]].data_ptr()  # a full rewrite: two sides


@pytest.mark.slow
def test_ort_steps_of_four_query_heads_per_kv_head_match_pytorch_to_the_last_slot(tmp_path):
    """Qwen3.5's grouping (8 query heads, 2 KV heads): batch-1 steps fold 4 query heads into one read
    of their KV head while p + 4 <= L, the last 3 slots take the plain op, a batch always does."""
    softmax = dict(num_heads=8, num_kv_heads=2, head_dim=8, rotary_dim=4)
    config = LMConfig(
        arch="kv-gqa4", mixer="softmax", d_model=32, n_layers=1, mlp_hidden=48, vocab_size=VOCAB, mixer_options=softmax
    )
    torch.manual_seed(5)
    model = LM(config).eval()
    set_kv_cache(model, 16)
    export(model, tmp_path, targets=("ort",))
    tokens = _ids(16, seed=4)
    with torch.no_grad():
        reference = model(torch.tensor(tokens[None]))[0].numpy()
    engine = Engine.load(tmp_path, target="ort", threads=1)
    s = engine.new_stream()
    got = np.concatenate([s.prefill(tokens[:2]), np.stack([s.step(int(t)) for t in tokens[2:]])])
    assert _rel(got, reference) <= 1e-5
    pair = [engine.new_stream() for _ in range(2)]
    for p in pair:
        p.prefill(tokens[:5])
    assert _rel(engine.step_batch(pair, tokens[[5, 5]]), np.stack([reference[5]] * 2)) <= 1e-5


@pytest.mark.slow
def test_past_max_length_is_a_clear_error_and_the_stream_stays_usable(exported):
    engine = Engine.load(exported["hybrid"][1], target="ort", threads=1)
    s = engine.new_stream()
    s.prefill(_ids(LENGTH - 1))
    with pytest.raises(
        CacheFullError, match=rf"max_length={LENGTH}.*position {LENGTH - 1} cannot take 2 more.*--sinks"
    ):
        s.prefill(_ids(2))
    last = s.step(7)
    assert s.position == LENGTH
    with pytest.raises(CacheFullError, match="cannot take 1 more"):
        s.step(7)
    other = engine.new_stream()
    with pytest.raises(CacheFullError):
        engine.step_batch([other, s], [1, 2])
    assert other.position == 0 and s.position == LENGTH and np.array_equal(s.logits, last)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hybrid", "window"])
def test_checkpoint_holds_the_filled_part_and_round_trips_exactly(exported, tmp_path, name):
    engine = Engine.load(exported[name][1], target="ort", threads=1)
    caches = engine.manifest.kv_cache["states"]
    tokens = _ids(45, seed=4)
    sizes = {}
    for n in (4, 12, 20):
        s = engine.new_stream()
        s.prefill(tokens[:n])
        s.save(tmp_path / f"{n}.safetensors")
        sizes[n] = (tmp_path / f"{n}.safetensors").stat().st_size
        stored = load_file(tmp_path / f"{n}.safetensors")
        assert all(stored[c].shape == (1, 2, n, 8) for c in caches)  # the filled rows only
        loaded = engine.load_stream(tmp_path / f"{n}.safetensors")
        for key, value in s.state_dict().items():
            assert np.array_equal(loaded.state_dict()[key], value), key
        for t in tokens[n : n + 3]:
            assert np.array_equal(loaded.step(int(t)), s.step(int(t)))
    per_token = sum(2 * 8 * 4 for _ in caches)  # H_kv · D · fp32 per cache
    for a, b in ((4, 12), (12, 20)):  # file size ∝ filled part (the JSON header differs by a few digits)
        assert 0 <= sizes[b] - sizes[a] - (b - a) * per_token < 32
    if name == "window":  # past max_length the whole window is the filled part
        s = engine.new_stream()
        s.prefill(tokens[:40])
        s.save(tmp_path / "40.safetensors")
        assert all(
            v.shape == (1, 2, LENGTH, 8) for k, v in load_file(tmp_path / "40.safetensors").items() if k in caches
        )
        assert 0 <= (tmp_path / "40.safetensors").stat().st_size - sizes[20] - (LENGTH - 20) * per_token < 32
        assert np.array_equal(engine.load_stream(tmp_path / "40.safetensors").step(5), s.step(5))


@pytest.mark.slow
def test_a_checkpoint_with_a_cache_of_the_wrong_length_is_refused(exported, tmp_path):

    engine = Engine.load(exported["hybrid"][1], target="ort", threads=1)
    s = engine.new_stream()
    s.prefill(_ids(6))
    s.save(tmp_path / "a.safetensors")
    state = load_file(tmp_path / "a.safetensors")
    state.pop("logits")
    bad = encode_checkpoint(
        engine.manifest, {k: v for k, v in state.items()}, 9, None
    )  # filled part says 6, position 9
    (tmp_path / "b.safetensors").write_bytes(bad)
    with pytest.raises(
        StateFileError, match=r"past_key_values.1.key has shape \[1, 2, 6, 8\], expected its filled part \[1, 2, 9, 8\]"
    ):
        engine.load_stream(tmp_path / "b.safetensors")


@pytest.mark.slow
def test_cli_export_max_length_and_sinks(tmp_path):
    result = CliRunner().invoke(main, ["export", "--arch", "softmax", "--out", str(tmp_path / "a"), "--sinks", "4"])
    assert result.exit_code != 0 and "--sinks needs --max-length" in result.output
    result = CliRunner().invoke(
        main,
        [
            "export",
            "--arch",
            "softmax",
            "--out",
            str(tmp_path / "b"),
            "--target",
            "ort",
            "--set",
            "d_model=32",
            "--set",
            "n_layers=1",
            "--set",
            "mlp_hidden=32",
            "--max-length",
            "64",
            "--sinks",
            "4",
        ],
    )
    assert result.exit_code == 0, result.output
    engine = Engine.load(tmp_path / "b")
    assert engine.manifest.kv_cache["max_length"] == 64 and engine.manifest.config["mixer_options"]["sinks"] == 4
    s = engine.new_stream()
    s.prefill(_ids(70))  # past max_length: the window slides
    assert s.position == 70
    result = CliRunner().invoke(main, ["verify", str(tmp_path / "b"), "--threads", "1"])  # rebuilt with the same cache
    assert result.exit_code == 0 and "checks within tolerance" in result.output, result.output


def test_a_preallocated_cache_converts_to_and_from_the_transformers_layout(tmp_path):
    from edgemem.models.hf.cache import from_external, to_external

    model = _qwen(tmp_path)
    growing = _qwen(tmp_path)  # same weights, growing cache
    set_kv_cache(model, LENGTH)
    ids = torch.tensor(_ids(14)[None].repeat(2, 0))
    with torch.no_grad():
        _, state = model.prefill(ids, model.init_state(2))
        _, grown = growing.prefill(ids, growing.init_state(2))
    layers = to_external(model, state)
    assert layers[1]["keys"].shape == (2, 2, 14, 16)
    assert torch.allclose(layers[1]["keys"], to_external(growing, grown)[1]["keys"], atol=1e-6)
    back = from_external(model, layers)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    state["1.position"][1] = 9
    with pytest.raises(ConfigError, match="at one position"):
        to_external(model, state)


@pytest.mark.slow
def test_a_malformed_kv_cache_entry_is_refused(exported, tmp_path):
    import json
    import shutil

    from edgemem.manifest import ManifestError

    directory = shutil.copytree(exported["hybrid"][1], tmp_path / "copy")
    manifest = json.loads((directory / "edgemem.json").read_text())
    manifest["kv_cache"]["states"] = ["past_key_values.9.key"]
    (directory / "edgemem.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="kv_cache is .*expected max_length"):
        Engine.load(directory)

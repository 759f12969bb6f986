"""The prefill graphs of Titans MAC and HOPE: an ONNX Loop over segments whose body is the traced
one-segment prefill.

Exported (two layers, segments of 4 tokens — HOPE's memory chunk 4 and CMS periods 4, 8, 16 — so
short prompts cross many segment and period boundaries) and run
by onnxruntime; references: the PyTorch model's own prefill and a float64 token-by-token loop of its
steps; onnx.reference runs the same graph as a second, independent ONNX runtime. A hand-made piece
graph checks the Loop itself: every piece within one segment, rows in order.
"""

from __future__ import annotations

import copy
import importlib.util
import random
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from conftest import TARGETS, export_presets
from onnx.reference import ReferenceEvaluator
from test_protocol import split_points

from edgemem.errors import EdgememError
from edgemem.export.segments import loop_over_segments, position_input, prefill_segment
from edgemem.export.verify import rebuild, verify
from edgemem.layers import TitansMAC
from edgemem.manifest import load
from edgemem.models import LM, LMConfig, build
from edgemem.runtime import Engine
from edgemem.runtime.state import initial_state

ROOT = Path(__file__).resolve().parents[1]

SEGMENT = 4
OVERRIDES = {"d_model": 32, "n_layers": 2, "mlp_hidden": 32, "chunk_size": SEGMENT}
LOOPED = {"titans-mac": OVERRIDES, "hope": {"d_model": 32, "n_layers": 2, "chunk_size": SEGMENT, "levels": [4, 8, 16]}}
ONNXRUNTIME_TARGETS = ["generic", "ort", "onnx27"]


@pytest.fixture(scope="module")
def exports(request, tmp_path_factory):
    return export_presets(request, tmp_path_factory, "looped-prefill", {a: (o, TARGETS) for a, o in LOOPED.items()})


@pytest.fixture(scope="module", params=list(LOOPED))
def directory(request, exports):
    return exports[request.param]


@pytest.fixture(scope="module")
def model(directory):
    return rebuild(load(directory))


@pytest.fixture(scope="module")
def model64(model):
    return copy.deepcopy(model).double()


def _session(directory, target, kind):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(directory / target / f"{kind}.onnx"), options, providers=["CPUExecutionProvider"])


def _graph_run(session, ids: np.ndarray, state: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    names = list(state)
    out = session.run(None, {"input_ids": ids, **state})
    return out[0], dict(zip(names, out[1:]))


def _stepped_fp64(model: LM, ids: torch.Tensor, start: int) -> tuple[np.ndarray, dict[str, np.ndarray], dict]:
    """A float64 model one token at a time from a fresh stream: the logits from `start` on, the final state
    and the state at `start`."""
    with torch.no_grad():
        state, rows, at_start = model.init_state(ids.shape[0]), [], None
        for t in range(ids.shape[1]):
            if t == start:
                at_start = state
            logits, state = model.step(ids[:, t], state)
            rows.append(logits)
    return torch.stack(rows[start:], dim=1).numpy(), {k: v.numpy() for k, v in state.items()}, at_start


def _feeds(manifest, state) -> dict[str, np.ndarray]:
    return {
        s.input: np.ascontiguousarray(v.detach().numpy() if isinstance(v, torch.Tensor) else v, dtype=s.dtype)
        for s, v in zip(manifest.state, state.values())
    }


def _close(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    scale = max(float(np.abs(expected).max()), 1e-6)
    err = float(np.abs(got.astype(np.float64) - expected).max()) / scale
    assert err <= 1e-4, f"{what}: relative error {err:.2e}"


def test_prefill_segment_is_mac_segment_and_divides_every_layer_segment():
    assert prefill_segment(build("titans-mac", seed=0, **OVERRIDES)) == SEGMENT
    assert prefill_segment(build("hope", seed=0, **LOOPED["hope"])) == SEGMENT
    assert prefill_segment(build("hope", seed=0, d_model=32, chunk_size=6, levels=[8, 12])) == 2
    assert prefill_segment(build("deltanet", seed=0, d_model=32, mlp_hidden=32)) == 0
    hybrid = LM(
        LMConfig(
            arch="hybrid",
            mixer="titans_mac",
            d_model=32,
            n_layers=2,
            mlp_hidden=0,
            mixer_options={"num_heads": 4, "chunk_size": 6},
            layer_types=["titans_mac", "deltanet"],
            layer_type_options={"deltanet": {"num_heads": 4}},
        )
    )
    assert prefill_segment(hybrid) == 6 and position_input(hybrid) == "past_key_values.0.position"
    hybrid.blocks[1].mixer = TitansMAC(32, 4, chunk_size=4)  # pieces must stop at every multiple of 4 and of 6
    assert prefill_segment(hybrid) == 2


@pytest.mark.parametrize("target", ONNXRUNTIME_TARGETS)
def test_exported_prefill_equals_eager_prefill_and_fp64_steps_across_segments(directory, model, model64, target):
    manifest = load(directory)
    assert manifest.graphs == {"prefill": True, "step": True}
    session = _session(directory, target, "prefill")
    rng = random.Random(0)
    # (start position, prompt length): at and off segment starts, crossing up to 6 boundaries, one token
    cases = [(0, 23), (3, 1), (4, 4), (5, 3), (7, 18)] + [(rng.randint(0, 30), rng.randint(2, 25)) for _ in range(4)]
    for start, length in cases:
        ids = torch.randint(0, manifest.vocab_size, (2, start + length), generator=torch.Generator().manual_seed(start))
        logits64, state64, at_start = _stepped_fp64(model64, ids, start)
        with torch.no_grad():
            eager, eager_state = model.prefill(
                ids[:, start:], {k: v.float() if v.is_floating_point() else v for k, v in at_start.items()}
            )
        logits, state = _graph_run(session, ids[:, start:].numpy(), _feeds(manifest, at_start))
        assert logits.shape == (2, length, manifest.vocab_size)
        _close(logits, eager.numpy(), f"{target} {start}+{length} logits vs eager prefill")
        _close(logits, logits64, f"{target} {start}+{length} logits vs fp64 steps")
        for spec, (name, value) in zip(manifest.state, state.items()):
            _close(value, eager_state[name.removeprefix("past_key_values.")].numpy(), f"{spec.input} vs eager")
            _close(value, state64[name.removeprefix("past_key_values.")], f"{spec.input} vs fp64 steps")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exported_forward_equals_prefill_and_steps_at_random_splits(directory, seed):
    manifest = load(directory)
    prefill, step = _session(directory, "ort", "prefill"), _session(directory, "ort", "step")
    ids = np.random.default_rng(seed).integers(0, manifest.vocab_size, (2, 37))
    state0 = initial_state(manifest, directory, 2)
    whole, whole_state = _graph_run(prefill, ids, state0)
    rows, state = [], state0
    for kind, a, b in split_points(37, seed):
        logits, state = _graph_run(prefill if kind == "prefill" else step, ids[:, a:b], state)
        rows.append(logits)
    _close(np.concatenate(rows, axis=1), whole, "logits")
    for name in state:
        _close(state[name], whole_state[name], name)


def test_onnx_reference_runs_the_generic_prefill_like_onnxruntime(directory):
    manifest = load(directory)
    ids = np.random.default_rng(3).integers(0, manifest.vocab_size, (1, 9))
    state = initial_state(manifest, directory, 1)
    _, state = _graph_run(_session(directory, "generic", "prefill"), ids[:, :2], state)  # start mid-segment
    expected = _session(directory, "generic", "prefill").run(None, {"input_ids": ids[:, 2:], **state})
    got = ReferenceEvaluator(onnx.load(directory / "generic" / "prefill.onnx")).run(
        None, {"input_ids": ids[:, 2:], **state}
    )
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _nodes(a.g)


@pytest.mark.parametrize("target", TARGETS)
def test_prefill_graph_is_one_loop_over_segments_holding_the_lowered_nodes(directory, target):
    model = onnx.load(directory / target / "prefill.onnx")
    assert [n.op_type for n in model.graph.node].count("Loop") == 1
    assert not [n for n in model.graph.node if n.domain == "edgemem"]  # the layers' nodes run inside the Loop
    inside = [n for n in _nodes(model.graph) if n.domain == "edgemem"]
    memories = {"titans-mac": 1, "hope": 4}[load(directory).arch]  # per layer; hope: its memory and 3 CMS levels
    assert [n.op_type for n in inside] == ["NeuralMemory"] * 2 * memories
    functions = {f.name for f in model.functions if f.domain == "edgemem"}
    if target == "trt":  # TensorRT's parser takes the plugins: attributes on the nodes, no local functions
        assert not functions
        attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in inside]
        assert all(a["plugin_namespace"] == b"edgemem" and a["plugin_version"] == b"1" for a in attrs)
    else:
        assert functions == {"NeuralMemory"}
    assert [i.name for i in model.graph.input] == [
        i.name for i in onnx.load(directory / target / "step.onnx").graph.input
    ]


def test_verify_checks_the_prefill_graph_on_every_onnxruntime_target(directory):
    checks, skipped = verify(directory, threads=1, prompt=13, steps=6)
    assert set(skipped) == {"trt"}
    assert {(c.target, c.graph) for c in checks} >= {
        (t, g) for t in ONNXRUNTIME_TARGETS for g in ("prefill", "prefill≡step")
    }
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_runtime_prefills_a_prompt_in_one_graph_run_per_chunk(directory, monkeypatch):
    engine = Engine.load(directory, threads=1)
    assert engine.has_prefill
    runs = []
    run = engine._run
    monkeypatch.setattr(engine, "_run", lambda kind, binding: (runs.append(kind), run(kind, binding))[1])
    ids = np.random.default_rng(4).integers(0, engine.vocab_size, 45)
    one = engine.new_stream().prefill(ids)
    assert runs == ["prefill"]
    runs.clear()
    chunked = engine.new_stream()
    parts = [
        chunked.prefill(ids[:3], chunk_size=2),
        chunked.prefill(ids[3:30], chunk_size=7),
        chunked.prefill(ids[30:], chunk_size=5),
    ]
    assert runs == ["prefill"] * (2 + 4 + 3)
    stepped = engine.new_stream()
    rows = np.stack([stepped.step(int(t)) for t in ids])
    _close(np.concatenate(parts), one, "odd chunks vs one call")
    _close(rows, one, "steps vs one call")
    assert chunked.position == stepped.position == 45
    for spec in engine.manifest.state:
        _close(chunked._read(spec.input), stepped._read(spec.input), spec.input)


def test_loop_over_segments_refuses_a_graph_without_the_position(directory):
    piece = onnx.load(directory / "generic" / "step.onnx")
    with pytest.raises(EdgememError, match="lacks"):
        loop_over_segments(piece, SEGMENT, "past_key_values.9.position", ["input_ids"])
    with pytest.raises(EdgememError, match="no int64 `position` state"):
        position_input(build("deltanet", seed=0, d_model=32, mlp_hidden=32))


def _toy_piece(rank3: bool = True) -> onnx.ModelProto:
    """A piece graph made by hand: logits[b, t] = 1000·id + position (read inside an If, from the outer
    scope), and states: the position, the number of pieces run and how many segment boundaries a piece crossed."""
    from onnx import TensorProto as T
    from onnx import helper as h

    c = lambda name, v: h.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.array(v, np.int64)))  # noqa: E731
    branch = h.make_graph(
        [h.make_node("Cast", ["input_ids"], ["ids_f"], to=T.FLOAT)],
        "read",
        [],
        [h.make_tensor_value_info("ids_f", T.FLOAT, None)],
    )
    nodes = [
        c("one", 1),
        c("zero", 0),
        c("axis1", [1]),
        c("axis2", [2]),
        c("segment", SEGMENT),
        c("thousand", 1000),
        h.make_node("Shape", ["input_ids"], ["n1"], start=1, end=2),
        h.make_node("Squeeze", ["n1"], ["n"]),
        h.make_node("Range", ["zero", "n", "one"], ["steps"]),
        h.make_node("Unsqueeze", ["past_key_values.position", "axis1"], ["pos_col"]),
        h.make_node("Add", ["pos_col", "steps"], ["positions"]),
        h.make_node("Constant", [], ["yes"], value=onnx.numpy_helper.from_array(np.array(True))),
        h.make_node("If", ["yes"], ["ids_read"], then_branch=branch, else_branch=branch),
        h.make_node("Cast", ["positions"], ["positions_f"], to=T.FLOAT),
        h.make_node("Cast", ["thousand"], ["thousand_f"], to=T.FLOAT),
        h.make_node("Mul", ["ids_read", "thousand_f"], ["scaled"]),
        h.make_node("Add", ["scaled", "positions_f"], ["flat_logits"]),
        h.make_node("Unsqueeze", ["flat_logits", "axis2"], ["logits"])
        if rank3
        else h.make_node("Identity", ["flat_logits"], ["logits"]),
        h.make_node("Add", ["past_key_values.position", "n"], ["present.position"]),
        h.make_node("Add", ["past_key_values.pieces", "one"], ["present.pieces"]),
        h.make_node("Div", ["positions", "segment"], ["segments"]),
        h.make_node("ReduceMax", ["segments", "axis1"], ["last"], keepdims=0),
        h.make_node("ReduceMin", ["segments", "axis1"], ["first"], keepdims=0),
        h.make_node("Sub", ["last", "first"], ["crossed"]),
        h.make_node("Add", ["past_key_values.crossings", "crossed"], ["present.crossings"]),
    ]
    graph = h.make_graph(
        nodes,
        "toy",
        [
            h.make_tensor_value_info("input_ids", T.INT64, ["batch", "sequence"]),
            *(
                h.make_tensor_value_info(f"past_key_values.{k}", T.INT64, ["batch"])
                for k in ("position", "pieces", "crossings")
            ),
        ],
        [
            h.make_tensor_value_info("logits", T.FLOAT, ["batch", "sequence", 1] if rank3 else ["batch", "sequence"]),
            *(
                h.make_tensor_value_info(f"present.{k}", T.INT64, ["batch"])
                for k in ("position", "pieces", "crossings")
            ),
        ],
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 20)])


@pytest.mark.parametrize("rank3", [True, False])
def test_loop_over_segments_runs_each_piece_within_one_segment_and_puts_rows_in_order(rank3):
    import onnxruntime as ort

    model = loop_over_segments(_toy_piece(rank3), SEGMENT, "past_key_values.position", ["input_ids"])
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    reference = ReferenceEvaluator(model)
    rng = np.random.default_rng(5)
    for start, length in [(0, 1), (0, 4), (3, 1), (3, 2), (5, 11), (8, 9), (2, 30)]:
        ids = rng.integers(0, 256, (2, length))
        starts = np.array([start, start + 3 * SEGMENT])  # rows a multiple of the segment apart share the pieces
        feeds = {
            "input_ids": ids,
            "past_key_values.position": starts,
            "past_key_values.pieces": np.zeros(2, np.int64),
            "past_key_values.crossings": np.zeros(2, np.int64),
        }
        expected = ids * 1000.0 + starts[:, None] + np.arange(length)
        for runtime, run in (("onnxruntime", session.run), ("onnx.reference", reference.run)):
            logits, position, pieces, crossings = run(None, feeds)
            np.testing.assert_array_equal(logits[..., 0] if rank3 else logits, expected, err_msg=runtime)
            assert list(position) == list(starts + length) and list(crossings) == [0, 0], runtime
            assert list(pieces) == [-(-(start % SEGMENT + length) // SEGMENT)] * 2, runtime
            logits = run(None, {**feeds, "past_key_values.position": np.array([start, start + 1])})[0]
            assert np.isfinite(logits[0]).all() and np.isnan(logits[1]).all(), runtime  # other pieces needed: NaN


def test_rows_at_positions_a_segment_apart_share_the_pieces_and_others_come_out_nan(directory, model):
    manifest = load(directory)
    session = _session(directory, "ort", "prefill")
    ids = torch.randint(0, manifest.vocab_size, (2, 16), generator=torch.Generator().manual_seed(9))
    rows = []
    with torch.no_grad():
        for row, start in enumerate((1, 1 + 2 * SEGMENT)):  # each row alone, eagerly, from its own position
            state = model.init_state(1)
            _, state = model.prefill(ids[row : row + 1, :start], state)
            rows.append((state, *model.prefill(ids[row : row + 1, start : start + 6], state)))
    both = {k: torch.cat([rows[0][0][k], rows[1][0][k]]) for k in rows[0][0]}
    logits, state = _graph_run(session, np.stack([ids[0, 1:7].numpy(), ids[1, 9:15].numpy()]), _feeds(manifest, both))
    for row in (0, 1):
        _close(logits[row], rows[row][1][0].numpy(), f"row {row} logits")
        for name, value in state.items():
            expected = rows[row][2][name.removeprefix("past_key_values.")][0].numpy()
            _close(value[row], expected, f"row {row} {name}")
    # one position further: the second row's segments are cut elsewhere, so it cannot share the Loop
    both["0.position"] = both["1.position"] = torch.tensor([1, 10])
    logits, state = _graph_run(session, logits.argmax(-1), _feeds(manifest, both))
    assert np.isfinite(logits[0]).all() and np.isnan(logits[1]).all()
    for name, value in state.items():
        if value.dtype.kind == "f":
            assert np.isfinite(value[0]).all() and np.isnan(value[1]).all(), name


def test_titans_mac_prefill_sample_measures_a_prefill_equal_to_stepping(small_exports):
    """samples/titans_mac_prefill.py's measurement on the small titans-mac export: the prefill graph's logits
    are the stepped logits, for prompts that cross segment boundaries."""
    spec = importlib.util.spec_from_file_location("titans_mac_prefill", ROOT / "samples" / "titans_mac_prefill.py")
    sample = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sample)
    report = sample.measure(small_exports["titans-mac"], [37, 70], repeats=1, threads=1)
    assert [row["tokens"] for row in report["results"]] == [37, 70]
    assert all(
        row["max_abs_logit_diff"] < 1e-4 and row["prefill_s"] > 0 and row["step_s"] > 0 for row in report["results"]
    )
    assert report["engine"]["target"] == "ort"

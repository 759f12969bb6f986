"""One weight store per target, one copy of the weights in memory (edgemem.weights, runtime/ort.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest

from edgemem.export import export
from edgemem.manifest import MANIFEST
from edgemem.models import build
from edgemem.runtime import Engine
from edgemem.runtime.errors import BackendError
from edgemem.weights import WEIGHTS

RSS = r"""
import sys
from edgemem.runtime import Engine

def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) * 1024

before = rss()
engine = Engine.load(sys.argv[1], threads=1, check_files=False)
print(rss() - before)
"""

ANON = r"""
import sys
import numpy as np
import onnxruntime  # its own pages are not the engine's
from edgemem.runtime import Engine

def anon():
    return int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon:")).split()[1]) * 1024

before = anon()
engine = Engine.load(sys.argv[1], threads=1, check_files=False)
stream = engine.new_stream()
stream.prefill(np.arange(40) % engine.vocab_size, all_logits=False)  # the last-position prefill session
stream.prefill(np.arange(8) % engine.vocab_size)  # the full prefill session, opened now
for token in range(4):
    logits = stream.step(token)
if len(sys.argv) > 2:
    np.save(sys.argv[2], logits)
print(sorted(engine._sessions), anon() - before)
"""

LOAD_PEAK = r"""
import sys
import onnxruntime  # its own pages are not the engine's
from edgemem.runtime import Engine
from edgemem.runtime.ort import _Weights

if sys.argv[2] == "kept":
    _Weights.DROP_EVERY = None

def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024

before = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) from here
engine = Engine.load(sys.argv[1], threads=1, check_files=False)
print(status("VmHWM:") - status("VmRSS:"))
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = build("gated-deltanet", seed=0, d_model=1024, n_layers=1)
    out = tmp_path_factory.mktemp("footprint") / "export"
    export(model, out, targets=("ort",))
    weight_bytes = sum(p.numel() * 4 for p in model.parameters())
    return out, weight_bytes


def _strip_store(src, dst):
    """The same export as one written before the store existed: the manifest without `weights`."""
    import shutil

    shutil.copytree(src, dst)
    manifest = json.loads((dst / MANIFEST).read_text())
    del manifest["weights"]
    (dst / MANIFEST).write_text(json.dumps(manifest))


def test_each_target_keeps_its_weights_once_in_one_file_the_graphs_read(exported):
    out, weight_bytes = exported
    manifest = json.loads((out / MANIFEST).read_text())
    for target in ("ort",):
        store = out / target / WEIGHTS
        assert manifest["weights"][target]["file"] == f"{target}/{WEIGHTS}"
        assert f"{target}/{WEIGHTS}" in manifest["files"]
        graphs = sum((out / target / f"{kind}.onnx").stat().st_size for kind in ("prefill", "step"))
        assert store.stat().st_size < 1.05 * weight_bytes  # prefill and step share every tensor
        assert graphs < 0.05 * weight_bytes
        for kind in ("prefill", "step"):
            onnx.checker.check_model(str(out / target / f"{kind}.onnx"))  # valid ONNX on its own, external data
            model = onnx.load(str(out / target / f"{kind}.onnx"), load_external_data=False)
            external = {t.name for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
            assert external == set(manifest["weights"][target]["tensors"][kind])


def test_the_store_names_the_weights_only_pre_packing_kernels_read(exported):
    """`packed`: per graph, the stored initializers whose every reader is a MatMul or Gemm weight input;
    the embedding table (a Gather reads it) and the norms are not among them."""
    out, _ = exported
    store = json.loads((out / MANIFEST).read_text())["weights"]["ort"]
    for kind in ("prefill", "prefill_last", "step"):
        graph = onnx.load(str(out / "ort" / f"{kind}.onnx"), load_external_data=False).graph
        weights = {n.input[1] for n in graph.node if n.op_type in ("MatMul", "Gemm")}
        others = {i for n in graph.node if n.op_type not in ("MatMul", "Gemm") for i in n.input}
        packed = set(store["packed"][kind])
        assert packed and packed <= set(store["tensors"][kind])
        assert packed == (weights - others) & set(store["tensors"][kind])
        gather = next(n for n in graph.node if n.op_type == "Gather")
        assert gather.input[0] in store["tensors"][kind] and gather.input[0] not in packed


def test_one_cpu_session_serves_prefill_and_steps(exported, tmp_path):
    """On the CPU the last-position prefill graph serves steps (one session, one packed copy) where the
    manifest says it may (`steps`); its steps equal the step graph's, which runs where it says "step"."""
    out, _ = exported
    engine = Engine.load(out, threads=1)
    assert engine.manifest.steps == "prefill_last"
    assert engine._sessions["step"] is engine._sessions["prefill_last"]
    import shutil

    shutil.copytree(out, tmp_path / "two")
    manifest = json.loads((tmp_path / "two" / MANIFEST).read_text())
    manifest["steps"] = "step"
    (tmp_path / "two" / MANIFEST).write_text(json.dumps(manifest))
    two = Engine.load(tmp_path / "two", threads=1, check_files=False)
    assert two._sessions["step"] is not two._sessions["prefill_last"]
    ids = np.random.default_rng(1).integers(0, 256, 24)
    a, b = engine.new_stream(), two.new_stream()
    np.testing.assert_allclose(
        a.prefill(ids[:11], all_logits=False), b.prefill(ids[:11], all_logits=False), rtol=1e-5, atol=1e-5
    )
    for token in ids[11:]:
        np.testing.assert_allclose(a.step(int(token)), b.step(int(token)), rtol=1e-5, atol=1e-5)
    for x, y in zip(a.state_dict().values(), b.state_dict().values()):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_a_layer_whose_prefill_costs_more_than_a_step_keeps_the_step_graph(small_exports, tmp_path):
    """AFT's prefill form is a prefix scan: its export says "step", and the runtime steps with the step graph."""
    import shutil

    engine = Engine.load(small_exports["aft"], threads=1)
    assert engine.manifest.steps == "step" and engine._sessions["step"] is not engine._sessions["prefill_last"]
    assert Engine.load(small_exports["gated-deltanet"], threads=1).manifest.steps == "prefill_last"
    shutil.copytree(small_exports["aft"], tmp_path / "aft")
    manifest = json.loads((tmp_path / "aft" / MANIFEST).read_text())
    manifest["steps"] = "prefill"
    (tmp_path / "aft" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(Exception, match="steps is 'prefill'; expected 'step', or 'prefill_last'"):
        Engine.load(tmp_path / "aft", check_files=False)


def test_both_sessions_read_one_mapping_of_the_store(exported):
    """Every initializer of the prefill and the step graph is handed to onnxruntime as a view into the one
    read-only mapping of weights.data, and a tensor the two graphs share is the same buffer in both."""
    out, _ = exported
    engine = Engine.load(out, threads=1)
    store = engine._weights
    whole = np.frombuffer(store._mapped, dtype=np.uint8)
    start, end = whole.ctypes.data, whole.ctypes.data + whole.size
    step, prefill = store.graph("step"), store.graph("prefill")
    assert len(step) == len(prefill) > 0
    for value in (*step.values(), *prefill.values()):
        assert start <= value.data_ptr() < end
    shared = {v.data_ptr() for v in step.values()} & {v.data_ptr() for v in prefill.values()}
    assert len(shared) == len(step)  # the two graphs hold the same weights under their own names


def test_loading_keeps_a_copy_fewer_than_each_session_reading_its_own(exported, tmp_path):
    """Resident memory that Engine.load adds, in a fresh process, against the same export loaded the way
    an export without the store is (each session reads the graph's weights itself and pre-packs its own
    copy): the prefill session reads the mapped weights instead of a packed copy of its own."""
    out, weight_bytes = exported
    _strip_store(out, tmp_path / "plain")
    shared, plain = (
        int(subprocess.run([sys.executable, "-c", RSS, str(d)], capture_output=True, text=True, check=True).stdout)
        for d in (out, tmp_path / "plain")
    )
    assert plain - shared > 0.8 * weight_bytes, (plain, shared, weight_bytes)


def test_loading_drops_the_mapped_pages_a_session_packs_from_as_it_goes(exported, tmp_path):
    """Where the step session packs every weight from the mapping (two sessions: `steps` "step"), the peak
    during `Engine.load` stays within half the weights of what is resident after it, in a fresh process; with
    the pages kept until the session is made, the peak holds the whole mapped source beside the packed copy."""
    out, weight_bytes = exported
    import shutil

    shutil.copytree(out, tmp_path / "two")
    manifest = json.loads((tmp_path / "two" / MANIFEST).read_text())
    manifest["steps"] = "step"
    (tmp_path / "two" / MANIFEST).write_text(json.dumps(manifest))
    command = [sys.executable, "-c", LOAD_PEAK, str(tmp_path / "two")]
    dropped, kept = (
        int(subprocess.run([*command, how], capture_output=True, text=True, check=True).stdout)
        for how in ("dropped", "kept")
    )
    assert dropped < 0.5 * weight_bytes < 0.8 * weight_bytes < kept, (dropped, kept, weight_bytes)


def test_no_session_of_an_engine_holds_a_copy_of_the_weights_of_its_own(exported):
    """Memory no file backs (RssAnon), added in a fresh process by loading, prefilling through both prefill
    graphs and stepping: the one packed copy the step session makes (MLAS's layout of each MatMul weight)
    and the runs' tensors. Three sessions run; one that copied the weights it was handed (as
    `add_external_initializers` does) would add a whole copy on top."""
    out, weight_bytes = exported
    done = subprocess.run([sys.executable, "-c", ANON, str(out)], capture_output=True, text=True, check=True)
    sessions, added = done.stdout.rsplit("]", 1)
    assert sessions == "['prefill', 'prefill_last', 'step'"
    assert 0 < int(added) < 1.6 * weight_bytes, (int(added), weight_bytes)  # one copy more: over 2.1×


def test_the_store_and_the_graphs_own_weights_compute_the_same(exported, tmp_path):
    out, _ = exported
    _strip_store(out, tmp_path / "plain")
    ids = np.arange(40) % 256
    logits = []
    for d in (out, tmp_path / "plain"):
        stream = Engine.load(d, threads=1, check_files=False).new_stream()
        logits.append(np.concatenate([stream.prefill(ids[:30]), *(stream.step(int(i))[None] for i in ids[30:])]))
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def test_a_truncated_weight_file_is_refused_at_load_naming_it(exported, tmp_path):
    out, _ = exported
    import shutil

    shutil.copytree(out, tmp_path / "cut")
    store = tmp_path / "cut" / "ort" / WEIGHTS
    with store.open("r+b") as f:
        f.truncate(store.stat().st_size // 2)
    with pytest.raises(Exception, match=f"ort/{WEIGHTS}") as checked:
        Engine.load(tmp_path / "cut")
    assert "sha256" in str(checked.value)
    with pytest.raises(BackendError, match=f"{WEIGHTS} is shorter than edgemem.json says"):
        Engine.load(tmp_path / "cut", check_files=False)


def test_int4_stores_a_tied_embedding_once_in_4_bits_for_lookup_and_head(tmp_path):
    """`calibrate --method int4` on a model whose head reads the embedding table: the lookup becomes a
    GatherBlockQuantized and the head a MatMulNBits over the same bytes, one copy in the weight store; no
    float table is left in either graph, and the logits stay close to fp32. The head's names for those bytes are
    not among what only pre-packing kernels read: the lookup reads them too, from the one mapping."""
    import dataclasses

    import torch

    from edgemem.models import load_config
    from edgemem.models.lm import LM
    from edgemem.quant import calibrate

    vocab, width = 2048, 64
    config = load_config("deltanet", d_model=width, n_layers=1, mlp_hidden=64, vocab_size=vocab)
    torch.manual_seed(0)
    model = LM(dataclasses.replace(config, tie_embeddings=True))  # as an imported model with tied embeddings
    export(model, tmp_path / "fp32", targets=("ort",))
    calibrate(tmp_path / "fp32", "int4", out=tmp_path / "int4")
    index = json.loads((tmp_path / "int4" / MANIFEST).read_text())["weights"]["ort"]
    store = index["tensors"]
    for kind in ("prefill", "step"):
        nodes = onnx.load(str(tmp_path / "int4" / "ort" / f"{kind}.onnx"), load_external_data=False).graph.node
        (gather,) = [n for n in nodes if n.op_type == "GatherBlockQuantized"]
        (head,) = [n for n in nodes if n.op_type == "MatMulNBits" and n.output[0].startswith("logits")]
        assert store[kind][gather.input[0]][0] == store[kind][head.input[1]][0]  # one offset: the same bytes
        assert store[kind][gather.input[2]][0] == store[kind][head.input[2]][0]  # scales too
        assert not set(head.input[1:]) & set(index["packed"][kind])
        assert any(n.op_type == "MatMulNBits" and n.input[1] in index["packed"][kind] for n in nodes)  # the others
        assert not [
            name
            for name, (_, dtype, shape) in store[kind].items()
            if dtype == "float32" and sorted(shape) == [width, vocab]
        ]  # no float table left
    sizes = {d: (tmp_path / d / "ort" / WEIGHTS).stat().st_size for d in ("fp32", "int4")}
    assert sizes["int4"] < 0.2 * sizes["fp32"], sizes  # the table is most of it: 4-bit blocks and scales are 5/32
    ids = np.random.default_rng(0).integers(0, vocab, 40)
    logits = {}
    for d in ("fp32", "int4"):
        stream = Engine.load(tmp_path / d, threads=1).new_stream()
        logits[d] = np.concatenate([stream.prefill(ids[:30]), *(stream.step(int(t))[None] for t in ids[30:])])
    err = np.linalg.norm(logits["int4"] - logits["fp32"]) / np.linalg.norm(logits["fp32"])
    assert 0 < err < 0.3, err


def test_next_token_prefill_projects_only_the_last_position(exported):
    """The prefill graph whose head projects only the last position (logits [batch, 1, V]) is what the
    runtime opens at load and runs when only the next token's logits are wanted; the full prefill graph opens
    at the first prefill that asks for every row, and the two agree on the last row and the state."""
    out, _ = exported
    assert json.loads((out / MANIFEST).read_text())["graphs"]["prefill_last"] is True
    graph = onnx.load(str(out / "ort" / "prefill_last.onnx"), load_external_data=False).graph
    logits = next(o for o in graph.output if o.name == "logits")
    assert [d.dim_value or d.dim_param for d in logits.type.tensor_type.shape.dim][1:] == [1, 256]
    engine = Engine.load(out, threads=1)
    assert sorted(engine._sessions) == ["prefill_last", "step"]
    ids = np.random.default_rng(0).integers(0, 256, 70)
    last = engine.new_stream()
    row = last.prefill(ids, chunk_size=32, all_logits=False)
    assert sorted(engine._sessions) == ["prefill_last", "step"]
    full = engine.new_stream()
    rows = full.prefill(ids, chunk_size=32)
    assert sorted(engine._sessions) == ["prefill", "prefill_last", "step"] and rows.shape == (70, 256)
    np.testing.assert_allclose(row, rows[-1], rtol=1e-5, atol=1e-5)
    for a, b in zip(last.state_dict().values(), full.state_dict().values()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(last.step(7), full.step(7), rtol=1e-5, atol=1e-5)


def test_a_node_that_only_writes_a_state_runs_right_after_the_layer_that_feeds_it(tmp_path):
    """`leaves_last` moves the nodes nothing reads to the end, the first ready last: onnxruntime then runs each
    state output's node right after its layer, not after the logits (which kept every layer's input to it
    alive for the whole run), and the graph computes the same."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from edgemem.export.lower import leaves_last

    nodes = [
        helper.make_node("Sin", ["x"], ["h1"], name="layer1"),
        helper.make_node("Cos", ["h1"], ["state1"], name="state1"),
        helper.make_node("Sin", ["h1"], ["h2"], name="layer2"),
        helper.make_node("Cos", ["h2"], ["state2"], name="state2"),
        helper.make_node("Neg", ["h2"], ["logits"], name="head"),
    ]
    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [4])  # noqa: E731
    graph = helper.make_graph(nodes, "g", [value("x")], [value("logits"), value("state1"), value("state2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    x = np.linspace(-1, 1, 4, dtype=np.float32)

    def run(m: onnx.ModelProto) -> tuple[list[str], list[np.ndarray]]:
        options = ort.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = str(tmp_path / "order")
        session = ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
        outputs = session.run(None, {"x": x})
        with open(session.end_profiling()) as f:
            events = json.load(f)
        order = [e["name"].removesuffix("_kernel_time") for e in events if e["name"].endswith("_kernel_time")]
        return order[-len(nodes) :], outputs

    before, expected = run(model)
    assert before.index("state1") > before.index("layer2")  # as written: layer 1's state after layer 2
    leaves_last(model.graph)
    onnx.checker.check_model(model)
    after, outputs = run(model)
    assert after == ["layer1", "state1", "layer2", "state2", "head"], after
    for a, b in zip(outputs, expected):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A model whose head reads its embedding table (8 MB of it, most of the weights), exported for onnxruntime
    and TensorRT."""
    import dataclasses

    import torch

    from edgemem.models import load_config
    from edgemem.models.lm import LM

    config = load_config("deltanet", d_model=64, n_layers=1, mlp_hidden=64, vocab_size=32000)
    torch.manual_seed(0)
    model = LM(dataclasses.replace(config, tie_embeddings=True))
    out = tmp_path_factory.mktemp("tied") / "fp32"
    export(model, out, targets=("ort", "trt"))
    return out, 32000 * 64 * 4


def _tables(graph: onnx.GraphProto) -> set[str]:
    return {v.name for v in graph.input} & {t.name for t in graph.initializer}


def test_a_tied_head_reads_the_one_table_in_place_where_onnxruntime_runs_it(tied, tmp_path):
    """The table the lookup and the head's Gemm(transB=1) both read is also listed as an input of the ort graphs
    (overridable: onnxruntime neither pre-packs it nor folds through it), not of the trt ones, and no session asks
    for it. In fresh processes, memory no file backs is a table smaller than with the table unlisted (where the
    session packs a copy of it), and the logits agree."""
    out, table_bytes = tied
    for kind in ("prefill", "prefill_last", "step"):
        graph = onnx.load(str(out / "ort" / f"{kind}.onnx"), load_external_data=False).graph
        (table,) = _tables(graph)
        assert {n.op_type for n in graph.node if table in n.input} == {"Gather", "Gemm"}
    for kind in ("prefill", "step"):  # TensorRT's engines pack what they read
        trt = onnx.load(str(out / "trt" / f"{kind}.onnx"), load_external_data=False).graph
        assert not _tables(trt) and any(n.op_type == "Gemm" for n in trt.node)
    engine = Engine.load(out, threads=1)
    assert table not in {i.name for s in engine._sessions.values() for i in s.get_inputs()}

    import shutil

    shutil.copytree(out, tmp_path / "unlisted")
    for kind in ("prefill", "prefill_last", "step"):
        path = tmp_path / "unlisted" / "ort" / f"{kind}.onnx"
        model = onnx.load(str(path), load_external_data=False)
        kept = [v for v in model.graph.input if v.name != table]
        del model.graph.input[:]
        model.graph.input.extend(kept)
        onnx.save(model, str(path))
    anon = {}
    for name, d in (("listed", out), ("unlisted", tmp_path / "unlisted")):
        command = [sys.executable, "-c", ANON, str(d), str(tmp_path / f"{name}.npy")]
        anon[name] = int(subprocess.run(command, capture_output=True, text=True, check=True).stdout.rsplit("]", 1)[1])
    assert anon["unlisted"] - anon["listed"] > 0.8 * table_bytes, (anon, table_bytes)
    listed, unlisted = (np.load(tmp_path / f"{name}.npy") for name in ("listed", "unlisted"))
    np.testing.assert_allclose(listed, unlisted, rtol=1e-5, atol=1e-5)


def test_dynamic_int8_keeps_the_tied_table_once_and_the_head_reading_it(tied, tmp_path):
    """onnxruntime's dynamic quantizer rewrites a Gemm(transB=1) as a MatMul over a transposed copy of its weight;
    calibrate puts the float tied head back as that Gemm over the table: no transposed copy in the store (which
    the table is most of), and the table listed again."""
    from edgemem.quant import calibrate

    out, table_bytes = tied
    calibrate(out, "dynamic", out=tmp_path / "int8")
    store = json.loads((tmp_path / "int8" / MANIFEST).read_text())["weights"]["ort"]["tensors"]
    for kind in ("prefill", "prefill_last", "step"):
        graph = onnx.load(str(tmp_path / "int8" / "ort" / f"{kind}.onnx"), load_external_data=False).graph
        (table,) = _tables(graph)
        assert {n.op_type for n in graph.node if table in n.input} == {"Gather", "Gemm"}
        assert [shape for _, dtype, shape in store[kind].values() if sorted(shape) == [64, 32000]] == [[32000, 64]]
    size = (tmp_path / "int8" / "ort" / WEIGHTS).stat().st_size
    assert table_bytes < size < 1.5 * table_bytes, (size, table_bytes)
    Engine.load(tmp_path / "int8", threads=1).new_stream().prefill(np.arange(8))

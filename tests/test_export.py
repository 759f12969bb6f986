"""Export: every preset becomes prefill/step ONNX graphs that ONNX Runtime (and onnx.reference)
run to PyTorch's numbers, lowered per target, with a manifest every later tool can trust."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
import torch
from click.testing import CliRunner
from onnx.reference import ReferenceEvaluator

from edgemem.cli import main
from edgemem.errors import EdgememError
from edgemem.export import export
from edgemem.export.verify import initial_state, verify
from edgemem.layers import GatedDeltaNet, SlidingWindowAttention
from edgemem.manifest import MANIFEST, load
from edgemem.models import archs, build, save_checkpoint

TARGETS = ["generic", "ort", "onnx27", "trt"]


# as shipped; every preset is also exported small (conftest). titans-mag is the README's main job.
FULL_SIZE = [pytest.param("titans-mag", marks=pytest.mark.slow), "gated-deltanet"]


def _verified(directory):
    checks, skipped = verify(directory, threads=1)
    assert set(skipped) <= {"trt"}  # onnxruntime runs every other target
    assert {c.target for c in checks} == {"generic", "ort", "onnx27"}
    bad = [c for c in checks if not c.ok]
    assert not bad, bad
    return load(directory)


@pytest.mark.parametrize("arch", archs())
def test_preset_exports_match_pytorch(small_exports, arch):
    manifest = _verified(small_exports[arch])
    # bidirectional: no step; the prefill graphs of titans-mac and hope loop over their segments
    # (test_segment_prefill.py); every LM with a one-pass prefill also gets its last-position prefill graph
    last = {"prefill_last": True} if arch not in ("longformer-encoder", "titans-mac", "hope", "led") else {}
    encoder = {"encoder": True} if arch == "led" else {}  # an encoder-decoder: the encoder, then a decoder
    assert manifest.graphs == {**encoder, "prefill": True, "step": arch != "longformer-encoder", **last}


@pytest.mark.parametrize("arch", FULL_SIZE)
def test_full_size_preset_exports_from_the_cli_and_matches_pytorch(arch, tmp_path):
    result = CliRunner().invoke(
        main, ["export", "--arch", arch, "--out", str(tmp_path / arch), "--target", ",".join(TARGETS)]
    )
    assert result.exit_code == 0, f"{arch}: {result.output}"
    manifest = _verified(tmp_path / arch)
    assert manifest.config["d_model"] == build(arch).config.d_model and manifest.config["n_layers"] == 2


def test_manifest_describes_the_graphs(small_exports):
    directory = small_exports["titans-mag"]
    raw = json.loads((directory / MANIFEST).read_text())
    assert raw["format"] == "edgemem/1" and raw["arch"] == "titans-mag" and raw["opset"] == 20
    assert raw["inputs"] == {"tokens": "input_ids"} and raw["outputs"] == {"logits": "logits"}
    assert raw["config"]["vocab_size"] == 256 and raw["targets"] == TARGETS
    step = onnx.load(directory / "generic" / "step.onnx")
    graph_inputs = {i.name: i for i in step.graph.input}
    kinds = set()
    for spec in raw["state"]:
        assert spec["input"] == f"past_key_values.{spec['layer']}.{spec['kind']}"
        assert spec["output"] == f"present.{spec['layer']}.{spec['kind']}"
        dims = [d.dim_param or d.dim_value for d in graph_inputs[spec["input"]].type.tensor_type.shape.dim]
        assert dims == spec["shape"] and spec["shape"][0] == "batch"
        kinds.add(spec["kind"])
    assert {"key", "value", "position", "memory.0", "momentum.0", "chunk_memory.0"} <= kinds
    assert any(s["init"] == "file" for s in raw["state"])  # Titans' learned initial memory
    assert set(raw["files"]) >= {f"{t}/{g}.onnx" for t in TARGETS for g in ("prefill", "step")} | {
        "state_init.safetensors"
    }


def test_softmax_state_declares_its_growing_cache(small_exports):
    raw = json.loads((small_exports["softmax"] / MANIFEST).read_text())
    assert all(s["shape"][2] == "past_sequence" for s in raw["state"])


@pytest.mark.parametrize("arch", ["gated-deltanet", "titans-mag", "longformer", "titans-lmm"])
def test_edgemem_nodes_and_their_functions_survive(small_exports, arch):
    model = onnx.load(small_exports[arch] / "generic" / "step.onnx")
    ops = {n.op_type for n in model.graph.node if n.domain == "edgemem"}
    assert ops and ops == {f.name for f in model.functions if f.domain == "edgemem"}
    assert any(o.domain == "edgemem" and o.version == 1 for o in model.opset_import)


def test_full_checker_passes_in_a_fresh_process(small_exports):
    files = [
        str(d / t / g)
        for d in small_exports.values()
        for t in ("generic", "ort", "onnx27")
        for g in ("prefill.onnx", "step.onnx")
        if (d / t / g).exists()
    ]
    code = "import sys, onnx\nfor f in sys.argv[1:]: onnx.checker.check_model(onnx.load(f), full_check=True)"
    subprocess.run([sys.executable, "-c", code, *files], check=True)


def test_ort_target_uses_the_native_kernel_and_onnx27_the_standard_op(small_exports):
    directory = small_exports["gated-deltanet"]
    ort_model = onnx.load(directory / "ort" / "step.onnx")
    assert {(n.domain, n.op_type) for n in ort_model.graph.node if n.op_type == "LinearAttention"} == {
        ("com.microsoft", "LinearAttention")
    }
    assert not [f for f in ort_model.functions if f.name == "LinearAttention"]
    std = onnx.load(directory / "onnx27" / "step.onnx")
    assert {(n.domain, n.op_type) for n in std.graph.node if n.op_type == "LinearAttention"} == {
        ("", "LinearAttention")
    }
    assert [o.version for o in std.opset_import if o.domain == ""] == [27]


@pytest.mark.parametrize("arch", ["gated-deltanet", "titans-mag", "longformer", "titans-mac"])
def test_trt_artifacts_carry_plugin_attributes_and_no_local_functions(small_exports, arch):
    graphs = load(small_exports[arch]).graphs_of("trt")
    for graph in graphs:
        model = onnx.load(small_exports[arch] / "trt" / f"{graph}.onnx")
        assert not [f for f in model.functions if f.domain == "edgemem"]
        graph = gs.import_onnx(model)
        nodes = [n for g in [graph, *graph.subgraphs(recursive=True)] for n in g.nodes if n.domain == "edgemem"]
        assert nodes  # titans-mac's prefill holds them inside its Loop over segments
        for node in nodes:
            assert node.attrs["plugin_namespace"] == "edgemem" and node.attrs["plugin_version"] == "1"


def test_prefill_graph_at_one_token_is_the_step_graph(small_exports):
    """What lets one TensorRT engine, built from the prefill graph, serve steps on a one-token profile: for
    every preset and the tiny LED, the step graph's inputs and outputs are the prefill graph's with sequence 1
    (trt target), and from a mid-stream state the prefill graph given one token returns the step graph's logits
    and state (generic target, onnxruntime)."""
    import onnxruntime as ort

    from edgemem.trt_build import _check_step

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    checked = []
    for arch, directory in sorted(small_exports.items()):
        manifest = load(directory)
        if not {"step", "prefill"} <= set(manifest.graphs_of("generic")):
            continue
        trt = {k: onnx.load(directory / "trt" / f"{k}.onnx", load_external_data=False) for k in ("step", "prefill")}
        _check_step(trt["step"], trt["prefill"], directory / "trt" / "step.onnx")
        step, prefill = (
            ort.InferenceSession(directory / "generic" / f"{k}.onnx", options) for k in ("step", "prefill")
        )
        state = initial_state(manifest, directory, 2)
        if manifest.encoder:  # an encoder-decoder's read-only cross keys and values: the encoder's, of 6 tokens
            encoder = ort.InferenceSession(directory / "generic" / "encoder.onnx", options)
            names = manifest.encoder["inputs"]
            ids = np.arange(6, 18).reshape(2, 6) % manifest.vocab_size
            filled = encoder.run(None, {names["tokens"]: ids, names["global_attention_mask"]: np.zeros_like(ids)})
            filled = dict(zip([o.name for o in encoder.get_outputs()], filled))
            state.update({name: filled[out] for name, out in manifest.encoder["fills"].items()})
        outputs = [o.name for o in step.get_outputs()]
        for token in (3, 9):  # two steps in: a state that is not the initial one
            values = dict(zip(outputs, step.run(None, {"input_ids": np.array([[token], [token + 1]]), **state})))
            state = {s.input: values[s.output] if s.output else state[s.input] for s in manifest.state}
        feeds = {"input_ids": np.array([[5], [min(200, manifest.vocab_size - 1)]]), **state}
        for name, a, b in zip(outputs, step.run(None, feeds), prefill.run(None, feeds)):
            assert a.shape == b.shape and np.allclose(a, b, rtol=1e-5, atol=1e-6), (arch, name)
        checked.append(arch)
    assert {"gated-deltanet", "titans-mag", "titans-mac", "longformer", "softmax", "led"} <= set(checked)
    step = onnx.load(small_exports["deltanet"] / "trt" / "step.onnx", load_external_data=False)
    prefill = onnx.load(small_exports["deltanet"] / "trt" / "prefill.onnx", load_external_data=False)
    step.graph.output[0].name = "scores"
    with pytest.raises(EdgememError, match=r"step.onnx is not the prefill graph at one token \(\('scores'"):
        _check_step(step, prefill, Path("step.onnx"))


@pytest.mark.parametrize("arch", ["gated-deltanet", "titans-mag", "longformer"])
def test_onnx_reference_evaluator_runs_the_generic_step(small_exports, arch):
    directory = small_exports[arch]
    manifest = load(directory)
    feeds = {"input_ids": np.array([[7], [42]], dtype=np.int64), **initial_state(manifest, directory, 2)}
    model = onnx.load(directory / "generic" / "step.onnx")
    got = ReferenceEvaluator(model).run(None, feeds)
    import onnxruntime as ort

    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


class HybridLM(torch.nn.Module):
    """A user's own model: gated DeltaNet and sliding-window layers, not a preset."""

    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"vocab_size": 64, "arch": "hybrid"})()
        self.embed = torch.nn.Embedding(64, 32)
        self.layers = torch.nn.ModuleList([GatedDeltaNet(32, 2), SlidingWindowAttention(32, 2, window=4)])
        self.head = torch.nn.Linear(32, 64)

    def init_state(self, batch, device=None, dtype=None):
        return {
            f"{i}.{k}": v
            for i, layer in enumerate(self.layers)
            for k, v in layer.init_state(batch, device, dtype).items()
        }

    def prefill(self, tokens, state):
        x, new = self.embed(tokens), {}
        for i, layer in enumerate(self.layers):
            mine = {k.split(".", 1)[1]: v for k, v in state.items() if k.startswith(f"{i}.")}
            y, mine = layer.prefill(x, mine)
            x = x + y
            new.update({f"{i}.{k}": v for k, v in mine.items()})
        return self.head(x), new

    def step(self, tokens, state):
        logits, state = self.prefill(tokens[:, None], state)
        return logits[:, 0], state


def test_user_built_model_exports_through_the_python_api(tmp_path):
    import onnxruntime as ort

    torch.manual_seed(0)
    model = HybridLM().eval()
    manifest = export(model, tmp_path / "hybrid", targets=["generic", "ort"])
    assert manifest.arch == "hybrid" and [s.kind for s in manifest.state][:2] == ["recurrent_state", "conv_state"]
    tokens = torch.randint(0, 64, (3, 9))
    with torch.no_grad():
        expected, _ = model.prefill(tokens, model.init_state(3))
    for target in ("generic", "ort"):
        session = ort.InferenceSession(
            str(tmp_path / "hybrid" / target / "prefill.onnx"), providers=["CPUExecutionProvider"]
        )
        feeds = {"input_ids": tokens.numpy(), **initial_state(manifest, tmp_path / "hybrid", 3)}
        np.testing.assert_allclose(session.run(["logits"], feeds)[0], expected.numpy(), rtol=1e-4, atol=1e-4)


def _invoke(*args):
    return CliRunner().invoke(main, list(args))


def test_cli_errors_are_one_line(tmp_path):
    result = _invoke("export", "--arch", "mamba", "--out", str(tmp_path / "x"))
    assert (
        result.exit_code == 2 and "unknown arch 'mamba'; known:" in result.output and "Traceback" not in result.output
    )
    result = _invoke("export", "--arch", "deltanet", "--out", str(tmp_path / "x"), "--set", "windw=3")
    assert result.exit_code == 2 and "unknown override 'windw'" in result.output
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    result = _invoke("export", "--arch", "deltanet", "--out", str(tmp_path / "full"))
    assert result.exit_code == 2 and "is not empty; pass --force" in result.output
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    (tmp_path / "bad.safetensors").write_bytes(b"not a checkpoint")
    result = _invoke("export", "--checkpoint", str(tmp_path / "bad.safetensors"), "--out", str(tmp_path / "y"))
    assert result.exit_code == 2 and "cannot read checkpoint" in result.output
    save_checkpoint(build("deltanet", seed=0, d_model=32, mlp_hidden=32), tmp_path / "deltanet.safetensors")
    result = _invoke(
        "export",
        "--arch",
        "softmax",
        "--checkpoint",
        str(tmp_path / "deltanet.safetensors"),
        "--out",
        str(tmp_path / "z"),
    )
    assert result.exit_code == 2 and "is a checkpoint of 'deltanet', not 'softmax'" in result.output
    result = _invoke("verify", str(tmp_path / "full"))
    assert result.exit_code == 2 and "is not an edgemem export" in result.output


def test_verify_that_runs_nothing_says_so_instead_of_all_checks_passing(small_exports, monkeypatch):
    """A trt-only export (a bf16 one, say) where TensorRT is not installed: verify lists the target as skipped and
    says nothing was checked, not "all 0 checks within tolerance"."""
    import edgemem.export.verify

    monkeypatch.setattr(edgemem.export.verify, "verify", lambda *a, **k: ([], {"trt": "TensorRT is not installed"}))
    result = _invoke("verify", str(small_exports["deltanet"]))
    assert result.exit_code == 0, result.output
    assert "trt: skipped (TensorRT is not installed)" in result.output and "nothing was checked" in result.output
    assert "within tolerance" not in result.output


def test_checkpoint_export_verifies_against_the_checkpoint(tmp_path):
    model = build("deltanet", seed=3, d_model=32, mlp_hidden=32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # weights no seed reproduces
    save_checkpoint(model, tmp_path / "ckpt.safetensors")
    result = _invoke(
        "export",
        "--checkpoint",
        str(tmp_path / "ckpt.safetensors"),
        "--out",
        str(tmp_path / "out"),
        "--target",
        "generic",
    )
    assert result.exit_code == 0, result.output
    checks, _ = verify(tmp_path / "out")
    assert checks and all(c.ok for c in checks)


def test_interrupted_export_leaves_no_directory(tmp_path, monkeypatch):
    import edgemem.export.exporter as export_module

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_module, "lower", interrupt)
    with pytest.raises(KeyboardInterrupt):
        export(build("deltanet", seed=0, d_model=32, mlp_hidden=32), tmp_path / "out", targets=["generic"])
    assert list(tmp_path.iterdir()) == []


def test_force_replaces_an_existing_export(small_exports, tmp_path):
    model = build("deltanet", seed=0, d_model=32, mlp_hidden=32)
    shutil.copytree(small_exports["deltanet"], tmp_path / "out")
    with pytest.raises(EdgememError, match="not empty"):
        export(model, tmp_path / "out", targets=["generic"])
    export(model, tmp_path / "out", targets=["ort"], force=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["edgemem.json", "genai_config.json", "ort"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_tampered_file_is_refused(small_exports, tmp_path):
    shutil.copytree(small_exports["deltanet"], tmp_path / "out")
    load(tmp_path / "out")
    step = tmp_path / "out" / "generic" / "step.onnx"
    data = bytearray(step.read_bytes())
    data[-1] ^= 0xFF
    step.write_bytes(bytes(data))
    with pytest.raises(EdgememError, match="does not match its sha256"):
        load(tmp_path / "out")


def test_fp16_export_keeps_state_in_fp32(tmp_path):
    model = build("gated-deltanet", seed=0, d_model=32, mlp_hidden=32)
    export(model, tmp_path / "out", targets=["generic", "trt"], dtype="fp16", extra_config={"seed": 0})
    manifest = load(tmp_path / "out")
    assert manifest.config["dtype"] == "fp16" and {s.dtype for s in manifest.state} == {"float32"}
    for target in ("generic", "trt"):
        graph = onnx.load(tmp_path / "out" / target / "step.onnx").graph
        types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output]}
        assert types["logits"] == onnx.TensorProto.FLOAT16
        assert all(types[s.input] == types[s.output] == onnx.TensorProto.FLOAT for s in manifest.state)
        assert any(t.data_type == onnx.TensorProto.FLOAT16 and len(t.dims) == 2 for t in graph.initializer)
    checks, _ = verify(tmp_path / "out")  # generic runs in onnxruntime at fp16 tolerance
    assert checks and all(c.ok for c in checks)


def test_bf16_export_of_an_onnxruntime_target_is_refused_before_anything_is_written(tmp_path):
    """bf16 is a TensorRT precision: onnxruntime's CPU kernels take no bfloat16, so any other target is refused in
    one line and no output directory appears (the trt graphs themselves: tests/test_rtx.py, which builds them)."""
    model = build("gated-deltanet", seed=0, d_model=32, mlp_hidden=32)
    with pytest.raises(EdgememError, match="dtype bf16 exports the trt target only") as e:
        export(model, tmp_path / "mixed", targets=["ort", "trt"], dtype="bf16")
    assert "\n" not in str(e.value) and not (tmp_path / "mixed").exists()


def test_a_graph_past_the_protobuf_limit_keeps_its_weights_in_the_store(tmp_path, monkeypatch):
    """A real-size model (Qwen3.5-0.8B in fp32 is 3 GB) cannot be one .onnx file. Its graphs' weights go to the
    target's weights.data like any export's, also when a graph is first written with ONNX external data (the
    limit lowered to a byte): no .onnx.data is left, and the runtime and int4 calibration read the store; logits
    equal the export written without the split."""
    import edgemem.files
    from edgemem.quant import calibrate
    from edgemem.runtime import Engine

    model = build("gated-deltanet", seed=0, d_model=32, mlp_hidden=32, n_layers=2, num_heads=2)
    export(model, tmp_path / "one", targets=["ort"])
    monkeypatch.setattr(edgemem.files, "PROTOBUF_LIMIT", 1)
    manifest = export(model, tmp_path / "split", targets=["ort"])
    assert {"ort/prefill.onnx", "ort/step.onnx", "ort/weights.data"} <= set(manifest.files)
    assert not [f for f in manifest.files if f.endswith(".onnx.data")]
    assert not list((tmp_path / "split/ort").glob("*.onnx.data"))
    ids = np.random.default_rng(0).integers(0, 256, 40)
    split = Engine.load(tmp_path / "split", threads=1, check_files=True).new_stream()
    logits = np.concatenate([split.prefill(ids[:30]), np.stack([split.step(int(t)) for t in ids[30:]])])
    one = Engine.load(tmp_path / "one", threads=1).new_stream()
    np.testing.assert_array_equal(
        logits, np.concatenate([one.prefill(ids[:30]), np.stack([one.step(int(t)) for t in ids[30:]])])
    )
    quantized = calibrate(tmp_path / "split", "int4", out=tmp_path / "int4")  # written split too (limit still 1)
    assert sum(quantized.quantization["quantized_projections"].values()) > 0 and "ort/weights.data" in quantized.files
    stream = Engine.load(tmp_path / "int4", threads=1, check_files=True).new_stream()
    assert np.isfinite(stream.prefill(ids[:30])).all()

"""INT8/INT4 calibration (`edgemem calibrate`, edgemem.quant): artifacts that run, float state, drift reports.

A small random-weight deltanet is exported once per module and quantized three ways; the trained
MQAR deltanet (checkpoints/deltanet-mqar.safetensors) is checked for drift when it exists.
"""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from edgemem.cli import main
from edgemem.manifest import ManifestError
from edgemem.manifest import load as load_manifest
from edgemem.runtime import Engine

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / "checkpoints" / "deltanet-mqar.safetensors"
HORIZONS = ["32", "512", "4096", "32768"]
QUANT_OPS = {
    "QuantizeLinear",
    "DequantizeLinear",
    "DynamicQuantizeLinear",
    "MatMulInteger",
    "MatMulIntegerToFloat",
    "DynamicQuantizeMatMul",
    "QLinearMatMul",
    "QGemm",
}
# a short calibration and one held-out stream: enough for every property below but the trained-model one
FAST_RECIPE = """
[data]
task = "bytes"
streams = 2
positions = { first = 16, last = 1024, count = 4 }
prefill_tokens = 32
[drift]
horizons = [32, 512, 4096, 32768]
streams = 1
window = 32
"""


def _invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    from edgemem.export import export
    from edgemem.models import build

    out = tmp_path_factory.mktemp("quant") / "deltanet"
    export(
        build("deltanet", seed=0, d_model=64, mlp_hidden=64, n_layers=2),
        out,
        targets=["generic", "ort", "trt"],
        extra_config={"seed": 0},
    )
    return out


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    path = tmp_path_factory.mktemp("recipes") / "fast.toml"
    path.write_text(FAST_RECIPE)
    return path


@pytest.fixture(scope="module")
def quantized(fp32, recipe):
    """{method: directory}: dynamic through the Python API, static through the CLI (with its drift report)."""
    from edgemem.quant import calibrate

    dynamic = fp32.with_name("deltanet-dyn")
    calibrate(fp32, "dynamic", str(recipe), dynamic, threads=1)
    report = fp32.with_name("static-report.json")
    result = _invoke("calibrate", fp32, "--method", "static", "--recipe", recipe, "--report", report)
    assert result.exit_code == 0, result.output
    return {
        "dynamic": dynamic,
        "static": fp32.with_name("deltanet-int8-static"),
        "report": report,
        "output": result.output,
    }


def _graphs(model):
    """(where, nodes) of the main graph, subgraphs in attributes, and every local function's body."""

    def walk(where, nodes):
        yield where, nodes
        for node in nodes:
            for attr in node.attribute:
                subgraphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
                for graph in subgraphs:
                    yield from walk(f"{where}/{node.name}", list(graph.node))

    yield from walk("main", list(model.graph.node))
    for function in model.functions:
        yield from walk(f"function {function.name}", list(function.node))


def _graph_files(directory):
    manifest = load_manifest(directory)
    return manifest, [directory / name for name in manifest.files if name.endswith(".onnx")]


# ---------------------------------------------------------------- artifacts


@pytest.mark.parametrize("method", ["dynamic", "static"])
def test_quantized_export_runs_in_onnxruntime_close_to_fp32(fp32, quantized, method):
    ids = np.random.default_rng(0).integers(0, 256, 300)
    reference = Engine.load(fp32, threads=1).new_stream().prefill(ids)
    manifest = load_manifest(quantized[method])
    assert manifest.targets == (["ort", "generic", "trt"] if method == "static" else ["ort", "generic"])
    for target in ("ort", "generic"):
        engine = Engine.load(quantized[method], threads=1, target=target)
        stream = engine.new_stream()
        prefilled = stream.prefill(ids[:200])
        stepped = np.stack([stream.step(int(t)) for t in ids[200:]])
        logits = np.concatenate([prefilled, stepped])
        err = np.linalg.norm(logits - reference) / np.linalg.norm(reference)
        assert 0 < err < 0.1, (target, err)  # quantized (not a copy), and still the same model
        assert all(v.dtype == np.float32 for v in stream.state_dict().values())


@pytest.mark.parametrize("method", ["dynamic", "static"])
def test_no_quantization_node_touches_state_or_custom_ops(quantized, method):
    manifest, files = _graph_files(quantized[method])
    state = {n for s in manifest.state for n in (s.input, s.output)}
    for path in files:
        model = onnx.load(str(path))
        custom = set()
        for _, nodes in _graphs(model):
            for node in nodes:
                if node.domain not in ("", "ai.onnx") and node.op_type not in QUANT_OPS:
                    custom.update(n for n in (*node.input, *node.output) if n)
        if path.parent.name == "generic":
            assert model.functions, f"{path}: the edgemem ops' local functions were lost"
        for where, nodes in _graphs(model):
            for node in nodes:
                if node.op_type not in QUANT_OPS:
                    continue
                assert not where.startswith("function"), f"{path} {where}: {node.op_type} inside a custom op's body"
                touched = {*node.input, *node.output} & (state | custom)
                assert not touched, f"{path} {where}: {node.op_type} {node.name} touches {sorted(touched)}"


@pytest.mark.parametrize("method", ["dynamic", "static"])
def test_the_nodes_that_only_write_outputs_stay_last_after_quantizing(quantized, method):
    """The quantizers sort the nodes again; calibrate puts back the export's order, in which the nodes nothing
    reads (a layer's new state) come last, so onnxruntime runs each right after its layer (`leaves_last`)."""
    from edgemem.export.lower import _subgraph_names

    _, files = _graph_files(quantized[method])
    for path in files:
        nodes = onnx.load(str(path), load_external_data=False).graph.node
        read = {name for node in nodes for name in (*node.input, *_subgraph_names(node))}
        leaves = [i for i, node in enumerate(nodes) if not read & set(node.output)]
        assert len(leaves) > 1 and leaves == list(range(len(nodes) - len(leaves), len(nodes))), (path, leaves)


@pytest.mark.parametrize("method", ["dynamic", "static"])
def test_every_weight_projection_is_int8(fp32, quantized, method):
    _, files = _graph_files(quantized[method])
    for path in files:
        source = onnx.load(str(fp32 / path.parent.name / path.name))
        weights = {i.name for i in source.graph.initializer}
        expected = sum(n.op_type == "MatMul" and n.input[1] in weights for n in source.graph.node)
        model = onnx.load(str(path))
        produced = {o: n.op_type for n in model.graph.node for o in n.output}
        if method == "dynamic":
            count = sum(n.op_type == "MatMulInteger" for n in model.graph.node)
        else:  # QDQ: activation and weight both come from DequantizeLinear; the weight is stored as int8
            count = sum(
                n.op_type == "MatMul" and produced.get(n.input[0]) == produced.get(n.input[1]) == "DequantizeLinear"
                for n in model.graph.node
            )
            int8 = {i.name for i in model.graph.initializer if i.data_type == onnx.TensorProto.INT8}
            assert sum(n.op_type == "DequantizeLinear" and n.input[0] in int8 for n in model.graph.node) == expected
        assert expected == 11 and count == expected, (path, count, expected)  # 2 × (qkv, beta, out, up, down) + head
        if method == "static":  # symmetric int8 activations: zero points are int8 zeros
            values = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
            zero_points = [values[n.input[2]] for n in model.graph.node if n.op_type == "QuantizeLinear"]
            assert zero_points and all(z.dtype == np.int8 and not z.any() for z in zero_points)


@pytest.mark.parametrize("method", ["dynamic", "static"])
def test_onnxruntime_targets_keep_int8_weights_to_7_bits(quantized, method):
    """onnxruntime's u8s8 kernels on x86 CPUs without VNNI add pairs of products in saturating 16-bit sums:
    the onnxruntime targets' weights stay within 7 bits (|q| <= 64) so no pair overflows; the trt target's
    use the full 8 bits."""
    _, files = _graph_files(quantized[method])
    reach = {}
    for path in files:
        model = onnx.load(str(path))
        int8 = [onnx.numpy_helper.to_array(i) for i in model.graph.initializer if i.data_type == onnx.TensorProto.INT8]
        weights = [w for w in int8 if w.ndim == 2]
        assert weights, path
        target = path.parent.name
        reach[target] = max(reach.get(target, 0), max(int(np.abs(w.astype(np.int32)).max()) for w in weights))
    assert reach["ort"] <= 64 and reach["generic"] <= 64, reach
    if method == "static":
        assert reach["trt"] == 127, reach


def test_static_trt_graphs_use_the_ort_calibration(quantized):
    for kind in ("prefill", "step"):
        scales = {}
        for target in ("ort", "trt"):
            model = onnx.load(str(quantized["static"] / target / f"{kind}.onnx"))
            values = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
            scales[target] = {
                n.input[0]: float(values[n.input[1]]) for n in model.graph.node if n.op_type == "QuantizeLinear"
            }
            if target == "trt":
                assert any(n.domain == "edgemem" for n in model.graph.node) and not model.functions
        assert scales["ort"] and scales["ort"] == scales["trt"]


@pytest.mark.parametrize("method", ["dynamic", "static"])
def test_manifest_records_quantization_and_hashes_verify(fp32, quantized, method):
    directory = quantized[method]
    manifest = load_manifest(directory, check_files=True)
    record = manifest.quantization
    assert record["method"] == method and record["recipe"]["name"] == "fast" and record["date"]
    assert record["source"]["identity"] == load_manifest(fp32).identity()
    assert set(record["excluded"]["state"]) == {n for s in manifest.state for n in (s.input, s.output)}
    assert sum(record["quantized_projections"].values()) == 11 * sum(f.endswith(".onnx") for f in manifest.files)
    assert not any(p.name.startswith(".") for p in directory.parent.iterdir() if "tmp" in p.name)  # no temp dir left
    path = directory / "ort" / "step.onnx"
    original = path.read_bytes()
    try:
        path.write_bytes(original + b"\0")
        with pytest.raises(ManifestError, match="sha256"):
            Engine.load(directory)
    finally:
        path.write_bytes(original)


def test_cli_run_and_bench_take_the_quantized_export(quantized):
    result = _invoke("run", quantized["static"], "--prompt", "def ", "--max-new-tokens", "8", "--threads", "1")
    assert result.exit_code == 0, result.output
    result = _invoke(
        "bench",
        quantized["dynamic"],
        "--positions",
        "64",
        "--batch",
        "1,2",
        "--steps",
        "3",
        "--time-limit",
        "0.2",
        "--no-eager",
    )
    assert result.exit_code == 0, result.output


# ---------------------------------------------------------------- drift report


def test_drift_report_json_has_the_documented_shape(fp32, quantized):
    report = json.loads(quantized["report"].read_text())
    kinds = {s.kind for s in load_manifest(fp32).state}
    assert list(report["horizons"]) == HORIZONS
    for row in report["horizons"].values():
        assert set(row) == {"logits_rel_err", "state_rel_err", "metric"}
        assert set(row["state_rel_err"]) == kinds == {"recurrent_state", "conv_state"}
        assert all(0 < v < 0.2 for v in (row["logits_rel_err"], *row["state_rel_err"].values()))
        assert isinstance(row["metric"], float)
    assert list(report["fp32_metric"]) == HORIZONS and report["metric_name"] == "bits_per_byte"
    assert report["us_per_token"]["fp32"] > 0 and report["us_per_token"]["quantized"] > 0
    # int8 weights; the embedding stays fp32, and at this size the graphs' own bytes weigh
    assert report["size_bytes"]["quantized"] < 0.8 * report["size_bytes"]["fp32"]
    assert "32,768" in quantized["output"]  # the table


def test_static_calibration_fits_an_in_place_kv_cache(tmp_path, caplog):
    """An export whose KV cache holds 96 positions, updated in place by onnxruntime's GroupQueryAttention (whose
    CPU kernel takes a prompt after a past for batch 1 only): static calibration with two streams runs, the
    recipe's positions and horizons that do not fit are left out with a warning naming them, and the manifest
    and the drift report record what was used; a recipe with no position that fits is refused in one line."""
    import dataclasses

    from edgemem.export import export
    from edgemem.models import load_config
    from edgemem.models.lm import LM, set_kv_cache

    softmax = dict(num_heads=4, num_kv_heads=2)
    config = load_config("gated-deltanet", d_model=32, n_layers=2, mlp_hidden=32)
    config = dataclasses.replace(
        config, layer_types=["gated_deltanet", "softmax"], layer_type_options={"softmax": softmax}
    )
    model = LM(config).eval()
    set_kv_cache(model, 96)
    export(model, tmp_path / "fp32", targets=["ort"])
    assert load_manifest(tmp_path / "fp32").kv_cache["in_place"] == ["ort"]
    recipe = tmp_path / "long.toml"
    recipe.write_text(
        FAST_RECIPE.replace("last = 1024", "last = 128").replace("prefill_tokens = 32", "prefill_tokens = 16")
    )
    report = tmp_path / "report.json"
    out = tmp_path / "int8"
    result = _invoke(
        "calibrate", tmp_path / "fp32", "--method", "static", "--recipe", recipe, "--report", report, "--out", out
    )
    assert result.exit_code == 0, result.output
    assert (
        "calibration positions 128 left out" in caplog.text
        and "drift horizons 512, 4,096, 32,768 left out" in caplog.text
    )
    assert load_manifest(out).quantization["recipe"]["positions"] == [16, 32, 64]
    assert list(json.loads(report.read_text())["horizons"]) == ["32"]
    recipe.write_text(FAST_RECIPE.replace("first = 16, last = 1024", "first = 90, last = 128"))
    _clean_failure(
        _invoke(
            "calibrate",
            tmp_path / "fp32",
            "--method",
            "static",
            "--recipe",
            recipe,
            "--out",
            tmp_path / "none",
            "--no-drift",
        ),
        "export with a larger --max-length",
    )


# ---------------------------------------------------------------- bad input


def _clean_failure(result, message):
    assert result.exit_code != 0
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit), result.output
    assert message in result.output, result.output


def test_not_an_export_is_a_clean_error(tmp_path):
    _clean_failure(_invoke("calibrate", tmp_path), "is not an edgemem export")


def test_unknown_method_is_a_clean_error(fp32):
    _clean_failure(_invoke("calibrate", fp32, "--method", "int3"), "'int3' is not one of")
    from edgemem.errors import ConfigError
    from edgemem.quant import calibrate

    with pytest.raises(ConfigError, match="unknown quantization method"):
        calibrate(fp32, "int3")


def test_missing_recipe_is_a_clean_error(fp32):
    _clean_failure(_invoke("calibrate", fp32, "--recipe", "calib/nope"), "no calibration recipe 'calib/nope'")


def test_recipe_naming_unknown_tensors_is_a_clean_error(fp32, tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[quantize]\nexclude = ["model.blocks.0.mixer.beta", "model.blocks.*.mixer.no_such_proj"]\n')
    result = _invoke("calibrate", fp32, "--recipe", path, "--out", tmp_path / "q")
    _clean_failure(result, "names no MatMul/Gemm of this export: model.blocks.*.mixer.no_such_proj (known")
    assert not (tmp_path / "q").exists()


def test_malformed_recipe_is_a_clean_error(fp32, tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[data]\ntask = "bytes"\nstreems = 3\n')
    _clean_failure(_invoke("calibrate", fp32, "--recipe", path), "unknown key(s) streems")


def test_existing_output_needs_force(fp32, quantized, recipe):
    _clean_failure(
        _invoke("calibrate", fp32, "--out", quantized["dynamic"], "--recipe", recipe, "--no-drift"), "--force"
    )


def test_verify_refuses_an_int8_export_and_names_the_source(fp32, quantized):
    _clean_failure(_invoke("verify", quantized["dynamic"]), f"Verify {fp32.resolve()} instead")


def test_recipe_exclusions_keep_projections_float(fp32, tmp_path):
    from edgemem.quant import calibrate

    path = tmp_path / "keep.toml"
    path.write_text('[quantize]\nexclude = ["model.blocks.*.mixer.beta", "model.head"]\n')
    manifest = calibrate(fp32, "dynamic", str(path), tmp_path / "q")
    assert set(manifest.quantization["quantized_projections"].values()) == {8}
    assert {"model.blocks.0.mixer.beta", "model.blocks.1.mixer.beta", "model.head"} <= set(
        manifest.quantization["excluded"]["projections_kept_float"]
    )


def test_shipped_recipes_load():
    from edgemem.quant import load_recipe, recipes

    assert {"default", "mqar", "bytes"} <= set(recipes())
    for name in recipes():
        recipe = load_recipe(f"calib/{name}")
        assert recipe.horizons == [32, 512, 4096, 32768] and recipe.positions[-1] > 1000
        recipe.make_task()


def test_example_recipes_in_calib_load_by_path():
    import pathlib

    from edgemem.quant import load_recipe

    examples = sorted((pathlib.Path(__file__).parents[1] / "calib").glob("*.toml"))
    assert examples
    for path in examples:
        recipe = load_recipe(str(path))
        assert recipe.name == path.stem and recipe.source == str(path)
        recipe.make_task()


# ---------------------------------------------------------------- int4 (MatMulNBits, weight-only)

INT4_RECIPE = """
[drift]
horizons = [32, 512, 4096]
streams = 1
window = 32
"""


@pytest.fixture(scope="module")
def int4(fp32, tmp_path_factory):
    """The int4 export through the CLI (block 16: four blocks per 64-wide input) with its drift report."""
    base = tmp_path_factory.mktemp("int4")
    recipe = base / "int4.toml"
    recipe.write_text(INT4_RECIPE)
    out, report = base / "deltanet-int4", base / "int4-report.json"
    result = _invoke(
        "calibrate",
        fp32,
        "--method",
        "int4",
        "--block-size",
        "16",
        "--recipe",
        recipe,
        "--out",
        out,
        "--report",
        report,
    )
    assert result.exit_code == 0, result.output
    return {"dir": out, "report": json.loads(report.read_text()), "output": result.output}


def _nbits_weights(model):
    """{MatMulNBits node name: (W [K, N] dequantized in numpy, scale [N, blocks], block)} from the packed
    initializers: 4-bit values two per byte (low nibble first) along K, a 4-bit zero point per block."""
    values = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    found = {}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        k, n, block = attrs["K"], attrs["N"], attrs["block_size"]
        blocks = -(-k // block)
        packed = values[node.input[1]].reshape(n, -1)
        q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1)[:, :k].astype(np.float64)
        scale = values[node.input[2]].reshape(n, blocks).astype(np.float64)
        zp = values[node.input[3]].reshape(n, -1)
        zp = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(n, -1)[:, :blocks].astype(np.float64)
        rows = np.arange(k) // block
        found[node.name] = (((q - zp[:, rows]) * scale[:, rows]).T, scale, block)
    return found


def _gathered_tables(model):
    """{table name: (table [V, H] dequantized in numpy, scale [V, blocks], block)} of each GatherBlockQuantized:
    uint8 data [V, H/2] two 4-bit values per byte (low nibble first), scales [V, H/block], packed zero points."""
    values = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    found = {}
    for node in model.graph.node:
        if node.op_type != "GatherBlockQuantized":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["bits"] == 4 and attrs["quantize_axis"] == 1 and attrs["gather_axis"] == 0
        packed, scale, zp = (values[name] for name in (node.input[0], node.input[2], node.input[3]))
        q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1).astype(np.float64)
        zp = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(zp.shape[0], -1)[:, : scale.shape[1]].astype(np.float64)
        rows = np.arange(q.shape[1]) // attrs["block_size"]
        found[node.input[0].removesuffix(".q4")] = ((q - zp[:, rows]) * scale[:, rows], scale, attrs["block_size"])
    return found


def test_int4_export_runs_in_onnxruntime_close_to_fp32(fp32, int4):
    ids = np.random.default_rng(0).integers(0, 256, 300)
    reference = Engine.load(fp32, threads=1).new_stream().prefill(ids)
    manifest = load_manifest(int4["dir"], check_files=True)
    assert manifest.targets == ["ort", "generic"]  # trt takes explicit Q/DQ only
    for target in ("ort", "generic"):
        stream = Engine.load(int4["dir"], threads=1, target=target).new_stream()
        logits = np.concatenate([stream.prefill(ids[:200]), np.stack([stream.step(int(t)) for t in ids[200:]])])
        err = np.linalg.norm(logits - reference) / np.linalg.norm(reference)
        assert 0 < err < 0.3, (target, err)
        assert all(v.dtype == np.float32 for v in stream.state_dict().values())


def test_int4_has_a_matmulnbits_node_per_projection_and_records_the_block(fp32, int4):
    manifest, files = _graph_files(int4["dir"])
    state = {n for s in manifest.state for n in (s.input, s.output)}
    for path in files:
        source = onnx.load(str(fp32 / path.parent.name / path.name))
        weights = {i.name for i in source.graph.initializer}
        projections = {n.name for n in source.graph.node if n.op_type == "MatMul" and n.input[1] in weights}
        model = onnx.load(str(path))
        nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
        assert len(projections) == 11 and {n.name.removesuffix("_Q4") for n in nbits} == projections, path
        assert not any(
            n.op_type == "MatMul" and n.input[1] in {i.name for i in model.graph.initializer} for n in model.graph.node
        )  # no float weight projection left
        for node in nbits:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert attrs["bits"] == 4 and attrs["block_size"] == 16 and node.domain == "com.microsoft"
            assert not {*node.input, *node.output} & state
    record = manifest.quantization
    assert record["method"] == "int4" and record["scheme"]["block_size"] == 16
    assert set(record["quantized_projections"].values()) == {11}
    assert "11 int4 projections" not in int4["output"] and "66 int4 projections in 6 graphs" in int4["output"]


def test_int4_weights_are_the_fp32_weights_rounded_to_their_block_grid(fp32, int4):
    """Unpacked in numpy: every weight within half a quantization step of the fp32 weight, per block."""
    source = onnx.load(str(fp32 / "ort" / "step.onnx"))
    weights = {i.name: onnx.numpy_helper.to_array(i) for i in source.graph.initializer}
    original = {
        n.name: weights[n.input[1]] for n in source.graph.node if n.op_type == "MatMul" and n.input[1] in weights
    }
    found = _nbits_weights(onnx.load(str(int4["dir"] / "ort" / "step.onnx")))
    assert len(found) == 11
    for name, (dequantized, scale, block) in found.items():
        w = original[name.removesuffix("_Q4")].astype(np.float64)
        step = np.repeat(scale.T, block, axis=0)[: w.shape[0]]
        assert np.all(np.abs(dequantized - w) <= step / 2 * (1 + 1e-5) + 1e-7), name
        assert 0 < np.abs(dequantized - w).max()  # really rounded


def test_int4_graph_matches_the_fp32_graph_with_dequantized_weights(fp32, int4):
    """The independent reference: the fp32 step graph with each projection's weight replaced by its blockwise
    dequantization (numpy) — the int4 graph is far closer to it than to the fp32 graph (what is left is the
    kernel's int8 activations per block)."""
    import onnxruntime as ort

    source = onnx.load(str(fp32 / "ort" / "step.onnx"))
    quantized = onnx.load(str(int4["dir"] / "ort" / "step.onnx"))
    found = _nbits_weights(quantized)
    by_node = {n.name: n.input[1] for n in source.graph.node if n.op_type == "MatMul"}
    replaced = {by_node[name.removesuffix("_Q4")]: w for name, (w, _, _) in found.items()}
    reference = onnx.load(str(fp32 / "ort" / "step.onnx"))
    tables = _gathered_tables(quantized)
    assert list(tables) == ["model.embed.weight"]  # the embedding is 4-bit too
    replaced |= {name: w for name, (w, _, _) in tables.items()}
    for init in reference.graph.initializer:
        if init.name in replaced:
            init.CopyFrom(onnx.numpy_helper.from_array(replaced[init.name].astype(np.float32), init.name))
    manifest = load_manifest(fp32)
    rng = np.random.default_rng(1)
    feeds = {manifest.inputs["tokens"]: rng.integers(0, 256, (3, 1))}
    for spec in manifest.state:
        shape = [3 if d == "batch" else d for d in spec.shape]
        feeds[spec.input] = (rng.standard_normal(shape) * 0.3).astype(np.float32)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1

    def run(model):
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
            None, feeds
        )

    outs_q, outs_deq, outs_fp = run(quantized), run(reference), run(source)
    for q, deq, fp in zip(outs_q, outs_deq, outs_fp):
        to_deq = np.linalg.norm(q - deq) / np.linalg.norm(deq)
        to_fp = np.linalg.norm(q - fp) / np.linalg.norm(fp)
        assert to_deq < 0.02 and to_deq < 0.25 * to_fp, (to_deq, to_fp)


def test_int4_drift_report_is_finite_bounded_and_smaller_on_disk(int4):
    report = int4["report"]
    assert report["method"] == "int4" and list(report["horizons"]) == ["32", "512", "4096"]
    for row in report["horizons"].values():
        assert all(0 < v < 0.5 for v in (row["logits_rel_err"], *row["state_rel_err"].values())), row
    assert report["size_bytes"]["quantized"] < 0.7 * report["size_bytes"]["fp32"]  # small tensors stay in the graphs
    assert "INT4" not in int4["output"] and "int4 vs fp32" in int4["output"]


def test_int4_quantizes_a_tied_head_read_through_a_transpose(tmp_path):
    """Large exports keep a tied output head as MatMul(x, Transpose(embedding)): int4 gives the head its own
    transposed weight (the embedding stays fp32 for the Gather) and makes it a MatMulNBits like the others."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from edgemem.quant.calibrate import _int4
    from edgemem.quant.graph import fold_transposed_weights, projections

    rng = np.random.default_rng(0)
    embed, w = rng.standard_normal((40, 32)).astype(np.float32), rng.standard_normal((32, 32)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["embed", "ids"], ["h"], name="embedding"),
            helper.make_node("MatMul", ["h", "w"], ["h2"], name="proj"),
            helper.make_node("Transpose", ["embed"], ["embed_t"], perm=[1, 0], name="tie"),
            helper.make_node("MatMul", ["h2", "embed_t"], ["logits"], name="head"),
        ],
        "tied",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "T"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "T", 40])],
        [numpy_helper.from_array(embed, "embed"), numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    assert [p.quantizable for p in projections(model, set())] == [True, False]
    assert [p.quantizable for p in projections(model, set(), transposed=True)] == [True, True]
    feeds = {"ids": rng.integers(0, 40, (1, 5))}

    def run(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]

    reference = run(model)
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    assert fold_transposed_weights(folded, ["proj", "head"]) == 1
    assert [n.op_type for n in folded.graph.node] == ["Gather", "MatMul", "MatMul"]
    np.testing.assert_array_equal(run(folded), reference)
    onnx.save(model, tmp_path / "tied.onnx")
    _int4(tmp_path / "tied.onnx", tmp_path / "int4.onnx", ["proj", "head"], 16, embeddings=False)
    quantized = onnx.load(str(tmp_path / "int4.onnx"))
    assert [n.op_type for n in quantized.graph.node] == ["Gather", "MatMulNBits", "MatMulNBits"]
    assert quantized.graph.node[0].input[0] == "embed"  # --embeddings fp32: the lookup reads the fp32 table
    err = np.linalg.norm(run(quantized) - reference) / np.linalg.norm(reference)
    assert 0 < err < 0.2, err

    _int4(tmp_path / "tied.onnx", tmp_path / "int4.onnx", ["proj", "head"], 16, embeddings=True)
    quantized = onnx.load(str(tmp_path / "int4.onnx"))
    assert [n.op_type for n in quantized.graph.node] == ["GatherBlockQuantized", "MatMulNBits", "MatMulNBits"]
    assert not any(list(i.dims) == [40, 32] and i.data_type == TensorProto.FLOAT for i in quantized.graph.initializer)
    values = {i.name: i for i in quantized.graph.initializer}
    gather, head = quantized.graph.node[0], quantized.graph.node[2]
    for a, b in zip(gather.input[::2][:1] + gather.input[2:], head.input[1:4]):  # data, scales, zero points
        assert values[a].raw_data == values[b].raw_data and values[a].data_type == values[b].data_type, (a, b)
    ((table, scale, block),) = _gathered_tables(quantized).values()
    step = np.repeat(scale, block, axis=1)
    assert np.all(np.abs(table - embed) <= step / 2 * (1 + 1e-5) + 1e-7) and np.abs(table - embed).max() > 0
    lookup = onnx.helper.make_model(
        onnx.helper.make_graph(
            [gather],
            "lookup",
            [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "T"])],
            [helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, "T", 32])],
            [values[n] for n in gather.input if n in values],
        ),
        opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)],
    )
    np.testing.assert_allclose(run(lookup), table[feeds["ids"]], rtol=1e-6, atol=1e-6)  # onnxruntime's kernel
    err = np.linalg.norm(run(quantized) - reference) / np.linalg.norm(reference)
    assert 0 < err < 0.25, err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--method", "int4", "--block-size", "48"], "int4 block size must be a power of two from 16 to 256"),
        (["--method", "int4", "--block-size", "8"], "int4 block size must be a power of two from 16 to 256"),
        (["--method", "dynamic", "--block-size", "32"], "a block size applies to --method int4 only"),
    ],
)
def test_bad_block_size_is_a_clean_error(fp32, tmp_path, args, message):
    _clean_failure(_invoke("calibrate", fp32, *args, "--out", tmp_path / "q", "--no-drift"), message)
    assert not (tmp_path / "q").exists()
    from edgemem.errors import ConfigError
    from edgemem.quant import calibrate

    with pytest.raises(ConfigError, match="block size"):
        calibrate(fp32, args[1], block_size=int(args[3]), out=tmp_path / "q")


def test_4_bit_embeddings_without_int4_are_a_clean_error(fp32, tmp_path):
    _clean_failure(
        _invoke(
            "calibrate", fp32, "--method", "dynamic", "--embeddings", "int4", "--out", tmp_path / "q", "--no-drift"
        ),
        "4-bit embeddings come with --method int4 only",
    )
    assert not (tmp_path / "q").exists()


# ---------------------------------------------------------------- trained model


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    if not CHECKPOINT.is_file():
        pytest.skip(f"no trained checkpoint at {CHECKPOINT} (edgemem train deltanet on mqar)")
    from edgemem.export import export
    from edgemem.models import load_checkpoint

    out = tmp_path_factory.mktemp("trained") / "deltanet-mqar"
    export(load_checkpoint(CHECKPOINT), out, targets=["ort"], extra_config={"checkpoint": str(CHECKPOINT)})
    return out


@pytest.mark.parametrize("method", ["dynamic", "static"])
def test_trained_deltanet_does_not_drift(trained, method):
    """Error at 32K at most twice the error at 512 (no growth with the horizon); accuracy within a point."""
    from edgemem.quant import calibrate, drift_report, load_recipe

    recipe = load_recipe("calib/mqar")
    recipe.drift_streams = 2
    out = trained.with_name(f"deltanet-mqar-{method}")
    calibrate(trained, method, recipe, out)
    report = drift_report(trained, out, recipe, timing_steps=20)
    rows = report["horizons"]
    assert rows["32768"]["logits_rel_err"] <= 2 * rows["512"]["logits_rel_err"], rows
    for horizon in HORIZONS:
        assert abs(rows[horizon]["metric"] - report["fp32_metric"][horizon]) <= 0.01, (horizon, report)

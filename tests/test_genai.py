"""onnxruntime-genai as a consumer: `edgemem export` writes `genai_config.json` when the prefill graph fits
genai's decoder contract, genai then generates what edgemem.runtime generates, and an export that does
not fit says why (manifest, `edgemem verify`)."""

import json
import logging

import pytest
import torch
from conftest import genai_greedy

from edgemem.export import export
from edgemem.export.genai import GENAI_CONFIG, decide
from edgemem.export.verify import verify
from edgemem.manifest import Manifest
from edgemem.manifest import load as load_manifest
from edgemem.models import build
from edgemem.runtime import Engine

og = pytest.importorskip(
    "onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install 'edgemem-toolkit[serve]')"
)

SMALL = {"d_model": 32, "mlp_hidden": 32, "n_layers": 2, "num_heads": 2}
PROMPT = list(b"The quick brown fox")
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """arch → export directory, made on first use (export tracing dominates this file's time)."""
    root, done = tmp_path_factory.mktemp("genai"), {}

    def get(arch: str, dtype: str = "fp32"):
        if (arch, dtype) not in done:
            model = build(arch, seed=0, **SMALL)
            export(model, root / f"{arch}-{dtype}", targets=["ort"], dtype=dtype, extra_config={"seed": 0})
            done[arch, dtype] = root / f"{arch}-{dtype}"
        return done[arch, dtype]

    return get


@pytest.mark.parametrize(
    "arch, dtype",
    [
        ("gated-deltanet", "fp32"),
        pytest.param("deltanet", "fp32", marks=pytest.mark.slow),
        pytest.param("softmax", "fp32", marks=pytest.mark.slow),
        pytest.param("gated-deltanet", "fp16", marks=pytest.mark.slow),  # fp16 weights and logits, fp32 state
    ],
)
def test_genai_generates_the_runtime_greedy_tokens(exported, arch, dtype):
    directory = exported(arch, dtype)
    manifest = load_manifest(directory)
    assert manifest.genai == {"fits": True, "config": GENAI_CONFIG, "target": "ort", "tokenizer": []}
    assert GENAI_CONFIG in manifest.files  # checked like every other file of the export
    reference = list(Engine.load(directory, threads=1).generate(bytes(PROMPT), max_new_tokens=NEW_TOKENS))
    eos = min(set(range(manifest.vocab_size)) - set(reference))
    assert genai_greedy(directory, PROMPT, NEW_TOKENS, eos) == reference


def test_genai_runs_the_int4_export_and_generates_its_greedy_tokens(exported, tmp_path):
    from edgemem.quant import calibrate

    out = tmp_path / "int4"
    manifest = calibrate(exported("gated-deltanet"), "int4", out=out, block_size=16)
    assert manifest.genai == {"fits": True, "config": GENAI_CONFIG, "target": "ort", "tokenizer": []}
    assert json.loads((out / GENAI_CONFIG).read_text())["model"]["decoder"]["filename"] == "ort/prefill.onnx"
    load_manifest(out, check_files=True)
    reference = list(Engine.load(out, threads=1).generate(bytes(PROMPT), max_new_tokens=NEW_TOKENS))
    eos = min(set(range(manifest.vocab_size)) - set(reference))
    assert genai_greedy(out, PROMPT, NEW_TOKENS, eos) == reference


def test_genai_runs_a_tied_head_whose_table_is_an_input_too(tmp_path):
    """A head tied to its embedding table reads the table in place: the ort graphs list it among their
    inputs too (`edgemem.export.lower.read_table_in_place`), and genai, which feeds only the inputs it
    knows, generates the runtime's greedy tokens."""
    import dataclasses

    import onnx

    from edgemem.models import load_config
    from edgemem.models.lm import LM

    config = load_config("gated-deltanet", d_model=64, mlp_hidden=32, n_layers=1, vocab_size=32000)
    torch.manual_seed(0)
    export(LM(dataclasses.replace(config, tie_embeddings=True)).eval(), tmp_path / "tied", targets=["ort"])
    graph = onnx.load(str(tmp_path / "tied" / "ort" / "prefill.onnx"), load_external_data=False).graph
    assert {v.name for v in graph.input} & {t.name for t in graph.initializer} == {"model.embed.weight"}
    reference = list(Engine.load(tmp_path / "tied", threads=1).generate(bytes(PROMPT), max_new_tokens=NEW_TOKENS))
    eos = min(set(range(config.vocab_size)) - set(reference))
    assert genai_greedy(tmp_path / "tied", PROMPT, NEW_TOKENS, eos) == reference


@pytest.mark.slow
def test_genai_runs_a_hybrid_of_recurrent_and_attention_layers(tmp_path):
    from edgemem.layers import SoftmaxAttention

    model = build("gated-deltanet", seed=0, **SMALL)
    torch.manual_seed(1)
    model.blocks[1].mixer = SoftmaxAttention(SMALL["d_model"], num_heads=SMALL["num_heads"])  # layer 1: a KV cache
    export(model, tmp_path / "hybrid", targets=["ort"])
    decoder = json.loads((tmp_path / "hybrid" / GENAI_CONFIG).read_text())["model"]["decoder"]
    assert decoder["layer_types"] == ["linear_attention", "full_attention"]
    reference = list(Engine.load(tmp_path / "hybrid", threads=1).generate(bytes(PROMPT), max_new_tokens=NEW_TOKENS))
    assert genai_greedy(tmp_path / "hybrid", PROMPT, NEW_TOKENS, min(set(range(256)) - set(reference))) == reference


def test_genai_config_names_the_manifest_state(exported):
    directory = exported("gated-deltanet")
    manifest = load_manifest(directory)
    config = json.loads((directory / GENAI_CONFIG).read_text())
    decoder = config["model"]["decoder"]
    assert decoder["filename"] == "ort/prefill.onnx" and (directory / decoder["filename"]).is_file()
    names = {decoder["inputs"][k] % i for k in ("past_conv_names", "past_recurrent_names") for i in range(2)}
    assert names == {s.input for s in manifest.state}
    outputs = {decoder["outputs"][k] % i for k in ("present_conv_names", "present_recurrent_names") for i in range(2)}
    assert outputs == {s.output for s in manifest.state}
    assert decoder["layer_types"] == ["linear_attention"] * 2 and decoder["num_hidden_layers"] == 2


def _manifest(arch, prefill=True, **overrides):
    """The manifest an export of `arch` would have (state from the model itself; nothing is traced), or with
    no prefill graph."""
    from edgemem.export import state_specs
    from edgemem.export.segments import prefill_segment

    model = build(arch, seed=0, **{**SMALL, **overrides})
    graphs = {"prefill": prefill and prefill_segment(model) is not None, "step": model.streaming}
    return Manifest(
        arch=arch,
        config={"vocab_size": 256, "dtype": "fp32"},
        opset=20,
        targets=["generic", "ort", "trt"],
        state=state_specs(model),
        graphs=graphs,
    )


@pytest.mark.parametrize(
    "arch, why",
    [
        ("titans-mag", "non-zero initial state"),
        ("titans-mag", "position"),
        ("linear", "recurrent_state but no conv_state"),
        ("longformer", "fixed-size window"),  # ring-buffer K/V of the window
        ("titans-mac", "chunk_memory.0"),
        ("longformer-encoder", "bidirectional"),
        ("ttt-linear", "memory.0"),
    ],
)
def test_exports_that_do_not_fit_say_why(arch, why):
    target, reasons = decide(_manifest(arch, **({"dilation": [1, 2]} if arch == "longformer" else {})))
    assert target is None and any(why in r for r in reasons), reasons


def test_an_export_without_a_prefill_graph_does_not_fit():
    target, reasons = decide(_manifest("gated-deltanet", prefill=False))
    assert target is None and reasons == [
        "no prefill graph (prompts are stepped): genai runs one graph for the whole prompt"
    ]


def test_recurrent_and_attention_presets_fit():
    for arch in ("gated-deltanet", "deltanet", "softmax"):
        assert decide(_manifest(arch)) == ("ort", [])
    only_trt = _manifest("deltanet")
    only_trt.targets = ["trt"]
    assert "model-local functions" in decide(only_trt)[1][0]
    no_conv = _manifest("gated-deltanet", conv_size=0)
    assert any("no conv_state" in r for r in decide(no_conv)[1])


@pytest.mark.slow
def test_verify_says_why_an_export_does_not_fit(tmp_path, caplog):
    model = build("titans-mag", seed=0, d_model=32, mlp_hidden=32, n_layers=1, num_heads=2, window=8, chunk_size=4)
    export(model, tmp_path / "mag", targets=["generic"], extra_config={"seed": 0})
    manifest = load_manifest(tmp_path / "mag")
    assert manifest.genai["fits"] is False and not (tmp_path / "mag" / GENAI_CONFIG).exists()
    with caplog.at_level(logging.INFO, logger="edgemem.export.verify"):
        checks, _ = verify(tmp_path / "mag", threads=1, prompt=5, steps=2)
    assert checks and all(c.ok for c in checks)
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "does not fit onnxruntime-genai" in message and "non-zero initial state" in message

"""Hugging Face Longformer import: edgemem's encoder and its ONNX export give transformers'
`LongformerModel.last_hidden_state`, at any length and with global tokens anywhere, without
a T×T tensor; bad checkpoints and inputs fail with one clear line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx.inliner
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator
from safetensors.torch import load_file, save_file

from edgemem.errors import ConfigError, EdgememError, ShapeError
from edgemem.export import export
from edgemem.export.verify import verify
from edgemem.manifest import load as load_manifest
from edgemem.models.hf import from_hf
from edgemem.models.hf.longformer import build

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4  # fp32, relative to the largest reference value


def import_dir(directory: Path) -> torch.nn.Module:
    """The checkpoint in `directory` through edgemem's Hugging Face import."""
    return from_hf(directory)


def checkpoint(directory: Path, *, cls=None, seed: int = 0, **options) -> torch.nn.Module:
    """A tiny random Longformer saved to `directory`; returns the transformers model.
    Weights are drawn wider than the usual init (0.02) so attention moves the output visibly."""
    defaults = dict(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        attention_window=4,
        max_position_embeddings=128,
        initializer_range=0.3,
    )
    torch.manual_seed(seed)
    model = (cls or transformers.LongformerModel)(transformers.LongformerConfig(**{**defaults, **options})).eval()
    model.save_pretrained(directory)
    return model


def global_rows(t: int) -> torch.Tensor:
    """Four sequences' global masks: none; the first token; a middle one; first, middle and last."""
    mask = torch.zeros(4, t, dtype=torch.long)
    mask[1, 0] = 1
    mask[2, t // 2] = 1
    mask[3, [0, t // 2, t - 1]] = 1
    return mask


def token_ids(t: int, vocab: int, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(3, vocab, (4, t), generator=torch.Generator().manual_seed(seed))
    ids[2, t // 3] = 1  # a pad id inside a sequence: it takes position pad_token_id, later ones shift
    return ids


def relative(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def reference(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=ids, global_attention_mask=mask).last_hidden_state.numpy()


@pytest.mark.parametrize(
    "options, length",
    [
        (dict(), 13),  # window 4 (one-sided 2), length not a multiple of it
        (dict(num_attention_heads=4, hidden_size=32, num_hidden_layers=3, attention_window=[8, 4, 16]), 37),
        (dict(num_attention_heads=1, hidden_size=12, num_hidden_layers=1, attention_window=6), 20),
        (dict(num_attention_heads=8, hidden_size=32, attention_window=[8, 4], pad_token_id=0), 9),
    ],
    ids=["2heads-w4-T13", "4heads-windows8,4,16-T37", "1head-w6-T20", "8heads-windows8,4-T9"],
)
def test_pytorch_matches_transformers_last_hidden_state(tmp_path, options, length):
    hf = checkpoint(tmp_path, **options)
    ours = import_dir(tmp_path)
    ids, mask = token_ids(length, hf.config.vocab_size), global_rows(length)
    expected = reference(hf, ids, mask)
    with torch.no_grad():
        got = ours(ids, mask).numpy()
        no_globals = ours(ids).numpy()
    assert relative(got, expected) <= TOLERANCE
    assert relative(no_globals[0], expected[0]) <= TOLERANCE  # no mask ≡ an all-zero mask
    # the comparison is not vacuous: global tokens move the output well past the tolerance
    assert relative(no_globals[3], expected[3]) > 100 * TOLERANCE


def test_task_model_trunk_is_imported_and_its_heads_ignored(tmp_path):
    hf = checkpoint(tmp_path, cls=transformers.LongformerForMaskedLM)
    ours = import_dir(tmp_path)
    ids, mask = token_ids(11, hf.config.vocab_size), global_rows(11)
    assert relative(ours(ids, mask).detach().numpy(), reference(hf.longformer, ids, mask)) <= TOLERANCE


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One export (any length) of a 2-layer, 4-head Longformer with windows 4 and 8."""
    root = tmp_path_factory.mktemp("longformer")
    hf = checkpoint(root / "hf", hidden_size=32, num_attention_heads=4, attention_window=[4, 8])
    export(import_dir(root / "hf"), root / "out", targets=("generic", "ort"))
    return hf, root / "out"


def test_export_is_an_encoder_with_a_global_mask_input(exported):
    _, out = exported
    manifest = load_manifest(out)
    assert manifest.graphs == {"prefill": True, "step": False} and manifest.state == []
    assert manifest.inputs == {"tokens": "input_ids", "global_attention_mask": "global_attention_mask"}
    assert manifest.outputs == {"last_hidden_state": "last_hidden_state"}
    model = onnx.load(out / "generic" / "prefill.onnx")
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert dims == {"input_ids": ["batch", "sequence"], "global_attention_mask": ["batch", "sequence"]}
    # two BandedAttention nodes per layer (local rows; global rows with the global projections)
    assert sum(n.op_type == "BandedAttention" and n.domain == "edgemem" for n in model.graph.node) == 4
    assert [f.name for f in model.functions] == ["BandedAttention"]


@pytest.mark.parametrize("target", ["generic", "ort"])
def test_onnxruntime_matches_transformers_at_two_lengths_from_one_export(exported, target):
    hf, out = exported
    session = ort.InferenceSession(str(out / target / "prefill.onnx"), providers=["CPUExecutionProvider"])
    for length in (3, 21, 70):  # below one block of the window-8 layer, not a multiple of either block
        ids, mask = token_ids(length, hf.config.vocab_size, seed=length), global_rows(length)
        (got,) = session.run(None, {"input_ids": ids.numpy(), "global_attention_mask": mask.numpy()})
        assert relative(got, reference(hf, ids, mask)) <= TOLERANCE


@pytest.mark.slow
def test_fp16_export_matches_transformers_within_fp16_tolerance(tmp_path):
    hf = checkpoint(tmp_path / "hf", hidden_size=32, num_attention_heads=4, attention_window=[4, 8])
    export(import_dir(tmp_path / "hf"), tmp_path / "out", targets=("generic",), dtype="fp16")
    session = ort.InferenceSession(
        str(tmp_path / "out" / "generic" / "prefill.onnx"), providers=["CPUExecutionProvider"]
    )
    ids, mask = token_ids(30, hf.config.vocab_size), global_rows(30)
    (got,) = session.run(None, {"input_ids": ids.numpy(), "global_attention_mask": mask.numpy()})
    assert got.dtype == np.float16 and relative(got, reference(hf, ids, mask)) <= 2e-2


def quadratic_tensors(model: onnx.ModelProto, feeds: dict[int, dict[str, np.ndarray]]) -> dict[str, tuple]:
    """Every tensor of `model` (local functions inlined) whose size grows faster than the
    sequence: run at two lengths T1 < T2, flag those with size(T2) / size(T1) > T2 / T1.
    A T×T tensor grows by (T2/T1)² and is flagged; band, global and projection tensors are not."""
    evaluator = ReferenceEvaluator(onnx.inliner.inline_local_functions(model))
    (t1, f1), (t2, f2) = sorted(feeds.items())
    small, large = (evaluator.run(None, f, intermediate=True) for f in (f1, f2))
    return {
        name: (np.shape(small[name]), np.shape(large[name]))
        for name in small
        if np.size(small[name]) and np.size(large[name]) / np.size(small[name]) > t2 / t1
    }


def test_exported_graph_has_no_tensor_growing_like_t_squared(exported):
    hf, out = exported
    model = onnx.load(out / "generic" / "prefill.onnx")
    feeds = {}
    for t in (40, 80):
        mask = np.zeros((1, t), np.int64)
        mask[0, [0, t // 2]] = 1  # the same two global tokens at both lengths
        feeds[t] = {"input_ids": token_ids(t, hf.config.vocab_size)[:1].numpy(), "global_attention_mask": mask}
    assert quadratic_tensors(model, feeds) == {}

    # the check can fail: plain attention scores q·kᵀ are T×T
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", 4])
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["x", "xt"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "x"], ["y"]),
    ]
    dense = helper.make_model(helper.make_graph(nodes, "dense", [x], [y]), opset_imports=[helper.make_opsetid("", 20)])
    flagged = quadratic_tensors(dense, {t: {"x": np.ones((1, t, 4), np.float32)} for t in (40, 80)})
    assert set(flagged) == {"scores", "probs"}


# bad input: one clear line each


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message and isinstance(error.value, EdgememError)
    return message


@pytest.fixture
def hf_dir(tmp_path):
    checkpoint(tmp_path)
    return tmp_path


def test_cli_exports_and_verifies_an_import_with_global_tokens(hf_dir, tmp_path_factory):
    """`edgemem export --hf` then `edgemem verify`, which feeds a global-attention mask to both sides."""
    from click.testing import CliRunner

    from edgemem.cli import main

    out = tmp_path_factory.mktemp("export") / "out"  # not inside the checkpoint directory: that is refused
    result = CliRunner().invoke(main, ["export", "--hf", str(hf_dir), "--out", str(out), "--target", "generic"])
    assert result.exit_code == 0, result.output
    checks, _ = verify(out, threads=1)
    assert [(c.target, c.graph, c.tensor) for c in checks] == [("generic", "prefill", "last_hidden_state")]
    assert all(c.ok for c in checks), checks


def test_a_weight_of_the_wrong_shape_is_named(hf_dir):
    weights = load_file(hf_dir / "model.safetensors")
    weights["encoder.layer.1.attention.self.key_global.weight"] = torch.zeros(16, 8)
    save_file(weights, hf_dir / "model.safetensors")
    with pytest.raises(ConfigError) as error:
        import_dir(hf_dir)
    assert "encoder.layer.1.attention.self.key_global.weight has shape (16, 8)" in one_line(error)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(num_hidden_layers=3, attention_window=[4] * 3), "encoder.layer.2.attention.self.query.weight is missing"),
        (dict(num_hidden_layers=1, attention_window=[4]), "not part of a 1-layer Longformer encoder"),
        (dict(hidden_size=32), "embeddings.word_embeddings.weight has shape (40, 16)"),
        (dict(intermediate_size=48), "encoder.layer.0.intermediate.dense.weight has shape (24, 16)"),
        (dict(max_position_embeddings=64), "embeddings.position_embeddings.weight has shape (128, 16)"),
    ],
)
def test_a_config_that_disagrees_with_the_weights(hf_dir, change, message):
    config = {**json.loads((hf_dir / "config.json").read_text()), **change}
    with pytest.raises(ConfigError) as error:
        build(config, load_file(hf_dir / "model.safetensors"))
    assert message in one_line(error)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(hidden_act="relu"), "hidden_act 'relu' is not supported; only 'gelu'"),
        (dict(position_embedding_type="relative_key"), "position_embedding_type 'relative_key' is not supported"),
        (dict(attention_window=5), "every attention_window must be an even int >= 2"),
        (dict(attention_window=[4]), "attention_window must be an int or a list of 2 ints"),
        (dict(hidden_size=15), "hidden_size (15) is not a multiple of num_attention_heads (2)"),
        (dict(model_type="bert"), "model_type 'bert' is not a Longformer"),
    ],
)
def test_an_unsupported_option_is_refused(hf_dir, change, message):
    config = {**json.loads((hf_dir / "config.json").read_text()), **change}
    with pytest.raises(ConfigError) as error:
        build(config, load_file(hf_dir / "model.safetensors"))
    assert message in one_line(error)


@pytest.mark.parametrize(
    "ids, mask, message",
    [
        (torch.ones(5, dtype=torch.long), None, "input_ids must be an integer tensor [B, T]; got (5,)"),
        (torch.ones(2, 5), None, "input_ids must be an integer tensor [B, T]; got (2, 5)"),
        (torch.ones(2, 5, dtype=torch.long), torch.ones(2, 4, dtype=torch.long), "shaped like input_ids (2, 5)"),
        (torch.ones(1, 200, dtype=torch.long), None, "longer than the position table allows (126)"),
        (torch.full((1, 5), 40), None, "input_ids must lie in [0, 40)"),
    ],
    ids=["1-d", "float", "mask-shape", "too-long", "out-of-vocab"],
)
def test_a_wrong_input_is_refused(hf_dir, ids, mask, message):
    model = import_dir(hf_dir)
    with pytest.raises(ShapeError) as error:
        model(ids, mask)
    assert message in one_line(error)


def test_the_encoder_has_no_step(hf_dir):
    model = import_dir(hf_dir)
    with pytest.raises(EdgememError) as error:
        model.step(torch.ones(1, dtype=torch.long), model.init_state(1))
    assert "bidirectional" in one_line(error)


@pytest.mark.slow
def test_memory_sample_runs_both_sides_and_they_agree():
    """samples/longformer_memory.py at a small length: both processes report, outputs agree."""
    script = Path(__file__).parent.parent / "samples" / "longformer_memory.py"
    args = ["--length", "600", "--window", "32", "--hidden", "32", "--heads", "2", "--layers", "1"]
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, check=True)
    lines = result.stdout.splitlines()
    assert any(line.strip().startswith("onnxruntime   peak RSS") for line in lines)
    assert any(line.strip().startswith("transformers  peak RSS") for line in lines)
    assert float(lines[-1].rsplit(":", 1)[1]) <= TOLERANCE

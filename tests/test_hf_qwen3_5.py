"""Qwen3.5 imported from a save_pretrained directory vs transformers' own model (tiny, random, made here)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import genai_greedy
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    DynamicCache,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
)

from edgemem.cli import main
from edgemem.export import export
from edgemem.models import from_hf
from edgemem.models.hf import tokenizer_files
from edgemem.models.hf.cache import from_external, to_external
from edgemem.quant import calibrate
from edgemem.runtime import Engine

VOCAB = 61


def text_config(
    layers: list[str], *, heads=4, kv_heads=2, head_dim=16, k_heads=2, v_heads=4, dk=8, dv=12, conv=4, tie=False
):
    return Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=len(layers),
        layer_types=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        linear_conv_kernel_dim=conv,
        linear_key_head_dim=dk,
        linear_value_head_dim=dv,
        linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        eos_token_id=None,
        pad_token_id=None,
        bos_token_id=None,
    )


def randomise(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights everywhere, norms included (transformers starts (1 + w) norms at w = 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if "linear_attn.norm" in name else 0.0))
            elif name.endswith("A_log") or name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def save(model, path, tokenizer: bool = False):
    model.save_pretrained(path)
    if tokenizer:
        words = ["<unk>", *(f"w{i}" for i in range(VOCAB - 1))]
        tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(path / "tokenizer.json"))
    return path


def rel(a, b) -> float:
    a, b = torch.as_tensor(np.asarray(a, dtype=np.float64)), torch.as_tensor(np.asarray(b, dtype=np.float64))
    return float((a - b).abs().max() / b.abs().max())


SHAPES = {
    # name: (layer types, config options, prompt length)
    "gva-dk!=dv": (["linear_attention", "full_attention"], {}, 7),
    "mha-4-layers": (
        ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        dict(heads=2, kv_heads=2, head_dim=8, k_heads=3, v_heads=3, dk=16, dv=8, conv=3),
        13,
    ),
    "gqa4-6-layers-tied": (
        [
            "full_attention",
            "linear_attention",
            "full_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
        ],
        dict(heads=8, kv_heads=2, head_dim=8, k_heads=1, v_heads=4, dk=12, dv=8, tie=True),
        21,
    ),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_forward_logits_match_transformers(tmp_path, shape):
    layers, options, length = SHAPES[shape]
    hf = randomise(Qwen3_5ForCausalLM(text_config(layers, **options)), seed=len(layers))
    ours = from_hf(save(hf, tmp_path))
    ids = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel(ours(ids), hf(ids).logits) <= 1e-4


def test_multimodal_checkpoint_uses_text_config_and_ignores_vision(tmp_path):
    text = text_config(["linear_attention", "full_attention"]).to_dict()
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=16,
        num_heads=2,
        out_hidden_size=32,
        patch_size=4,
        temporal_patch_size=1,
        num_position_embeddings=16,
    )
    hf = randomise(Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)), seed=5)
    path = save(hf, tmp_path)
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3_5"
    ours = from_hf(path)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel(ours(ids), hf(input_ids=ids).logits) <= 1e-4


def hf_stream(hf, prompt: torch.Tensor, tokens: list[int]) -> list[torch.Tensor]:
    """transformers with its cache: prompt logits (last row), then one row per fed token."""
    with torch.no_grad():
        out = hf(prompt, use_cache=True)
        rows, cache = [out.logits[0, -1]], out.past_key_values
        for t in tokens:
            out = hf(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            rows.append(out.logits[0, -1])
            cache = out.past_key_values
    return rows


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    layers = ["linear_attention", "full_attention", "linear_attention"]
    hf = randomise(Qwen3_5ForCausalLM(text_config(layers, k_heads=1, v_heads=2, dk=8, dv=16)), seed=11)
    src = save(hf, tmp_path_factory.mktemp("qwen"), tokenizer=True)
    out = tmp_path_factory.mktemp("export") / "qwen"
    manifest = export(from_hf(src), out, targets=["generic", "ort"], tokenizer=tokenizer_files(src))
    return hf, src, out, manifest


def test_export_manifest_carries_kv_cache_next_to_fixed_state_and_the_tokenizer(exported):
    _, _, out, manifest = exported
    kinds = {(s.layer, s.kind): s.shape for s in manifest.state}
    assert kinds[("1", "key")] == ["batch", 2, "past_sequence", 16]
    assert kinds[("0", "recurrent_state")] == ["batch", 2, 8, 16]
    assert kinds[("0", "conv_state")] == ["batch", 2 * 8 + 2 * 16, 3]
    assert manifest.config["tokenizer"] == "tokenizer/tokenizer.json"
    assert "tokenizer/tokenizer.json" in manifest.files and (out / "tokenizer" / "tokenizer.json").is_file()


@pytest.mark.parametrize("target", ["generic", "ort"])
def test_onnxruntime_prefill_then_32_steps_match_transformers_cache(exported, target):
    hf, _, out, _ = exported
    prompt = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(2))
    tokens = torch.randint(0, VOCAB, (32,), generator=torch.Generator().manual_seed(3)).tolist()
    expected = hf_stream(hf, prompt, tokens)
    stream = Engine.load(out, target=target, threads=1).new_stream()
    got = [stream.prefill(prompt[0].numpy(), all_logits=False)] + [stream.step(t) for t in tokens]
    assert max(rel(g, e) for g, e in zip(got, expected)) <= 1e-4


def test_runtime_greedy_generation_equals_transformers_generate_and_survives_checkpoint_and_fork(exported, tmp_path):
    hf, _, out, _ = exported
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        reference = hf.generate(prompt, max_new_tokens=32, do_sample=False)[0, 9:].tolist()
    engine = Engine.load(out, threads=1)
    assert engine.generate(prompt[0].tolist(), max_new_tokens=32) == reference
    stream = engine.new_stream()
    first = stream.generate(prompt[0].tolist(), max_new_tokens=10)
    fork = stream.fork()
    stream.save(tmp_path / "s.safetensors")
    restored = engine.load_stream(tmp_path / "s.safetensors")
    rest = [s.generate(max_new_tokens=22) for s in (stream, fork, restored)]
    assert first + rest[0] == reference and rest[0] == rest[1] == rest[2]


def test_onnxruntime_genai_generates_what_transformers_generates(exported):
    """The hybrid import's export fits onnxruntime-genai's contract, and genai's greedy tokens equal
    transformers' `generate`."""
    pytest.importorskip(
        "onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install 'edgemem-toolkit[serve]')"
    )
    hf, _, out, manifest = exported
    assert manifest.genai["fits"] and (out / manifest.genai["config"]).is_file(), manifest.genai
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        reference = hf.generate(prompt, max_new_tokens=32, do_sample=False)[0, 9:].tolist()
    eos = min(set(range(VOCAB)) - set(reference))
    assert genai_greedy(out, prompt[0].tolist(), 32, eos) == reference


def test_edgemem_run_encodes_and_decodes_text_with_the_exported_tokenizer(exported):
    hf, src, out, _ = exported
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    text = "w3 w14 w15 w9 w2"
    ids = torch.tensor([tok.encode(text).ids])
    with torch.no_grad():
        reference = hf.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist()
    result = CliRunner().invoke(main, ["run", str(out), "--prompt", text, "--max-new-tokens", "8", "--threads", "1"])
    assert result.exit_code == 0, result.output
    assert result.stdout == tok.decode(reference)


@pytest.mark.parametrize("method", ["dynamic", "int4"])
def test_a_quantized_export_keeps_the_tokenizer_and_runs_text(exported, tmp_path, method):
    """calibrate carries the tokenizer beside the graphs (hashed), so `edgemem run --prompt` works on its output."""
    _, _, out, _ = exported
    quantized = tmp_path / method
    calibrate(out, method, out=quantized)
    files = json.loads((quantized / "edgemem.json").read_text())["files"]
    assert (
        files["tokenizer/tokenizer.json"]
        == json.loads((out / "edgemem.json").read_text())["files"]["tokenizer/tokenizer.json"]
    )
    result = CliRunner().invoke(
        main, ["run", str(quantized), "--prompt", "w3 w14 w15", "--max-new-tokens", "4", "--threads", "1"]
    )
    assert result.exit_code == 0, result.output


def test_calibrating_a_model_smaller_than_the_byte_tasks_is_refused_before_writing(exported, tmp_path):
    _, _, out, _ = exported  # vocabulary 61: the calibration and drift tasks feed byte ids up to 255
    result = CliRunner().invoke(main, ["calibrate", str(out), "--method", "int4", "--out", str(tmp_path / "q")])
    assert result.exit_code == 2 and "vocabulary of 61" in result.output and "at least 256 tokens" in result.output
    assert not (tmp_path / "q").exists()


def test_state_hands_over_both_ways_with_transformers_cache(exported):
    hf, src, _, _ = exported
    ours = from_hf(src)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        _, state = ours.prefill(prompt, ours.init_state(1))
        # edgemem → transformers: fill a fresh transformers cache from edgemem's state, continue there
        cache = DynamicCache(config=hf.config)
        for i, layer in enumerate(to_external(ours, state)):
            if "keys" in layer:
                cache.update(layer["keys"], layer["values"], i)
            else:
                cache.update_conv_state(layer["conv_states"], i)
                cache.update_recurrent_state(layer["recurrent_states"], i)
        theirs = hf(torch.tensor([[7]]), past_key_values=cache, use_cache=True)
        mine, _ = ours.step(torch.tensor([7]), state)
        assert rel(mine, theirs.logits[:, -1]) <= 1e-4
        # transformers → edgemem: read transformers' cache after the prompt, continue in edgemem
        out = hf(prompt, use_cache=True)
        layers = []
        for i, layer in enumerate(out.past_key_values.layers):
            if i == 1:
                layers.append({"keys": layer.keys, "values": layer.values})
            else:
                layers.append({"conv_states": layer.conv_states[0], "recurrent_states": layer.recurrent_states[0]})
        handed = from_external(ours, layers)
        for name, tensor in state.items():
            assert torch.allclose(handed[name], tensor, rtol=1e-4, atol=1e-5), name


def test_text_codec_and_hybrid_engine_run_without_torch(exported):
    """An app on a device: the tokenizer export streams text with torch, onnx and transformers unimportable."""
    _, _, out, _ = exported
    code = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('torch', 'onnx', 'onnxscript', 'transformers'):
                    raise ImportError('blocked: ' + name)
        sys.meta_path.insert(0, Block())
        from edgemem.runtime import Engine
        from edgemem.runtime.text import load_codec
        engine = Engine.load({str(out)!r}, threads=1)
        codec = load_codec({str(out)!r}, engine.manifest)
        ids = codec.encode('w1 w2 w3')
        assert ids == [2, 3, 4], ids
        print(codec.decode(engine.generate(ids, max_new_tokens=4)))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert all(word.startswith("w") for word in result.stdout.split()) and len(result.stdout.split()) == 4

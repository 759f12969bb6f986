"""`edgemem export --hf DIR`: sharded checkpoints, and bad input as one error line with nothing written."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from edgemem.cli import main
from edgemem.errors import ConfigError
from edgemem.models import from_hf

CONFIG = dict(
    vocab_size=40,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    linear_conv_kernel_dim=3,
    linear_key_head_dim=4,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    layer_types=["linear_attention", "full_attention"],
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**CONFIG)).eval()
    single, sharded = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("sharded")
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="8KB")
    return model, single, sharded


def copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_sharded_and_single_file_checkpoints_import_the_same_model(checkpoint):
    model, single, sharded = checkpoint
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 2
    ids = torch.randint(0, 40, (1, 5))
    with torch.no_grad():
        a, b = from_hf(single)(ids), from_hf(sharded)(ids)
        assert torch.equal(a, b) and torch.allclose(a, model(ids).logits, atol=1e-5)


def test_cli_export_hf_writes_a_runnable_export(checkpoint, tmp_path):
    _, single, _ = checkpoint
    result = CliRunner().invoke(
        main, ["export", "--hf", str(single), "--out", str(tmp_path / "out"), "--target", "generic"]
    )
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "out" / "edgemem.json").read_text())
    assert manifest["arch"] == "qwen3_5_text" and manifest["config"]["source"] == str(single.resolve())
    result = CliRunner().invoke(main, ["verify", str(tmp_path / "out"), "--threads", "1"])
    assert result.exit_code == 0 and "checks within tolerance" in result.output, result.output


def _break(kind, path):
    config = json.loads((path / "config.json").read_text())
    if kind == "unknown model_type":
        config["model_type"] = "mamba2"
    elif kind == "config disagrees with weights":
        config["num_hidden_layers"], config["layer_types"] = 1, ["linear_attention"]
    elif kind == "missing shard":
        index = json.loads((path / "model.safetensors.index.json").read_text())
        (path / sorted(set(index["weight_map"].values()))[1]).unlink()
    elif kind == "wrong tensor shape":
        index = json.loads((path / "model.safetensors.index.json").read_text())
        name = "model.layers.0.linear_attn.in_proj_qkv.weight"
        shard = path / index["weight_map"][name]
        tensors = load_file(shard)
        tensors[name] = tensors[name][:-1]
        save_file(tensors, shard, metadata={"format": "pt"})
    elif kind == "unsupported option":
        config["num_experts"] = 8
    elif kind == "tied in config, not in weights":
        config["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "kind, message",
    [
        ("unknown model_type", "model_type 'mamba2' is not supported; supported: qwen3_5_text"),
        ("config disagrees with weights", "model.layers.1."),
        ("missing shard", "listed in model.safetensors.index.json is missing"),
        ("wrong tensor shape", "in_proj_qkv.weight [31, 16]; config.json implies [32, 16]"),
        ("unsupported option", "mixture-of-experts layers are not supported"),
        (
            "tied in config, not in weights",
            "ties the embeddings but lm_head.weight differs from model.embed_tokens.weight",
        ),
    ],
)
def test_bad_checkpoint_is_one_error_line_and_nothing_written(checkpoint, tmp_path, kind, message):
    _, _, sharded = checkpoint
    src = copy(sharded, tmp_path / "src")
    _break(kind, src)
    with pytest.raises(ConfigError, match=None):
        from_hf(src)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", "--hf", str(src), "--out", str(out)])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["src"]

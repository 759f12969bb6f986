"""Hugging Face `led` checkpoints (LEDForConditionalGeneration, or LEDModel) as an edgemem
`EncoderDecoder` whose logits are LEDForConditionalGeneration's.

What is read from config.json: d_model, encoder_layers, decoder_layers, encoder_attention_heads,
decoder_attention_heads, encoder_ffn_dim, decoder_ffn_dim, vocab_size,
max_encoder_position_embeddings, max_decoder_position_embeddings, attention_window (an int or
one per encoder layer; even, positive: the one-sided window is half of it), pad_token_id,
decoder_start_token_id, eos_token_id, tie_word_embeddings, activation_function (only "gelu").
LayerNorm eps is transformers' default (1e-5): LED's config has none. Dropout is
inference-off; there is no padding mask (inputs of one batch have one length). Weights of any
floating dtype are read as float32; a checkpoint without `final_logits_bias` gets zeros (as
transformers does).
"""

from __future__ import annotations

from typing import Any

import torch

from edgemem.errors import ConfigError
from edgemem.models.hf.importer import load_table, require, tied_ignore
from edgemem.models.seq2seq import EncoderDecoder, Seq2SeqConfig

MODEL_TYPES = ("led",)
ARCH = "hf-led"
WHERE = "led config.json"

_ENCODER_LAYER = {
    "attn.qkv.{p}": (
        "self_attn.longformer_self_attn.query.{p}",
        "self_attn.longformer_self_attn.key.{p}",
        "self_attn.longformer_self_attn.value.{p}",
    ),
    "attn.qkv_global.{p}": (
        "self_attn.longformer_self_attn.query_global.{p}",
        "self_attn.longformer_self_attn.key_global.{p}",
        "self_attn.longformer_self_attn.value_global.{p}",
    ),
    "attn.out.{p}": "self_attn.output.{p}",
    "attn_norm.{p}": "self_attn_layer_norm.{p}",
    "up.{p}": "fc1.{p}",
    "down.{p}": "fc2.{p}",
    "mlp_norm.{p}": "final_layer_norm.{p}",
}
_DECODER_LAYER = {
    "qkv.{p}": ("self_attn.q_proj.{p}", "self_attn.k_proj.{p}", "self_attn.v_proj.{p}"),
    "out.{p}": "self_attn.out_proj.{p}",
    "attn_norm.{p}": "self_attn_layer_norm.{p}",
    "cross.q.{p}": "encoder_attn.q_proj.{p}",
    "cross.k.{p}": "encoder_attn.k_proj.{p}",
    "cross.v.{p}": "encoder_attn.v_proj.{p}",
    "cross.out.{p}": "encoder_attn.out_proj.{p}",
    "cross_norm.{p}": "encoder_attn_layer_norm.{p}",
    "up.{p}": "fc1.{p}",
    "down.{p}": "fc2.{p}",
    "mlp_norm.{p}": "final_layer_norm.{p}",
}


def _windows(config: dict[str, Any], n_layers: int) -> list[int]:
    raw = config.get("attention_window", 512)
    values = [raw] * n_layers if isinstance(raw, int) and not isinstance(raw, bool) else raw
    if (
        not isinstance(values, list)
        or len(values) != n_layers
        or any(not isinstance(w, int) or isinstance(w, bool) or w < 2 or w % 2 for w in values)
    ):
        raise ConfigError(
            f"{WHERE}: attention_window must be an even int >= 2 or a list of {n_layers} of them "
            f"(encoder_layers); got {raw!r}"
        )
    return [w // 2 for w in values]


def seq2seq_config(config: dict[str, Any]) -> Seq2SeqConfig:
    """The `Seq2SeqConfig` an LED config.json describes; unsupported options are refused."""
    if config.get("activation_function", "gelu") != "gelu":
        raise ConfigError(
            f"{WHERE}: activation_function {config['activation_function']!r} is not supported; only 'gelu'"
        )

    def positive(key: str) -> int:
        value = require(config, key, int, WHERE)
        if value < 1:
            raise ConfigError(f"{WHERE}: {key} must be >= 1; got {value}")
        return value

    def token(key: str, default: int) -> int:
        value = config.get(key, default)
        if value is None:
            value = default
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab:
            raise ConfigError(f"{WHERE}: {key} must be a token id in [0, {vocab}); got {value!r}")
        return value

    vocab, encoder_layers = positive("vocab_size"), positive("encoder_layers")
    tied = config.get("tie_word_embeddings", True)
    if not isinstance(tied, bool):
        raise ConfigError(f"{WHERE}: tie_word_embeddings must be true or false; got {tied!r}")
    return Seq2SeqConfig(
        arch=ARCH,
        vocab_size=vocab,
        d_model=positive("d_model"),
        encoder_layers=encoder_layers,
        decoder_layers=positive("decoder_layers"),
        encoder_heads=positive("encoder_attention_heads"),
        decoder_heads=positive("decoder_attention_heads"),
        encoder_ffn=positive("encoder_ffn_dim"),
        decoder_ffn=positive("decoder_ffn_dim"),
        windows=_windows(config, encoder_layers),
        max_encoder_positions=positive("max_encoder_position_embeddings"),
        max_decoder_positions=positive("max_decoder_position_embeddings"),
        pad_token_id=token("pad_token_id", 1),
        decoder_start_token_id=token("decoder_start_token_id", 2),
        eos_token_id=token("eos_token_id", 2),
        tie_embeddings=tied,
    )


def _table(config: Seq2SeqConfig, prefix: str) -> dict[str, str | tuple[str, ...]]:
    table: dict[str, str | tuple[str, ...]] = {
        "embed.weight": f"{prefix}shared.weight",
        "encoder_positions.weight": f"{prefix}encoder.embed_positions.weight",
        "decoder_positions.weight": f"{prefix}decoder.embed_positions.weight",
    }
    for side in ("encoder", "decoder"):
        for p in ("weight", "bias"):
            table[f"{side}_norm.{p}"] = f"{prefix}{side}.layernorm_embedding.{p}"
    for side, layer, count in (
        ("encoder", _ENCODER_LAYER, config.encoder_layers),
        ("decoder", _DECODER_LAYER, config.decoder_layers),
    ):
        for i in range(count):
            for p in ("weight", "bias"):
                for ours, theirs in layer.items():
                    names = (theirs,) if isinstance(theirs, str) else theirs
                    table[f"{side}.{i}.{ours.format(p=p)}"] = tuple(
                        f"{prefix}{side}.layers.{i}.{n.format(p=p)}" for n in names
                    )
    if not config.tie_embeddings:
        table["head.weight"] = "lm_head.weight"
    return table


def build(config: dict[str, Any], weights: dict[str, torch.Tensor]) -> EncoderDecoder:
    """The edgemem `EncoderDecoder` of an LED checkpoint (config.json as a dict, its tensors by name)."""
    cfg = seq2seq_config(config)
    try:
        model = EncoderDecoder(cfg)
    except ConfigError as e:
        raise ConfigError(f"{WHERE}: {e}") from None
    prefix = "led." if any(n.startswith("led.") for n in weights) else ""
    weights = dict(weights)
    bias = weights.pop("final_logits_bias", None)
    if bias is not None:
        if bias.numel() != cfg.vocab_size:
            raise ConfigError(f"final_logits_bias has {bias.numel()} entries; vocab_size is {cfg.vocab_size}")
        weights["final_logits_bias"] = bias.reshape(-1)
    else:
        weights["final_logits_bias"] = torch.zeros(cfg.vocab_size)
    table = {**_table(cfg, prefix), "final_logits_bias": "final_logits_bias"}
    shared = f"{prefix}shared.weight"
    ignore = [f"{prefix}encoder.embed_tokens.", f"{prefix}decoder.embed_tokens.", "classification_head.", "qa_outputs."]
    for side in ("encoder", "decoder"):  # copies of the shared table, when saved
        copy = weights.get(f"{prefix}{side}.embed_tokens.weight")
        if copy is not None and shared in weights and not torch.equal(copy, weights[shared]):
            raise ConfigError(f"{prefix}{side}.embed_tokens.weight differs from {shared}: LED shares one embedding")
    if cfg.tie_embeddings:
        ignore += tied_ignore(weights, "lm_head.weight", shared)
    for name, tensor in weights.items():
        if not tensor.is_floating_point():
            raise ConfigError(f"led weights: {name} is {tensor.dtype}; expected a floating tensor")
    load_table(model, weights, table, ignore=ignore)
    return model.eval()

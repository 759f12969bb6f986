"""Hugging Face `longformer` checkpoints (LongformerModel, or the `longformer.` trunk of its task
models) as an edgemem `Encoder` whose output is LongformerModel's `last_hidden_state`.

What is read from config.json: hidden_size, num_hidden_layers, num_attention_heads,
intermediate_size, vocab_size, max_position_embeddings, type_vocab_size, pad_token_id,
layer_norm_eps, attention_window (an int or one per layer; even, positive: the one-sided
window is half of it), hidden_act (only "gelu"). Task heads (pooler, lm_head, classifier,
qa_outputs) are not part of the encoder and are ignored. Dropout is inference-off. Inputs
are token ids and a global-attention mask; token_type_ids are all 0 and there is no padding
mask (see `edgemem.models.encoder`). Weights of any floating dtype are read as float32.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from edgemem.errors import ConfigError
from edgemem.models.encoder import Encoder, EncoderConfig

log = logging.getLogger(__name__)

MODEL_TYPES = ("longformer",)
ARCH = "hf-longformer"

_TRUNK_PREFIX = "longformer."  # LongformerFor* task models keep the encoder under this name
_ENCODER_PARTS = ("embeddings.", "encoder.")
_POSITION_IDS = "embeddings.position_ids"  # a buffer (arange), not a weight

# edgemem name → the Hugging Face names it is made of (concatenated along dim 0 when several)
_EMBEDDINGS = {
    "embed.weight": ("embeddings.word_embeddings.weight",),
    "positions.weight": ("embeddings.position_embeddings.weight",),
    "token_types.weight": ("embeddings.token_type_embeddings.weight",),
    "embed_norm.weight": ("embeddings.LayerNorm.weight",),
    "embed_norm.bias": ("embeddings.LayerNorm.bias",),
}
_LAYER = {
    "attn.qkv.{p}": ("attention.self.query.{p}", "attention.self.key.{p}", "attention.self.value.{p}"),
    "attn.qkv_global.{p}": (
        "attention.self.query_global.{p}",
        "attention.self.key_global.{p}",
        "attention.self.value_global.{p}",
    ),
    "attn.out.{p}": ("attention.output.dense.{p}",),
    "attn_norm.{p}": ("attention.output.LayerNorm.{p}",),
    "up.{p}": ("intermediate.dense.{p}",),
    "down.{p}": ("output.dense.{p}",),
    "mlp_norm.{p}": ("output.LayerNorm.{p}",),
}


def _int(config: dict[str, Any], key: str, default: int | None = None, minimum: int = 1) -> int:
    value = config.get(key, default)
    if value is None:
        raise ConfigError(f"longformer config.json has no {key!r}")
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"longformer config.json: {key} must be an int >= {minimum}; got {value!r}")
    return value


def _windows(config: dict[str, Any], n_layers: int) -> list[int]:
    """One-sided windows per layer from `attention_window` (full widths, even, one or per layer)."""
    raw = config.get("attention_window", 512)
    values = [raw] * n_layers if isinstance(raw, int) and not isinstance(raw, bool) else raw
    if not isinstance(values, list) or len(values) != n_layers:
        raise ConfigError(
            f"longformer config.json: attention_window must be an int or a list of {n_layers} ints "
            f"(num_hidden_layers); got {raw!r}"
        )
    for w in values:
        if not isinstance(w, int) or isinstance(w, bool) or w < 2 or w % 2:
            raise ConfigError(f"longformer config.json: every attention_window must be an even int >= 2; got {raw!r}")
    return [w // 2 for w in values]


def encoder_config(config: dict[str, Any]) -> EncoderConfig:
    """The `EncoderConfig` a Longformer config.json describes; unsupported options are refused."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"model_type {model_type!r} is not a Longformer ({', '.join(MODEL_TYPES)})")
    if config.get("hidden_act", "gelu") != "gelu":
        raise ConfigError(f"longformer config.json: hidden_act {config['hidden_act']!r} is not supported; only 'gelu'")
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ConfigError(
            f"longformer config.json: position_embedding_type {config['position_embedding_type']!r} is not "
            "supported; only 'absolute'"
        )
    d_model, heads = _int(config, "hidden_size"), _int(config, "num_attention_heads")
    if d_model % heads:
        raise ConfigError(
            f"longformer config.json: hidden_size ({d_model}) is not a multiple of num_attention_heads ({heads})"
        )
    n_layers = _int(config, "num_hidden_layers")
    eps = config.get("layer_norm_eps", 1e-12)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps <= 0:
        raise ConfigError(f"longformer config.json: layer_norm_eps must be a positive number; got {eps!r}")
    return EncoderConfig(
        arch=ARCH,
        vocab_size=_int(config, "vocab_size"),
        d_model=d_model,
        n_layers=n_layers,
        num_heads=heads,
        mlp_hidden=_int(config, "intermediate_size"),
        windows=_windows(config, n_layers),
        max_positions=_int(config, "max_position_embeddings"),
        pad_token_id=_int(config, "pad_token_id", 1, minimum=0),
        type_vocab_size=_int(config, "type_vocab_size", 2),
        norm_eps=float(eps),
    )


def _table(n_layers: int) -> dict[str, tuple[str, ...]]:
    table = dict(_EMBEDDINGS)
    for i in range(n_layers):
        for param in ("weight", "bias"):
            for ours, theirs in _LAYER.items():
                table[f"blocks.{i}.{ours.format(p=param)}"] = tuple(
                    f"encoder.layer.{i}.{name.format(p=param)}" for name in theirs
                )
    return table


def _trunk(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The encoder's tensors, without a task model's `longformer.` prefix; heads, the pooler and
    the position-id buffer of older checkpoints dropped."""
    trunk = weights
    if any(name.startswith(_TRUNK_PREFIX) for name in weights):
        trunk = {n[len(_TRUNK_PREFIX) :]: t for n, t in weights.items() if n.startswith(_TRUNK_PREFIX)}
    kept = {n: t for n, t in trunk.items() if n.startswith(_ENCODER_PARTS) and n != _POSITION_IDS}
    if len(kept) < len(weights):
        log.info("ignoring %d tensors outside the encoder (task heads, pooler)", len(weights) - len(kept))
    return kept


def build(config: dict[str, Any], weights: dict[str, torch.Tensor]) -> Encoder:
    """The edgemem `Encoder` of a Longformer checkpoint: its config.json as a dict and its
    safetensors tensors by name. Every tensor is checked against the shape the config implies."""
    cfg = encoder_config(config)
    model = Encoder(cfg)
    expected = model.state_dict()
    trunk = _trunk(weights)
    table = _table(cfg.n_layers)
    state = {}
    for ours, theirs in table.items():
        parts = []
        for name, rows in zip(theirs, expected[ours].split(expected[ours].shape[0] // len(theirs))):
            if name not in trunk:
                raise ConfigError(f"longformer weights: {name} is missing (config num_hidden_layers={cfg.n_layers})")
            tensor = trunk[name]
            if tuple(tensor.shape) != tuple(rows.shape):
                raise ConfigError(
                    f"longformer weights: {name} has shape {tuple(tensor.shape)}; config.json implies "
                    f"{tuple(rows.shape)} (hidden_size={cfg.d_model}, intermediate_size={cfg.mlp_hidden}, "
                    f"vocab_size={cfg.vocab_size}, max_position_embeddings={cfg.max_positions}, "
                    f"type_vocab_size={cfg.type_vocab_size})"
                )
            if not tensor.is_floating_point():
                raise ConfigError(f"longformer weights: {name} is {tensor.dtype}; expected a floating tensor")
            parts.append(tensor.to(torch.float32))
        state[ours] = torch.cat(parts) if len(parts) > 1 else parts[0]
    used = {name for names in table.values() for name in names}
    extra = sorted(set(trunk) - used)
    if extra:
        raise ConfigError(
            f"longformer weights: {extra[0]} (and {len(extra) - 1} more) are not part of a "
            f"{cfg.n_layers}-layer Longformer encoder: config.json disagrees with the weights"
        )
    model.load_state_dict(state, strict=True)
    return model.eval()

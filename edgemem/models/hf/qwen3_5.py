"""Qwen3.5 (`qwen3_5_text`, and the text model of `qwen3_5` checkpoints; vision weights ignored).

Layers in the order of `layer_types`: `linear_attention` → edgemem `GatedDeltaNet` (H_k key
heads of `linear_key_head_dim`, H_v value heads of `linear_value_head_dim`, one conv of width
`linear_conv_kernel_dim` over q‖k‖v, gated RMSNorm), `full_attention` → `SoftmaxAttention` with a
sigmoid output gate, (1 + w) q/k RMSNorm, partial RoPE and GQA. Decoder norms are (1 + w)
RMSNorms; the MLP is SwiGLU with gate/up concatenated into edgemem's one up projection.
"""

from __future__ import annotations

from typing import Any

import torch

from edgemem.errors import ConfigError
from edgemem.models.hf.importer import load_table, new_lm, require, tied_ignore
from edgemem.models.lm import LM, LMConfig

MODEL_TYPES = ("qwen3_5_text", "qwen3_5")
LAYER_TYPES = {"linear_attention": "gated_deltanet", "full_attention": "softmax"}


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    if config.get("model_type") == "qwen3_5":
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("config.json: a qwen3_5 checkpoint needs a text_config object")
        return {"tie_word_embeddings": config.get("tie_word_embeddings", False), **text}
    return config


def lm_config(config: dict[str, Any]) -> LMConfig:
    model_type = config.get("model_type")
    text = text_config(config)
    where = "config.json" + (" text_config" if model_type == "qwen3_5" else "")

    def get(key: str, kind: type | tuple[type, ...] = int) -> Any:
        return require(text, key, kind, where)

    for key in ("num_experts", "moe_intermediate_size"):
        if text.get(key):
            raise ConfigError(
                f"{where}: {key} is set: mixture-of-experts layers are not supported (dense Qwen3.5 only)"
            )
    if text.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act {text['hidden_act']!r} is not supported (silu only)")
    if text.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias is not supported")
    rope = text.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"{where}: rope_type {rope['rope_type']!r} is not supported (default only)")
    n_layers = get("num_hidden_layers")
    layer_types = text.get("layer_types") or [
        "full_attention" if (i + 1) % text.get("full_attention_interval", 4) == 0 else "linear_attention"
        for i in range(n_layers)
    ]
    unknown = sorted({t for t in layer_types if t not in LAYER_TYPES})
    if unknown:
        raise ConfigError(
            f"{where}: layer type(s) {', '.join(unknown)} not supported; supported: {', '.join(LAYER_TYPES)}"
        )
    if len(layer_types) != n_layers:
        raise ConfigError(f"{where}: layer_types has {len(layer_types)} entries but num_hidden_layers is {n_layers}")
    eps = float(get("rms_norm_eps", (int, float)))
    head_dim = text.get("head_dim") or get("hidden_size") // get("num_attention_heads")
    partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    return LMConfig(
        arch=model_type,
        mixer="gated_deltanet",
        d_model=get("hidden_size"),
        n_layers=n_layers,
        mlp_hidden=get("intermediate_size"),
        vocab_size=get("vocab_size"),
        norm_eps=eps,
        mixer_options=dict(
            num_heads=get("linear_num_key_heads"),
            conv_size=get("linear_conv_kernel_dim"),
            head_dim=get("linear_key_head_dim"),
            num_v_heads=get("linear_num_value_heads"),
            v_head_dim=get("linear_value_head_dim"),
            norm_eps=eps,
        ),
        layer_types=[LAYER_TYPES[t] for t in layer_types],
        layer_type_options={
            "softmax": dict(
                num_heads=get("num_attention_heads"),
                num_kv_heads=get("num_key_value_heads"),
                head_dim=head_dim,
                rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
                rotary_dim=int(head_dim * partial),
                qk_norm=True,
                norm_unit_offset=True,
                norm_eps=eps,
                output_gate=True,
            )
        },
        norm_unit_offset=True,
        tie_embeddings=bool(text.get("tie_word_embeddings", False)),
    )


def table(config: LMConfig, prefix: str) -> dict[str, str | tuple[str, ...]]:
    """edgemem parameter name → checkpoint name(s) (tuples are concatenated along dim 0)."""
    names: dict[str, str | tuple[str, ...]] = {
        "embed.weight": f"{prefix}embed_tokens.weight",
        "norm.weight": f"{prefix}norm.weight",
    }
    if not config.tie_embeddings:
        names["head.weight"] = "lm_head.weight"
    for i, kind in enumerate(config.layer_types):
        ours, theirs = f"blocks.{i}.", f"{prefix}layers.{i}."
        names |= {
            ours + "mixer_norm.weight": theirs + "input_layernorm.weight",
            ours + "mlp_norm.weight": theirs + "post_attention_layernorm.weight",
            ours + "mlp.up.weight": (theirs + "mlp.gate_proj.weight", theirs + "mlp.up_proj.weight"),
            ours + "mlp.down.weight": theirs + "mlp.down_proj.weight",
        }
        mixer = ours + "mixer."
        if kind == "gated_deltanet":
            attn = theirs + "linear_attn."
            names |= {
                mixer + a: attn + b
                for a, b in (
                    ("qkv.weight", "in_proj_qkv.weight"),
                    ("conv.weight", "conv1d.weight"),
                    ("beta.weight", "in_proj_b.weight"),
                    ("a.weight", "in_proj_a.weight"),
                    ("g.weight", "in_proj_z.weight"),
                    ("A_log", "A_log"),
                    ("dt_bias", "dt_bias"),
                    ("norm.weight", "norm.weight"),
                    ("out.weight", "out_proj.weight"),
                )
            }
        else:
            attn = theirs + "self_attn."
            names |= {
                mixer + "qkv.weight": (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
                mixer + "out.weight": attn + "o_proj.weight",
                mixer + "q_norm.weight": attn + "q_norm.weight",
                mixer + "k_norm.weight": attn + "k_norm.weight",
            }
    return names


def build(config: dict[str, Any], weights: dict[str, torch.Tensor]) -> LM:
    lm = lm_config(config)
    model = new_lm(lm)
    multimodal = config.get("model_type") == "qwen3_5"
    prefix = "model.language_model." if multimodal else "model."
    ignore = ["mtp.", "model.visual.", "visual."]
    if lm.tie_embeddings:
        ignore += tied_ignore(weights, "lm_head.weight", f"{prefix}embed_tokens.weight")
    load_table(model, weights, table(lm, prefix), ignore=ignore)
    return model

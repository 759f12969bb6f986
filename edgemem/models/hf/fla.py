"""flash-linear-attention checkpoints: `gated_deltanet` (GatedDeltaNetForCausalLM) and `delta_net`
(DeltaNetForCausalLM).

fla's separate q/k/v projections and q/k/v short convs are depthwise, so they concatenate
into edgemem's one q‖k‖v projection and conv (same math, fewer ops). Gated DeltaNet: H_k =
`num_heads` of `head_dim`, H_v = `num_v_heads` of `head_dim·expand_v`; DeltaNet: H heads with
key/value widths `hidden_size·expand_k/v / num_heads`. Blocks are pre-norm RMSNorm with fla's
GatedMLP (SwiGLU; `intermediate_size`, else `hidden_ratio`·2/3·d rounded up to 256).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from edgemem.errors import ConfigError
from edgemem.models.hf.importer import load_table, new_lm, require, tied_ignore
from edgemem.models.lm import LM, LMConfig

MODEL_TYPES = ("gated_deltanet", "delta_net")


def _mlp_hidden(config: dict[str, Any], d_model: int) -> int:
    if config.get("intermediate_size"):
        return int(config["intermediate_size"])
    hidden = int(d_model * (config.get("hidden_ratio") or 4) * 2 / 3)
    return 256 * math.ceil(hidden / 256)


def lm_config(config: dict[str, Any]) -> LMConfig:
    model_type = config["model_type"]

    def get(key: str, kind: type | tuple[type, ...] = int) -> Any:
        return require(config, key, kind, "config.json")

    if config.get("attn"):
        raise ConfigError("config.json: attn is set: fla hybrid softmax-attention layers are not supported")
    if config.get("conv_bias"):
        raise ConfigError("config.json: conv_bias is not supported (fla's default, no conv bias, only)")
    if config.get("hidden_act", "swish") not in ("swish", "silu"):
        raise ConfigError(f"config.json: hidden_act {config['hidden_act']!r} is not supported (swish only)")
    d_model, heads = get("hidden_size"), get("num_heads")
    conv = get("conv_size") if config.get("use_short_conv", True) else 0
    options: dict[str, Any] = dict(
        num_heads=heads,
        conv_size=conv,
        output_gate=bool(config.get("use_gate", model_type == "gated_deltanet")),
        allow_neg_eigval=bool(config.get("allow_neg_eigval", False)),
        norm_eps=float(get("norm_eps", (int, float))),
    )
    if model_type == "gated_deltanet":
        head_dim = get("head_dim")
        v_head_dim = head_dim * float(config.get("expand_v", 2.0))
        options |= dict(head_dim=head_dim, num_v_heads=config.get("num_v_heads") or heads)
        mixer = "gated_deltanet"
    else:
        for key, wanted in (
            ("qk_activation", "silu"),
            ("qk_norm", "l2"),
            ("use_beta", True),
            ("use_output_norm", True),
        ):
            if config.get(key, wanted) != wanted:
                raise ConfigError(f"config.json: {key}={config[key]!r} is not supported (only {wanted!r})")
        key_dim = int(d_model * float(config.get("expand_k", 1.0)))
        value_dim = int(d_model * float(config.get("expand_v", 1.0)))
        if key_dim % heads or value_dim % heads:
            raise ConfigError(f"config.json: key/value widths {key_dim}/{value_dim} do not split into {heads} heads")
        head_dim, v_head_dim = key_dim // heads, value_dim / heads
        options |= dict(head_dim=head_dim)
        mixer = "deltanet"
    if v_head_dim != int(v_head_dim):
        raise ConfigError(f"config.json: expand_v gives a non-integer value head width {v_head_dim}")
    options["v_head_dim"] = int(v_head_dim)
    return LMConfig(
        arch=model_type,
        mixer=mixer,
        d_model=d_model,
        n_layers=get("num_hidden_layers"),
        mlp_hidden=_mlp_hidden(config, d_model),
        vocab_size=get("vocab_size"),
        norm_eps=options["norm_eps"],
        mixer_options=options,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def table(config: LMConfig) -> dict[str, str | tuple[str, ...]]:
    """edgemem parameter name → fla checkpoint name(s) (tuples are concatenated along dim 0)."""
    names: dict[str, str | tuple[str, ...]] = {
        "embed.weight": "model.embeddings.weight",
        "norm.weight": "model.norm.weight",
    }
    if not config.tie_embeddings:
        names["head.weight"] = "lm_head.weight"
    options = config.mixer_options
    for i in range(config.n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        mixer, attn = ours + "mixer.", theirs + "attn."
        names |= {
            ours + "mixer_norm.weight": theirs + "attn_norm.weight",
            ours + "mlp_norm.weight": theirs + "mlp_norm.weight",
            ours + "mlp.up.weight": (theirs + "mlp.gate_proj.weight", theirs + "mlp.up_proj.weight"),
            ours + "mlp.down.weight": theirs + "mlp.down_proj.weight",
            mixer + "qkv.weight": tuple(attn + f"{p}_proj.weight" for p in "qkv"),
            mixer + "beta.weight": attn + "b_proj.weight",
            mixer + "norm.weight": attn + "o_norm.weight",
            mixer + "out.weight": attn + "o_proj.weight",
        }
        if options["conv_size"]:
            names[mixer + "conv.weight"] = tuple(attn + f"{p}_conv1d.weight" for p in "qkv")
        if options["output_gate"]:
            names[mixer + "g.weight"] = attn + "g_proj.weight"
        if config.mixer == "gated_deltanet":
            names |= {
                mixer + "a.weight": attn + "a_proj.weight",
                mixer + "A_log": attn + "A_log",
                mixer + "dt_bias": attn + "dt_bias",
            }
    return names


def build(config: dict[str, Any], weights: dict[str, torch.Tensor]) -> LM:
    lm = lm_config(config)
    model = new_lm(lm)
    ignore = tied_ignore(weights, "lm_head.weight", "model.embeddings.weight") if lm.tie_embeddings else []
    load_table(model, weights, table(lm), ignore=ignore)
    return model

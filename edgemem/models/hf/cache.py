"""Hand a stream over between edgemem and the library a model came from.

edgemem's state is `{"{layer}.{kind}": tensor}`. The per-layer layouts elsewhere:
- transformers (Qwen3.5 cache): a linear-attention layer keeps `conv_states` `[B, C, K]` (the
  last K conv inputs; edgemem keeps K − 1, the oldest is never read again) and
  `recurrent_states` `[B, H_v, d_k, d_v]`; an attention layer `keys` / `values` `[B, H_kv, L, D]`
  after RoPE, as edgemem's growing cache (a preallocated one, `max_length`, is cut to its filled
  part and padded back; its rows must be at one position, and a sink window does not convert).
- flash-linear-attention 0.6: `conv_state` is a (q, k, v) triple of `[B, C_x, K]` and
  `recurrent_state` is `[B, H_v, d_v, d_k]` (its layers call the kernels with state_v_first).
"""

from __future__ import annotations

import torch
from torch import nn

from edgemem.errors import ConfigError
from edgemem.layers import DeltaNet, SoftmaxAttention

LAYOUTS = ("transformers", "fla")
Layer = dict[str, "torch.Tensor | tuple[torch.Tensor, ...]"]


def _layers(model: nn.Module, layout: str) -> list[nn.Module]:
    if layout not in LAYOUTS:
        raise ConfigError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    mixers = [block.mixer for block in model.blocks]
    if layout == "fla" and any(not isinstance(m, DeltaNet) for m in mixers):
        raise ConfigError("the fla layout holds DeltaNet layers only")
    if any(not isinstance(m, (DeltaNet, SoftmaxAttention)) for m in mixers):
        raise ConfigError("state conversion covers DeltaNet and softmax-attention layers only")
    return mixers


def _filled(mixer: SoftmaxAttention, position: torch.Tensor | None) -> int | None:
    """How many cache slots a preallocated cache at `position` fills (None: a growing cache, all of it)."""
    if mixer.max_length is None:
        return None
    if mixer.sinks is not None:
        raise ConfigError("a sliding-window KV cache (sinks) has no transformers layout; export without --sinks")
    if position.unique().numel() != 1 or int(position[0]) > mixer.max_length:
        raise ConfigError(
            f"a KV cache converts at one position within max_length={mixer.max_length}; got positions "
            f"{position.tolist()}"
        )
    return int(position[0])


def to_external(model: nn.Module, state: dict[str, torch.Tensor], layout: str = "transformers") -> list[Layer]:
    """edgemem state → one dict per layer in `layout` (see the module docstring)."""
    out: list[Layer] = []
    for i, mixer in enumerate(_layers(model, layout)):
        if isinstance(mixer, SoftmaxAttention):
            filled = _filled(mixer, state.get(f"{i}.position"))
            out.append({"keys": state[f"{i}.key"][:, :, :filled], "values": state[f"{i}.value"][:, :, :filled]})
            continue
        recurrent = state[f"{i}.recurrent_state"]
        conv = state.get(f"{i}.conv_state")
        if conv is not None:
            conv = torch.cat([conv.new_zeros(*conv.shape[:2], 1), conv], dim=2)
        if layout == "transformers":
            out.append({"conv_states": conv, "recurrent_states": recurrent})
        else:
            out.append(
                {
                    "conv_state": None if conv is None else tuple(conv.split(mixer.split, dim=1)),
                    "recurrent_state": recurrent.transpose(-1, -2),
                }
            )
    return out


def from_external(model: nn.Module, layers: list[Layer], layout: str = "transformers") -> dict[str, torch.Tensor]:
    """One dict per layer in `layout` → edgemem state (checked against the model's shapes)."""
    mixers = _layers(model, layout)
    if len(layers) != len(mixers):
        raise ConfigError(f"{len(layers)} layer states for a model of {len(mixers)} layers")
    state: dict[str, torch.Tensor] = {}
    for i, (mixer, layer) in enumerate(zip(mixers, layers)):
        if isinstance(mixer, SoftmaxAttention):
            keys, values = layer["keys"], layer["values"]
            if mixer.max_length is not None:
                filled = _filled(mixer, torch.full(keys.shape[:1], keys.shape[2], dtype=torch.int64))
                pad = (0, 0, 0, mixer.max_length - filled)
                keys, values = torch.nn.functional.pad(keys, pad), torch.nn.functional.pad(values, pad)
                state[f"{i}.position"] = torch.full(keys.shape[:1], filled, dtype=torch.int64)
            state[f"{i}.key"], state[f"{i}.value"] = keys, values
            continue
        if layout == "transformers":
            conv, recurrent = layer["conv_states"], layer["recurrent_states"]
        else:
            conv, recurrent = layer["conv_state"], layer["recurrent_state"].transpose(-1, -2)
            conv = None if conv is None else torch.cat(list(conv), dim=1)
        state[f"{i}.recurrent_state"] = recurrent
        if mixer.conv is not None:
            state[f"{i}.conv_state"] = conv[:, :, 1:]
    fresh = model.init_state(next(iter(state.values())).shape[0])
    for name, tensor in state.items():
        want, got = list(fresh[name].shape), list(tensor.shape)
        if name.endswith((".key", ".value")) and len(got) == 4:
            want[2] = got[2]  # a KV cache holds as many positions as the stream has seen
        if got != want:
            raise ConfigError(f"state {name} has shape {got}; the model expects {want}")
    return {name: state[name].contiguous() for name in fresh}

"""A preset (a recipe of `edgemem.presets`) built by name, and its sizes measured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from edgemem.errors import ConfigError
from edgemem.models.lm import LM
from edgemem.models.recipes import load_config
from edgemem.models.seq2seq import EncoderDecoder, Seq2SeqConfig
from edgemem.presets import names as archs
from edgemem.presets import save_sizes


def build(arch: str, *, seed: int | None = None, **overrides: Any) -> LM | EncoderDecoder:
    """The preset `arch` (see `archs()`), randomly initialised (from `seed` if given): an LM, or an
    EncoderDecoder for an encoder-decoder recipe."""
    config = load_config(arch, **overrides)
    if seed is not None:
        torch.manual_seed(seed)
    try:
        return EncoderDecoder(config) if isinstance(config, Seq2SeqConfig) else LM(config)
    except ConfigError as e:
        raise ConfigError(f"arch {arch}: {e}") from None


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@torch.no_grad()
def describe(arch: str, **overrides: Any) -> dict[str, Any]:
    """Size facts of a preset: parameters, state bytes per stream, and how much the state grows
    per token (measured by stepping one token, so a KV cache shows up as growth; None for a
    bidirectional model, which does not stream). An encoder-decoder's layers are the encoder's and
    the decoder's, its heads the encoder's; its state is the decoder's preallocated KV cache, and
    the cross keys and values add `state_bytes_per_input_token` for each token of the input."""
    model = build(arch, seed=0, **overrides)
    if isinstance(model, EncoderDecoder):
        return _describe_seq2seq(arch, model)
    state = model.init_state(1)
    start = state_bytes(state)
    growth = None  # a bidirectional model has no stream
    if model.streaming:
        _, state = model.step(torch.zeros(1, dtype=torch.long), state)
        growth = state_bytes(state) - start
    config = model.config
    return {
        "arch": arch,
        "mixer": config.mixer,
        "layers": config.n_layers,
        "d_model": config.d_model,
        "heads": config.mixer_options.get("num_heads"),
        "params": sum(p.numel() for p in model.parameters()),
        "state_bytes": start,
        "streaming": model.streaming,
        "state_bytes_per_token": growth,
    }


@torch.no_grad()
def _describe_seq2seq(arch: str, model: EncoderDecoder) -> dict[str, Any]:
    config = model.config
    empty = state_bytes(model.init_state(1))
    state = model.start(torch.zeros(1, 1, dtype=torch.long))
    _, stepped = model.step(torch.zeros(1, dtype=torch.long), state)
    return {
        "arch": arch,
        "mixer": "encoder_decoder",
        "layers": config.encoder_layers + config.decoder_layers,
        "d_model": config.d_model,
        "heads": config.encoder_heads,
        "params": sum(p.numel() for p in model.parameters()),
        "state_bytes": empty,
        "streaming": model.streaming,
        "state_bytes_per_token": state_bytes(stepped) - state_bytes(state),
        "state_bytes_per_input_token": state_bytes(state) - empty,
    }


def write_sizes() -> Path:
    """Measure every preset and write `edgemem/presets/sizes.json` (after changing a preset or a layer)."""
    return save_sizes({name: describe(name) for name in archs()})

"""A preset (a recipe of `edgemem.presets`) built by name, and its sizes measured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from edgemem.errors import ConfigError
from edgemem.models.lm import LM
from edgemem.models.recipes import load_config
from edgemem.presets import names as archs
from edgemem.presets import save_sizes


def build(arch: str, *, seed: int | None = None, **overrides: Any) -> LM:
    """The preset `arch` (see `archs()`), randomly initialised (from `seed` if given)."""
    config = load_config(arch, **overrides)
    if seed is not None:
        torch.manual_seed(seed)
    try:
        return LM(config)
    except ConfigError as e:
        raise ConfigError(f"arch {arch}: {e}") from None


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@torch.no_grad()
def describe(arch: str, **overrides: Any) -> dict[str, Any]:
    """Size facts of a preset: parameters, state bytes per stream, and how much the state grows
    per token (measured by stepping one token, so a KV cache shows up as growth; None for a
    bidirectional model, which does not stream)."""
    model = build(arch, seed=0, **overrides)
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


def write_sizes() -> Path:
    """Measure every preset and write `edgemem/presets/sizes.json` (after changing a preset or a layer)."""
    return save_sizes({name: describe(name) for name in archs()})

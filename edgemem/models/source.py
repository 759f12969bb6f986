"""Where an exported model came from: the record `edgemem export` writes into the manifest
(`source`) and `verify` / `bench` read back to rebuild the PyTorch model.

    {"origin": "preset" | "checkpoint" | "hf", "path": str | None, "seed": int | None,
     "kind": "lm" | "encoder" | "encoder_decoder", "kv_cache": {"max_length": int, "sinks": int | None} | None}

A preset is rebuilt from the manifest's config and the seed, a checkpoint or a Hugging Face
directory is read again from `path`; then the export's KV-cache layout is applied (checkpoints
and imports are saved without it). Manifests written before this record are read from the keys
their config held (`seed`, `checkpoint`, `source`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from edgemem import kinds
from edgemem.errors import ConfigError, EdgememError

ORIGINS = ("preset", "checkpoint", "hf")


@dataclass
class Source:
    origin: str
    kind: str = kinds.DEFAULT
    path: str | None = None
    seed: int | None = None
    kv_cache: dict[str, Any] | None = None

    @classmethod
    def of(cls, model: nn.Module, origin: str, *, path: str | Path | None = None, seed: int | None = None) -> Source:
        """The record of `model`, made from `origin` (a preset with `seed`, or a file or directory `path`)."""
        kv = getattr(model, "kv_cache", None)
        layout = None if kv is None else {"max_length": kv["max_length"], "sinks": kv["sinks"]}
        return cls(origin, kinds.of(model).name, None if path is None else str(Path(path).resolve()), seed, layout)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def config_entries(self) -> dict[str, Any]:
        """The keys older readers of a manifest's config look for (`seed`, `checkpoint`, `source`)."""
        key = {"preset": "seed", "checkpoint": "checkpoint", "hf": "source"}[self.origin]
        return {key: self.seed if self.origin == "preset" else self.path}

    @classmethod
    def from_manifest(
        cls, source: Mapping[str, Any] | None, config: Mapping[str, Any], kind: str, kv_cache: Mapping[str, Any] | None
    ) -> Source:
        """The record of a manifest (its `source`, or for older exports the keys of its config)."""
        layout = (
            None
            if not kv_cache
            else {
                "max_length": kv_cache["max_length"],
                "sinks": kv_cache["sinks"] if kv_cache["overflow"] == "sink_window" else None,
            }
        )
        if source:
            try:
                return cls(**{**source, "kv_cache": source.get("kv_cache") or layout})
            except TypeError as e:
                raise EdgememError(f"the manifest's source record is not valid: {e}") from None
        if config.get("checkpoint") is not None:
            return cls("checkpoint", kind, config["checkpoint"], kv_cache=layout)
        if config.get("source") is not None:
            return cls("hf", kind, config["source"], kv_cache=layout)
        return cls("preset", kind, seed=config.get("seed"), kv_cache=layout)

    def load(self, config: Mapping[str, Any], checkpoint: str | Path | None = None) -> nn.Module:
        """The PyTorch model, in eval mode; `checkpoint` replaces a recorded or missing weight file."""
        kind = kinds.get(self.kind)
        if checkpoint is not None or self.origin == "checkpoint":
            from edgemem.models.checkpoint import load_checkpoint

            model = load_checkpoint(checkpoint or self.path)
        elif self.origin == "hf":
            from edgemem.models.hf import from_hf

            model = from_hf(self.path)
        elif self.origin == "preset":
            if self.seed is None:
                raise EdgememError("the manifest records no seed and no checkpoint: pass --checkpoint")
            torch.manual_seed(self.seed)
            model = kind.build(config)
        else:
            raise EdgememError(f"unknown model origin {self.origin!r} in the manifest; known: {', '.join(ORIGINS)}")
        if self.kv_cache:
            apply_kv_cache(model, self.kv_cache["max_length"], self.kv_cache["sinks"])
        return model.eval()


def apply_kv_cache(model: nn.Module, max_length: int, sinks: int | None = None) -> None:
    """Give `model` a preallocated KV cache of `max_length` tokens: every softmax-attention layer of an
    LM (`set_kv_cache`), the decoder of an encoder-decoder (no sinks: its positions end)."""
    if kinds.of(model).name == "encoder_decoder":
        if sinks is not None:
            raise ConfigError("an encoder-decoder's decoder has learned positions that end: it takes no sinks")
        config = model.config
        if not 1 <= max_length <= config.max_decoder_positions:
            raise ConfigError(
                f"max_length {max_length} must lie in [1, {config.max_decoder_positions}] (the decoder's positions)"
            )
        config.max_length = max_length
        return
    from edgemem.models.lm import set_kv_cache

    set_kv_cache(model, max_length, sinks)

"""Model kinds: the one table that says what an export, a checkpoint or a model source holds.

Adding a kind is one entry here. Checkpoints record the kind and are rebuilt through it
(`edgemem.models.checkpoint`), the manifest names it (`edgemem.manifest`), `verify` and `bench`
rebuild the PyTorch model through it (`edgemem.models.source`), and the runtime and the CLI read
how its streams start. Model and config classes are named as "module:Class" and imported when
asked for, so this module (and the runtime, which reads it) stays free of torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from importlib import import_module
from typing import Any

from edgemem.errors import ConfigError


@dataclass(frozen=True)
class Kind:
    name: str
    model: str  # "module:Class" of the nn.Module
    config: str  # "module:Class" of its config dataclass
    graphs: tuple[str, ...]  # the graphs its export holds
    streams: str  # how a runtime stream starts: "fresh" (empty state), "encode" (Engine.encode), "none" (no stream)

    def model_class(self) -> type:
        module, _, name = self.model.partition(":")
        return getattr(import_module(module), name)

    def config_class(self) -> type:
        module, _, name = self.config.partition(":")
        return getattr(import_module(module), name)

    def build(self, config: Mapping[str, Any]) -> Any:
        """The model of this kind for `config` (a config dataclass as a dict; other keys are ignored)."""
        cls = self.config_class()
        names = {f.name for f in fields(cls)}
        return self.model_class()(cls(**{k: v for k, v in config.items() if k in names}))


KINDS = {
    k.name: k
    for k in (
        Kind("lm", "edgemem.models.lm:LM", "edgemem.models.lm:LMConfig", ("prefill", "step"), "fresh"),
        Kind("encoder", "edgemem.models.encoder:Encoder", "edgemem.models.encoder:EncoderConfig", ("prefill",), "none"),
        Kind(
            "encoder_decoder",
            "edgemem.models.seq2seq:EncoderDecoder",
            "edgemem.models.seq2seq:Seq2SeqConfig",
            ("encoder", "prefill", "step"),
            "encode",
        ),
    )
}
DEFAULT = "lm"  # the kind of checkpoints and exports that name none (written before kinds existed)


def get(name: str) -> Kind:
    if name not in KINDS:
        raise ConfigError(f"unknown model kind {name!r}; known: {', '.join(KINDS)}")
    return KINDS[name]


def of(model: object) -> Kind:
    """The kind of a model instance (by its class); a module of no kind is an LM-like custom model."""
    for kind in KINDS.values():
        module, _, name = kind.model.partition(":")
        if any(c.__module__ == module and c.__name__ == name for c in type(model).__mro__):
            return kind
    return KINDS[DEFAULT]

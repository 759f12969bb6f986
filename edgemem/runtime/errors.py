"""Errors the runtime raises on purpose; all are `edgemem.EdgememError`s (the CLI prints one line)."""

from __future__ import annotations

from edgemem.errors import EdgememError


class BackendError(EdgememError):
    """A backend, execution provider or target that cannot run here, with what is missing."""


class TokenError(EdgememError, ValueError):
    """A token id outside `[0, vocab_size)`, a non-integer token or an empty prompt."""


class StateFileError(EdgememError):
    """A state checkpoint that is corrupt, truncated, not a checkpoint, or written by another model."""


class BatchError(EdgememError, ValueError):
    """Streams that cannot run in one batch (other engine, repeated, unequal KV-cache lengths)."""


__all__ = ["BackendError", "BatchError", "EdgememError", "StateFileError", "TokenError"]

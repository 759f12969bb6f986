"""Exceptions a user can act on. The CLI prints them as one line and exits non-zero."""


class EdgememError(Exception):
    """Base class of every error edgemem raises on purpose."""


class ConfigError(EdgememError, ValueError):
    """An unknown architecture, override key or a value of the wrong kind."""


class ShapeError(EdgememError, ValueError):
    """A tensor whose shape or dtype does not match the op or layer contract."""


class CacheFullError(EdgememError, ValueError):
    """A stream would pass the `max_length` of its preallocated KV cache (exported without a sliding window)."""

"""Exceptions a user can act on. The CLI prints them as one line and exits non-zero."""

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar


class EdgememError(Exception):
    """Base class of every error edgemem raises on purpose."""


class ConfigError(EdgememError, ValueError):
    """An unknown architecture, override key or a value of the wrong kind."""


class ShapeError(EdgememError, ValueError):
    """A tensor whose shape or dtype does not match the op or layer contract."""


class CacheFullError(EdgememError, ValueError):
    """A stream would pass the `max_length` of its preallocated KV cache (exported without a sliding window)."""


_cli: ContextVar[bool] = ContextVar("edgemem_cli", default=False)


@contextmanager
def cli_names() -> Iterator[None]:
    """While the `edgemem` command runs: messages name its options instead of Python arguments."""
    token = _cli.set(True)
    try:
        yield
    finally:
        _cli.reset(token)


def named(python: str, cli: str) -> str:
    """How a message names an argument: `cli` (an option such as "--force") inside the command, else `python`."""
    return cli if _cli.get() else python

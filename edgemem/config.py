"""Reading settings: TOML recipes, `--set key=value` literals, and the range checks options go through.

Pure Python: the runtime, the CLI and the export side all read settings through here.
"""

from __future__ import annotations

import math
import sys
from typing import Any

from edgemem.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def read_toml(text: str, source: str, error: type[ConfigError] = ConfigError) -> dict[str, Any]:
    """The table in `text`; `error` names `source` when it is not valid TOML."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise error(f"{source} is not valid TOML: {e}") from None


def parse_value(text: str) -> Any:
    """A `--set` value: a TOML literal (64, 1e-3, true, [1, 2], "x"), or else the plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(items: tuple[str, ...] | list[str], option: str = "--set") -> dict[str, Any]:
    """`key=value` pairs (see `parse_value`) as a dict; a malformed pair is a ConfigError."""
    overrides = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{option} expects key=value; got {item!r}")
        overrides[key.strip()] = parse_value(text)
    return overrides


def positive_int(value: Any, name: str, error: type[ConfigError] = ConfigError) -> int:
    """`value` if it is an integer ≥ 1 (not a bool), else `error` naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise error(f"{name} must be a positive integer; got {value!r}")
    return value


def finite(value: Any, name: str, *, positive: bool = False, error: type[ConfigError] = ConfigError) -> float:
    """`value` as a float if it is a finite real number (and > 0 with `positive`), else `error`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise error(f"{name} must be a finite number; got {value!r}")
    if positive and value <= 0:
        raise error(f"{name} must be positive; got {value!r}")
    return float(value)

"""Reading settings: TOML recipes, `--set key=value` literals, and the range checks options go through.

Pure Python: the runtime, the CLI and the export side all read settings through here.
"""

from __future__ import annotations

import math
import os
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


def seed(value: Any, name: str = "seed", error: type[ConfigError] = ConfigError) -> int:
    """`value` if it is an integer in [0, 2**64) (what numpy and torch generators take), else `error`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
        raise error(f"{name} must be an integer in [0, 2**64); got {value!r}")
    return value


MAX_THREADS = 256  # past this a thread pool only adds start-up and contention, whatever the machine
DEFAULT_CHUNK = 128  # tokens per prefill-graph run (benchmarks/README.md, "Figures behind choices in the code")


def thread_limit() -> int:
    """The most threads a command runs here: four per core, at most MAX_THREADS."""
    return min(MAX_THREADS, 4 * (os.cpu_count() or 1))


def threads(value: Any, name: str = "threads", limit: int | None = None, error: type[ConfigError] = ConfigError) -> int:
    """`value` if it is an integer in [1, limit] (default `thread_limit()`), else `error` naming `name`."""
    why = f"four per core of this machine, at most {MAX_THREADS}" if limit is None else "more only add contention"
    limit = thread_limit() if limit is None else limit
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise error(f"{name} must be an integer from 1 to {limit} ({why}); got {value!r}")
    return value


def memory_bytes() -> int:
    """Physical memory of this machine in bytes (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 0


def size_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def fits_memory(nbytes: float, what: str, error: type[ConfigError] = ConfigError) -> None:
    """Refuse, before any allocation, work that would need more than this machine's memory."""
    total = memory_bytes()
    if total and nbytes > total:
        raise error(f"{what} would need about {size_text(nbytes)} of memory; this machine has {size_text(total)}")


# Settings (preset keys and mixer options) that must be > 0; every other numeric setting must be ≥ 0.
POSITIVE_SETTINGS = frozenset(
    {
        "d_model",
        "n_layers",
        "encoder_layers",
        "decoder_layers",
        "encoder_heads",
        "decoder_heads",
        "encoder_ffn",
        "decoder_ffn",
        "windows",
        "max_encoder_positions",
        "max_decoder_positions",
        "vocab_size",
        "norm_eps",
        "num_heads",
        "chunk_size",
        "depth",
        "expansion",
        "window",
        "dilation",
        "max_lr",
        "eps",
        "s",
    }
)


LAYER_BYTES = 32 * 1024  # what one layer's modules and parameter objects cost in Python before any weight


def check_settings(settings: dict[str, Any], name: str = "model") -> None:
    """Range checks of a model's settings before it is built: finite numbers, > 0 or ≥ 0 as the key
    needs (`POSITIVE_SETTINGS`), and weights (with each layer's objects) that fit this machine's memory."""
    for key, value in settings.items():
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if not math.isfinite(v):
                raise ConfigError(f"{key} must be a finite number; got {v!r}")
            if key in POSITIVE_SETTINGS and v <= 0:
                raise ConfigError(f"{key} must be positive; got {v!r}")
            if v < 0:
                raise ConfigError(f"{key} must be ≥ 0; got {v!r}")
    d, layers = settings.get("d_model", 0), settings.get("n_layers", 0)
    mlp, vocab, expansion = settings.get("mlp_hidden", 0), settings.get("vocab_size", 256), settings.get("expansion", 1)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in (d, layers, mlp, vocab, expansion)):
        params = 2 * vocab * d + layers * (4 * d * d * max(1, expansion) + 2 * d * mlp)  # a lower bound, fp32
        fits_memory(
            4 * params + LAYER_BYTES * layers,
            f"{name} with d_model={d}, n_layers={layers}, mlp_hidden={mlp}, vocab_size={vocab}",
        )

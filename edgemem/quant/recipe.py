"""Calibration recipes: TOML files shipped in `edgemem/quant/calib/` (`default`, `bytes`, `mqar`) or
of the user's (examples in the top-level `calib/` folder).

    [data]                     what the calibration rolls out
    task = "bytes"             an `edgemem.tasks` task: mqar, copy, bytes
    params = {}                its parameters (`edgemem.tasks.get_task`), e.g. {length = 64, pairs = 8}
    streams = 4                calibration streams (one batch)
    positions = {first = 16, last = 4096, count = 9}   log-spaced positions (or a list)
    prefill_tokens = 64        tokens per prefill-graph sample, fed from each position
    seed = 1                   seed of the calibration streams

    [quantize]
    exclude = []               MatMul/Gemm nodes kept float: module paths (model.blocks.0.mixer.beta),
                               node, tensor or weight names; fnmatch patterns; each must match a node

    [drift]
    horizons = [32, 512, 4096, 32768]
    streams = 2                held-out streams (seeds differ from the calibration's)
    seed = 1000
    window = 64                positions before a horizon whose logits are compared
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from edgemem.config import fits_memory, positive_int, read_toml
from edgemem.errors import ConfigError
from edgemem.tasks import VOCAB, Task, get_task

log = logging.getLogger(__name__)

DEFAULT = "default"
_SECTIONS = {
    "data": {"task", "params", "streams", "positions", "prefill_tokens", "seed"},
    "quantize": {"exclude"},
    "drift": {"horizons", "streams", "seed", "window"},
}


class RecipeError(ConfigError):
    """A calibration recipe that is missing, malformed or names tensors the export does not have."""


@dataclass
class Recipe:
    name: str
    task: str = "bytes"
    params: dict[str, Any] = field(default_factory=dict)
    streams: int = 4
    positions: list[int] = field(default_factory=lambda: log_positions(16, 4096, 9))
    prefill_tokens: int = 64
    seed: int = 1
    exclude: list[str] = field(default_factory=list)
    horizons: list[int] = field(default_factory=lambda: [32, 512, 4096, 32768])
    drift_streams: int = 2
    drift_seed: int = 1000
    window: int = 64
    source: str = ""

    def make_task(self) -> Task:
        """The `edgemem.tasks` task the recipe rolls out."""
        return get_task(self.task, **self.params)

    def check_vocabulary(self, arch: str, vocab_size: int) -> None:
        """The recipe's tasks feed byte ids: a model with fewer tokens cannot take them."""
        if vocab_size < VOCAB:
            raise RecipeError(
                f"recipe {self.name!r} feeds byte ids 0-{VOCAB - 1} (edgemem.tasks) but {arch} has a "
                f"vocabulary of {vocab_size}: calibration data and drift reports need a model of at least "
                f"{VOCAB} tokens (dynamic and int4 need no data: calibrate --no-drift)"
            )

    def check_memory(self, state_bytes: int, *, calibration: bool, drift: bool) -> None:
        """The data the recipe rolls out fits this machine's memory: token ids and, for static calibration, a
        batch of states per position (the feeds); the drift report's streams of token ids and targets."""
        if calibration:
            length = max(self.positions) + self.prefill_tokens
            fits_memory(
                self.streams * (8 * length + 3 * state_bytes * len(self.positions)),
                f"recipe {self.name!r}: {self.streams:,} calibration streams of {length:,} tokens",
                RecipeError,
            )
        if drift:
            fits_memory(
                16 * self.drift_streams * max(self.horizons),
                f"recipe {self.name!r}: {self.drift_streams:,} drift streams of {max(self.horizons):,} tokens",
                RecipeError,
            )

    def calibration_within(self, room: int | None) -> Recipe:
        """The recipe for streams that hold `room` positions (`Manifest.max_positions`; None: no limit): the
        calibration positions whose prefill sample fits; those left out are logged."""
        kept = self.positions if room is None else [p for p in self.positions if p + self.prefill_tokens <= room]
        self._left_out("calibration positions", sorted(set(self.positions) - set(kept)), room)
        return replace(self, positions=kept)

    def drift_within(self, room: int | None, after: int) -> Recipe:
        """The recipe for streams that hold `room` positions: the drift horizons that leave `after` more
        positions (the steps timed at the last one); those left out are logged."""
        kept = self.horizons if room is None else [h for h in self.horizons if h + after <= room]
        self._left_out("drift horizons", sorted(set(self.horizons) - set(kept)), room)
        return replace(self, horizons=kept)

    def _left_out(self, what: str, values: list[int], room: int | None) -> None:
        if values:
            log.warning(
                "recipe %r: %s %s left out: the export's streams hold %s positions (its --max-length)",
                self.name,
                what,
                ", ".join(f"{v:,}" for v in values),
                f"{room:,}",
            )

    def to_dict(self) -> dict[str, Any]:
        """The recipe as recorded in a quantized export's manifest."""
        return {
            "name": self.name,
            "source": self.source,
            "task": self.task,
            "params": self.params,
            "streams": self.streams,
            "positions": self.positions,
            "prefill_tokens": self.prefill_tokens,
            "seed": self.seed,
            "exclude": self.exclude,
            "horizons": self.horizons,
        }


def log_positions(first: int, last: int, count: int) -> list[int]:
    """`count` log-spaced integer positions from `first` to `last` (duplicates dropped)."""
    return sorted({int(round(p)) for p in np.geomspace(first, last, count)})


def recipes() -> list[str]:
    """Names of the shipped recipes, sorted."""
    return sorted(
        f.name[: -len(".toml")] for f in resources.files("edgemem.quant.calib").iterdir() if f.name.endswith(".toml")
    )


def _read(spec: str) -> tuple[str, str, str]:
    """(name, source, text) of a recipe given as a shipped name, `calib/<name>` or a path to a TOML file."""
    path = Path(spec)
    for candidate in (path, path.with_name(path.name + ".toml")):
        if candidate.is_file():
            return candidate.stem, str(candidate), candidate.read_text()
    name = spec.removeprefix("calib/").removesuffix(".toml")
    shipped = resources.files("edgemem.quant.calib") / f"{name}.toml"
    if "/" not in name and shipped.is_file():
        return name, f"edgemem/quant/calib/{name}.toml", shipped.read_text()
    raise RecipeError(
        f"no calibration recipe {spec!r}: not a file, and not one of the shipped recipes ({', '.join(recipes())})"
    )


def _int_list(value: Any, key: str, minimum: int) -> list[int]:
    if isinstance(value, dict):
        unknown = set(value) - {"first", "last", "count"}
        if unknown or not all(isinstance(value.get(k), int) for k in ("first", "last", "count")):
            raise RecipeError(f"{key} must be a list of integers or {{first, last, count}}; got {value!r}")
        if not 1 <= value["first"] <= value["last"] or value["count"] < 1:
            raise RecipeError(f"{key}: need 1 <= first <= last and count >= 1; got {value!r}")
        return log_positions(value["first"], value["last"], value["count"])
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise RecipeError(f"{key} must be a non-empty list of integers; got {value!r}")
    if min(value) < minimum:
        raise RecipeError(f"{key} must be at least {minimum}; got {value!r}")
    return sorted(set(value))


def load_recipe(spec: str | None = None) -> Recipe:
    """Read and validate a recipe: a shipped name (`mqar`, `calib/mqar`) or a TOML file; default `default`."""
    name, source, text = _read(spec or DEFAULT)
    raw = read_toml(text, source, RecipeError)
    for section, value in raw.items():
        if section not in _SECTIONS or not isinstance(value, dict):
            raise RecipeError(f"{source}: unknown section [{section}]; expected {', '.join(_SECTIONS)}")
        unknown = set(value) - _SECTIONS[section]
        if unknown:
            raise RecipeError(
                f"{source}: unknown key(s) {', '.join(sorted(unknown))} in [{section}]; "
                f"expected {', '.join(sorted(_SECTIONS[section]))}"
            )
    data, quantize, drift = raw.get("data", {}), raw.get("quantize", {}), raw.get("drift", {})
    recipe = Recipe(name=name, source=source)
    try:
        if "task" in data:
            if not isinstance(data["task"], str):
                raise RecipeError(f"data.task must be a string; got {data['task']!r}")
            recipe.task = data["task"]
        if "params" in data:
            if not isinstance(data["params"], dict):
                raise RecipeError(f"data.params must be a table; got {data['params']!r}")
            recipe.params = data["params"]
        try:
            get_task(recipe.task, **recipe.params)
        except ConfigError as e:
            raise RecipeError(f"[data]: {e}") from None
        for key, attr in (("streams", "streams"), ("prefill_tokens", "prefill_tokens"), ("seed", "seed")):
            if key in data:
                setattr(recipe, attr, positive_int(data[key], f"data.{key}", RecipeError))
        if "positions" in data:
            recipe.positions = _int_list(data["positions"], "data.positions", 1)
        if "exclude" in quantize:
            exclude = quantize["exclude"]
            if not isinstance(exclude, list) or not all(isinstance(p, str) and p for p in exclude):
                raise RecipeError(f"quantize.exclude must be a list of names or patterns; got {exclude!r}")
            recipe.exclude = exclude
        if "horizons" in drift:
            recipe.horizons = _int_list(drift["horizons"], "drift.horizons", 1)
        for key, attr in (("streams", "drift_streams"), ("seed", "drift_seed"), ("window", "window")):
            if key in drift:
                setattr(recipe, attr, positive_int(drift[key], f"drift.{key}", RecipeError))
    except RecipeError as e:
        raise RecipeError(f"{source}: {e}") from None
    return recipe

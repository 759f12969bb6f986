"""The shipped presets: one TOML recipe per `--arch` (read by `edgemem.models.recipes`), and their
sizes in `sizes.json`, so that listing them (`edgemem archs`) needs no torch. Data only: measuring
the presets is `edgemem.models`' (`describe`, `write_sizes`)."""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Any

from edgemem.files import write_atomic

SIZES = "sizes.json"


def files() -> dict[str, Any]:
    """{name: recipe file} of the shipped presets."""
    folder = resources.files(__name__)
    return {f.name[: -len(".toml")]: f for f in folder.iterdir() if f.name.endswith(".toml")}


def names() -> list[str]:
    """Names of the shipped presets, sorted."""
    return sorted(files())


def _digest(file: Any) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()


def sizes() -> dict[str, dict[str, Any] | None]:
    """{name: its `edgemem.models.describe` row} of every preset, sorted by name, from `sizes.json`;
    None for a preset whose recipe changed since it was written (or that is new)."""
    table = json.loads(resources.files(__name__).joinpath(SIZES).read_text())
    rows = {}
    for name, file in sorted(files().items()):
        row = table.get(name)
        rows[name] = row if row is not None and row.pop("sha256") == _digest(file) else None
    return rows


def save_sizes(rows: dict[str, dict[str, Any]]) -> Path:
    """Write `sizes.json` beside the recipes: {name: `describe` row} of every preset, with each
    recipe's digest."""
    table = {name: {**rows[name], "sha256": _digest(file)} for name, file in sorted(files().items())}
    path = Path(str(resources.files(__name__).joinpath(SIZES)))
    write_atomic(path, (json.dumps(table, indent=1) + "\n").encode())
    return path

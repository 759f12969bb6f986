"""The shipped presets: one TOML recipe per `--arch` (read by `edgemem.models.recipes`), and their
sizes in `sizes.json`, so that listing them (`edgemem archs`) needs no torch."""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Any

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


def sizes() -> list[dict[str, Any]]:
    """`edgemem.models.describe` of every preset, sorted by name: from `sizes.json` for the presets whose
    recipe is unchanged since it was written, measured (with torch) for the others."""
    table = json.loads(resources.files(__name__).joinpath(SIZES).read_text())
    rows = []
    for name, file in sorted(files().items()):
        row = table.get(name)
        if row is None or row.pop("sha256") != _digest(file):
            from edgemem.models import describe  # noqa: PLC0415 — torch, only for an edited or new preset

            row = describe(name)
        rows.append(row)
    return rows


def write_sizes() -> Path:
    """Measure every preset and write `sizes.json` beside the recipes (after changing a preset or a layer)."""
    from edgemem.files import write_atomic  # noqa: PLC0415
    from edgemem.models import describe  # noqa: PLC0415

    table = {name: {**describe(name), "sha256": _digest(file)} for name, file in sorted(files().items())}
    path = Path(str(resources.files(__name__).joinpath(SIZES)))
    write_atomic(path, (json.dumps(table, indent=1) + "\n").encode())
    return path

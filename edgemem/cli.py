"""The `edgemem` command. Each command imports its heavy modules itself, so `--help` is fast."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

from edgemem import __version__
from edgemem.errors import EdgememError


class _Group(click.Group):
    """Turns EdgememError into one line on stderr and exit code 2, never a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except EdgememError as e:
            click.secho(f"error: {e}", fg="red", err=True)
            sys.exit(2)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="edgemem")
@click.option("-v", "--verbose", is_flag=True, help="Log progress details.")
def main(verbose: bool) -> None:
    """Constant-memory sequence models from PyTorch to edge GPUs and CPUs."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON.")
def archs(as_json: bool) -> None:
    """The presets: layers, width, parameters and state bytes per stream."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from edgemem.models import archs as names
    from edgemem.models import describe

    rows = [describe(name) for name in names()]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table(
        title="edgemem presets",
        box=box.SIMPLE_HEAD,
        caption="state: fp32 bytes per stream at position 0; +/token: its growth per token\n"
        "(0: constant memory; n/a: bidirectional, prefill only)",
    )
    for column in ("arch", "layers", "d_model", "heads", "params", "state", "+/token"):  # fits 80 columns
        table.add_column(column, justify="left" if column == "arch" else "right", no_wrap=True)
    for r in rows:
        growth = r["state_bytes_per_token"]
        growth = "n/a" if growth is None else _size(growth) if growth else "0"
        table.add_row(
            r["arch"], str(r["layers"]), str(r["d_model"]), str(r["heads"] or "-"),
            f"{r['params'] / 1e6:.2f} M", _size(r["state_bytes"]), growth,
        )
    Console().print(table)


def _parse_set(items: tuple[str, ...]) -> dict:
    """`key=value` pairs; values are TOML literals (64, 1e-3, true, [1, 2]) or else plain strings."""
    import tomllib

    from edgemem.errors import ConfigError

    overrides = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects key=value; got {item!r}")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        overrides[key.strip()] = value
    return overrides


@main.command("export")
@click.option("--arch", help="Preset to export (see `edgemem archs`).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--target", "targets", default="generic,ort,trt", show_default=True,
              help="Comma-separated targets: generic, ort, onnx27, trt.")
@click.option("--seed", default=0, show_default=True, help="Seed of the random initialisation.")
@click.option("--checkpoint", type=click.Path(dir_okay=False), help="Export trained weights instead.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a preset setting (repeatable).")
@click.option("--dtype", type=click.Choice(["fp32", "fp16"]), default="fp32", show_default=True,
              help="Weights and activations; state is always fp32.")
@click.option("--force", is_flag=True, help="Replace a non-empty output directory.")
def export_command(arch, out_dir, targets, seed, checkpoint, overrides, dtype, force) -> None:
    """Export prefill and step ONNX graphs, lowered per target, with edgemem.json."""
    from rich.console import Console

    from edgemem.errors import ConfigError
    from edgemem.export import export
    from edgemem.models import build, load_checkpoint

    extra = {}
    if checkpoint:
        if overrides:
            raise ConfigError("--set cannot change a checkpoint's architecture; export it as trained")
        model = load_checkpoint(checkpoint)
        if arch and arch != model.config.arch:
            raise ConfigError(f"{checkpoint} is a checkpoint of {model.config.arch!r}, not {arch!r}")
        extra["checkpoint"] = str(Path(checkpoint).resolve())
    elif arch:
        model = build(arch, seed=seed, **_parse_set(overrides))
        extra["seed"] = seed
    else:
        raise ConfigError("give --arch (a preset) or --checkpoint")
    console = Console(stderr=True)
    with console.status(f"exporting {model.config.arch}"):
        manifest = export(model, out_dir, targets=[t.strip() for t in targets.split(",") if t.strip()],
                          dtype=dtype, force=force, extra_config=extra)
    state = sum(_numel(s.shape) * (8 if s.dtype in ("int64", "float64") else 4) for s in manifest.state)
    click.echo(f"exported {manifest.arch} to {out_dir}: {', '.join(manifest.targets)}; "
               f"{len(manifest.state)} state tensors, {_size(state)} per stream")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= 1 if isinstance(d, str) else d
    return n


@main.command("verify")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--checkpoint", type=click.Path(dir_okay=False), help="Weights the export came from, if not recorded.")
@click.option("--threads", type=int, help="onnxruntime intra-op threads.")
def verify_command(directory, checkpoint, threads) -> None:
    """Run each target here against the PyTorch model; exit 1 beyond tolerance."""
    from rich.console import Console
    from rich.table import Table

    from edgemem.export.verify import verify

    checks, skipped = verify(directory, checkpoint=checkpoint, threads=threads)
    table = Table("target", "graph", "tensor", "max abs", "max rel", "")
    for c in checks:
        table.add_row(c.target, c.graph, c.tensor, f"{c.max_abs:.2e}", f"{c.max_rel:.2e}", "ok" if c.ok else "FAIL")
    Console().print(table)
    for target, why in skipped.items():
        click.echo(f"{target}: skipped ({why})")
    failed = [c for c in checks if not c.ok]
    if failed:
        click.secho(f"{len(failed)} of {len(checks)} checks beyond tolerance", fg="red", err=True)
        sys.exit(1)
    click.echo(f"all {len(checks)} checks within tolerance")

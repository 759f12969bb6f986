"""The `edgemem` command. Each command imports its heavy modules itself, so `--help` is fast."""

from __future__ import annotations

import json
import logging
import sys

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

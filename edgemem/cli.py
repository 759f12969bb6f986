"""The `edgemem` command. Each command imports its heavy modules itself, so `--help` is fast."""

from __future__ import annotations

import io
import json
import logging
import os
import sys
from pathlib import Path

import click

from edgemem import __version__
from edgemem.config import DEFAULT_CHUNK, MAX_THREADS, finite, parse_overrides, seed, threads
from edgemem.errors import EdgememError, cli_names

# optional modules → the extra that installs them (pyproject.toml)
EXTRAS = {
    "torch": "export",
    "onnx": "export",
    "onnxscript": "export",
    "onnx_graphsurgeon": "export",
    "transformers": "hf",
    "tokenizers": "text",
    "matplotlib": "bench",
    "tritonclient": "serve",
    "pytriton": "serve",
    "onnxruntime_genai": "serve",
    "google": "serve",
}


class _Group(click.Group):
    """Turns EdgememError into one line on stderr and exit code 2, never a traceback; messages name
    the command's options, not the Python arguments behind them. A missing optional module is one line
    naming the extra that installs it."""

    def invoke(self, ctx: click.Context):
        try:
            with cli_names():
                return super().invoke(ctx)
        except EdgememError as e:
            click.secho(f"error: {e}", fg="red", err=True)
            sys.exit(2)
        except ModuleNotFoundError as e:
            top = (e.name or "").partition(".")[0]
            if top not in EXTRAS:
                raise
            command = ctx.invoked_subcommand or ""
            click.secho(
                f"error: `edgemem {command}` needs {top}, which is not installed: "
                f"pip install 'edgemem-toolkit[{EXTRAS[top]}]'",
                fg="red",
                err=True,
            )
            sys.exit(2)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="edgemem")
@click.option("-v", "--verbose", is_flag=True, help="Log progress details.")
def main(verbose: bool) -> None:
    """Constant-memory sequence models from PyTorch to edge GPUs and CPUs."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("edgemem.progress").setLevel(logging.INFO)  # off a terminal, long work reports as log lines


def _checked(check, **options):
    """A click callback running one of edgemem.config's checks; a bad value is a usage error naming the option."""

    def callback(ctx: click.Context, param: click.Parameter, value):
        if value is None:
            return value
        try:
            return check(value, param.opts[0], **options)
        except EdgememError as e:
            raise click.BadParameter(str(e)) from None

    return callback


_SEED = _checked(seed)
_THREADS = _checked(threads)  # this machine's limit
_REMOTE_THREADS = _checked(threads, limit=MAX_THREADS)  # for another machine (a Triton server)


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

    from edgemem.presets import sizes

    rows = sizes()
    if None in rows.values():
        from edgemem.models import describe  # torch, only for an edited or new preset

        rows = {name: row or describe(name) for name, row in rows.items()}
    rows = list(rows.values())
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table(
        title="edgemem presets",
        box=box.SIMPLE_HEAD,
        caption="state: fp32 bytes per stream at position 0; +/token: its growth per token\n"
        "(0: constant memory; n/a: bidirectional, prefill only); an encoder-decoder:\n"
        "encoder + decoder layers, its state grows with the input (cross keys and values)",
    )
    for column in ("arch", "layers", "d_model", "heads", "params", "state", "+/token"):  # fits 80 columns
        table.add_column(column, justify="left" if column == "arch" else "right", no_wrap=True)
    for r in rows:
        growth = r["state_bytes_per_token"]
        growth = "n/a" if growth is None else _size(growth) if growth else "0"
        table.add_row(
            r["arch"],
            str(r["layers"]),
            str(r["d_model"]),
            str(r["heads"] or "-"),
            f"{r['params'] / 1e6:.2f} M",
            _size(r["state_bytes"]),
            growth,
        )
    Console().print(table)


@main.command("export")
@click.option("--arch", help="Preset to export (see `edgemem archs`), or a recipe file (*.toml, see export/).")
@click.option(
    "--hf",
    "hf_dir",
    type=click.Path(file_okay=False),
    help="A Hugging Face / flash-linear-attention save_pretrained directory to import instead.",
)
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option(
    "--target",
    "targets",
    default="generic,ort,trt",
    show_default=True,
    help="Comma-separated targets: generic, ort, onnx27, trt.",
)
@click.option("--seed", default=0, show_default=True, callback=_SEED, help="Seed of the random initialisation.")
@click.option("--checkpoint", type=click.Path(dir_okay=False), help="Export trained weights instead.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a preset setting (repeatable).")
@click.option(
    "--dtype",
    type=click.Choice(["fp32", "fp16", "bf16"]),
    default="fp32",
    show_default=True,
    help="Weights and activations; state is always fp32. bf16: --target trt only.",
)
@click.option("--force", is_flag=True, help="Replace a non-empty output directory.")
@click.option(
    "--max-length",
    type=click.IntRange(min=1),
    help="Preallocate the softmax-attention KV cache to this many tokens per stream (default: a growing cache).",
)
@click.option(
    "--sinks",
    type=click.IntRange(min=0),
    help="With --max-length: past it, keep the first SINKS tokens and a sliding window (default: an error).",
)
def export_command(
    arch, hf_dir, out_dir, targets, seed, checkpoint, overrides, dtype, force, max_length, sinks
) -> None:
    """Export prefill and step ONNX graphs, lowered per target, with edgemem.json."""
    from rich.console import Console

    from edgemem.errors import ConfigError
    from edgemem.export import check_cache_length, export
    from edgemem.files import check_output_dir
    from edgemem.models import checkpoint_tokenizer, load_checkpoint

    check_output_dir(out_dir, force=force, inputs=[p for p in (checkpoint, hf_dir) if p], what="--out")
    if sinks is not None and max_length is None:
        raise ConfigError("--sinks needs --max-length (the window is the preallocated cache)")
    if max_length is not None:
        check_cache_length(max_length, sinks)
    tokenizer = []
    if hf_dir:
        if arch or checkpoint or overrides:
            raise ConfigError("--hf imports a model as saved: it takes no --arch, --checkpoint or --set")
        from edgemem.models.hf import from_hf, tokenizer_files

        model = from_hf(hf_dir)
        origin = {"origin": "hf", "path": hf_dir}
        tokenizer = tokenizer_files(hf_dir)
    elif checkpoint:
        if overrides:
            raise ConfigError("--set cannot change a checkpoint's architecture; export it as trained")
        model = load_checkpoint(checkpoint)
        if arch and arch != model.config.arch:
            raise ConfigError(f"{checkpoint} is a checkpoint of {model.config.arch!r}, not {arch!r}")
        origin = {"origin": "checkpoint", "path": checkpoint}
        tokenizer = checkpoint_tokenizer(checkpoint)  # e.g. from `edgemem linearize --hf`
    elif arch:
        model = _preset(arch, seed, overrides)
        origin = {"origin": "preset", "seed": seed}
    else:
        raise ConfigError("give --arch (a preset), --checkpoint or --hf DIR")
    from edgemem.models.source import Source, apply_kv_cache

    if max_length is not None:
        apply_kv_cache(model, max_length, sinks)
    source = Source.of(model, **origin)
    console = Console(stderr=True)
    if not console.is_terminal:  # no spinner in a log: a line per stage instead
        logging.getLogger("edgemem.export").setLevel(logging.INFO)
    with console.status(f"exporting {model.config.arch}"):
        manifest = export(
            model,
            out_dir,
            targets=[t.strip() for t in targets.split(",") if t.strip()],
            dtype=dtype,
            force=force,
            tokenizer=tokenizer,
            source=source,
        )
    itemsize = {"int64": 8, "float64": 8, "float16": 2}
    fixed = sum(_numel(s.shape) * itemsize.get(s.dtype, 4) for s in manifest.state if "past_sequence" not in s.shape)
    growth = sum(_numel(s.shape) * itemsize.get(s.dtype, 4) for s in manifest.state if "past_sequence" in s.shape)
    size = f"{_size(fixed)} per stream" + (f" + {_size(growth)} per token" if growth else "")
    click.echo(
        f"exported {manifest.arch} to {out_dir}: {', '.join(manifest.targets)}; "
        f"{len(manifest.state)} state tensors, {size}"
    )


def _preset(arch: str, seed: int, overrides: tuple[str, ...]):
    """The preset with its --set values; says what a new width leaves as the preset had it, and the size."""
    from edgemem.models import build

    values = parse_overrides(overrides)
    model = build(arch, seed=seed, **values)
    if values:
        config = model.config
        kept = (
            f"; mlp_hidden stays the preset's {config.mlp_hidden} (--set mlp_hidden=N to change it)"
            if "d_model" in values and "mlp_hidden" not in values and getattr(config, "mlp_hidden", 0)
            else ""
        )
        click.echo(
            f"{config.arch} with {', '.join(overrides)}: {sum(p.numel() for p in model.parameters()):,} "
            f"parameters{kept}",
            err=True,
        )
    return model


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= 1 if isinstance(d, str) else d
    return n


@main.command("verify")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--checkpoint", type=click.Path(dir_okay=False), help="Weights the export came from, if not recorded.")
@click.option("--threads", type=click.IntRange(min=1), callback=_THREADS, help="onnxruntime intra-op threads.")
@click.option(
    "-v",
    "--verbose",
    is_flag=True,
    help="Print every check, and every reason the export does not fit onnxruntime-genai.",
)
def verify_command(directory, checkpoint, threads, verbose) -> None:
    """Run each target here against the PyTorch model; exit 1 beyond tolerance."""
    from rich.console import Console
    from rich.table import Table

    from edgemem.export.genai import unfit_reasons
    from edgemem.export.verify import TOLERANCE, verify
    from edgemem.manifest import load as load_manifest

    checks, skipped = verify(directory, checkpoint=checkpoint, threads=threads)
    manifest = load_manifest(directory)
    tolerance = TOLERANCE[manifest.config.get("dtype", "fp32")]
    failed = [c for c in checks if not c.ok]
    if verbose or failed:  # a failure is shown in full: its rows at least
        table = Table("target", "graph", "tensor", "max abs", "max rel", "")
        for c in checks if verbose else failed:
            table.add_row(c.target, c.graph, c.tensor, f"{c.max_abs:.2e}", f"{c.max_rel:.2e}", "ok" if c.ok else "FAIL")
        Console().print(table)
    for target in dict.fromkeys(c.target for c in checks):
        mine = [c for c in checks if c.target == target]
        worst = max(mine, key=lambda c: c.max_rel)
        bad = sum(not c.ok for c in mine)
        click.echo(
            f"{target}: {len(mine)} checks, worst {worst.max_rel:.2e} relative ({worst.graph} {worst.tensor}): "
            + (f"{bad} FAIL" if bad else "ok")
        )
    for target, why in skipped.items():
        click.echo(f"{target}: skipped ({why})")
    unfit = unfit_reasons(manifest)
    if unfit:
        if verbose:
            click.echo("no genai_config.json: onnxruntime-genai cannot run this export:")
            for why in unfit:
                click.echo(f"  - {why}")
        else:
            click.echo(
                f"note: no genai_config.json (onnxruntime-genai cannot run this export; "
                f"{len(unfit)} reason{'s' if len(unfit) > 1 else ''}: verify -v)"
            )
    if failed:
        click.secho(
            f"{len(failed)} of {len(checks)} checks beyond tolerance ({tolerance:g} relative)", fg="red", err=True
        )
        sys.exit(1)
    if not checks:  # e.g. a trt-only export (bf16 is one) where TensorRT is not installed
        click.echo("nothing was checked: no target of this export runs here (see the skipped ones above)")
        return
    click.echo(
        f"all {len(checks)} checks within tolerance ({tolerance:g} relative)"
        + ("" if verbose else "; verify -v lists them")
    )


def _csv_ints(text: str, option: str) -> list[int]:
    from edgemem.errors import ConfigError

    try:
        values = [int(v.strip().replace("_", "")) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{option} expects comma-separated integers; got {text!r}") from None
    if not values or min(values) < 0:
        raise ConfigError(f"{option} expects comma-separated non-negative integers; got {text!r}")
    return values


def _ids(text: str, option: str) -> list[int]:
    """Token ids separated by commas or whitespace."""
    from edgemem.errors import ConfigError

    ids = []
    for item in text.replace(",", " ").split():
        try:
            ids.append(int(item))
        except ValueError:
            raise ConfigError(f"{option}: {item!r} is not a token id (a non-negative integer)") from None
        if ids[-1] < 0:
            raise ConfigError(f"{option}: {item} is not a token id (a non-negative integer)")
    if not ids:
        raise ConfigError(f"{option} holds no token ids; give them separated by commas or spaces")
    return ids


def _ids_file(path: str) -> list[int]:
    from edgemem.errors import ConfigError

    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--ids-file {path}: {getattr(e, 'strerror', None) or 'not a text file'}") from None
    return _ids(text, f"--ids-file {path}")


def _shared(a, b) -> bool:
    """Whether two streams write to the same place (one terminal, one pipe, one file)."""
    try:
        x, y = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return False
    return (x.st_dev, x.st_ino) == (y.st_dev, y.st_ino)


def _rate(n: int, seconds: float) -> str:
    rate = n / max(seconds, 1e-9)
    return f"{rate:.1f}" if rate < 10 else f"{rate:.0f}"


@main.command("run")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--prompt", default="", help="Text to start from (UTF-8). Empty: continue the --load-state stream.")
@click.option("--ids", "ids_text", metavar="1,2,3", help="Start from these token ids instead of text.")
@click.option(
    "--ids-file",
    type=click.Path(dir_okay=False),
    help="Start from the token ids in this file (separated by commas or whitespace).",
)
@click.option(
    "--print-ids",
    is_flag=True,
    help="Print the generated token ids instead of text (always, for an export without a tokenizer).",
)
@click.option(
    "--max-new-tokens",
    default=200,
    show_default=True,
    type=click.IntRange(min=0),
    help="Tokens (bytes for a byte-level model) to generate.",
)
@click.option("--load-state", type=click.Path(dir_okay=False), help="Continue a stream saved with --save-state.")
@click.option("--save-state", type=click.Path(dir_okay=False), help="Save the stream here afterwards (also on Ctrl-C).")
@click.option(
    "--temperature",
    default=0.0,
    show_default=True,
    type=click.FloatRange(min=0),
    callback=_checked(finite),
    help="0 is greedy.",
)
@click.option(
    "--top-k", type=click.IntRange(min=1), help="Sample from the k most likely tokens (needs --temperature > 0)."
)
@click.option(
    "--top-p",
    type=click.FloatRange(0, 1, min_open=True),
    help="Sample from the smallest set of tokens with this much probability (needs --temperature > 0).",
)
@click.option("--seed", type=int, callback=_SEED, help="Seed of the sampler (default: fresh randomness).")
@click.option("--threads", type=click.IntRange(min=1), callback=_THREADS, help="onnxruntime intra-op threads.")
@click.option("--target", help="Lowered graphs to run (default: ort if exported, else generic).")
@click.option(
    "--backend",
    type=click.Choice(["ort", "ort-cuda", "trt"]),
    default="ort",
    show_default=True,
    help="trt: the engines of `edgemem build` in DIRECTORY/engines.",
)
@click.option(
    "--plugins",
    type=click.Path(dir_okay=False),
    help="--backend trt: the plugin library the engines were built with (default: $EDGEMEM_TRT_PLUGINS).",
)
@click.option(
    "--draft",
    metavar="prompt-lookup|DIR",
    help="Speculative decoding: draft tokens by prompt lookup, or with "
    "the (smaller) export in DIR of the same vocabulary; the output is the same (greedy) or has the same "
    "distribution (sampled).",
)
@click.option("--draft-tokens", default=4, show_default=True, type=int, help="Tokens drafted per round (with --draft).")
@click.option(
    "--num-beams",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Beam search over this many beams (greedy: 1); the best beam is printed when the search ends.",
)
@click.option(
    "--global",
    "global_positions",
    metavar="0,5,9",
    help="An encoder-decoder's global tokens: positions of the input (from 0) that attend to, and are "
    "attended by, every token (default: none).",
)
@click.option(
    "--prefix-cache",
    "prefix_cache",
    metavar="BYTES",
    type=click.IntRange(min=1),
    help="Prefix state cache of this many bytes (snapshots of the prompt's state at each prefill chunk); one "
    "run prefills one prompt, so it pays off in the Triton model (`edgemem triton --prefix-cache`), "
    "where sequences share it.",
)
def run_command(
    directory,
    prompt,
    ids_text,
    ids_file,
    print_ids,
    max_new_tokens,
    load_state,
    save_state,
    temperature,
    top_k,
    top_p,
    seed,
    threads,
    target,
    backend,
    plugins,
    draft,
    draft_tokens,
    num_beams,
    global_positions,
    prefix_cache,
) -> None:
    """Stream generated text (or token ids) to stdout; statistics go to stderr."""
    import itertools
    import time

    import numpy as np

    from edgemem.errors import ConfigError
    from edgemem.files import check_output_file
    from edgemem.runtime import Engine
    from edgemem.runtime.speculative import GenerationStats
    from edgemem.runtime.text import ByteCodec, load_codec

    if temperature == 0 and (top_k is not None or top_p is not None):
        given = [name for name, value in (("--top-k", top_k), ("--top-p", top_p)) if value is not None]
        raise ConfigError(
            f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} --temperature > 0 "
            "(temperature 0, the default, is greedy)"
        )
    if sum(bool(x) for x in (prompt, ids_text is not None, ids_file)) > 1:
        raise ConfigError("give one prompt: --prompt TEXT, --ids 1,2,3 or --ids-file PATH")
    ids = _ids(ids_text, "--ids") if ids_text is not None else _ids_file(ids_file) if ids_file else None
    if save_state:
        check_output_file(save_state, "--save-state", inputs=[directory])
    if draft is None and draft_tokens != 4:
        raise ConfigError("--draft-tokens needs --draft (prompt-lookup or an export directory)")
    if num_beams > 1 and (temperature or draft is not None or save_state):
        raise ConfigError(
            "--num-beams searches deterministically and leaves the stream as it was: give it without "
            "--temperature, --draft and --save-state"
        )
    engine = Engine.load(
        directory, backend=backend, target=target, threads=threads, plugins=plugins, prefix_cache_bytes=prefix_cache
    )
    if draft is not None and draft != "prompt-lookup":
        if not Path(draft, "edgemem.json").is_file():
            raise ConfigError(f"--draft {draft}: neither prompt-lookup nor an export directory (no edgemem.json there)")
        draft = Engine.load(draft, backend=backend, threads=threads, plugins=plugins)
    codec = load_codec(directory, engine.manifest, required=False)
    if codec is None and prompt:
        raise ConfigError(
            f"{engine.manifest.arch} has a vocabulary of {engine.vocab_size} and its export carries no "
            "tokenizer to encode --prompt: give token ids (--ids 1,2,3 or --ids-file PATH); the output "
            "is token ids (--print-ids)"
        )
    if ids is not None:
        bad = next((i for i in ids if i >= engine.vocab_size), None)
        if bad is not None:
            raise ConfigError(
                f"{'--ids' if ids_text is not None else '--ids-file'}: token id {bad} is outside the "
                f"vocabulary of {engine.manifest.arch} (0 to {engine.vocab_size - 1})"
            )
    prompt_ids = ids if ids is not None else codec.encode(prompt) if prompt else []
    print_ids = print_ids or codec is None
    if engine.kind.streams == "encode" and not load_state:  # an encoder-decoder: the prompt is the input
        if not prompt_ids:
            raise ConfigError(
                f"{engine.manifest.arch} is an encoder-decoder: give the input to encode (--prompt TEXT, "
                "--ids 1,2,3 or --ids-file PATH)"
            )
        mask = None
        if global_positions is not None:
            mask = np.zeros(len(prompt_ids), dtype=np.int64)
            for position in _csv_ints(global_positions, "--global"):
                if not 0 <= position < len(prompt_ids):
                    raise ConfigError(
                        f"--global: position {position} is not in the input (positions 0 to {len(prompt_ids) - 1})"
                    )
                mask[position] = 1
        stream, prompt_ids = engine.encode(prompt_ids, mask), []
    else:
        if global_positions is not None:
            raise ConfigError(f"--global marks an encoder-decoder's input; {engine.manifest.arch} has no encoder")
        stream = engine.load_stream(load_state) if load_state else engine.new_stream()
    out = sys.stdout.buffer  # bytes, not text: a byte-level model's output need not be UTF-8
    begin, last = stream.position, b"\n"
    try:
        options = {"draft": draft, "draft_tokens": draft_tokens}
        if num_beams > 1:  # the best beam is known only when the search ends; the stream stays as it was
            start = time.perf_counter()
            generated = stream.generate(prompt_ids, max_new_tokens, num_beams=num_beams) if max_new_tokens else []
            stream.generation = GenerationStats(len(prompt_ids), tokens=len(generated))
            stream.generation.decode_s = time.perf_counter() - start
        elif len(prompt_ids) > engine.chunk_size:  # more than one prefill run: not silent
            from edgemem.progress import track

            with track("prefill", len(prompt_ids)) as bar:
                generated = stream.generate_iter(
                    prompt_ids,
                    max_new_tokens,
                    temperature,
                    top_k,
                    top_p,
                    seed,
                    progress=lambda n: bar.update(advance=n),
                    **options,
                )
                first = next(generated, None)  # the prompt is prefilled before the first token
            generated = itertools.chain([] if first is None else [first], generated)
        else:
            generated = stream.generate_iter(prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, **options)
        if print_ids:
            pieces = (f"{' ' if n else ''}{token}".encode() for n, token in enumerate(generated))
        elif isinstance(codec, ByteCodec):
            pieces = (bytes((token,)) for token in generated)
        else:
            pieces = (text.encode() for text in codec.stream(generated))
        for piece in pieces:
            out.write(piece)
            out.flush()
            last = piece[-1:] or last
    except KeyboardInterrupt:
        if save_state:
            stream.save(save_state)  # every token written so far is in the stream's state
        click.echo(
            f"\ninterrupted at position {stream.position}" + (f"; saved {save_state}" if save_state else ""), err=True
        )
        sys.exit(130)
    stats = stream.generation
    tokens = stats.tokens if num_beams > 1 else stream.position - begin - len(prompt_ids)
    if save_state:
        stream.save(save_state)
    if last != b"\n" and (print_ids or out.isatty()):  # ids are lines; a terminal gets its line ended
        out.write(b"\n")
        out.flush()
        last = b"\n"
    unit = "bytes" if isinstance(codec, ByteCodec) and not print_ids else "tokens"
    prefill = f"prefill {len(prompt_ids)} {unit} in {stats.prefill_s:.2f} s; " if prompt_ids else ""
    if engine.prefix_cache is not None and engine.prefix_cache.tokens_reused:
        prefill = f"{prefill[:-2]} ({engine.prefix_cache.tokens_reused} from the prefix cache); "
    apart = "\n" if last != b"\n" and (sys.stderr.isatty() or _shared(out, sys.stderr)) else ""
    accepted = (
        f"; draft acceptance {stats.accepted}/{stats.drafted} ({stats.acceptance_rate:.0%})"
        if stats.drafted
        else "; no draft tokens proposed"
        if draft is not None
        else ""
    )
    click.echo(
        f"{apart}[{prefill}{tokens} {unit} in {stats.decode_s:.2f} s, {_rate(tokens, stats.decode_s)} {unit}/s"
        f"{accepted}; position {stream.position}, state {_size(stream.state_bytes)}"
        + (f"; saved {save_state}]" if save_state else "]"),
        err=True,
    )


@main.command("bench")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option(
    "--positions",
    default="1000,10000",
    show_default=True,
    help="Comma-separated positions; reached by prefilling in chunks (prefill graph).",
)
@click.option("--batch", "batches", default="1,8,64", show_default=True, help="Comma-separated batch sizes.")
@click.option(
    "--steps",
    default=100,
    show_default=True,
    type=click.IntRange(min=3),
    help="Timed steps per configuration, at most.",
)
@click.option(
    "--time-limit",
    default=2.0,
    show_default=True,
    type=float,
    callback=_checked(finite, positive=True),
    help="Seconds of timed steps per configuration, at most.",
)
@click.option(
    "--threads",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    callback=_THREADS,
    help="onnxruntime and torch threads.",
)
@click.option("--target", help="Lowered graphs to run (default: ort if exported, else generic).")
@click.option(
    "--chunk-size",
    default=DEFAULT_CHUNK,
    show_default=True,
    type=click.IntRange(min=1),
    help="Prefill chunk to reach a position.",
)
@click.option("--no-eager", is_flag=True, help="Skip the PyTorch eager baseline (and torch).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Save the results as JSON.")
@click.option(
    "--plot", "plot_path", type=click.Path(dir_okay=False), help="Save latency and memory vs position as PNG."
)
def bench_command(
    directory, positions, batches, steps, time_limit, threads, target, chunk_size, no_eager, json_path, plot_path
) -> None:
    """µs/token, tokens/s, state and RSS at positions × batch sizes, vs PyTorch eager and a softmax KV cache."""
    import importlib.util

    from rich import box
    from rich.console import Console
    from rich.table import Table

    from edgemem.config import fits_memory
    from edgemem.files import check_output_file, write_atomic
    from edgemem.progress import track
    from edgemem.runtime import bench

    positions, batches = _csv_ints(positions, "--positions"), _csv_ints(batches, "--batch")
    if min(batches) < 1:
        raise EdgememError("--batch sizes must be at least 1")
    fits_memory(8 * max(positions), f"--positions {max(positions):,} (the random prompt that reaches it)")
    for path, option in ((json_path, "--json"), (plot_path, "--plot")):
        if path:
            check_output_file(path, option, inputs=[directory])
    if plot_path and importlib.util.find_spec("matplotlib") is None:
        raise EdgememError("--plot needs matplotlib: pip install 'edgemem-toolkit[bench]'")
    total = len(set(positions)) * (1 + len(set(batches)) * (1 if no_eager else 2)) + (0 if no_eager else 1)
    with track("bench", total) as bar:
        first = True

        def advance(description: str) -> None:
            nonlocal first
            bar.update(f"bench: {description}", advance=0 if first else 1)
            first = False

        if no_eager:
            measure = bench.run
        else:
            from edgemem.eager_bench import run_with_eager as measure  # imports torch after the runtime's measurements

        result = measure(
            directory,
            positions=positions,
            batches=batches,
            steps=steps,
            time_limit=time_limit,
            threads=threads,
            target=target,
            chunk_size=chunk_size,
            progress=advance,
        )
        bar.update("bench", completed=total)
    env, model = result["environment"], result["model"]
    table = Table(
        "position",
        "batch",
        "µs/token",
        "tokens/s",
        "eager µs/token",
        "× eager",
        "state/stream",
        "softmax KV",
        "RSS",
        title=f"{model['arch']} ({model['target']}), {threads} thread(s)",
        box=box.SIMPLE_HEAD,
        caption=(
            f"load average {env['load_avg_before'][0]:.2f} → {env['load_avg_after'][0]:.2f} on {env['cpus']} CPUs; "
            if env["load_avg_before"]
            else ""
        )
        + f"graphs and weights {_size(model['file_bytes'])}, resident after load +{_size(model['load_rss_bytes'])}, "
        f"peak +{_size(model['peak_rss_bytes'])} (process peak RSS {_size(env['runtime_peak_rss_bytes'])})",
    )
    for r in result["rows"]:
        if "skipped" in r:
            table.add_row(f"{r['position']:,}", str(r["batch"]), f"skipped: {r['skipped']}", *[""] * 6)
            continue
        table.add_row(
            f"{r['position']:,}",
            str(r["batch"]),
            f"{r['us_per_token']:.1f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['eager_us_per_token']:.1f}" if "eager_us_per_token" in r else "-",
            f"{r['speedup_vs_eager']:.2f}" if "speedup_vs_eager" in r else "-",
            _size(r["state_bytes"]),
            _size(r["softmax_kv_bytes"]) if "softmax_kv_bytes" in r else "-",
            _size(r["rss_bytes"]),
        )
    Console(width=None if sys.stdout.isatty() else 132).print(table)
    if json_path:
        write_atomic(Path(json_path), (json.dumps(result, indent=2) + "\n").encode())
        click.echo(f"wrote {json_path}", err=True)
    if plot_path:
        bench.plot(result, plot_path)
        click.echo(f"wrote {plot_path}", err=True)


def _stdout_console():
    """stdout's console: the terminal's width, else $COLUMNS, else 132."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit() else 132)


def _print_fitted(headers: list[str], rows: list[list[str]], *, title: str, caption: str) -> None:
    """A table that never cuts a cell: as given if it fits the width, else one column per row (the first
    column's values as headers), else one block of `header: value` lines per row."""
    from rich import box
    from rich.measure import Measurement
    from rich.table import Table

    console = _stdout_console()

    def table(head: list[str], body: list[list[str]]) -> Table:
        t = Table(*head, box=box.SIMPLE_HEAD, title=title, caption=caption)
        for column in t.columns:
            column.no_wrap = True
        for row in body:
            t.add_row(*row)
        return t

    transposed = [[name, *(row[i] for row in rows)] for i, name in enumerate(headers) if i]
    for head, body in ((headers, rows), ([headers[0], *(row[0] for row in rows)], transposed)):
        candidate = table(head, body)
        if Measurement.get(console, console.options.update_width(1 << 16), candidate).maximum <= console.width:
            console.print(candidate)
            return
    console.print(title, caption, sep="\n", soft_wrap=False)
    width = max(map(len, headers[1:]))
    for row in rows:
        console.print(f"{headers[0]} {row[0]}", highlight=False)
        for name, value in zip(headers[1:], row[1:]):
            console.print(f"  {name:<{width}}  {value}", highlight=False, soft_wrap=True)


def _sm_list(ctx, param, value: str | None) -> tuple[int, ...]:
    """`--sm 86,89,120` → (86, 89, 120)."""
    if not value:
        return ()
    try:
        return tuple(int(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(
            f"{value!r}: expected compute capabilities as comma-separated numbers, e.g. 86,89,120"
        ) from None


@main.command("build")
@click.argument("directory", type=click.Path(file_okay=False, exists=True))
@click.option(
    "--fp16",
    is_flag=True,
    help="Require an FP16 export (`edgemem export --dtype fp16`): engines are "
    "strongly typed, so precision comes from the export (state stays FP32).",
)
@click.option(
    "--plugins",
    "plugins",
    type=click.Path(dir_okay=False),
    help="libedgemem_trt_plugins.so built for this TensorRT major (default: $EDGEMEM_TRT_PLUGINS); "
    "with --rtx, built against the TensorRT 11 headers with kernels for the --sm targets.",
)
@click.option(
    "--max-batch",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Largest batch (streams) of the optimisation profile.",
)
@click.option(
    "--max-sequence",
    default=2048,
    show_default=True,
    type=click.IntRange(min=1),
    help="Longest prompt of the prefill profile.",
)
@click.option(
    "--out", "out_dir", type=click.Path(file_okay=False), help="Engine directory (default: DIRECTORY/engines)."
)
@click.option(
    "--rtx",
    is_flag=True,
    help="Build with TensorRT for RTX (pip install 'edgemem-toolkit[rtx]'): ahead of time, no GPU needed.",
)
@click.option(
    "--sm",
    callback=_sm_list,
    metavar="86,89,120",
    help="With --rtx: the compute capabilities to build for (default: TensorRT for RTX's default set).",
)
@click.option("--force", is_flag=True, help="Replace an earlier engine set in the engine directory (nothing else).")
def build_command(directory, fp16, plugins, max_batch, max_sequence, out_dir, rtx, sm, force) -> None:
    """Build strongly typed TensorRT engines and engines.json from an export's trt target (needs TensorRT and a GPU;
    with --rtx, TensorRT for RTX and no GPU)."""
    from edgemem.trt_build import build_engines

    paths = build_engines(
        directory,
        fp16=fp16,
        plugins=plugins,
        max_batch=max_batch,
        max_sequence=max_sequence,
        out=out_dir,
        rtx=rtx,
        sm=sm,
        force=force,
    )
    click.echo(f"built {len(paths)} engine(s): {', '.join(str(p) for p in paths)}")


@main.command("calibrate")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option(
    "--method",
    type=click.Choice(["dynamic", "static", "int4"]),
    default="dynamic",
    show_default=True,
    help="dynamic: int8 weights, activations quantized at run time; static: QDQ calibrated on rolled-out "
    "states; int4: 4-bit blockwise weights (MatMulNBits), no calibration data.",
)
@click.option(
    "--block-size", type=int, help="int4 only: input rows per quantization block (16, 32, 64, 128, 256; default 32)."
)
@click.option(
    "--embeddings",
    type=click.Choice(["int4", "fp32"]),
    help="int4 only: the embedding table in 4-bit blocks (GatherBlockQuantized, the tied head's blocks "
    "shared; the default) or kept fp32.",
)
@click.option(
    "--recipe",
    default="default",
    show_default=True,
    help="Calibration recipe: a shipped one by name (default, mqar, bytes; in edgemem/quant/calib/) or a "
    "TOML file (e.g. calib/long-horizon.toml).",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    help="Output export directory (default: DIRECTORY-int8-METHOD, DIRECTORY-int4).",
)
@click.option("--report", "report_path", type=click.Path(dir_okay=False), help="Save the drift report as JSON.")
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    help="Save the drift plot as PNG (default with --report: beside it, .png).",
)
@click.option("--no-drift", is_flag=True, help="Quantize only; skip the drift report.")
@click.option(
    "--threads",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    callback=_THREADS,
    help="onnxruntime intra-op threads.",
)
@click.option("--force", is_flag=True, help="Replace a non-empty output directory.")
def calibrate_command(
    directory, method, block_size, embeddings, recipe, out_dir, report_path, plot_path, no_drift, threads, force
) -> None:
    """INT8/INT4 projections (state, gates, norms and edgemem ops stay float), then a drift report against fp32."""
    from edgemem.files import check_output_file, write_atomic
    from edgemem.manifest import load as load_manifest
    from edgemem.progress import track
    from edgemem.quant import block_size_for, calibrate, default_out, drift_report, load_recipe, plot_report
    from edgemem.quant.calibrate import embeddings_for

    block_size_for(method, block_size)  # a bad block size fails before any work
    embeddings_for(method, embeddings)
    if report_path and not plot_path:
        plot_path = str(Path(report_path).with_suffix(".png"))  # the plot's default: beside the report
    for path, option in ((report_path, "--report"), (plot_path, "--plot")):
        if path:
            check_output_file(path, option, inputs=[directory])
    recipe = load_recipe(recipe)
    if not no_drift:  # the report's data must fit the model before anything is written
        source = load_manifest(directory)
        recipe.check_vocabulary(source.arch, source.vocab_size)
        recipe.check_memory(source.state_bytes(), calibration=False, drift=True)
    out = Path(out_dir) if out_dir else default_out(directory, method)
    with track(f"calibrate ({method}, recipe {recipe.name})") as bar:
        manifest = calibrate(
            directory,
            method,
            recipe,
            out,
            force=force,
            threads=threads,
            block_size=block_size,
            embeddings=embeddings,
            progress=lambda text: bar.update(f"calibrate: {text}"),
        )
    counts = manifest.quantization["quantized_projections"]
    bits = "int4" if method == "int4" else "int8"
    click.echo(
        f"wrote {out}: {', '.join(manifest.targets)}; {sum(counts.values())} {bits} projections in "
        f"{len(counts)} graphs; state stays fp32"
    )
    if no_drift:
        return
    with track("drift report") as bar:
        report = drift_report(
            directory, out, recipe, threads=threads, progress=lambda text: bar.update(f"drift: {text}")
        )
    kinds = list(next(iter(report["horizons"].values()))["state_rel_err"])
    headers = [
        "horizon",
        "logits rel err",
        *(f"{k} rel err" for k in kinds),
        f"{report['metric_name']} {bits}",
        f"{report['metric_name']} fp32",
    ]

    def number(value, spec: str = ".4f") -> str:  # the report holds None for a NaN/inf error or metric
        return "non-finite" if value is None else format(value, spec)

    rows = [
        [
            f"{int(horizon):,}",
            number(row["logits_rel_err"], ".2e"),
            *(number(row["state_rel_err"][k], ".2e") for k in kinds),
            number(row["metric"]),
            number(report["fp32_metric"][horizon]),
        ]
        for horizon, row in report["horizons"].items()
    ]
    _print_fitted(
        headers,
        rows,
        title=f"{manifest.arch} {bits if method == 'int4' else f'int8 {method}'} vs fp32: {report['task']['name']}, "
        f"{report['task']['streams']} held-out stream(s)",
        caption=f"µs/token (step): fp32 {report['us_per_token']['fp32']:.1f}, {bits} "
        f"{report['us_per_token']['quantized']:.1f}; {report['target']} graphs "
        f"{_size(report['size_bytes']['fp32'])} → {_size(report['size_bytes']['quantized'])}",
    )
    if report_path:
        write_atomic(Path(report_path), (json.dumps(report, indent=2) + "\n").encode())
        click.echo(f"wrote {report_path}", err=True)
    if plot_path and plot_report(report, plot_path):
        click.echo(f"wrote {plot_path}", err=True)


@main.command("train")
@click.option("--arch", help="Preset to train (see `edgemem archs`).")
@click.option(
    "--init",
    "init",
    type=click.Path(dir_okay=False),
    help="Fine-tune this checkpoint instead (e.g. from `edgemem linearize`).",
)
@click.option(
    "--task", "task_name", required=True, help="Task: mqar, mqar-far, copy, copy-marked or bytes (see edgemem.tasks)."
)
@click.option("--steps", default=1000, show_default=True, type=click.IntRange(min=1), help="Optimizer steps.")
@click.option("--out", type=click.Path(dir_okay=False), help="Checkpoint to write (default: ARCH-TASK.safetensors).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a preset setting (repeatable).")
@click.option(
    "--task-set",
    "task_set",
    multiple=True,
    metavar="KEY=VALUE",
    help="Task parameter (repeatable): length (episode = training length), pairs (mqar, mqar-far), "
    "gap (mqar-far), tokens (copy, copy-marked).",
)
@click.option(
    "--seed", default=0, show_default=True, callback=_SEED, help="Seed of the initialisation and the training data."
)
@click.option("--batch", default=64, show_default=True, type=click.IntRange(min=1), help="Sequences per step.")
@click.option(
    "--lr",
    default=3e-3,
    show_default=True,
    type=float,
    callback=_checked(finite, positive=True),
    help="Peak learning rate.",
)
@click.option(
    "--threads", default=1, show_default=True, type=click.IntRange(min=1), callback=_THREADS, help="torch threads."
)
@click.option("--device", default="cpu", show_default=True, help="torch device to train on (cpu, cuda).")
def train_command(arch, init, task_name, steps, out, overrides, task_set, seed, batch, lr, threads, device) -> None:
    """Train a preset (or fine-tune a checkpoint) on a task (AdamW, warmup + cosine) and save a
    checkpoint; then evaluate it held out."""
    import torch

    from edgemem.errors import ConfigError
    from edgemem.files import check_output_file
    from edgemem.models import checkpoint_tokenizer, load_checkpoint, tokenizer_dir
    from edgemem.train import Interrupted, evaluate, train

    if (arch is None) == (init is None):
        raise ConfigError("give --arch (a preset to train from scratch) or --init CHECKPOINT (to fine-tune), not both")
    if init and overrides:
        raise ConfigError("--set changes a preset; a checkpoint given with --init is trained as it is")
    torch.set_num_threads(threads)
    inputs = [init, tokenizer_dir(init)] if init else []
    if out:
        check_output_file(out, "--out", inputs=inputs)
    model = load_checkpoint(init) if init else _preset(arch, seed, overrides)
    out = check_output_file(
        out or f"{model.config.arch if init else arch}-{task_name}.safetensors", "--out", inputs=inputs
    )
    task_params = parse_overrides(task_set, "--task-set")
    try:
        result = train(
            model,
            task_name,
            steps,
            out,
            seed=seed,
            task_params=task_params,
            batch=batch,
            lr=lr,
            device=device,
            tokenizer=checkpoint_tokenizer(init) if init else (),
        )
    except Interrupted as stop:
        click.echo(
            f"interrupted after {stop.steps} of {steps} steps" + (f"; saved {stop.out}" if stop.out else ""), err=True
        )
        sys.exit(130)
    scores = evaluate(result.model, task_name, batch=128, task_params=task_params)  # as `edgemem eval`
    click.echo(
        f"saved {out}: {steps} steps in {result.seconds:.0f} s, final loss {result.losses[-1]:.4f}; "
        f"held-out at length {scores['length']}: {_metrics(scores)}"
    )


def _metrics(scores: dict) -> str:
    """The metrics of an `evaluate` row: "accuracy 0.9912", "exact_match 0.98, token_accuracy 0.99"."""
    return ", ".join(f"{k} {v:.4f}" for k, v in scores.items() if k not in ("task", "arch", "length"))


@main.command("linearize")
@click.option("--checkpoint", type=click.Path(dir_okay=False), help="A checkpoint with softmax attention layers.")
@click.option(
    "--hf",
    "hf_dir",
    type=click.Path(file_okay=False),
    help="Or a Hugging Face save_pretrained directory (a hybrid such as Qwen3.5).",
)
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Checkpoint to write.")
@click.option("--window", default=64, show_default=True, type=click.IntRange(min=1), help="Sliding-window length.")
@click.option(
    "--update-rule",
    default="gated_delta",
    show_default=True,
    help="Linear branch's rule: linear, gated, delta or gated_delta.",
)
@click.option(
    "--gate-init", default=0.5, show_default=True, type=float, help="Initial share of linear attention, in (0, 1)."
)
def linearize_command(checkpoint, hf_dir, out, window, update_rule, gate_init) -> None:
    """Turn softmax attention layers into LiZA layers (constant memory), keeping every weight; fine-tune
    the result with `edgemem train --init OUT`, export it with `edgemem export --checkpoint OUT`."""
    from edgemem.errors import ConfigError
    from edgemem.files import check_output_file
    from edgemem.models import checkpoint_tokenizer, linearize, load_checkpoint, save_checkpoint, tokenizer_dir

    if (checkpoint is None) == (hf_dir is None):
        raise ConfigError("give --checkpoint FILE or --hf DIR (one of them)")
    source = [checkpoint, tokenizer_dir(checkpoint)] if checkpoint else [hf_dir]
    out = check_output_file(out, "--out", inputs=source)
    if hf_dir:
        from edgemem.models.hf import from_hf, tokenizer_files

        model, tokenizer = from_hf(hf_dir), tokenizer_files(hf_dir)
    else:
        model, tokenizer = load_checkpoint(checkpoint), checkpoint_tokenizer(checkpoint)
    new = linearize(model, window=window, update_rule=update_rule, gate_init=gate_init)
    save_checkpoint(new, out, tokenizer)
    kinds = [new.config.mixer_of(i)[0] for i in range(new.config.n_layers)]
    click.echo(
        f"saved {out}: {new.config.arch}, {kinds.count('liza')} of {len(kinds)} layers now LiZA (window {window})"
        + (f"; its tokenizer in {tokenizer_dir(out)}" if tokenizer else "")
    )


@main.command("eval")
@click.option("--checkpoint", required=True, type=click.Path(dir_okay=False), help="A checkpoint from `edgemem train`.")
@click.option("--task", "task_name", required=True, help="Task: mqar, mqar-far, copy, copy-marked or bytes.")
@click.option(
    "--length",
    type=click.IntRange(min=1),
    help="Training length (default: the task's episode length); also reported at 4× it.",
)
@click.option("--task-set", "task_set", multiple=True, metavar="KEY=VALUE", help="Task parameter, as given to train.")
@click.option("--batch", default=128, show_default=True, type=click.IntRange(min=1), help="Held-out streams.")
@click.option("--seed", default=0, show_default=True, callback=_SEED, help="Seed of the held-out streams.")
@click.option(
    "--threads", default=1, show_default=True, type=click.IntRange(min=1), callback=_THREADS, help="torch threads."
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='Print a JSON list, one object per length: {"task", "arch", "length", and the metrics: "accuracy" | '
    '"bits_per_byte" | "exact_match" and "token_accuracy"}.',
)
@click.option(
    "--no-memory",
    "no_memory",
    is_flag=True,
    help="Turn the Titans neural memory's writes off (gates θ = α = 0): every memory stays at its M_0.",
)
def eval_command(checkpoint, task_name, length, task_set, batch, seed, threads, as_json, no_memory) -> None:
    """The task's metric on held-out streams at the training length and at 4× it."""
    import torch

    from edgemem.models import load_checkpoint
    from edgemem.tasks import check_shape, get_task
    from edgemem.train import evaluate, without_memory

    torch.set_num_threads(threads)
    task = get_task(task_name, **parse_overrides(task_set, "--task-set"))
    length = length or task.length
    check_shape(batch, 4 * length)  # the longer of the two evaluations, before the first
    model = load_checkpoint(checkpoint)
    if no_memory:
        without_memory(model)
    rows = []
    for n in (length, 4 * length):
        if not as_json:  # a line per length: a long evaluation is not silent
            click.echo(f"evaluating {model.config.arch} on {task.name} at length {n:,}", err=True)
        rows.append(evaluate(model, task, n, batch, seed))
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        off = " (memory off)" if no_memory else ""
        click.echo(f"{r['arch']}{off} on {r['task']}, length {r['length']:>6}: {_metrics(r)}")


@main.command("triton")
@click.argument("directory", type=click.Path(file_okay=False, exists=True))
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Model repository to write.")
@click.option("--name", help="Model name (default: the export's arch); the onnxruntime model is NAME-onnx.")
@click.option(
    "--max-live",
    default=64,
    show_default=True,
    type=click.IntRange(min=1),
    help="Python model: sequences kept in memory; the least recently used beyond go to checkpoints.",
)
@click.option(
    "--idle-seconds",
    default=600.0,
    show_default=True,
    type=float,
    callback=_checked(finite, positive=True),
    help="Python model: checkpoint a sequence idle this long; onnxruntime model: sequence idle timeout.",
)
@click.option(
    "--checkpoints",
    default="checkpoints",
    show_default=True,
    help="Python model: directory for evicted sequences (relative to the model directory, or absolute).",
)
@click.option(
    "--threads",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    callback=_REMOTE_THREADS,
    help="onnxruntime threads per model.",
)
@click.option(
    "--max-batch-size",
    default=8,
    show_default=True,
    type=click.IntRange(min=1),
    help="onnxruntime model: sequences batched per run by the sequence batcher.",
)
@click.option(
    "--prefix-cache",
    "prefix_cache",
    metavar="BYTES",
    type=click.IntRange(min=1),
    help="Python model: a prefix state cache of this many bytes, shared by sequences that start with the "
    "same prompt (off by default).",
)
@click.option("--force", is_flag=True, help="Replace a non-empty output directory (and the checkpoints inside it).")
def triton_command(
    directory, out_dir, name, max_live, idle_seconds, checkpoints, threads, max_batch_size, prefix_cache, force
) -> None:
    """Write a Triton Inference Server model repository for an export (Python backend; onnxruntime if it fits)."""
    from edgemem.serve.repository import write_repository

    repo = write_repository(
        directory,
        out_dir,
        name=name,
        max_live=max_live,
        idle_seconds=idle_seconds,
        checkpoints=checkpoints,
        threads=threads,
        max_batch_size=max_batch_size,
        force=force,
        prefix_cache_bytes=prefix_cache,
    )
    click.echo(
        f"wrote {repo.path}: {repo.python_model} (python backend, edgemem.runtime)"
        + (f", {repo.onnx_model} (onnxruntime backend, implicit state)" if repo.onnx_model else "")
    )
    if repo.skipped:
        click.echo(f"no onnxruntime-backend model: {'; '.join(repo.skipped)}")


@main.command("serve")
@click.argument("repository", type=click.Path(file_okay=False, exists=True))
@click.option("--http-port", type=click.IntRange(1, 65535), help="HTTP port on 127.0.0.1 (default: a free one).")
@click.option("--grpc-port", type=click.IntRange(1, 65535), help="gRPC port on 127.0.0.1 (default: a free one).")
@click.option("--log-file", type=click.Path(dir_okay=False), help="Append tritonserver's log here.")
@click.option(
    "--timeout",
    default=120.0,
    show_default=True,
    type=float,
    callback=_checked(finite, positive=True),
    help="Seconds to wait for readiness.",
)
def serve_command(repository, http_port, grpc_port, log_file, timeout) -> None:
    """Run tritonserver (nvidia-pytriton wheel) on loopback ports until Ctrl-C; live sequences are checkpointed."""
    import signal
    import threading

    from edgemem.serve.server import TritonServer

    server = TritonServer(repository, http_port=http_port, grpc_port=grpc_port, log_file=log_file)
    stop, started = threading.Event(), threading.Event()

    def terminate(*_) -> None:
        stop.set()
        if not started.is_set():  # still starting: as Ctrl-C
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    try:
        server.start(timeout)  # stops the server itself on Ctrl-C or a failed start
        started.set()
    except KeyboardInterrupt:
        click.echo("interrupted while tritonserver was starting; it was stopped", err=True)
        sys.exit(130)
    click.echo(
        f"serving {', '.join(server.models)}: grpc {server.grpc_url}, http {server.http_url}"
        + (f" (not loaded, no such backend here: {', '.join(server.skipped)})" if server.skipped else "")
    )
    try:
        while not stop.wait(1.0) and server.running:
            pass
    except KeyboardInterrupt:
        pass
    finally:
        code = server.stop()
    click.echo(f"tritonserver stopped (exit code {code})")

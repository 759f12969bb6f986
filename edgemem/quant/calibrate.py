"""`calibrate`: an fp32 export directory → an INT8 or INT4 export directory (projections only, state float).

dynamic: onnxruntime `quantize_dynamic` (MatMulInteger with per-channel INT8 weights, activations
  quantized at run time), inside a prefill's segment Loop as in the step graph; no calibration data. Targets: the onnxruntime-runnable ones (ort, generic,
  onnx27). The trt target is left out: TensorRT takes explicit Q/DQ, not MatMulInteger.
static: onnxruntime `quantize_static` in QDQ format, symmetric INT8 activations, symmetric per-channel
  INT8 weights (a layout TensorRT's explicit quantization accepts), MinMax ranges from states that the
  edgemem runtime rolls out at the recipe's log-spaced positions. Ranges are calibrated once per graph
  (prefill, step) on the first runnable target and reused, by tensor name, for the other targets,
  trt included (its MatMuls are the same nodes; the plugin nodes stay float).
int4: onnxruntime's `MatMulNBitsQuantizer` (weight-only, round-to-nearest): each selected MatMul becomes a
  `com.microsoft::MatMulNBits` with 4-bit weights, asymmetric per block of `block_size` input rows (a float
  scale and a 4-bit zero point per block and output column); activations stay float in the graph, the CPU
  kernel multiplies them as int8 per block (accuracy_level 4). Targets: the onnxruntime-runnable ones. No
  calibration data.

On the onnxruntime targets the INT8 weights take 7 bits (onnxruntime's `reduce_range`): on x86 CPUs
without VNNI its u8s8 kernels add pairs of uint8 x int8 products in saturating 16-bit sums, which
full-range weights overflow without an error (benchmarks/README.md, "Figures behind choices in the code").
The trt target keeps 8-bit weights.

Only the recipe-approved projections (see `edgemem.quant.graph`) are quantized; outputs of MatMul/Gemm
are never quantized, so nothing downstream (gates, decays, norms, custom nodes, state) sees INT8.
The output directory is built beside its final place and renamed into it, like `edgemem export`.
"""  # noqa: E501

from __future__ import annotations

import datetime
import logging
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)

from edgemem import weights
from edgemem.errors import ConfigError, EdgememError, named
from edgemem.export.lower import leaves_last, read_table_in_place
from edgemem.files import check_output_dir, save_onnx, sha256, staged_directory, write_atomic
from edgemem.manifest import MANIFEST, ORT_TARGETS, PREFILL_LAST, STATE_INIT, TOKENIZER_DIR, Manifest
from edgemem.manifest import load as load_manifest
from edgemem.quant.graph import (
    PROJECTION_OPS,
    Projection,
    boundary_violations,
    embedding_tables,
    fold_transposed_weights,
    graph_bodies,
    isolate_inputs,
    projections,
    quantized_projections,
)
from edgemem.quant.recipe import Recipe, RecipeError, load_recipe

log = logging.getLogger(__name__)

METHODS = ("dynamic", "static", "int4")
BLOCK_SIZES = (16, 32, 64, 128, 256)  # MatMulNBits: a power of two, at least 16
DEFAULT_BLOCK = 32
ACCURACY_LEVEL = 4  # MatMulNBits on CPU: int8 activations per block inside the kernel (the fast path)
GRAPHS = ("prefill", "step")
# methods that quantize the projections inside Loop bodies too (the segment loop of a MAC or HOPE prefill), so
# that prefill and step run the same quantized projections; static QDQ cannot calibrate inside a Loop: there the
# loop's projections stay float, and the record and a warning say so
SUBGRAPH_METHODS = ("dynamic", "int4")


def default_out(directory: str | Path, method: str) -> Path:
    """Where `edgemem calibrate DIR --method M` writes by default: `DIR-int8-M` beside DIR (`DIR-int4` for int4)."""
    directory = Path(directory).resolve()
    return directory.with_name(f"{directory.name}-int4" if method == "int4" else f"{directory.name}-int8-{method}")


def block_size_for(method: str, block_size: int | None) -> int | None:
    """The int4 block size (default 32); None for the int8 methods, which take none."""
    if method != "int4":
        if block_size is not None:
            raise ConfigError(f"a block size applies to --method int4 only, not {method!r}")
        return None
    if block_size is None:
        return DEFAULT_BLOCK
    if block_size not in BLOCK_SIZES:
        raise ConfigError(
            f"int4 block size must be a power of two from 16 to 256 "
            f"({', '.join(map(str, BLOCK_SIZES))}); got {block_size}"
        )
    return block_size


def embeddings_for(method: str, embeddings: str | None) -> str:
    """How the embedding tables are stored: int4 (the int4 default) or fp32 (the only choice of the int8 methods)."""
    if embeddings not in (None, "int4", "fp32"):
        raise ConfigError(f"embeddings are stored as int4 or fp32, not {embeddings!r}")
    if method != "int4":
        if embeddings == "int4":
            int4 = named('method="int4"', "--method int4")
            raise ConfigError(f"4-bit embeddings come with {int4} only, not {method!r}")
        return "fp32"
    return embeddings or "int4"


class _Reader(CalibrationDataReader):
    """Feeds onnxruntime's calibrator a list of prepared inputs."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]):
        self.feeds = feeds
        self._iter: Iterator[dict[str, np.ndarray]] = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._iter, None)

    def __len__(self) -> int:
        return len(self.feeds)


def calibration_feeds(
    directory: Path,
    manifest: Manifest,
    recipe: Recipe,
    threads: int | None,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, list]:
    """Inputs of the prefill and step graphs at the recipe's positions: `streams` held-out streams of the
    recipe's task rolled out by the fp32 runtime (chunked prefill). The step sample is the next token, batched
    as one [streams, ...] feed per position; the prefill sample the next `prefill_tokens`, a feed per stream
    (onnxruntime's GroupQueryAttention, which updates a KV cache in place, takes T > 1 after a past for
    batch 1 only)."""
    from edgemem.runtime import Engine

    engine = Engine.load(directory, threads=threads, check_files=False)
    length = max(recipe.positions) + recipe.prefill_tokens
    tokens = recipe.make_task().stream(recipe.streams, length, recipe.seed).tokens
    streams = [engine.new_stream() for _ in range(recipe.streams)]
    feeds: dict[str, list] = {kind: [] for kind in GRAPHS}
    ids = manifest.inputs["tokens"]
    for position in recipe.positions:
        progress(f"calibration states to position {position:,}")
        if position > streams[0].position:
            for row, stream in zip(tokens, streams):
                stream.prefill(row[stream.position : position], all_logits=False)
        states = [s.state_dict() for s in streams]
        state = {spec.input: np.concatenate([st[spec.input] for st in states]) for spec in manifest.state}
        feeds["step"].append({ids: tokens[:, position : position + 1], **state})
        for row, st in zip(tokens, states):  # batch 1: the CPU's GroupQueryAttention takes T > 1 after a past
            sample = {ids: row[None, position : position + recipe.prefill_tokens]}
            feeds["prefill"].append({**sample, **{spec.input: st[spec.input] for spec in manifest.state}})
        log.info("calibration states at position %d", position)
    return feeds


def _loop_projections(paths: dict[tuple[str, str], Path], state_names: set[str]) -> dict[str, int]:
    """Per graph file, the projections inside Loop bodies (a MAC or HOPE prefill's segment loop)."""
    found = {}
    for (target, kind), path in paths.items():
        model = onnx.load(str(path), load_external_data=False)
        every = sum(p.quantizable for p in projections(model, state_names, subgraphs=True))
        if inside := every - sum(p.quantizable for p in projections(model, state_names)):
            found[f"{target}/{kind}.onnx"] = inside
    return found


def _select(
    paths: dict[tuple[str, str], Path],
    state_names: set[str],
    recipe: Recipe,
    *,
    matmul_only: bool = False,
    subgraphs: bool = False,
) -> tuple[dict[tuple[str, str], list[Projection]], dict[tuple[str, str], list[str]]]:
    """Every projection per (target, graph) and the node names to quantize (with `matmul_only`, for MatMulNBits:
    MatMul only, it has no Gemm form, but a weight read through a Transpose counts, and so does the tied head's
    Gemm, which `fold_transposed_weights` turns back into a MatMul); each recipe exclusion must
    name a projection of some graph."""
    models = {key: onnx.load(str(path), load_external_data=False) for key, path in paths.items()}
    found: dict[tuple[str, str], list[Projection]] = {
        key: projections(model, state_names, transposed=matmul_only, subgraphs=subgraphs)
        for key, model in models.items()
    }
    # fold_transposed_weights reaches the top-level graph only, not a segment Loop's body: where an export's
    # prefill is such a Loop, Gemm heads stay float in every graph, so that prefill and steps quantize alike
    looped = subgraphs and any(n.op_type == "Loop" for model in models.values() for n in model.graph.node)
    everything = [p for ps in found.values() for p in ps]
    unknown = [pattern for pattern in recipe.exclude if not any(p.matches(pattern) for p in everything)]
    if unknown:
        modules = sorted({p.module or p.node for p in everything})
        raise RecipeError(
            f"{recipe.source}: quantize.exclude names no MatMul/Gemm of this export: {', '.join(unknown)} "
            f"(known projections: {', '.join(modules)})"
        )
    selected = {
        key: [
            p.node
            for p in ps
            if p.quantizable
            and not any(p.matches(x) for x in recipe.exclude)
            and (not matmul_only or p.op_type == "MatMul" or (p.head and not looped))
        ]
        for key, ps in found.items()
    }
    return found, selected


class _QuietQuantizer(logging.Filter):
    """onnxruntime.quantization logs on the root logger (pre-processing advice, a line per tensor): debug here."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "onnxruntime" in record.pathname and record.levelno < logging.ERROR:
            log.debug("onnxruntime: %s", record.getMessage())
            return False
        return True


def _int4(source: Path, dest: Path, nodes: list[str], block_size: int, embeddings: bool) -> None:
    """MatMulNBits on `nodes` (the quantizer takes every MatMul it is not told to exclude); with `embeddings`,
    GatherBlockQuantized on the embedding tables."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    root.handlers[:], root.level = handlers, level  # its import calls logging.basicConfig(level=INFO): undo that
    chatty = logging.getLogger(MatMulNBitsQuantizer.__module__)  # a line per node at INFO
    chatty_level = chatty.level
    chatty.setLevel(logging.WARNING)
    try:
        model = onnx.load(str(source))
        fold_transposed_weights(model, nodes)  # a tied output head: MatMulNBits needs the weight as an initializer
        chosen = set(nodes)
        others = [
            n.name for nodes in graph_bodies(model) for n in nodes if n.op_type == "MatMul" and n.name not in chosen
        ]
        quantizer = MatMulNBitsQuantizer(
            model,
            bits=4,
            block_size=block_size,
            is_symmetric=False,
            accuracy_level=ACCURACY_LEVEL,
            nodes_to_exclude=others,
            op_types_to_quantize=("MatMul",),
        )
        quantizer.process()
        model = quantizer.model.model
        if embeddings:
            _embeddings_int4(model, quantizer.node_quantizer, block_size)
    finally:
        chatty.setLevel(chatty_level)
    save_onnx(model, dest)


def _embeddings_int4(model: onnx.ModelProto, quantizer: Any, block_size: int) -> int:
    """Each embedding Gather as `com.microsoft::GatherBlockQuantized` over 4-bit rows (modifies `model`).

    The table [V, H] is quantized as MatMulNBits quantizes a weight [K, N] = [H, V] (its transpose): uint8
    blocks [V, H/block, block/2] (low nibble first), scales [V, H/block], packed 4-bit zero points per row.
    GatherBlockQuantized (bits 4, quantize_axis 1) reads the same bytes as [V, H/2], [V, H/block] and
    [V, ceil(H/block / 2)], so a tied head's MatMulNBits, quantized from the same table, has byte-identical
    initializers and the weight store keeps one copy for both. Returns the number of tables quantized."""
    values = {i.name: i for i in model.graph.initializer}
    done = 0
    for node in embedding_tables(model):
        table = numpy_helper.to_array(values[node.input[0]])
        vocab, hidden = table.shape
        if hidden % block_size:
            log.warning(
                "embedding %s stays fp32: its width %d is not a multiple of the block size %d",
                node.input[0],
                hidden,
                block_size,
            )
            continue
        packed, scales, zero_points = quantizer.qbits_block_quant(np.ascontiguousarray(table.T))
        name = node.input[0]
        arrays = {
            f"{name}.q4": packed.reshape(vocab, hidden // 2),
            f"{name}.q4_scales": scales.reshape(vocab, hidden // block_size),
            f"{name}.q4_zero_points": zero_points.reshape(vocab, -1),
        }
        model.graph.initializer.extend(numpy_helper.from_array(a, n) for n, a in arrays.items())
        gathered = onnx.helper.make_node(
            "GatherBlockQuantized",
            [f"{name}.q4", node.input[1], f"{name}.q4_scales", f"{name}.q4_zero_points"],
            list(node.output),
            name=node.name,
            domain="com.microsoft",
            gather_axis=0,
            quantize_axis=1,
            block_size=block_size,
            bits=4,
        )
        gathered.metadata_props.extend(node.metadata_props)
        node.CopyFrom(gathered)
        done += 1
    read = {name for n in model.graph.node for name in n.input}
    kept = [i for i in model.graph.initializer if i.name in read]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    if done and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return done


def _quantize(
    method: str,
    source: Path,
    dest: Path,
    nodes: list[str],
    feeds: list | None,
    cache: Path,
    block_size: int | None = None,
    embeddings: str = "fp32",
    reduce_range: bool = False,
) -> None:
    """onnxruntime.quantization on `nodes`; static ranges come from `feeds`, or from `cache` when None.
    `reduce_range`: INT8 weights in 7 bits (see calibrate's module docstring)."""
    common = dict(
        op_types_to_quantize=list(PROJECTION_OPS),
        per_channel=True,
        nodes_to_quantize=nodes,
        weight_type=QuantType.QInt8,
        reduce_range=reduce_range,
    )
    quiet = _QuietQuantizer()
    logging.getLogger().addFilter(quiet)
    try:
        if method == "int4":
            _int4(source, dest, nodes, block_size or DEFAULT_BLOCK, embeddings == "int4")
            return
        if method == "dynamic":
            quantize_dynamic(source, dest, extra_options={"MatMulConstBOnly": True, "EnableSubgraph": True}, **common)
            return
        quantize_static(
            source,
            dest,
            _Reader(feeds) if feeds is not None else None,
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,
            calibration_cache_path=cache,
            extra_options={
                "ActivationSymmetric": True,
                "WeightSymmetric": True,
                "MatMulConstBOnly": True,
                "OpTypesToExcludeOutputQuantization": list(PROJECTION_OPS),
            },
            **common,
        )
    except Exception as e:  # noqa: BLE001 — onnxruntime.quantization raises varied exception types
        raise EdgememError(
            f"onnxruntime.quantization failed on {dest.parent.name}/{dest.name} ({method}): {type(e).__name__}: {e}"
        ) from e
    finally:
        logging.getLogger().removeFilter(quiet)


def _unlist(graph: onnx.GraphProto, names: set[str]) -> None:
    """Drop `names` from the graph's inputs (tables that `read_table_in_place` listed)."""
    kept = [v for v in graph.input if v.name not in names]
    del graph.input[:]
    graph.input.extend(kept)


def _tied_heads_back(graph: onnx.GraphProto) -> None:
    """quantize_dynamic rewrites every Gemm(x, W, transB=1) as MatMul(x, W_Transposed) over a transposed copy
    of W that it adds. A float MatMul left so (the tied head, which no recipe quantizes) goes back to
    Gemm(x, W, transB=1), reading the one table again, and the copy is dropped. Modifies `graph`."""
    inits = {t.name: t for t in graph.initializer}
    for node in graph.node:
        copy = node.input[1] if node.op_type == "MatMul" and len(node.input) == 2 else ""
        table = copy.removesuffix("_Transposed")
        if copy != table and table in inits and copy in inits and list(inits[copy].dims) == inits[table].dims[::-1]:
            gemm = onnx.helper.make_node(
                "Gemm", [node.input[0], table], list(node.output), name=node.name.removesuffix("_MatMul"), transB=1
            )
            gemm.metadata_props.extend(node.metadata_props)
            node.CopyFrom(gemm)
    read = {name for n in graph.node for name in n.input}
    kept = [t for t in graph.initializer if t.name in read or not t.name.endswith("_Transposed")]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def calibrate(
    directory: str | Path,
    method: str = "dynamic",
    recipe: str | Recipe | None = None,
    out: str | Path | None = None,
    *,
    force: bool = False,
    threads: int | None = 1,
    block_size: int | None = None,
    embeddings: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> Manifest:
    """Quantize the export in `directory` to INT8 or INT4 (see the module docstring); returns the new manifest.
    `embeddings` (int4 only): "int4" (the default) stores the embedding tables in 4-bit blocks
    (GatherBlockQuantized, sharing a tied head's blocks), "fp32" keeps them float. `progress(text)` hears of
    each stage."""
    progress = progress or (lambda _: None)
    directory = Path(directory)
    manifest = load_manifest(directory)
    if method not in METHODS:
        raise ConfigError(f"unknown quantization method {method!r}; choose from {', '.join(METHODS)}")
    block_size = block_size_for(method, block_size)
    embeddings = embeddings_for(method, embeddings)
    if manifest.quantization:
        raise EdgememError(
            f"{directory} is already quantized ({manifest.quantization['method']}); calibrate the fp32 export"
        )
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    if method == "static":
        recipe.check_vocabulary(manifest.arch, manifest.vocab_size)
        room = manifest.max_positions
        recipe = recipe.calibration_within(room)
        if not recipe.positions:
            raise RecipeError(
                f"recipe {recipe.source or recipe.name}: no calibration position leaves room for its "
                f"{recipe.prefill_tokens} prefill tokens in the export's {room:,} positions (its --max-length); "
                f"give [data] positions up to {room - recipe.prefill_tokens:,}, or export with a larger --max-length"
            )
    runnable = [t for t in ORT_TARGETS if t in manifest.targets]
    if not runnable:
        raise EdgememError(
            f"{directory} has no target onnxruntime can run (it has {', '.join(manifest.targets)}); "
            "calibration needs ort or generic"
        )
    targets = runnable + (["trt"] if method == "static" and "trt" in manifest.targets else [])
    if method == "int4" and "trt" in manifest.targets:
        log.warning(
            "int4 leaves the trt target out (MatMulNBits is an onnxruntime operator): TensorRT runs the "
            "float export, or INT8 with %s",
            named('method="static"', "--method static"),
        )
    elif method != "static" and "trt" in manifest.targets:
        log.warning(
            "%s leaves the trt target out (TensorRT needs explicit Q/DQ: use %s)",
            method,
            named('method="static"', "--method static"),
        )
    kinds = [k for k in (*GRAPHS, PREFILL_LAST) if manifest.graphs.get(k)]
    out = Path(out) if out is not None else default_out(directory, method)
    out = check_output_dir(out, force=force, inputs=[directory])

    state_names = {n for s in manifest.state for n in (s.input, s.output)}
    for target in targets:
        weights.check_single_link(directory / target)
    sources = {(t, k): directory / t / f"{k}.onnx" for t in targets for k in kinds if k in manifest.graphs_of(t)}
    found, selected = _select(
        sources, state_names, recipe, matmul_only=method == "int4", subgraphs=method in SUBGRAPH_METHODS
    )
    if not any(selected.values()):
        why = (
            f"quantize.exclude ({', '.join(recipe.exclude)}) keeps every one float"
            if recipe.exclude
            else "the export has none outside state and edgemem's ops"
        )
        raise RecipeError(
            f"{recipe.source or recipe.name}: nothing to quantize: {why}; the result would be the float export"
        )
    recipe.check_memory(manifest.state_bytes(), calibration=method == "static", drift=False)
    loop_float = {} if method in SUBGRAPH_METHODS else _loop_projections(sources, state_names)
    if loop_float:
        log.warning(
            "%s keeps the %d projections inside the prefill's segment Loop float (onnxruntime calibrates no "
            "Loop body): prefill runs them float, steps INT8; %s quantizes both",
            method,
            sum(loop_float.values()),
            named('method="dynamic"', "--method dynamic"),
        )
    feeds = calibration_feeds(directory, manifest, recipe, threads, progress) if method == "static" else None

    with staged_directory(out) as tmp:
        files: dict[str, str] = {}
        counts: dict[str, int] = {}
        tables: dict[str, int] = {}
        written: dict[str, list[Path]] = {target: [] for target in targets}
        for kind in kinds:
            cache = tmp / f".{kind}.calibration.json"  # ranges of the first target, reused by the others
            for i, target in enumerate(t for t in targets if (t, kind) in sources):
                dest = tmp / target / f"{kind}.onnx"
                dest.parent.mkdir(exist_ok=True)
                nodes = selected[(target, kind)]
                log.info("quantizing %s/%s: %d projections (%s)", target, kind, len(nodes), method)
                progress(f"quantizing {target}/{kind}.onnx ({len(nodes)} projections)")
                if nodes:
                    source = sources[(target, kind)]
                    listed = onnx.load(str(source), load_external_data=False).graph
                    in_place = {v.name for v in listed.input} & {t.name for t in listed.initializer}
                    if method == "static":  # QDQ rewires every reader of a quantized tensor: isolate them first
                        model = onnx.load(str(source))
                        isolate_inputs(model, nodes)
                        _unlist(model.graph, in_place)  # the calibration session would warn of each listed table
                        source = tmp / f".{target}-{kind}.isolated.onnx"
                        onnx.save(model, source)
                    samples = (
                        feeds["prefill" if kind == PREFILL_LAST else kind] if feeds is not None and i == 0 else None
                    )
                    _quantize(
                        method, source, dest, nodes, samples, cache, block_size, embeddings, target in ORT_TARGETS
                    )
                    if method == "static":
                        source.unlink()
                    # the quantizers sort the nodes again: the export's order of the state outputs' nodes back;
                    # the tied table is listed as an input again only where a float head still reads it (not int4)
                    model = onnx.load(str(dest), load_external_data=False)
                    if method == "dynamic":
                        _tied_heads_back(model.graph)
                    _unlist(model.graph, in_place)
                    if target in ORT_TARGETS:
                        read_table_in_place(model.graph)
                    leaves_last(model.graph)
                    onnx.save(model, str(dest))
                else:  # unchanged, its weights brought in from the source's store
                    save_onnx(onnx.load(str(sources[(target, kind)])), dest)
                tables[f"{target}/{kind}.onnx"] = _check(dest, state_names, len(nodes))
                counts[f"{target}/{kind}.onnx"] = len(nodes)
                written[target].append(dest)
            cache.unlink(missing_ok=True)
        stores = {}
        for target, paths in written.items():  # one weight store per target, as export writes it
            if (store := weights.share(tmp / target, paths)) is not None:
                stores[target] = store
                files[store["file"]] = sha256(tmp / store["file"])
            for path in paths:
                files[f"{target}/{path.name}"] = sha256(path)
        for name in manifest.files:  # what travels beside the graphs unchanged: the initial state, the tokenizer
            if name == STATE_INIT or name.startswith(f"{TOKENIZER_DIR}/"):
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(directory / name, tmp / name)
                files[name] = sha256(tmp / name)
        quantized = Manifest(
            arch=manifest.arch,
            config=dict(manifest.config),
            opset=manifest.opset,
            targets=targets,
            state=manifest.state,
            graphs=manifest.graphs,
            files=files,
            inputs=manifest.inputs,
            outputs=manifest.outputs,
            kv_cache=manifest.kv_cache,
            weights=stores or None,
            steps=manifest.steps,
            quantization=_record(
                directory, manifest, method, recipe, found, selected, counts, block_size, embeddings, tables
            ),
        )
        if loop_float:
            quantized.quantization["excluded"]["loop_projections_kept_float"] = loop_float
        if method == "int4":  # weight-only MatMulNBits is onnxruntime-genai's own format: it runs the int4 export
            from edgemem.export import genai

            quantized.genai, config = genai.entry(quantized)
            if config is not None:
                write_atomic(tmp / genai.GENAI_CONFIG, config)
                files[genai.GENAI_CONFIG] = sha256(tmp / genai.GENAI_CONFIG)
        write_atomic(tmp / MANIFEST, quantized.to_json().encode())
    log.info("wrote %s", out)
    return quantized


def _check(path: Path, state_names: set[str], expected: int) -> int:
    """The written graph keeps state and custom nodes float and quantizes every selected projection; returns
    the number of 4-bit embedding tables it reads."""
    model = onnx.load(str(path))
    problems = boundary_violations(model, state_names)
    if problems:
        raise EdgememError(f"{path.name}: quantization reached float-only tensors: {'; '.join(problems[:3])}")
    count = quantized_projections(model)
    if count != expected:
        raise EdgememError(f"{path.name}: {count} projections quantized, {expected} selected")
    return sum(n.op_type == "GatherBlockQuantized" for n in model.graph.node)


def _scheme(method: str, block_size: int | None, embeddings: str) -> dict[str, Any]:
    if method == "int4":
        return {
            "weights": f"int4 asymmetric blockwise (block {block_size} input rows, float scale, 4-bit zero point)",
            "activations": f"float in the graph; int8 per block inside MatMulNBits (accuracy_level {ACCURACY_LEVEL})",
            "ops": ["MatMul"],
            "block_size": block_size,
            "embeddings": "int4 blockwise along the hidden axis (GatherBlockQuantized; a tied head's MatMulNBits "
            "reads the same blocks)"
            if embeddings == "int4"
            else "fp32",
        }
    return {
        "weights": "int8 symmetric per-channel",
        "activations": "int8 dynamic per-tensor"
        if method == "dynamic"
        else "int8 symmetric per-tensor (QDQ, MinMax calibration)",
        "ops": list(PROJECTION_OPS),
    }


def _record(
    directory: Path,
    manifest: Manifest,
    method: str,
    recipe: Recipe,
    found: dict,
    selected: dict,
    counts: dict[str, int],
    block_size: int | None,
    embeddings: str,
    tables: dict[str, int],
) -> dict[str, Any]:
    """The manifest's record of how this export was quantized."""
    kept = {p.module or p.node for key, ps in found.items() for p in ps if p.node not in selected[key]}
    return {
        "method": method,
        "scheme": _scheme(method, block_size, embeddings),
        "recipe": recipe.to_dict(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": {"directory": str(directory.resolve()), "identity": manifest.identity()},
        "quantized_projections": counts,
        "quantized_embeddings": tables,
        "excluded": {
            "state": [s.input for s in manifest.state] + [s.output for s in manifest.state],
            "projections_kept_float": sorted(kept),
            "patterns": recipe.exclude,
        },
    }

"""`engines.json` and the TensorRT plugin library: what `edgemem build` records beside the engines
it writes (`write`), and what backend 'trt' checks before it loads them (`read`).

    {"format": "edgemem-engines/3",
     "library": {"module": "tensorrt_rtx", "version": "1.7.1.116", "compute_capabilities": ["SM86", "SM89"]},
     "plugins": {"file": "/abs/libedgemem_trt_plugins.so", "sha256": ...},
     "export": {"arch": ..., "identity": Manifest.identity(), "dtype": "fp32"},
     "max_batch": 1, "max_sequence": 2048,
     "shared": "profiles",
     "engines": {"step": {"file": "model.engine", "sha256": ..., "profile_index": 0,
                          "profile": {input: [min, opt, max]},
                          "in_place": [state inputs bound to one buffer for input and output],
                          "plugins": [{"op": "LinearAttention", "namespace": "edgemem", "version": "1"}, ...]},
                 "prefill": {"file": "model.engine", "sha256": ..., "profile_index": 1, ...},
                 "encoder": {"file": "encoder.engine", "sha256": ..., "profile_index": 0, ...}}}

"library" is the Python module that built the engines and must load them: "tensorrt" (compute
capabilities empty: the engine is for the GPU it was built on) or "tensorrt_rtx" (TensorRT for RTX,
built ahead of time for the listed compute capabilities). "plugins" per engine: the plugin layers
the ONNX parser made, i.e. which library implements each edgemem node (edgemem's, namespace "edgemem").
An encoder-decoder's engine set has an "encoder" engine too (no state: input ids and global mask in,
the cross keys and values the manifest's `encoder.fills` names out), in a file of its own (profile 0).

"engines" maps each graph kind to the engine file that serves it and the optimisation profile
(`profile_index`, with its shapes in "profile") a context must select to run it. "shared":
"profiles" when the decoder's kinds (step, prefill) name the same file: one engine, so one copy of
the weights, whose execution contexts (one per kind, each on its profile) serve both graphs; "none"
when each has an engine of its own. The encoder, with weights of its own, is always a file apart. A
reader deserializes each distinct file once and creates one execution context per kind on that
kind's profile. Format edgemem-engines/2 (one engine per
graph, one profile each, before "shared" and "profile_index") still reads, as "shared": "none"
with every profile_index 0.

`read` refuses, before TensorRT is touched, engines built from another export, engine files that
changed since, and (`plugin_library`) a plugin library other than the one they were built with.
Pure Python: imports neither TensorRT nor onnx.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from edgemem.errors import named
from edgemem.files import as_path, sha256, write_atomic
from edgemem.manifest import Manifest
from edgemem.runtime.errors import BackendError

ENGINES_DIR = "engines"
ENGINES_JSON = "engines.json"
FORMAT = "edgemem-engines/3"
ENCODER = "encoder"  # an encoder-decoder's encoder graph kind: an engine file of its own
SEPARATE_FORMAT = "edgemem-engines/2"  # one engine per graph: read as "shared": "none"
LIBRARIES = {"tensorrt": "TensorRT", "tensorrt_rtx": "TensorRT for RTX"}  # module → name
PLUGINS_ENV = "EDGEMEM_TRT_PLUGINS"


class Toolkit(NamedTuple):
    """What built the engines: the Python module (a key of LIBRARIES), its version, the target compute capabilities."""

    module: str
    version: str
    compute_capabilities: Sequence[str] = ()


def plugin_library(plugins: str | os.PathLike | None, built: Mapping[str, str] | None = None) -> Path:
    """The plugin library: `plugins`, else $EDGEMEM_TRT_PLUGINS. With `built` (engines.json's "plugins"
    record), it must be the library the engines were built with."""
    name = plugins or os.environ.get(PLUGINS_ENV)
    origin = (
        f"; the engines were built with {built['file']}"
        if built is not None
        else "; build it from plugins/ for this TensorRT major (plugins/README.md)"
    )
    if not name:
        raise BackendError(
            f"no plugin library: pass {named('plugins=PATH', '--plugins PATH')} or set "
            f"{PLUGINS_ENV}=PATH, PATH being libedgemem_trt_plugins.so{origin}"
        )
    path = Path(name)
    if not path.is_file():
        raise BackendError(f"plugin library {path} does not exist{origin}")
    if built is not None and sha256(path) != built["sha256"]:
        raise BackendError(
            f"plugin library {path} is not the one the engines were built with ({built['file']}, "
            f"sha256 {built['sha256'][:12]}); pass that library or rebuild the engines with this one"
        )
    return path


def load_plugins(trt: Any, library: Path) -> Any:
    """Register the library's plugin creators with TensorRT (module `trt`); its handle."""
    handle = trt.get_plugin_registry().load_library(str(library))
    if not handle:
        raise BackendError(f"TensorRT could not load the plugin library {library} (built for another TensorRT major?)")
    return handle


def entry(
    path: Path,
    index: int,
    profile: Mapping[str, list[list[int]]],
    in_place: Sequence[str],
    plugins: Sequence[Mapping[str, str]],
) -> dict[str, Any]:
    """The record of one graph: the engine file that serves it and its sha256, the index and shapes of the
    graph's optimisation profile in that engine, its in-place state inputs and the engine's plugin layers
    ({op, namespace, version} each)."""
    return {
        "file": path.name,
        "sha256": sha256(path),
        "profile_index": index,
        "profile": dict(profile),
        "in_place": list(in_place),
        "plugins": [dict(p) for p in plugins],
    }


def write(
    folder: Path,
    manifest: Manifest,
    toolkit: Toolkit,
    library: Path,
    max_batch: int,
    max_sequence: int,
    engines: Mapping[str, Mapping[str, Any]],
) -> Path:
    """Write FOLDER/engines.json atomically, after the engines (`entry` per graph kind)."""
    if toolkit.module not in LIBRARIES:
        raise ValueError(f"library {toolkit.module!r} is none of {', '.join(LIBRARIES)}")
    shared = "profiles" if len({record["file"] for record in decoder(engines).values()}) == 1 else "none"
    info = {
        "format": FORMAT,
        "library": {
            "module": toolkit.module,
            "version": toolkit.version,
            "compute_capabilities": list(toolkit.compute_capabilities),
        },
        "plugins": {"file": str(library.resolve()), "sha256": sha256(library)},
        "export": {
            "arch": manifest.arch,
            "identity": manifest.identity(),
            "dtype": manifest.config.get("dtype", "fp32"),
        },
        "max_batch": max_batch,
        "max_sequence": max_sequence,
        "shared": shared,
        "engines": dict(engines),
    }
    path = folder / ENGINES_JSON
    write_atomic(path, (json.dumps(info, indent=2) + "\n").encode())
    return path


def decoder(engines: Mapping[str, Any]) -> dict[str, Any]:
    """The records of the decoder's graph kinds (step, prefill): all but an encoder-decoder's encoder."""
    return {kind: record for kind, record in engines.items() if kind != ENCODER}


def _check_format(info: Any) -> None:
    """Every field the runtime reads is there (else ValueError naming the first one missing); an
    edgemem-engines/2 `info` gains its implied "shared" and "profile_index" fields."""
    found = info.get("format") if isinstance(info, dict) else None
    if found not in (FORMAT, SEPARATE_FORMAT):
        raise ValueError(f"format {found!r}, expected {FORMAT!r}")
    fields = {"library": dict, "plugins": dict, "export": dict, "max_batch": int, "max_sequence": int, "engines": dict}
    for key, kind in fields.items():
        if not isinstance(info.get(key), kind):
            raise ValueError(f"no {kind.__name__} {key!r}")
    if info["library"].get("module") not in LIBRARIES or not isinstance(info["library"].get("version"), str):
        raise ValueError(f"'library' needs a module ({' or '.join(LIBRARIES)}) and a version")
    if not {"file", "sha256"} <= info["plugins"].keys():
        raise ValueError("'plugins' needs file and sha256")
    for kind, record in info["engines"].items():
        if not isinstance(record, dict) or not {"file", "sha256", "profile", "in_place", "plugins"} <= record.keys():
            raise ValueError(f"engine {kind!r} needs file, sha256, profile, in_place and plugins")
        if found == SEPARATE_FORMAT:
            record["profile_index"] = 0
        elif type(record.get("profile_index")) is not int or record["profile_index"] < 0:
            raise ValueError(f"engine {kind!r} needs a profile_index (0, 1, ...)")
    if found == SEPARATE_FORMAT:
        info["shared"] = "none"
    records = list(info["engines"].values())
    by_file = {r["file"]: [q for q in records if q["file"] == r["file"]] for r in records}
    for file, served in by_file.items():
        if len({r["profile_index"] for r in served}) < len(served) or len({r["sha256"] for r in served}) > 1:
            raise ValueError(f"the graphs that {file} serves need distinct profile_index values and one sha256")
    encoder = info["engines"].get(ENCODER)
    if encoder is not None and len(by_file[encoder["file"]]) > 1:
        raise ValueError(f"the encoder's engine {encoder['file']} serves other graphs too")
    files = {r["file"] for r in decoder(info["engines"]).values()}
    if info.get("shared") != ("profiles" if len(files) == 1 else "none"):
        raise ValueError(f"'shared' is {info.get('shared')!r} for {len(files)} engine file(s)")


def read(directory: Path, manifest: Manifest, engines: str | os.PathLike | None = None) -> tuple[Path, dict[str, Any]]:
    """The engine folder (`engines`, else DIR/engines) and its engines.json, checked against the export
    in `directory` and against the engine files."""
    folder = as_path(engines, named("engines", "--engines")) if engines is not None else directory / ENGINES_DIR
    build = f"`edgemem build {directory} --plugins libedgemem_trt_plugins.so`"
    if not folder.is_dir():
        raise BackendError(f"{folder}: no TensorRT engines; build them with {build}")
    path = folder / ENGINES_JSON
    if not path.is_file():
        raise BackendError(f"{folder} has no {ENGINES_JSON} (engines from an older edgemem?); rebuild with {build}")
    try:
        info = json.loads(path.read_text())
        _check_format(info)
    except ValueError as e:  # json.JSONDecodeError is one
        raise BackendError(f"{path} is not a valid {ENGINES_JSON} ({e}); rebuild with {build}") from None
    if info["library"]["module"] == "tensorrt_rtx":
        build = f"`edgemem build {directory} --rtx --plugins libedgemem_trt_plugins.so`"
    source = info["export"]
    if source.get("identity") != manifest.identity():
        raise BackendError(
            f"{folder} holds engines built from another export (arch {source.get('arch')}, identity "
            f"{str(source.get('identity'))[:12]}); {directory} is {manifest.arch}, identity {manifest.identity()[:12]}: "  # noqa: E501
            f"rebuild with {build}"
        )
    for kind in ("step", *([ENCODER] if manifest.encoder else [])):
        if kind not in info["engines"]:
            raise BackendError(f"{path} lists no {kind} engine; rebuild with {build}")
    checked = set()
    for kind, record in info["engines"].items():
        file = folder / record["file"]
        if not file.is_file():
            raise BackendError(
                f"{folder}: the {kind} engine {record['file']} listed in {ENGINES_JSON} is missing; "
                f"rebuild with {build}"
            )
        if file not in checked and sha256(file) != record["sha256"]:
            raise BackendError(
                f"{file} does not match its sha256 in {ENGINES_JSON} (modified, or a build that did "
                f"not finish); rebuild with {build}"
            )
        checked.add(file)
    return folder, info


def files(folder: Path, info: Mapping[str, Any]) -> dict[Path, dict[str, int]]:
    """Each engine file to deserialize (once) → {graph kind it serves: the optimisation profile its context selects}."""
    found: dict[Path, dict[str, int]] = {}
    for kind, record in info["engines"].items():
        found.setdefault(folder / record["file"], {})[kind] = record["profile_index"]
    return found


def check_library_version(info: Mapping[str, Any], version: str) -> None:
    """Engines load only into the version of the library (engines.json's "library") that built them."""
    built = info["library"]
    if built["version"] != version:
        name = LIBRARIES[built["module"]]
        command = "edgemem build --rtx" if built["module"] == "tensorrt_rtx" else "edgemem build"
        raise BackendError(
            f"the engines were built by {name} {built['version']}, this is {name} {version}; rebuild "
            f"them with `{command}` here (engines are not portable across versions)"
        )


def in_place(info: Mapping[str, Any], kinds: Collection[str]) -> frozenset[str]:
    """State inputs bound to one buffer: those every engine of `kinds` may update in place."""
    sets = [set(info["engines"][k]["in_place"]) for k in kinds]
    return frozenset(set.intersection(*sets)) if sets else frozenset()


def check_profile(info: Mapping[str, Any], kind: str, shapes: Mapping[str, Sequence[int]]) -> None:
    """Every input shape lies inside the engine's optimisation profile."""
    for name, (lo, _, hi) in info["engines"][kind]["profile"].items():
        shape = shapes[name]
        if any(not a <= s <= b for s, a, b in zip(shape, lo, hi)):
            raise BackendError(
                f"the {kind} engine takes {name} from {lo} to {hi}, this run needs {list(shape)}; rebuild with "
                f"`edgemem build --max-batch N --max-sequence N` (built with --max-batch {info['max_batch']} "
                f"--max-sequence {info['max_sequence']})"
            )


def max_tokens(info: Mapping[str, Any], kind: str, tokens: str) -> int:
    """The longest token block one run of the `kind` engine takes (1 when its sequence dim is fixed)."""
    ranges = info["engines"][kind]["profile"].get(tokens)
    return ranges[2][1] if ranges else 1

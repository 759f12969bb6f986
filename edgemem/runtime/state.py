"""Stream state as numpy: a fresh stream's initial state, and state checkpoints.

Pure numpy + safetensors (no torch): `edgemem.export.verify` uses `initial_state` too.

Checkpoint format (`edgemem-state/1`): one safetensors file (no pickle) holding

    past_key_values.{layer}.{kind}   every state tensor of the stream, batch 1, as in edgemem.json;
                                     a preallocated KV cache (manifest `kv_cache`) only up to its
                                     filled length min(position, max_length), zero-padded on load
    logits                           float32 [vocab] — the next-token logits, when the stream has them
    __metadata__                     format, arch, identity (Manifest.identity(): a hash of the
                                     model files), position, sha256 (see `_checksum`)

`sha256` covers the other metadata and every tensor's name, dtype, shape and bytes, so a flipped
byte anywhere in the file is reported as corruption rather than, say, a state of another model.
Files are written with `edgemem.files.write_atomic` (temp file, fsync, rename).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save as save_safetensors

from edgemem.files import write_atomic
from edgemem.manifest import STATE_INIT, Manifest, ManifestError, StateSpec
from edgemem.runtime.errors import StateFileError

FORMAT = "edgemem-state/1"
LOGITS = "logits"
GROWING = "past_sequence"
MAX_POSITION = 2**62  # graphs take positions as int64; a stream this long would take centuries at any speed
ENCODED = "encoder_sequence"  # an encoder-decoder's cross keys/values: the encoded input's length, set per stream


def concrete_shape(spec: StateSpec, batch: int, past: int = 0, encoded: int = 0) -> list[int]:
    """The shape of one state tensor for `batch` rows, a KV cache of `past` tokens and an encoded input
    of `encoded` tokens."""
    sizes = {"batch": batch, GROWING: past, ENCODED: encoded}
    return [sizes[d] if isinstance(d, str) else int(d) for d in spec.shape]


def is_growing(spec: StateSpec) -> bool:
    """Whether the tensor's size is set per stream (a growing KV cache, cross keys/values): such states
    are rebound at every run instead of living in fixed buffers."""
    return GROWING in spec.shape or ENCODED in spec.shape


def variable_dim(spec: StateSpec) -> int:
    """The index of the per-stream dim of a growing state."""
    return next(i for i, d in enumerate(spec.shape) if d in (GROWING, ENCODED))


def initial_state(manifest: Manifest, directory: str | Path, batch: int = 1) -> dict[str, np.ndarray]:
    """Every state input of a fresh stream of `batch` rows, from the manifest (KV caches empty).

    States marked `"init": "file"` (Titans' learned memory) come from `state_init.safetensors`
    (stored with batch 1, broadcast to `batch`); the others start at zero.
    """
    directory = Path(directory)
    stored: dict[str, np.ndarray] = {}
    if any(s.init == "file" for s in manifest.state):
        path = directory / STATE_INIT
        if not path.is_file():
            raise ManifestError(f"{directory}: {STATE_INIT} is missing but edgemem.json says states start from it")
        try:
            stored = load_safetensors(path.read_bytes())
        except SafetensorError as e:
            raise ManifestError(f"{path} is not a valid safetensors file: {e}") from None
    state = {}
    for spec in manifest.state:
        shape = concrete_shape(spec, batch)
        if spec.init == "file":
            value = stored.get(spec.input)
            if value is None or list(value.shape[1:]) != shape[1:] or value.dtype != np.dtype(spec.dtype):
                raise ManifestError(
                    f"{directory / STATE_INIT}: {spec.input} is missing or not {spec.dtype} {spec.shape}"
                )
            if value.dtype.kind == "f" and not np.isfinite(value).all():
                raise ManifestError(f"{directory / STATE_INIT}: {spec.input} holds NaN or infinite values")
            state[spec.input] = np.ascontiguousarray(np.broadcast_to(value, shape))
        else:
            state[spec.input] = np.zeros(shape, dtype=spec.dtype)
    return state


@dataclass
class Checkpoint:
    state: dict[str, np.ndarray]
    position: int
    logits: np.ndarray | None


def _checksum(metadata: Mapping[str, str], tensors: Mapping[str, np.ndarray]) -> str:
    digest = hashlib.sha256(json.dumps({k: v for k, v in metadata.items() if k != "sha256"}, sort_keys=True).encode())
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        digest.update(json.dumps([name, array.dtype.str, list(array.shape)]).encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def _caches(manifest: Manifest, position: int) -> tuple[list[str], int]:
    """The preallocated KV-cache states and how many of their slots hold tokens at `position`."""
    kv = manifest.kv_cache
    return (list(kv["states"]), min(position, kv["max_length"])) if kv else ([], 0)


def check_position(
    manifest: Manifest, position: object, name: str = "position", error: type[Exception] = StateFileError
) -> int:
    """`position` if it is a place a stream of this export can be at: an integer in [0, MAX_POSITION), and no
    later than the end of a preallocated KV cache without a window."""
    integer = isinstance(position, (int, np.integer)) and not isinstance(position, (bool, np.bool_))
    if not integer or not 0 <= position < MAX_POSITION:
        raise error(f"{name} must be an integer in [0, 2**62); got {position!r}")
    kv = manifest.kv_cache
    if kv and kv["overflow"] == "error" and position > kv["max_length"]:
        raise error(f"{name} {position:,} is past the KV cache of max_length={kv['max_length']:,} tokens")
    return int(position)


def filled_part(manifest: Manifest, state: Mapping[str, np.ndarray], position: int) -> dict[str, np.ndarray]:
    """`state` with each preallocated KV cache cut to the slots that hold tokens at `position` (views)."""
    caches, filled = _caches(manifest, position)
    return {name: a[:, :, :filled] if name in caches else a for name, a in state.items()}


def padded(manifest: Manifest, state: Mapping[str, np.ndarray], position: int) -> dict[str, np.ndarray]:
    """The inverse of `filled_part`: each preallocated KV cache zero-padded to max_length slots."""
    caches, filled = _caches(manifest, position)
    full = dict(state)
    for spec in manifest.state:
        if spec.input in caches:
            full[spec.input] = np.zeros(concrete_shape(spec, 1), dtype=spec.dtype)
            full[spec.input][:, :, :filled] = state[spec.input]
    return full


def encode_checkpoint(
    manifest: Manifest, state: Mapping[str, np.ndarray], position: int, logits: np.ndarray | None
) -> bytes:
    tensors = {name: np.ascontiguousarray(a) for name, a in filled_part(manifest, state, position).items()}
    if logits is not None:
        tensors[LOGITS] = np.ascontiguousarray(logits, dtype=np.float32)
    metadata = {
        "format": FORMAT,
        "arch": manifest.arch,
        "identity": manifest.identity(),
        "position": str(int(position)),
    }
    metadata["sha256"] = _checksum(metadata, tensors)
    return save_safetensors(tensors, metadata=metadata)


def save_checkpoint(
    path: str | Path, manifest: Manifest, state: Mapping[str, np.ndarray], position: int, logits: np.ndarray | None
) -> None:
    """Write atomically: a crash leaves either the old file or the new one, never half of one."""
    path = Path(path)
    if path.is_dir():
        raise StateFileError(f"{path} is a directory; give a file name for the state checkpoint")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StateFileError(f"cannot write the state checkpoint {path}: {e.strerror} ({e.filename})") from None
    write_atomic(path, encode_checkpoint(manifest, state, position, logits))


def _header(data: bytes, where: str) -> dict:
    if len(data) < 8:
        raise StateFileError(f"{where} is not a valid edgemem state file (truncated: {len(data)} bytes)")
    size = int.from_bytes(data[:8], "little")
    if size > len(data) - 8:
        raise StateFileError(
            f"{where} is not a valid edgemem state file (truncated, or not safetensors at all: "
            f"its header claims {size} bytes, the file has {len(data)})"
        )
    try:
        header = json.loads(data[8 : 8 + size])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StateFileError(f"{where} is not a valid edgemem state file (corrupt header: {e})") from None
    if not isinstance(header, dict):
        raise StateFileError(f"{where} is not a valid edgemem state file (corrupt header)")
    return header


def decode_checkpoint(data: bytes, manifest: Manifest, where: str = "state file") -> Checkpoint:
    """Parse and check a checkpoint against `manifest`: integrity, identity, names, shapes, dtypes."""
    metadata = _header(data, where).get("__metadata__")
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        found = metadata.get("format") if isinstance(metadata, dict) else None
        raise StateFileError(
            f"{where} is not an edgemem state checkpoint, or its header is corrupt "
            f"(metadata format {found!r}, expected {FORMAT!r})"
        )
    try:
        tensors = load_safetensors(data)
    except SafetensorError as e:
        raise StateFileError(f"{where} is not a valid edgemem state file (corrupt or truncated: {e})") from None
    if metadata.get("sha256") != _checksum(metadata, tensors):
        raise StateFileError(f"{where} is corrupt: its checksum does not match its contents (modified or damaged)")
    if metadata.get("identity") != manifest.identity():
        raise StateFileError(
            f"{where} was saved from another model (arch {metadata.get('arch')}, identity "
            f"{str(metadata.get('identity'))[:12]}) — this export is {manifest.arch}, identity {manifest.identity()[:12]}"  # noqa: E501
        )
    try:
        position = int(metadata["position"])
        if not 0 <= position < MAX_POSITION:
            raise ValueError
    except (KeyError, ValueError):
        raise StateFileError(f"{where}: invalid position {metadata.get('position')!r}") from None
    position = check_position(manifest, position, f"{where}: position")
    logits = tensors.pop(LOGITS, None)
    caches, filled = _caches(manifest, position)
    for spec in manifest.state:
        array = tensors.get(spec.input)
        if spec.input in caches and array is not None:
            want = concrete_shape(spec, 1)
            if array.ndim != 4 or list(array.shape) != [*want[:2], filled, want[3]]:
                raise StateFileError(
                    f"{where}: {spec.input} has shape {list(array.shape)}, expected its filled part "
                    f"{[*want[:2], filled, want[3]]} at position {position}"
                )
            full = np.zeros(want, dtype=array.dtype)
            full[:, :, :filled] = array
            tensors[spec.input] = full
    check_state(manifest, tensors, where)
    if logits is not None and (logits.shape != (manifest.vocab_size,) or logits.dtype != np.float32):
        raise StateFileError(
            f"{where}: logits are {logits.dtype} {list(logits.shape)}, expected float32 [{manifest.vocab_size}]"
        )
    if logits is not None and not np.isfinite(logits).all():
        raise StateFileError(f"{where}: the logits hold NaN or infinite values")
    return Checkpoint(state=tensors, position=position, logits=logits)


def check_state(manifest: Manifest, state: Mapping[str, np.ndarray], where: str = "state") -> None:
    """The state of one stream (batch 1) matches the manifest: names, dtypes, shapes, cache lengths, finite values."""
    expected = [s.input for s in manifest.state]
    missing, unexpected = [n for n in expected if n not in state], sorted(set(state) - set(expected))
    if missing or unexpected:
        parts = [
            f"missing {', '.join(missing)}" if missing else "",
            f"unexpected {', '.join(unexpected)}" if unexpected else "",
        ]
        raise StateFileError(f"{where} does not hold this model's state tensors: {'; '.join(p for p in parts if p)}")
    lengths: dict[str, int] = {}
    for spec in manifest.state:
        array = state[spec.input]
        if not isinstance(array, np.ndarray):
            raise StateFileError(f"{where}: {spec.input} must be a numpy array; got {type(array).__name__}")
        if array.dtype != np.dtype(spec.dtype):
            raise StateFileError(f"{where}: {spec.input} is {array.dtype}, expected {spec.dtype}")
        if is_growing(spec) and array.ndim == len(spec.shape):
            symbol = spec.shape[variable_dim(spec)]
            length = array.shape[variable_dim(spec)]
            if lengths.setdefault(symbol, length) != length:
                raise StateFileError(
                    f"{where}: states of different {symbol} lengths ({lengths[symbol]} and {length} at {spec.input})"
                )
        want = concrete_shape(spec, 1, lengths.get(GROWING, 0), lengths.get(ENCODED, 0))
        if list(array.shape) != want:
            raise StateFileError(
                f"{where}: {spec.input} has shape {list(array.shape)}, expected {want} "
                f"(manifest: {spec.shape}, batch 1)"
            )
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise StateFileError(f"{where}: {spec.input} holds NaN or infinite values")

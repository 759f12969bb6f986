"""Engine and Stream: what every runtime backend shares.

A backend (`edgemem.runtime.ort`, `edgemem.runtime.trt`) provides device memory and graph runs:

- its engine opens the graphs (`_open`) and runs one step over a batch slot (`_run_batch`);
- its stream keeps one stream's fixed-size state in two sides of buffers, A and B (a backend may
  use one buffer for a tensor it can update in place), reads and writes them (`_own`, `_write`)
  and runs the step and prefill graphs from the current side into the other (`_run_step`,
  `_prefill_chunk`);
- its batch slot keeps the same for n streams as [n, ...] buffers (`row`, `_gather`, `_restore`).

Everything else is here: loading (`Engine.load` picks the backend in `BACKENDS` and imports its
module by name: the backends import this module, not the other way round), token checks, state
sizes, flipping sides and counting positions, prefill in chunks, fork, reset, checkpoints (any
backend reads any backend's), generation, and which streams a batch slot holds.
The prefix state cache (`edgemem.runtime.prefix`) hooks into `Stream.prefill`; speculative decoding
(`edgemem.runtime.speculative`) into `Stream.generate_iter`, through `_mark` / `_rollback` (a copy of
the state here; a backend may keep it in place) and `_run_block` (one graph run).

Batching (`Engine.step_batch`). A batch slot per batch size n (the last few sizes are kept) holds
[n, ...] state sides A and B, the batch-level form of a stream's ping-pong. The first batched step
of a set of streams copies their states into rows of the slot (gather); from then on their
fixed-size state lives there, and stepping the same streams in the same order again runs the other
side with no copy at all. A stream used on its own again (step, prefill) first copies its row back
(`Stream._sync`); reads (save, fork, state_dict) read the row; a slot gives its members their rows
back before it takes other streams or is dropped. Streams may be at different positions: every row
carries its own state (Titans and Longformer keep a per-row position tensor, and so does a
preallocated KV cache, manifest `kv_cache`).

Preallocated KV caches. They are fixed-size state like any other; a backend may keep them in one
buffer that the graph updates in place (manifest `kv_cache.in_place`). Past `max_length` a stream
is refused with `CacheFullError` before anything runs, unless the export keeps a sliding window
with attention sinks. Checkpoints hold only their filled part (`edgemem.runtime.state`); slots past
a stream's position are unspecified (the `ort` target's batch-1 step writes copies of its token
there, which the next tokens overwrite: `edgemem.export.lower`).

Threads. Every stream has a lock: step, prefill, save, fork, reset and state_dict hold it, so a
stream used from several threads runs one operation at a time and loses no step. `step_batch` holds
the locks of all its streams (taken in a fixed order, so batches never deadlock) and then the
engine's; a stream that another batch is stepping at that moment is refused with a BatchError
rather than waited for. Lock order everywhere: stream, then engine.
"""

from __future__ import annotations

import contextlib
import operator
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from importlib import import_module
from pathlib import Path
from typing import Any

import numpy as np

from edgemem import kinds
from edgemem.config import DEFAULT_CHUNK, finite, positive_int
from edgemem.config import seed as check_seed
from edgemem.errors import CacheFullError, ConfigError, named
from edgemem.files import as_path
from edgemem.manifest import Manifest
from edgemem.manifest import load as load_manifest
from edgemem.runtime.errors import BackendError, BatchError, StateFileError, TokenError
from edgemem.runtime.prefix import PrefixCache, Snapshot
from edgemem.runtime.sampling import check_sampling, sample
from edgemem.runtime.speculative import Draft, GenerationStats, PromptLookup, check_draft, speculate
from edgemem.runtime.state import (
    check_position,
    check_state,
    concrete_shape,
    decode_checkpoint,
    filled_part,
    initial_state,
    is_growing,
    padded,
    save_checkpoint,
)

TokenIds = Sequence[int] | np.ndarray | bytes | bytearray
# backend → "module:class" of its engine, imported when asked for (each needs its own library)
BACKENDS = {
    "ort": "edgemem.runtime.ort:OrtEngine",
    "ort-cuda": "edgemem.runtime.ort:OrtEngine",
    "trt": "edgemem.runtime.trt:TrtEngine",
}
LONG_PREFILL = 16  # chunks past which a prefill without a progress callback logs its progress
BATCH_SLOTS = 4  # batch sizes whose [n, ...] buffers an engine keeps


class Engine:
    """An exported model loaded into a backend; makes streams and steps batches of them.

    Use `Engine.load(directory, backend=...)`. One engine serves any number of streams.
    """

    backend: str
    target: str
    threads: int | None
    logits_dtype: np.dtype
    _max_tokens: int | None = None  # the longest token block one prefill run takes (None: any)

    def __init__(self, directory: Path, manifest: Manifest, chunk_size: int, has_prefill: bool):
        self.directory, self.manifest, self.chunk_size, self.has_prefill = directory, manifest, chunk_size, has_prefill
        self.vocab_size = manifest.vocab_size
        self.kind = kinds.get(manifest.kind)
        self._specs = list(manifest.state)
        self._fixed = [s for s in self._specs if not is_growing(s)]
        self._growing = [s for s in self._specs if is_growing(s)]
        self._written = [s for s in self._growing if s.output]  # a read-only state has no output
        self._read_only = [s for s in self._specs if not s.output]  # filled by the encoder, never written by a run
        self.grows = bool(self._growing)
        self._initial = initial_state(manifest, directory, 1)
        self._fixed_bytes = sum(self._initial[s.input].nbytes for s in self._fixed)
        self._growth = sum(  # bytes per token of the KV caches
            int(np.prod(concrete_shape(s, 1, 1))) * np.dtype(s.dtype).itemsize for s in self._growing
        )
        self._max_length = manifest.max_positions  # None: no limit
        self._slots: OrderedDict[int, BatchSlot] = OrderedDict()
        self._lock = threading.RLock()  # reentrant: a slot gives states back while a batch holds it
        self.prefix_cache: PrefixCache | None = None  # `Engine.load(prefix_cache_bytes=)`: `edgemem.runtime.prefix`

    @staticmethod
    def load(
        directory: str | Path,
        backend: str = "ort",
        target: str | None = None,
        threads: int | None = None,
        *,
        chunk_size: int = DEFAULT_CHUNK,
        check_files: bool = True,
        engines: str | Path | None = None,
        plugins: str | Path | None = None,
        prefix_cache_bytes: int | None = None,
    ) -> Engine:
        """Load the export in `directory` (its `edgemem.json`; every file's sha256 is checked).

        backend: "ort" (CPU), "ort-cuda" (onnxruntime's CUDA execution provider) or "trt" (the TensorRT
            engines of `edgemem build` in DIR/engines or `engines`, with the plugin library `plugins` or
            $EDGEMEM_TRT_PLUGINS: `edgemem.runtime.trt`).
        target: which lowered graphs to run; default "ort" if the export has it, else "generic".
        threads: onnxruntime intra-op threads (default: onnxruntime's choice, one per core).
        chunk_size: tokens per prefill-graph run.
        prefix_cache_bytes: keep snapshots of prefilled prompts in this many bytes and restore the longest
            cached prefix of a later prompt instead of prefilling it again (`edgemem.runtime.prefix`; off by default).
        """
        if backend not in BACKENDS:
            raise BackendError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
        if backend != "trt" and (engines is not None or plugins is not None):
            raise ConfigError(named("engines= and plugins= are for backend 'trt'", "--plugins is for --backend trt"))
        positive_int(chunk_size, "chunk_size")
        if prefix_cache_bytes is not None:
            positive_int(prefix_cache_bytes, named("prefix_cache_bytes", "--prefix-cache"))
        directory = as_path(directory, "directory")
        manifest = load_manifest(directory, check_files=check_files)
        if not manifest.graphs.get("step"):
            raise BackendError(
                f"{directory}: {manifest.arch} has no step graph (a bidirectional model does not "
                "stream); the runtime needs one"
            )
        module, name = BACKENDS[backend].split(":")
        engine = getattr(import_module(module), name)
        options = {"engines_dir": engines, "plugins": plugins} if backend == "trt" else {"backend": backend}
        engine = engine._open(directory, manifest, target, threads, chunk_size, **options)
        if prefix_cache_bytes is not None:
            smallest = engine.snapshot_bytes(1)
            if prefix_cache_bytes < smallest:
                raise ConfigError(
                    named("prefix_cache_bytes", "--prefix-cache") + f"={prefix_cache_bytes} is smaller "
                    f"than one snapshot of {manifest.arch}'s state ({smallest} bytes at position 1); give "
                    "at least that, or leave the prefix cache off"
                )
            engine.prefix_cache = PrefixCache(prefix_cache_bytes)
        return engine

    # ------------------------------------------------------------------ backend hooks
    def _new(self, state: Mapping[str, np.ndarray], position: int, logits: np.ndarray | None) -> Stream:
        """A stream of this backend from numpy state (batch 1)."""
        raise NotImplementedError

    def _new_slot(self, n: int) -> BatchSlot:
        raise NotImplementedError

    def _run_batch(self, slot: BatchSlot, streams: list[Stream], tokens: np.ndarray) -> np.ndarray:
        """One run of the step graph over `slot`'s current side (its members are `streams`); logits [n, V]."""
        raise NotImplementedError

    def _check_room(self, position: int, tokens: int) -> None:
        """Refuse `tokens` more at `position` past the end of a preallocated KV cache (exported without a window)."""
        if self._max_length is not None and position + tokens > self._max_length:
            raise CacheFullError(
                f"the KV cache holds max_length={self._max_length} tokens: a stream at position {position} cannot take "
                f"{tokens} more; export with a larger --max-length, or with --sinks S for a sliding window"
            )

    # ------------------------------------------------------------------ streams
    def _encode(self, input_ids: np.ndarray, global_attention_mask: np.ndarray) -> dict[str, np.ndarray]:
        """Run the encoder graph on one input ([1, S] each); the states it fills by input name."""
        raise BackendError(f"backend {self.backend!r} does not run encoder graphs; load the export with backend 'ort'")

    def _encoded_stream(self, input_ids: np.ndarray, global_attention_mask: np.ndarray) -> Stream:
        """A stream at position 0 whose read-only states are the encoder's outputs for one input ([1, S] each).
        Here: `_encode`'s arrays copied into a new stream; a backend may have the encoder write them in place."""
        fills = self._encode(input_ids, global_attention_mask)
        return self._new({s.input: fills.get(s.input, self._initial[s.input]) for s in self._specs}, 0, None)

    def new_stream(self) -> Stream:
        """A fresh stream at position 0 (Titans' memory starts from `state_init.safetensors`)."""
        if self.kind.streams == "encode":
            raise ConfigError(
                f"{self.manifest.arch} is an encoder-decoder: its streams start from an input, engine.encode(input_ids)"
            )
        stream = self._new(self._initial, 0, None)
        stream._fresh = True
        return stream

    def encode(self, input_ids: TokenIds, global_attention_mask: Sequence[int] | np.ndarray | None = None) -> Stream:
        """Encode one input (an encoder-decoder export) and return a decoder stream that has consumed the
        decoder start token: its logits are those of the first output token. `global_attention_mask`: one
        0/1 per input token (1: the token attends, and is attended by, every token); None: no global token."""
        if self.kind.streams != "encode":
            raise ConfigError(
                f"{self.manifest.arch} is a {self.kind.name} export: encode needs an encoder-decoder "
                "(an export with an encoder graph); start its streams with new_stream()"
            )
        ids = self._tokens(input_ids, "input")
        limit = self.manifest.encoder["max_length"]
        if ids.size > limit:
            raise TokenError(f"an input of {ids.size} tokens: the encoder takes 1 to {limit} (its positions)")
        if global_attention_mask is None:
            mask = np.zeros_like(ids)
        else:
            mask = np.asarray(global_attention_mask)
            if (
                mask.ndim != 1
                or mask.size != ids.size
                or mask.dtype.kind not in "biu"
                or not np.isin(mask, (0, 1)).all()
            ):
                raise TokenError(
                    f"global_attention_mask must hold one 0 or 1 per input token ({ids.size}); got "
                    f"{mask.dtype} of shape {list(mask.shape)}"
                )
            mask = mask.astype(np.int64)
        stream = self._encoded_stream(ids[None], mask[None])
        stream.step(int(self.manifest.config["decoder_start_token_id"]))
        return stream

    def load_stream(self, path: str | Path) -> Stream:
        """A stream restored from `Stream.save` (on any backend): refused unless it is this model's, intact
        and well-formed."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise StateFileError(f"{path}: no such state file") from None
        except OSError as e:
            raise StateFileError(f"{path}: cannot read ({e.strerror})") from None
        checkpoint = decode_checkpoint(data, self.manifest, str(path))
        return self._new(checkpoint.state, checkpoint.position, checkpoint.logits)

    def stream_from_state(
        self, state: Mapping[str, np.ndarray], position: int = 0, logits: np.ndarray | None = None
    ) -> Stream:
        """A stream from numpy state tensors of batch 1 (names as in edgemem.json), checked like a checkpoint."""
        if isinstance(position, (bool, np.bool_)) or not isinstance(position, (int, np.integer)) or position < 0:
            raise ConfigError(f"position must be a non-negative integer; got {position!r}")
        position = check_position(self.manifest, position, error=ConfigError)
        check_state(self.manifest, state)
        if logits is not None:
            logits = np.asarray(logits)
            if logits.shape != (self.vocab_size,) or not np.isfinite(logits).all():
                raise StateFileError(
                    f"logits must be {self.vocab_size} finite numbers; got {logits.dtype} {list(logits.shape)}"
                )
        return self._new(state, int(position), logits)

    def state_bytes(self, position: int = 0) -> int:
        """Bytes of one stream's state at `position` (constant unless the model has a KV cache)."""
        return self._fixed_bytes + self._growth * position

    @property
    def state_bytes_per_token(self) -> int:
        return self._growth

    def snapshot_bytes(self, position: int) -> int:
        """Bytes of one prefix-cache snapshot after `position` tokens: the state (preallocated KV caches up to
        their filled part), the next-token logits and the token ids."""
        state = filled_part(self.manifest, self._initial, position)
        return (
            sum(state[s.input].nbytes for s in self._fixed)
            + self._growth * position
            + self.vocab_size * np.dtype(self.logits_dtype).itemsize
            + 8 * position
        )

    def _room(self, position: int) -> int | None:
        """Tokens a stream at `position` can still take (None: no limit)."""
        return None if self._max_length is None else self._max_length - position

    # ------------------------------------------------------------------ batches
    def step_batch(self, streams: Sequence[Stream], token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """One token for each stream in one run of the step graph; returns logits [n, V].

        Streams may be at different positions. Equivalent to `stream.step(token)` for each stream
        (see the module docstring for where their states live meanwhile).
        """
        streams, tokens = self._check_batch(streams, token_ids)
        with contextlib.ExitStack() as held:
            for s in sorted(streams, key=id):  # one order for every batch: no deadlock between batches
                if not s._lock.acquire(blocking=False):
                    if s._in_batch:
                        raise BatchError(
                            f"step_batch: {s!r} is being stepped in another batch right now; a stream "
                            "takes part in one batch at a time"
                        )
                    s._lock.acquire()  # a single-stream operation: wait for it
                held.callback(s._lock.release)
            for s in streams:
                self._check_room(s._position, 1)
            for s in streams:
                s._in_batch = True
                held.callback(setattr, s, "_in_batch", False)
            with self._lock:
                slot = self._slot(len(streams))
                if not slot.holds(streams):
                    slot.adopt(streams)
                logits = self._run_batch(slot, streams, tokens)
                slot.side ^= 1  # the members' states are now the other side's rows
            for i, s in enumerate(streams):
                s._logits_view[0, 0] = logits[i]
                s._has_logits = True
                s._position += 1
        return logits

    def _slot(self, n: int) -> BatchSlot:
        slot = self._slots.get(n)
        if slot is None:
            slot = self._slots[n] = self._new_slot(n)
            while len(self._slots) > BATCH_SLOTS:
                self._slots.popitem(last=False)[1].release()
        else:
            self._slots.move_to_end(n)
        return slot

    def _check_batch(self, streams: Sequence[Stream], token_ids: Any) -> tuple[list[Stream], np.ndarray]:
        """The checked arguments of `step_batch`: distinct streams of this engine, one token id each."""
        streams = list(streams)
        n = len(streams)
        if n == 0:
            raise BatchError("step_batch needs at least one stream")
        if any(not isinstance(s, Stream) or s._engine is not self for s in streams):
            raise BatchError("step_batch: every stream must come from this engine (engine.new_stream())")
        if len({id(s) for s in streams}) != n:
            raise BatchError("step_batch: a stream appears more than once in the batch")
        tokens = self._tokens(token_ids, "batch's token ids")
        if tokens.size != n:
            raise BatchError(f"step_batch: {n} streams but {tokens.size} token ids")
        if self._read_only:
            lengths = sorted({s._input_length() for s in streams})
            if len(lengths) > 1:
                raise BatchError(
                    f"step_batch: these streams were encoded from inputs of {', '.join(map(str, lengths[:6]))}"
                    f"{'…' if len(lengths) > 6 else ''} tokens, and one run takes the cross keys and values of one "
                    "input length (the decoder graphs have no mask for padding); batch streams of equal input length"
                )
        return streams, tokens

    # ------------------------------------------------------------------ tokens
    def _token(self, token: Any) -> int:
        if type(token) is int and 0 <= token < self.vocab_size:  # the fast path
            return token
        if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)):
            raise TokenError(f"a token id must be an integer; got {type(token).__name__} {token!r}")
        token = operator.index(token)
        if not 0 <= token < self.vocab_size:
            raise TokenError(f"token id {token} is outside the vocabulary [0, {self.vocab_size})")
        return token

    def _tokens(self, token_ids: Any, what: str = "prompt") -> np.ndarray:
        if isinstance(token_ids, (bytes, bytearray, memoryview)):
            ids = np.frombuffer(bytes(token_ids), dtype=np.uint8).astype(np.int64)
        elif isinstance(token_ids, str):
            raise TokenError(f"the {what} is text: pass token ids (for a byte-level model, text.encode())")
        else:
            ids = np.asarray(token_ids)
            if ids.dtype == object or (ids.size and ids.dtype.kind not in "iu"):
                raise TokenError(f"the {what} must hold integer token ids; got dtype {ids.dtype}")
            ids = ids.astype(np.int64, copy=False).reshape(-1) if ids.ndim <= 1 else None
            if ids is None:
                raise TokenError(f"the {what} must be one sequence of token ids (1-D)")
        if ids.size == 0:
            raise TokenError(f"the {what} is empty: give at least one token")
        bad = np.flatnonzero((ids < 0) | (ids >= self.vocab_size))
        if bad.size:
            raise TokenError(
                f"token id {int(ids[bad[0]])} at index {int(bad[0])} of the {what} is outside the "
                f"vocabulary [0, {self.vocab_size})"
            )
        return ids

    def generate(
        self,
        prompt: bytes | str | Sequence[int],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        *,
        draft: Draft = None,
        draft_tokens: int = 4,
    ) -> bytes | list[int]:
        """Generate from a fresh stream (see `Stream.generate`)."""
        return self.new_stream().generate(
            prompt, max_new_tokens, temperature, top_k, top_p, seed, draft=draft, draft_tokens=draft_tokens
        )


class BatchSlot:
    """Batch-size-n state buffers of an engine (the backend's subclass allocates them) and the streams
    last batched there (`members`), whose fixed-size state are rows of the current side `side`."""

    def __init__(self, engine: Engine, n: int):
        self.engine, self.n, self.side = engine, n, 0
        self.members: list[weakref.ref[Stream]] = []

    # ------------------------------------------------------------------ backend hooks
    def row(self, name: str, index: int) -> np.ndarray:
        """Row `index` of state tensor `name` on the current side, as [1, ...] (a view where the memory allows)."""
        raise NotImplementedError

    def _gather(self, streams: list[Stream]) -> None:
        """Copy each stream's own fixed-size state into its row of the current side."""
        raise NotImplementedError

    def _restore(self, stream: Stream, index: int) -> None:
        """Copy row `index` back into the stream's own buffers."""
        for spec in self.engine._fixed:
            stream._write(spec.input, self.row(spec.input, index))

    # ------------------------------------------------------------------ members
    def holds(self, streams: list[Stream]) -> bool:
        return len(self.members) == len(streams) and all(s._slot is self and s._row == i for i, s in enumerate(streams))

    def adopt(self, streams: list[Stream]) -> None:
        """Make `streams` the members: their states become the current side's rows."""
        self.release()
        for s in streams:  # a member of another slot takes its state back first; that slot's row goes stale
            s._sync()
        self._gather(streams)
        for i, s in enumerate(streams):
            s._slot, s._row = self, i
        self.members = [weakref.ref(s) for s in streams]

    def release(self) -> None:
        """Give every member still here its state back (into its own buffers)."""
        for ref in self.members:
            stream = ref()
            if stream is not None and stream._slot is self:
                stream._sync()
        self.members = []


class Stream:
    """One sequence's state and position. Make it with `engine.new_stream()` or `engine.load_stream(path)`.

    A backend's subclass allocates the state buffers and `_logits_view` ([1, 1, V]: the next-token
    logits, which its step graph run writes), then calls `_assign`.
    """

    _logits_view: np.ndarray

    def __init__(self, engine: Engine):
        self._engine = engine
        self._side = 0  # which side of the stream's own buffers holds the state
        self._slot: BatchSlot | None = None  # set while the fixed-size state is a row of a batch slot
        self._row = 0
        self._position = 0
        self._has_logits = False
        self._lock = threading.RLock()  # one operation at a time (see the module docstring)
        self._in_batch = False  # set while a step_batch holds this stream
        self._fresh = (
            False  # the engine's initial state (new_stream, reset): at position 0, prefills use the prefix cache
        )
        self.generation = GenerationStats()  # of the last generate / generate_iter

    # ------------------------------------------------------------------ backend hooks
    def _own(self, name: str) -> np.ndarray:
        """One fixed-size state tensor in the stream's own buffers (current side), batch 1."""
        raise NotImplementedError

    def _write(self, name: str, value: np.ndarray) -> None:
        """Overwrite one fixed-size state tensor in the stream's own buffers (current side)."""
        raise NotImplementedError

    def _run_step(self, token: int) -> None:
        """Run the step graph from the current side to the other; the logits land in `_logits_view`."""
        raise NotImplementedError

    def _prefill_chunk(self, ids: np.ndarray, last_only: bool) -> np.ndarray:
        """Run the prefill graph on `ids` from the current side to the other; logits [T, V], or with `last_only`
        the last row [1, V] (a chunk's logits are T·V floats: 0.5 GB at T 512, V 248K, too many to copy unread)."""
        raise NotImplementedError

    def _input_length(self) -> int:
        """The length of the input an encoder-decoder stream was encoded from (its cross keys' encoder_sequence)."""
        raise NotImplementedError

    def _share(self, name: str) -> Any:
        """Read-only state `name` as a fork takes it: here a copy; a backend hands over its buffer instead,
        which `_assign` then keeps (no run writes a read-only state, so streams may share it)."""
        return np.array(self._read(name), copy=True)

    # ------------------------------------------------------------------ state
    def _read(self, name: str) -> np.ndarray:
        """The current value of one state tensor, batch 1 (a view on host memory: do not keep it across steps)."""
        if self._slot is not None:
            return self._slot.row(name, self._row)
        return self._own(name)

    def _sync(self) -> None:
        """Take the fixed-size state back from a batch slot before using the stream on its own."""
        slot = self._slot
        if slot is None:
            return
        with self._engine._lock:
            if self._slot is slot:
                slot._restore(self, self._row)
                self._slot = None

    def _assign(self, state: Mapping[str, np.ndarray], position: int, logits: np.ndarray | None) -> None:
        self._slot = None  # every tensor is overwritten: nothing to take back from a batch slot
        self._fresh = False
        for spec in self._engine._fixed:
            self._write(spec.input, state[spec.input])
        self._position = position
        self._has_logits = logits is not None
        if logits is not None:
            self._logits_view[0, 0] = logits

    def _advance(self, tokens: int, logits: np.ndarray | None = None) -> None:
        """After a run over the stream's own buffers: the state is on the other side, `tokens` later."""
        self._side ^= 1
        self._position += tokens
        if logits is not None:
            self._logits_view[0, 0] = logits
        self._has_logits = True

    def state_dict(self) -> dict[str, np.ndarray]:
        """A copy of every state tensor (batch 1), named as the graph inputs in edgemem.json."""
        return self._snapshot()[0]

    def _copy_state(self) -> dict[str, np.ndarray]:
        """A copy of every state tensor, preallocated KV caches up to their filled part."""
        state = filled_part(
            self._engine.manifest, {s.input: self._read(s.input) for s in self._engine._specs}, self._position
        )
        return {name: np.array(a, copy=True) for name, a in state.items()}

    def _capture(self, tokens: np.ndarray) -> Snapshot:
        """A prefix-cache snapshot of the state after `tokens`, all the tokens it consumed."""
        return Snapshot(
            tokens=np.array(tokens, dtype=np.int64), state=self._copy_state(), logits=self._logits_view[0, 0].copy()
        )

    def _mark(self, tokens: int, one_run: bool) -> Any:
        """Remember the state before `tokens` more (fed in one graph run if `one_run`), for `_rollback`. Here:
        a copy of the state; a backend may keep the state where it is instead."""
        self._sync()
        return self._copy_state(), self._position, self.logits

    def _rollback(self, mark: Any) -> None:
        """Back to the state `_mark` remembered."""
        state, position, logits = mark
        self._assign(padded(self._engine.manifest, state, position), position, logits)

    def _run_block(self, ids: Sequence[int]) -> np.ndarray:
        """Feed `ids` in one run of the prefill graph (steps without one); logits [T, V]."""
        if not self._engine.has_prefill:
            return np.stack([self.step(t) for t in ids])
        self._sync()
        rows = self._prefill_chunk(np.asarray(ids, dtype=np.int64), last_only=False)
        self._advance(len(ids), rows[-1])
        return rows

    def _snapshot(self) -> tuple[dict[str, np.ndarray], int, np.ndarray | None]:
        """Copies of the state, the position and the logits, read as one (a batch slot's rows included)."""
        with self._lock, self._engine._lock:
            state = {s.input: np.array(self._read(s.input), copy=True) for s in self._engine._specs}
            return state, self._position, self.logits

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def position(self) -> int:
        """Tokens consumed since the stream started (kept through save/load and fork)."""
        return self._position

    @property
    def state_bytes(self) -> int:
        """Bytes of this stream's state (constant for recurrent models; grows with a KV cache)."""
        return self._engine._fixed_bytes

    @property
    def logits(self) -> np.ndarray | None:
        """Logits [V] for the next token (after the last prefill or step), or None for a fresh stream."""
        return self._logits_view[0, 0].copy() if self._has_logits else None

    # ------------------------------------------------------------------ running
    def step(self, token_id: int) -> np.ndarray:
        """Consume one token; returns the logits [V] for the next one."""
        token = self._engine._token(token_id)
        with self._lock:
            self._engine._check_room(self._position, 1)
            if self._slot is not None:
                self._sync()
            self._run_step(token)
            self._advance(1)
            return self._logits_view[0, 0].copy()

    def prefill(
        self,
        token_ids: TokenIds,
        *,
        chunk_size: int | None = None,
        all_logits: bool = True,
        progress: Callable[[int], None] | None = None,
    ) -> np.ndarray:
        """Consume a block of tokens; returns logits [T, V] (or only the last row [V] with `all_logits=False`).

        Runs the prefill graph on chunks of `chunk_size` tokens (default: the engine's), or steps
        through the tokens when the export has no prefill graph. Prefilling in chunks equals prefilling
        at once (the stateful protocol's law), and keeps activations and logits bounded. With the
        engine's prefix cache, a fresh stream snapshots its state after each chunk, and (with
        `all_logits=False`) first restores the longest cached prefix of the tokens (`edgemem.runtime.prefix`).
        `progress(n)` is called after each chunk (or token) with the number of tokens it consumed; without
        it, a prefill of more than LONG_PREFILL chunks reports on the `edgemem.progress` logger.
        """
        engine = self._engine
        ids = engine._tokens(token_ids)
        chunk = positive_int(engine.chunk_size if chunk_size is None else chunk_size, "chunk_size")
        if progress is None and ids.size > LONG_PREFILL * chunk:
            from edgemem.progress import track

            with track(f"prefill of {ids.size:,} tokens", ids.size, terminal=False) as bar:
                return self.prefill(
                    ids, chunk_size=chunk, all_logits=all_logits, progress=lambda n: bar.update(advance=n)
                )
        rows: list[np.ndarray] = []
        with self._lock:
            engine._check_room(self._position, ids.size)
            if not engine.has_prefill:
                for token in ids.tolist():
                    logits = self.step(token)
                    if progress:
                        progress(1)
                    if all_logits:
                        rows.append(logits)
                return np.stack(rows) if all_logits else logits
            if engine._max_tokens is not None:
                chunk = min(chunk, engine._max_tokens)
            self._sync()
            cache = engine.prefix_cache if self._fresh and self._position == 0 else None
            begin = 0
            if cache is not None and not all_logits:  # a hit has no logits for the tokens it skips
                hit = cache.longest(ids)
                if hit is not None:
                    self._assign(padded(engine.manifest, hit.state, hit.tokens.size), hit.tokens.size, hit.logits)
                    begin = hit.tokens.size
                    if progress:
                        progress(begin)
            for start in range(begin, ids.size, chunk):
                piece = ids[start : start + chunk]
                part = self._prefill_chunk(piece, last_only=not all_logits)
                self._advance(piece.size, part[-1])
                if cache is not None:
                    cache.put(self._capture(ids[: start + piece.size]))
                if progress:
                    progress(piece.size)
                if all_logits:
                    rows.append(part)
            return np.concatenate(rows) if all_logits else self._logits_view[0, 0].copy()

    # ------------------------------------------------------------------ lifecycle
    def fork(self) -> Stream:
        """An independent copy: same state, position and next-token logits, its own buffers. Read-only states
        (an encoder-decoder's cross keys and values, which no run writes) are shared with the fork (`_share`)."""
        engine = self._engine
        with self._lock, engine._lock:
            state = {
                s.input: np.array(self._read(s.input), copy=True) if s.output else self._share(s.input)
                for s in engine._specs
            }
            position, logits = self._position, self.logits
        return engine._new(state, position, logits)

    def reset(self) -> None:
        """Back to a fresh stream at position 0 (buffers are reused)."""
        if self._engine.kind.streams == "encode":
            raise ConfigError(
                f"{self._engine.manifest.arch} is an encoder-decoder: a stream starts from its input, not empty; "
                "start another with engine.encode(input_ids)"
            )
        with self._lock, self._engine._lock:
            self._assign(self._engine._initial, 0, None)
            self._fresh = True

    def save(self, path: str | Path) -> None:
        """Checkpoint to a safetensors file, atomically (see `edgemem.runtime.state`)."""
        save_checkpoint(path, self._engine.manifest, *self._snapshot())

    # ------------------------------------------------------------------ generation
    def _eos(self, eos_token_id: int | None) -> int | None:
        """The token that ends generation: the one given, else an encoder-decoder's (its config); None: none."""
        if eos_token_id is not None:
            return self._engine._token(eos_token_id)
        return self._engine.manifest.config.get("eos_token_id") if self._engine.kind.streams == "encode" else None

    def generate_iter(
        self,
        prompt: bytes | str | Sequence[int] = b"",
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        *,
        draft: Draft = None,
        draft_tokens: int = 4,
        eos_token_id: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> Iterator[int]:
        """Yield new token ids one by one. Each yielded token has already been fed to the stream, so
        stopping early leaves a stream ready to continue. An empty prompt continues from the stream's
        last logits (e.g. after `engine.load_stream`). `progress` is the prompt's prefill progress.
        Generation ends after the end token, if there is one (`eos_token_id`, or an encoder-decoder's).

        draft: speculative decoding (`edgemem.runtime.speculative`): "prompt-lookup" proposes the
            `draft_tokens` tokens that followed the latest earlier occurrence of the last few tokens (of the
            prompt and the output), an `Engine` of the same vocabulary (a smaller export) generates them;
            one prefill-graph run of this stream checks them all. Greedy output is the same as without a
            draft; sampled output has the same distribution. `self.generation` has the statistics.
        """
        eos = self._eos(eos_token_id)
        if draft is not None and eos is not None:
            raise ConfigError(
                "speculative decoding runs to max_new_tokens: give no end token (eos_token_id) with a draft"
            )
        check_sampling(temperature, top_k, top_p)
        finite(temperature, "temperature")
        if seed is not None:
            check_seed(seed)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be a non-negative integer; got {max_new_tokens!r}")
        check_draft(draft, draft_tokens, self._engine, Engine)
        if isinstance(prompt, str):
            if self._engine.vocab_size != 256:
                raise TokenError("text prompts need a byte-level model (vocab 256); pass token ids")
            prompt = prompt.encode()
        ids = self._engine._tokens(prompt) if len(prompt) else np.zeros(0, dtype=np.int64)
        stats = self.generation = GenerationStats(prompt_tokens=int(ids.size))
        start = time.perf_counter()
        if ids.size:
            logits = self.prefill(ids, all_logits=False, progress=progress)
        elif self._has_logits:
            logits = self._logits_view[0, 0].copy()
        else:
            raise TokenError("nothing to continue from: the stream is fresh, give a prompt")
        stats.prefill_s = time.perf_counter() - start
        rng = np.random.default_rng(seed)
        if draft is None:
            start = time.perf_counter()
            for _ in range(max_new_tokens):
                token = sample(logits, temperature, top_k, top_p, rng)
                stats.tokens += 1
                if token == eos:
                    stats.decode_s = time.perf_counter() - start
                    yield token
                    return
                logits = self.step(token)
                stats.decode_s = time.perf_counter() - start
                yield token
            return
        drafter = PromptLookup(ids.tolist()) if isinstance(draft, str) else draft.new_stream()
        if not isinstance(draft, str) and ids.size:
            drafter.prefill(ids, all_logits=False)
        yield from speculate(
            self, logits, drafter, draft_tokens, max_new_tokens, (temperature, top_k, top_p), rng, stats
        )

    def generate(
        self,
        prompt: bytes | str | Sequence[int] = b"",
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        *,
        draft: Draft = None,
        draft_tokens: int = 4,
        num_beams: int = 1,
        length_penalty: float = 1.0,
        early_stopping: bool = True,
        eos_token_id: int | None = None,
    ) -> bytes | list[int]:
        """The new tokens after `prompt`: bytes for a byte-level model (vocab 256), else a list of ids.
        Greedy at temperature 0; otherwise sampled with top-k / top-p, reproducibly with `seed`; `draft`
        and `draft_tokens`: speculative decoding (`generate_iter`). With `num_beams` > 1, beam search
        (`beam_search`), which leaves this stream as it was."""
        if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
            raise ConfigError(f"num_beams must be an integer >= 1 (1: no beam search); got {num_beams!r}")
        if num_beams > 1:
            if temperature:
                raise ConfigError("beam search here is deterministic: give temperature 0 with num_beams > 1")
            if draft is not None:
                raise ConfigError("beam search takes no draft: give num_beams 1 for speculative decoding")
            if len(prompt):
                self.prefill(prompt, all_logits=False)
            return self.beam_search(
                max_new_tokens,
                num_beams,
                length_penalty=length_penalty,
                early_stopping=early_stopping,
                eos_token_id=eos_token_id,
            )
        tokens = list(
            self.generate_iter(
                prompt,
                max_new_tokens,
                temperature,
                top_k,
                top_p,
                seed,
                draft=draft,
                draft_tokens=draft_tokens,
                eos_token_id=eos_token_id,
            )
        )
        return bytes(tokens) if self._engine.vocab_size == 256 else tokens

    def beam_search(
        self,
        max_new_tokens: int,
        num_beams: int,
        *,
        length_penalty: float = 1.0,
        early_stopping: bool = True,
        eos_token_id: int | None = None,
    ) -> list[int]:
        """The best of `num_beams` beams continuing from this stream's logits, as transformers' beam search
        defines it: each round keeps the 2·num_beams best continuations of every beam by summed log
        probability; one ending in the end token among the first num_beams of them is a finished
        hypothesis scored sum / length^length_penalty (length: tokens generated, the end token included),
        and the best num_beams of the others run on. With `early_stopping` the search ends once num_beams
        hypotheses are finished; at `max_new_tokens` the running beams finish too. Beams are forks of
        this stream stepped as one batch (`Engine.step_batch`); the stream itself is left as it was."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be a positive integer; got {max_new_tokens!r}")
        eos = self._eos(eos_token_id)
        if not self._has_logits:
            raise TokenError("nothing to continue from: the stream is fresh, give a prompt")
        engine, keep = self._engine, 2 * num_beams
        beams: list[Stream] = [self.fork()]
        logits = self.logits[None]
        sequences: list[list[int]] = [[]]
        scores = np.zeros(1)
        finished: list[tuple[float, list[int]]] = []
        for length in range(1, max_new_tokens + 1):
            shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
            log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True)) + scores[:, None]
            flat = log_probs.reshape(-1)
            top = np.argsort(-flat, kind="stable")[:keep]
            vocab = logits.shape[-1]
            last = length == max_new_tokens
            running: list[tuple[float, int, int]] = []
            for rank, index in enumerate(top.tolist()):
                beam, token, score = index // vocab, index % vocab, float(flat[index])
                if token == eos or last:
                    if rank < num_beams:
                        finished.append((score / length**length_penalty, sequences[beam] + [token]))
                elif len(running) < num_beams:
                    running.append((score, beam, token))
            finished.sort(key=lambda f: -f[0])
            del finished[num_beams:]
            if last or not running or (early_stopping and len(finished) >= num_beams):
                break
            claimed: set[int] = set()
            step: list[Stream] = []
            for _, beam, _ in running:  # forks first: a beam continued twice is copied before it steps
                step.append(beams[beam] if beam not in claimed else beams[beam].fork())
                claimed.add(beam)
            sequences = [sequences[beam] + [token] for _, beam, token in running]
            scores = np.array([score for score, _, _ in running])
            beams = step
            logits = engine.step_batch(beams, [token for _, _, token in running])
        return finished[0][1] if finished else []

    def __repr__(self) -> str:
        return f"Stream({self._engine.manifest.arch}, position={self._position}, state_bytes={self.state_bytes})"

"""What every runtime backend shares: token checks, state sizes, prefill in chunks, checkpoints and
generation. A backend's engine and stream subclass these and provide the rest (see each class)."""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edgemem.errors import ConfigError
from edgemem.manifest import Manifest
from edgemem.runtime.errors import BatchError, StateFileError, TokenError
from edgemem.runtime.sampling import check_sampling, sample
from edgemem.runtime.state import check_state, decode_checkpoint, save_checkpoint

TokenIds = Sequence[int] | np.ndarray | bytes | bytearray
DEFAULT_CHUNK = 512  # tokens per prefill-graph run


class EngineBase:
    """An exported model loaded into a backend. Subclasses set `manifest`, `vocab_size`,
    `chunk_size`, `has_prefill`, `_specs` (the manifest's StateSpecs), `_initial` (a fresh stream's
    state, batch 1), `_fixed_bytes` and `_growth` (bytes per token of KV caches), and implement
    `_new` (their stream from numpy state)."""

    manifest: Manifest
    vocab_size: int
    chunk_size: int
    has_prefill: bool
    _initial: dict[str, np.ndarray]

    def _new(self, state: Mapping[str, np.ndarray], position: int, logits: np.ndarray | None) -> StreamBase:
        raise NotImplementedError

    def new_stream(self) -> StreamBase:
        """A fresh stream at position 0 (Titans' memory starts from `state_init.safetensors`)."""
        return self._new(self._initial, 0, None)

    def load_stream(self, path: str | Path) -> StreamBase:
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

    def stream_from_state(self, state: Mapping[str, np.ndarray], position: int = 0,
                          logits: np.ndarray | None = None) -> StreamBase:
        """A stream from numpy state tensors of batch 1 (names as in edgemem.json), checked like a checkpoint."""
        check_state(self.manifest, state)
        return self._new(state, int(position), logits)

    def state_bytes(self, position: int = 0) -> int:
        """Bytes of one stream's state at `position` (constant unless the model has a KV cache)."""
        return self._fixed_bytes + self._growth * position

    @property
    def state_bytes_per_token(self) -> int:
        return self._growth

    def _token(self, token: Any) -> int:
        if type(token) is int and 0 <= token < self.vocab_size:  # the fast path
            return token
        if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)):
            raise TokenError(f"a token id must be an integer; got {type(token).__name__} {token!r}")
        token = operator.index(token)
        if not 0 <= token < self.vocab_size:
            raise TokenError(f"token id {token} is outside the vocabulary [0, {self.vocab_size})")
        return token

    def _check_batch(self, streams: Sequence[StreamBase], token_ids: Any) -> tuple[list[StreamBase], np.ndarray]:
        """The checked arguments of `step_batch`: distinct streams of this engine, one token id each."""
        streams = list(streams)
        n = len(streams)
        if n == 0:
            raise BatchError("step_batch needs at least one stream")
        if any(not isinstance(s, StreamBase) or s._engine is not self for s in streams):
            raise BatchError("step_batch: every stream must come from this engine (engine.new_stream())")
        if len({id(s) for s in streams}) != n:
            raise BatchError("step_batch: a stream appears more than once in the batch")
        tokens = self._tokens(token_ids, "batch's token ids")
        if tokens.size != n:
            raise BatchError(f"step_batch: {n} streams but {tokens.size} token ids")
        return streams, tokens

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
            raise TokenError(f"token id {int(ids[bad[0]])} at index {int(bad[0])} of the {what} is outside the "
                             f"vocabulary [0, {self.vocab_size})")
        return ids

    def generate(self, prompt: bytes | str | Sequence[int], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None) -> bytes | list[int]:
        """Generate from a fresh stream (see `Stream.generate`)."""
        return self.new_stream().generate(prompt, max_new_tokens, temperature, top_k, top_p, seed)


class StreamBase:
    """One stream of tokens through an engine. Subclasses set `_engine`, `_position`,
    `_has_logits` and `_logits_view` ([1, 1, V], the next-token logits), and implement `_read`
    (one state tensor, batch 1), `step` and `_prefill_chunk` (tokens → logits [T, V])."""

    _engine: EngineBase
    _position: int
    _has_logits: bool
    _logits_view: np.ndarray

    def _read(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def step(self, token_id: int) -> np.ndarray:
        raise NotImplementedError

    def _prefill_chunk(self, ids: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def state_dict(self) -> dict[str, np.ndarray]:
        """A copy of every state tensor (batch 1), named as the graph inputs in edgemem.json."""
        return {s.input: np.array(self._read(s.input), copy=True) for s in self._engine._specs}

    @property
    def engine(self) -> EngineBase:
        return self._engine

    @property
    def position(self) -> int:
        """Tokens consumed since the stream started (kept through save/load and fork)."""
        return self._position

    @property
    def logits(self) -> np.ndarray | None:
        """Logits [V] for the next token (after the last prefill or step), or None for a fresh stream."""
        return self._logits_view[0, 0].copy() if self._has_logits else None

    def prefill(self, token_ids: TokenIds, *, chunk_size: int | None = None, all_logits: bool = True) -> np.ndarray:
        """Consume a block of tokens; returns logits [T, V] (or only the last row [V] with `all_logits=False`).

        Runs the prefill graph on chunks of `chunk_size` tokens (default: the engine's), or steps
        through the tokens when the export has no prefill graph.
        """
        engine = self._engine
        ids = engine._tokens(token_ids)
        chunk = chunk_size or engine.chunk_size
        if not isinstance(chunk, int) or chunk < 1:
            raise ConfigError(f"chunk_size must be a positive integer; got {chunk!r}")
        rows: list[np.ndarray] = []
        if not engine.has_prefill:
            for token in ids.tolist():
                logits = self.step(token)
                if all_logits:
                    rows.append(logits)
            return np.stack(rows) if all_logits else logits
        for start in range(0, ids.size, chunk):
            part = self._prefill_chunk(ids[start : start + chunk])
            if all_logits:
                rows.append(part)
        return np.concatenate(rows) if all_logits else self._logits_view[0, 0].copy()

    def save(self, path: str | Path) -> None:
        """Checkpoint to a safetensors file, atomically (see `edgemem.runtime.state`)."""
        save_checkpoint(path, self._engine.manifest, {s.input: self._read(s.input) for s in self._engine._specs},
                        self._position, self.logits)

    def generate_iter(self, prompt: bytes | str | Sequence[int] = b"", max_new_tokens: int = 64,
                      temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                      seed: int | None = None) -> Iterator[int]:
        """Yield new token ids one by one. Each yielded token has already been fed to the stream, so
        stopping early leaves a stream ready to continue. An empty prompt continues from the stream's
        last logits (e.g. after `engine.load_stream`)."""
        check_sampling(temperature, top_k, top_p)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be a non-negative integer; got {max_new_tokens!r}")
        if isinstance(prompt, str):
            if self._engine.vocab_size != 256:
                raise TokenError("text prompts need a byte-level model (vocab 256); pass token ids")
            prompt = prompt.encode()
        if len(prompt):
            logits = self.prefill(prompt, all_logits=False)
        elif self._has_logits:
            logits = self._logits_view[0, 0].copy()
        else:
            raise TokenError("nothing to continue from: the stream is fresh, give a prompt")
        rng = np.random.default_rng(seed)
        for _ in range(max_new_tokens):
            token = sample(logits, temperature, top_k, top_p, rng)
            logits = self.step(token)
            yield token

    def generate(self, prompt: bytes | str | Sequence[int] = b"", max_new_tokens: int = 64, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None) -> bytes | list[int]:
        """The new tokens after `prompt`: bytes for a byte-level model (vocab 256), else a list of ids.
        Greedy at temperature 0; otherwise sampled with top-k / top-p, reproducibly with `seed`."""
        tokens = list(self.generate_iter(prompt, max_new_tokens, temperature, top_k, top_p, seed))
        return bytes(tokens) if self._engine.vocab_size == 256 else tokens

    def __repr__(self) -> str:
        return f"Stream({self._engine.manifest.arch}, position={self._position}, state_bytes={self.state_bytes})"

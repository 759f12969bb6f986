"""Live streams keyed by sequence (correlation) id, bounded in number, evicted to checkpoints when idle.

What the Triton Python-backend model runs, with no Triton in it (numpy + edgemem.runtime only):

- a request carries a sequence id, its token ids and the START / END flags; one token is a step
  (`Stream.step`), several are a prompt (`Stream.prefill`), exactly as a stream run alone; none
  returns the sequence's next-token logits again (e.g. for a client that resumes);
- START begins a fresh stream (replacing one of the same id); a request without START continues
  the live stream of that id, or restores it from its checkpoint file; neither → `SequenceError`;
- at most `max_live` streams stay in memory: when another one is needed, the least recently used is
  saved to `checkpoints/<id>.safetensors` (edgemem's state checkpoint: atomic, checked on load) and
  dropped; streams idle for `idle_seconds` are evicted the same way;
- END answers the request, then forgets the stream and removes its checkpoint;
- `checkpoint_all` saves every live stream (the model calls it when Triton unloads it), so a server
  restart continues every sequence where it stopped.

Sequence ids are unsigned 64-bit integers or strings of letters, digits, `-` and `_` (Triton's two
kinds of correlation id), which name the checkpoint files directly.
"""

from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from edgemem.errors import EdgememError
from edgemem.runtime import Engine, Stream

log = logging.getLogger(__name__)

_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


class SequenceError(EdgememError, ValueError):
    """A request for a sequence that was never started (or already ended), or with an unusable sequence id."""


class Sequences:
    """Streams of one engine keyed by sequence id (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        checkpoints: str | Path,
        *,
        max_live: int = 64,
        idle_seconds: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_live < 1:
            raise EdgememError(f"max_live must be at least 1; got {max_live}")
        if idle_seconds <= 0:
            raise EdgememError(f"idle_seconds must be positive; got {idle_seconds}")
        self.engine, self.max_live, self.idle_seconds, self._clock = engine, max_live, idle_seconds, clock
        self.checkpoints = Path(checkpoints)
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        self._live: OrderedDict[str, tuple[Stream, float]] = OrderedDict()  # least recently used first

    @property
    def live(self) -> list[str]:
        """Ids of the streams in memory, least recently used first."""
        return list(self._live)

    def path(self, sequence_id: int | str) -> Path:
        return self.checkpoints / f"{_key(sequence_id)}.safetensors"

    def run(
        self, sequence_id: int | str, tokens: Sequence[int] | np.ndarray, *, start: bool = False, end: bool = False
    ) -> tuple[np.ndarray, int]:
        """Feed `tokens` to the sequence; returns the next-token logits [V] and the stream's position."""
        key = _key(sequence_id)
        stream = self._stream(key, start)
        ids = np.asarray(tokens)
        if ids.size == 0 and not start and stream.logits is not None:  # a look at the next-token logits
            logits = stream.logits
        elif ids.size == 1 and ids.dtype.kind in "iu":  # decoding: the step graph, as a stream run alone steps
            logits = stream.step(ids.item())
        else:  # a prompt: the prefill graph; token ids are checked before the state is touched
            logits = stream.prefill(tokens, all_logits=False)
        position = stream.position
        if start:
            self.path(key).unlink(missing_ok=True)  # the sequence that had this id is replaced
        if end:
            self._live.pop(key, None)
            self.path(key).unlink(missing_ok=True)
        else:
            self._live[key] = (stream, self._clock())
            self._live.move_to_end(key)
        return logits, position

    def evict(self, key: str) -> None:
        """Save a live stream to its checkpoint and drop it from memory."""
        stream, _ = self._live[key]
        stream.save(self.path(key))  # first: a failed save leaves the stream live
        del self._live[key]
        log.info("sequence %s evicted at position %d", key, stream.position)

    def evict_idle(self) -> list[str]:
        """Evict every stream idle for `idle_seconds` or longer; returns their ids."""
        now = self._clock()
        idle = [k for k, (_, used) in self._live.items() if now - used >= self.idle_seconds]
        for key in idle:
            self.evict(key)
        return idle

    def checkpoint_all(self) -> int:
        """Evict every live stream (e.g. before the server stops); returns how many were saved."""
        keys = list(self._live)
        for key in keys:
            self.evict(key)
        return len(keys)

    def _stream(self, key: str, start: bool) -> Stream:
        if start:
            stream = self.engine.new_stream()
            if key in self._live:  # replaced on success; the live count does not grow
                return stream
        elif key in self._live:
            return self._live[key][0]
        elif self.path(key).is_file():
            stream = self.engine.load_stream(self.path(key))
            log.info("sequence %s restored at position %d", key, stream.position)
        else:
            raise SequenceError(
                f"sequence {key} is not live and has no checkpoint: start it with the START flag "
                "(it may have ended already)"
            )
        while len(self._live) >= self.max_live:
            self.evict(next(iter(self._live)))
        return stream


def _key(sequence_id: int | str) -> str:
    if isinstance(sequence_id, (int, np.integer)) and not isinstance(sequence_id, bool):
        if not 0 < int(sequence_id) < 1 << 64:
            raise SequenceError(f"sequence id {sequence_id} is outside [1, 2^64): 0 means no sequence")
        return str(int(sequence_id))
    if isinstance(sequence_id, str) and _ID.fullmatch(sequence_id):
        return sequence_id
    raise SequenceError(f"sequence id {sequence_id!r} must be a positive integer or 1-128 letters, digits, '-' or '_'")


__all__ = ["SequenceError", "Sequences"]

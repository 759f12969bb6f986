"""The prefix state cache: snapshots of streams' states keyed by the tokens they consumed from position 0.

`Engine.load(..., prefix_cache_bytes=N)` gives the engine one. A fresh stream (`new_stream`, `reset`)
that prefills stores a snapshot after every chunk of the prefill graph and at the end of the prompt,
keyed by the token prefix consumed so far; a later fresh stream whose prompt starts with a cached
prefix restores the longest one and prefills only the rest. A snapshot is every state tensor of the
stream (a preallocated KV cache only up to its filled length, as in a checkpoint), its position and
its next-token logits; its size is constant for recurrent models, so a long shared prompt (a system
prompt, earlier turns of a chat) costs one state however long it is.

Keys are a digest of the token ids plus their count; a hit also compares the stored tokens with the
prompt, so a digest collision can never restore another prompt's state. Entries are kept least
recently used first within `capacity` bytes (tensors, logits and tokens counted): the cache never
holds more, evicts the oldest entries to make room, and skips a snapshot larger than all of it.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Snapshot:
    """A stream's state after `tokens` from position 0 (KV caches cut to their filled part)."""

    tokens: np.ndarray  # int64 [position]
    state: dict[str, np.ndarray]
    logits: np.ndarray  # float32 [V]

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + self.logits.nbytes + sum(a.nbytes for a in self.state.values())


def _key(tokens: np.ndarray) -> tuple[int, bytes]:
    return tokens.size, hashlib.blake2b(np.ascontiguousarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


class PrefixCache:
    """Snapshots by token prefix, least recently used first, at most `capacity` bytes in all.

    Counters: `hits` (prefills that restored a snapshot), `misses` (prefills from position 0 that found
    none), `tokens_reused` (tokens not prefilled thanks to hits), `bytes` and `len()` (what it holds now).
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.hits = self.misses = self.tokens_reused = self.bytes = 0
        self._entries: OrderedDict[tuple[int, bytes], Snapshot] = OrderedDict()
        self._lengths: dict[int, int] = {}  # prefix length → entries of that length
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, tokens: np.ndarray) -> Snapshot | None:
        """The snapshot of the longest cached prefix of `tokens` (the whole of it included), counted as a hit or a miss."""  # noqa: E501
        with self._lock:
            for length in sorted((n for n in self._lengths if n <= tokens.size), reverse=True):
                key = _key(tokens[:length])
                found = self._entries.get(key)
                if found is not None and np.array_equal(found.tokens, tokens[:length]):
                    self._entries.move_to_end(key)
                    self.hits += 1
                    self.tokens_reused += length
                    return found
            self.misses += 1
            return None

    def put(self, snapshot: Snapshot) -> bool:
        """Store `snapshot` (evicting the least recently used as needed); False if it is larger than the cache."""
        size = snapshot.nbytes
        if size > self.capacity:
            return False
        key = _key(snapshot.tokens)
        with self._lock:
            if key in self._entries:
                self._drop(key)
            while self.bytes + size > self.capacity:
                self._drop(next(iter(self._entries)))
            self._entries[key] = snapshot
            self._lengths[snapshot.tokens.size] = self._lengths.get(snapshot.tokens.size, 0) + 1
            self.bytes += size
        return True

    def _drop(self, key: tuple[int, bytes]) -> None:
        old = self._entries.pop(key)
        self.bytes -= old.nbytes
        n = old.tokens.size
        self._lengths[n] -= 1
        if not self._lengths[n]:
            del self._lengths[n]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._lengths.clear()
            self.bytes = 0

    def __repr__(self) -> str:
        return (
            f"PrefixCache({len(self)} snapshots, {self.bytes} of {self.capacity} bytes, hits={self.hits}, "
            f"misses={self.misses}, tokens_reused={self.tokens_reused})"
        )

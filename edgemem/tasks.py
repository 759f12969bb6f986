"""Synthetic and text tasks for training and evaluating the byte-level models (numpy only).

Every task speaks the LM's vocabulary of 256 byte ids and yields a `Sample`: token ids and
next-token targets, -1 where a position is not scored; a sequence-to-sequence task (`kind`
"encoder_decoder") yields `Pairs`: encoder inputs with their global mask, decoder ids and targets.

- `mqar` — multi-query associative recall (Arora et al. 2023, Zoology). An episode of
  `length` tokens (default 64) starts with `pairs` (default 8) key-value pairs
  `k1 v1 k2 v2 ...`; the rest is the filler token 0 with every key of the episode asked once,
  in random order, at random positions. The target at a query is the value paired with that
  key earlier in the episode; only those positions are scored (metric: accuracy). Keys are
  distinct within an episode, drawn from ids 64–127 (64 keys); values from ids 128–191
  (64 values, with repetition).
- `mqar-far` — MQAR whose queries lie `gap` tokens or more after their pairs: an episode is
  the `pairs` (default 4) key-value pairs, `gap` (default 32) filler tokens 0, then every key
  asked once in a row, in random order (length 3 × pairs + gap). A query is at least gap + 1
  tokens after the value it asks for, so a model whose attention sees fewer tokens back
  (a sliding window, a segment) must carry the pairs in its recurrent state (metric: accuracy).
- `copy` — selective copying (Gu & Dao 2023, Mamba). `tokens` (default 8) data tokens from
  ids 128–143 lie in order at random positions among noise tokens (ids 192–207), then the
  marker 1 follows and the data tokens are reproduced: the target at the marker is the first
  data token, at each reproduced token the next one (metric: accuracy over those positions).
  Episode length `length` (default 64) = noise span + 1 + `tokens`.
- `copy-marked` — sequence to sequence, for encoder-decoders (`led`): an input of `length`
  (default 32) tokens from ids 128–191 in which `tokens` (default 3) are marked, each by the
  marker 1 just before it (markers never adjacent); the marked tokens, in order, then the end
  token 2 are the output. The first token is global (`global_mask`, as LED marks `<s>`). The decoder
  reads the start token 2 and the output shifted by one (teacher forcing); every output token is
  scored. Metrics: `exact_match`, the share of inputs whose greedy output (up to and including
  the end token) is the target, and `token_accuracy`, the share of output tokens predicted right
  under teacher forcing. At 4× the input is 4× as long, with as many marks.
- `bytes` — next-byte prediction on the `.py` sources of the running Python's standard
  library (nothing downloaded). A file is held out when `zlib.crc32(relative path) % 10 == 0`
  (about a tenth); training windows come from the other files. Metric: bits per byte.

Training batches (`Task.batch`) are single episodes (random text windows for `bytes`) drawn
from the caller's generator. Held-out data (`Task.stream`) is drawn from generators seeded
with `(HELD_OUT, seed, row)`, seed sequences no training run uses (`edgemem.train` seeds
with `(TRAIN, seed)`), so stream `row` is the same whatever the batch. A stream of any length
is independent episodes of the task's episode length concatenated without a reset (the last
one cut at `length`; a longer stream starts with the shorter one), or a contiguous held-out
text window for `bytes`.

Evaluation "at 4× the training length" means a stream 4× as long: for `mqar` and `copy` four
consecutive episodes in one stream, so a recurrent model must overwrite the associations of
earlier episodes in its fixed-size state (a key recurs across episodes with a new value); for
`bytes` a held-out text window 4× as long, scored at every position.
"""

from __future__ import annotations

import functools
import inspect
import math
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgemem.config import fits_memory
from edgemem.errors import ConfigError

TASKS: tuple[str, ...] = ("mqar", "mqar-far", "copy", "copy-marked", "bytes")
VOCAB = 256  # every task's token ids are bytes
HELD_OUT = 0x4E1D  # first word of every held-out seed sequence
TRAIN = 0x7EA1  # first word of every training seed sequence (used by edgemem.train)

FILLER, MARKER = 0, 1
KEYS, VALUES = (64, 128), (128, 192)  # [start, stop) id ranges
DATA, NOISE = (128, 144), (192, 208)
END = 2  # copy-marked: the decoder's start token and the output's end token (LED's `</s>`)


@dataclass
class Sample:
    tokens: np.ndarray  # [B, T] int64 token ids
    targets: np.ndarray  # [B, T] int64 next-token targets; -1 where not scored


@dataclass
class Pairs:
    """Sequence-to-sequence data: an encoder input and the decoder's teacher-forced ids and targets."""

    inputs: np.ndarray  # [B, S] int64 encoder input ids
    global_mask: np.ndarray  # [B, S] int64, 1 at the input's global tokens
    tokens: np.ndarray  # [B, T] int64 decoder ids: the start token, then the output but its last token
    targets: np.ndarray  # [B, T] int64 the output; -1 where not scored


def held_out_rng(seed: int, row: int) -> np.random.Generator:
    """The generator of held-out stream `row` for `seed` (never used for training)."""
    return np.random.default_rng([HELD_OUT, seed, row])


def train_rng(seed: int) -> np.random.Generator:
    """The generator of training data for `seed`."""
    return np.random.default_rng([TRAIN, seed])


def check_shape(batch: int, length: int) -> None:
    """`batch` streams of `length` tokens: positive, and their token ids and targets fit in memory."""
    if batch < 1 or length < 1:
        raise ConfigError(f"batch and length must be positive; got batch={batch}, length={length}")
    fits_memory(16 * batch * length, f"{batch} streams of {length:,} tokens (token ids and targets)")


class Task:
    """A task: training batches, held-out streams and the metric over logits."""

    name: str
    metric: str
    length: int  # episode length = default training length
    kind = "lm"  # the model kind it trains (`edgemem.kinds`)

    def batch(self, batch: int, length: int, rng: np.random.Generator) -> Sample:
        """Training data: `batch` rows of `length` tokens."""
        raise NotImplementedError

    def stream(self, batch: int, length: int, seed: int) -> Sample:
        """Held-out streams of `length` tokens (independent of every training seed)."""
        check_shape(batch, length)
        count = math.ceil(length / self.length)
        rows = []
        for row in range(batch):
            rng = held_out_rng(seed, row)
            rows.append([self.batch(1, self.length, rng) for _ in range(count)])
        return Sample(
            np.stack([np.concatenate([e.tokens[0] for e in r])[:length] for r in rows]),
            np.stack([np.concatenate([e.targets[0] for e in r])[:length] for r in rows]),
        )

    def score(self, logits: np.ndarray, targets: np.ndarray) -> float:
        """Accuracy of the argmax over positions with a target ≥ 0."""
        logits, targets = np.asarray(logits), np.asarray(targets)
        scored = targets >= 0
        if not scored.any():
            raise ConfigError("no scored positions (every target is -1)")
        return float((logits.argmax(-1)[scored] == targets[scored]).mean())


def _pairs(batch: int, length: int, pairs: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """Keys, values `[batch, pairs]` and episodes (tokens, targets) that start `k1 v1 k2 v2 ...`,
    the rest filler with nothing scored."""
    keys = KEYS[0] + rng.permuted(np.tile(np.arange(KEYS[1] - KEYS[0]), (batch, 1)), axis=1)[:, :pairs]
    values = rng.integers(*VALUES, size=(batch, pairs))
    tokens = np.full((batch, length), FILLER, dtype=np.int64)
    targets = np.full((batch, length), -1, dtype=np.int64)
    tokens[:, 0 : 2 * pairs : 2], tokens[:, 1 : 2 * pairs : 2] = keys, values
    return keys, values, tokens, targets


class MQAR(Task):
    name, metric = "mqar", "accuracy"

    def __init__(self, length: int = 64, pairs: int = 8):
        if not 1 <= pairs <= KEYS[1] - KEYS[0]:
            raise ConfigError(f"mqar pairs must be in 1..{KEYS[1] - KEYS[0]}; got {pairs}")
        if length < 3 * pairs:
            raise ConfigError(f"mqar length must be ≥ 3 × pairs = {3 * pairs}; got {length}")
        self.length, self.pairs = length, pairs

    def batch(self, batch: int, length: int, rng: np.random.Generator) -> Sample:
        """Episodes of `length` tokens: the pairs, then the queries spread over the rest."""
        check_shape(batch, length)
        p = self.pairs
        if length < 3 * p:
            raise ConfigError(f"an mqar episode with {p} pairs needs length ≥ {3 * p}; got {length}")
        keys, values, tokens, targets = _pairs(batch, length, p, rng)
        rows = np.arange(batch)[:, None]
        positions = 2 * p + np.sort(rng.random((batch, length - 2 * p)).argsort(axis=1)[:, :p], axis=1)
        order = rng.random((batch, p)).argsort(axis=1)  # which pair each query asks
        tokens[rows, positions] = keys[rows, order]
        targets[rows, positions] = values[rows, order]
        return Sample(tokens, targets)


class MQARFar(Task):
    name, metric = "mqar-far", "accuracy"

    def __init__(self, pairs: int = 4, gap: int = 32):
        if not 1 <= pairs <= KEYS[1] - KEYS[0]:
            raise ConfigError(f"mqar-far pairs must be in 1..{KEYS[1] - KEYS[0]}; got {pairs}")
        if gap < 0:
            raise ConfigError(f"mqar-far gap must be ≥ 0; got {gap}")
        self.pairs, self.gap, self.length = pairs, gap, 3 * pairs + gap

    def batch(self, batch: int, length: int, rng: np.random.Generator) -> Sample:
        """Episodes: the pairs, `gap` filler tokens, the queries."""
        check_shape(batch, length)
        if length != self.length:
            raise ConfigError(
                f"an mqar-far episode with {self.pairs} pairs and gap {self.gap} is "
                f"{self.length} tokens (3 × pairs + gap); got length {length}"
            )
        p = self.pairs
        keys, values, tokens, targets = _pairs(batch, length, p, rng)
        rows = np.arange(batch)[:, None]
        order = rng.random((batch, p)).argsort(axis=1)  # which pair each query asks
        tokens[:, length - p :], targets[:, length - p :] = keys[rows, order], values[rows, order]
        return Sample(tokens, targets)


class Copy(Task):
    name, metric = "copy", "accuracy"

    def __init__(self, length: int = 64, tokens: int = 8):
        if tokens < 1:
            raise ConfigError(f"copy tokens must be ≥ 1; got {tokens}")
        if length < 3 * tokens + 1:
            raise ConfigError(f"copy length must be ≥ 3 × tokens + 1 = {3 * tokens + 1}; got {length}")
        self.length, self.tokens = length, tokens

    def batch(self, batch: int, length: int, rng: np.random.Generator) -> Sample:
        """Episodes of `length` tokens: data among noise, the marker, the data again."""
        check_shape(batch, length)
        n = self.tokens
        span = length - 1 - n
        if span < 2 * n:
            raise ConfigError(f"a copy episode with {n} tokens needs length ≥ {3 * n + 1}; got {length}")
        data = rng.integers(*DATA, size=(batch, n))
        tokens = np.empty((batch, length), dtype=np.int64)
        tokens[:, :span] = rng.integers(*NOISE, size=(batch, span))
        rows = np.arange(batch)[:, None]
        positions = np.sort(rng.random((batch, span)).argsort(axis=1)[:, :n], axis=1)
        tokens[rows, positions] = data
        tokens[:, span] = MARKER
        tokens[:, span + 1 :] = data
        targets = np.full((batch, length), -1, dtype=np.int64)
        targets[:, span : length - 1] = data
        return Sample(tokens, targets)


class CopyMarked(Task):
    name, metric, kind = "copy-marked", "exact_match", "encoder_decoder"
    metrics = ("exact_match", "token_accuracy")
    end_token = END

    def __init__(self, length: int = 32, tokens: int = 3):
        if tokens < 1:
            raise ConfigError(f"copy-marked tokens must be ≥ 1; got {tokens}")
        if length < 2 * tokens:
            raise ConfigError(f"copy-marked length must be ≥ 2 × tokens = {2 * tokens}; got {length}")
        self.length, self.tokens = length, tokens

    def batch(self, batch: int, length: int, rng: np.random.Generator) -> Pairs:
        """Inputs of `length` tokens with `tokens` marked ones; outputs of tokens + 1."""
        check_shape(batch, length)
        n = self.tokens
        if length < 2 * n:
            raise ConfigError(f"a copy-marked input with {n} marks needs length ≥ {2 * n}; got {length}")
        inputs = rng.integers(*VALUES, size=(batch, length))
        # n sorted distinct draws from [0, length − n), the i-th moved i on: markers at least 2 apart
        markers = np.sort(rng.random((batch, length - n)).argsort(axis=1)[:, :n], axis=1) + np.arange(n)
        rows = np.arange(batch)[:, None]
        marked = inputs[rows, markers + 1]
        inputs[rows, markers] = MARKER
        global_mask = np.zeros((batch, length), dtype=np.int64)
        global_mask[:, 0] = 1
        end = np.full((batch, 1), END, dtype=np.int64)
        return Pairs(inputs, global_mask, np.concatenate([end, marked], 1), np.concatenate([marked, end], 1))

    def stream(self, batch: int, length: int, seed: int) -> Pairs:
        """Held-out inputs of `length` tokens, one episode each (as many marks at any length)."""
        check_shape(batch, length)
        rows = [self.batch(1, length, held_out_rng(seed, row)) for row in range(batch)]
        return Pairs(
            *(np.concatenate([getattr(r, f) for r in rows]) for f in ("inputs", "global_mask", "tokens", "targets"))
        )


@functools.lru_cache(maxsize=2)
def _stdlib_text(held_out: bool) -> np.ndarray:
    """The standard library's `.py` files of one split, concatenated as bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if "site-packages" in path.relative_to(root).parts or not path.is_file():
            continue
        if (zlib.crc32(relative.encode()) % 10 == 0) == held_out:
            parts.append(np.frombuffer(path.read_bytes(), dtype=np.uint8))
    if not parts:
        raise ConfigError(f"no .py files found under {root}")
    return np.concatenate(parts)


class Bytes(Task):
    name, metric = "bytes", "bits_per_byte"

    def __init__(self, length: int = 256):
        if length < 1:
            raise ConfigError(f"bytes length must be positive; got {length}")
        self.length = length

    @staticmethod
    def _windows(text: np.ndarray, starts: np.ndarray, length: int) -> Sample:
        if len(text) < length + 1:
            raise ConfigError(f"a text of {len(text)} bytes has no window of {length + 1}")
        starts = starts % (len(text) - length)
        windows = text[starts[:, None] + np.arange(length + 1)].astype(np.int64)
        return Sample(windows[:, :-1], windows[:, 1:])

    def batch(self, batch: int, length: int, rng: np.random.Generator) -> Sample:
        """Random windows of the training files."""
        check_shape(batch, length)
        return self._windows(_stdlib_text(False), rng.integers(0, 2**62, size=batch), length)

    def stream(self, batch: int, length: int, seed: int) -> Sample:
        """Random windows of the held-out files."""
        check_shape(batch, length)
        starts = np.array([held_out_rng(seed, row).integers(0, 2**62) for row in range(batch)])
        return self._windows(_stdlib_text(True), starts, length)

    def score(self, logits: np.ndarray, targets: np.ndarray) -> float:
        """Bits per byte: the mean negative log2-likelihood over positions with a target ≥ 0."""
        logits, targets = np.asarray(logits, dtype=np.float64), np.asarray(targets)
        scored = targets >= 0
        if not scored.any():
            raise ConfigError("no scored positions (every target is -1)")
        z = logits[scored]
        z = z - z.max(-1, keepdims=True)
        nll = np.log(np.exp(z).sum(-1)) - z[np.arange(len(z)), targets[scored]]
        return float(nll.mean() / math.log(2))


_CLASSES: dict[str, type[Task]] = {
    "mqar": MQAR,
    "mqar-far": MQARFar,
    "copy": Copy,
    "copy-marked": CopyMarked,
    "bytes": Bytes,
}


def get_task(name: str, **params: int) -> Task:
    """The task `name` (one of `TASKS`) with its parameters (`length`, `pairs`, `gap`, `tokens`)."""
    if name not in _CLASSES:
        raise ConfigError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    valid = inspect.signature(_CLASSES[name]).parameters
    for key, value in params.items():
        if key not in valid:
            raise ConfigError(f"unknown parameter {key!r} for task {name}; valid: {', '.join(valid)}")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ConfigError(f"task parameter {key} must be an integer; got {value!r}")
    return _CLASSES[name](**{k: int(v) for k, v in params.items()})

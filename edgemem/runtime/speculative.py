"""Speculative decoding for `Stream.generate_iter(draft=...)`: propose, verify in one run, roll back.

Each round starts from the target stream's state S, which has consumed every token yielded so far,
and the next token t, already drawn from the target's distribution. A drafter proposes d_1..d_k to
follow t: prompt lookup (`PromptLookup`: the tokens that followed the latest earlier occurrence of
the last few tokens) or a draft model (a stream of a smaller export with the same vocabulary,
stepped k times). One run of the target's prefill graph on [t, d_1..d_k] gives its logits after t,
d_1, ..., d_k. Draft d_i is accepted while every earlier one was:

- greedy (temperature 0): when it is the target's argmax after the tokens before it;
- sampled: with probability min(1, p(d_i) / q(d_i)), p the target's and q the drafter's
  distribution (a point mass for prompt lookup); at the first rejection the next token is drawn
  from max(0, p - q) renormalised. This is the rejection rule of Leviathan et al. 2023 and Chen et
  al. 2023 (speculative sampling), under which every token has the target's distribution.

With m drafts accepted, t, d_1..d_m are yielded and the next round's t is the target's token after
d_m (the correction at a rejection, else drawn after d_k). If all k were accepted, the state after
the run is the one wanted. Otherwise the stream rolls back to S (`Stream._mark` / `_rollback`: the
onnxruntime backend keeps S in its other side of buffers, so this is free; other backends restore a
copy) and feeds t, d_1..d_m again: one or two tokens step by step, more in one prefill-graph run
(benchmarks/README.md measures the choices). A draft model's stream follows the same tokens: it rolls back the same way when fewer
than k - 1 drafts were accepted.
"""  # noqa: E501

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from edgemem.errors import ConfigError, named
from edgemem.runtime.sampling import distribution, sample

if TYPE_CHECKING:
    from edgemem.runtime.base import Engine, Stream

Draft = Union[None, str, "Engine"]
NGRAM = 3  # the longest suffix prompt lookup matches (it tries shorter ones down to 1)
REAPPLY_STEPS = 2  # accepted tokens fed again step by step after a rollback (more: one prefill run)


@dataclass
class GenerationStats:
    """What the last `generate` / `generate_iter` of a stream did (updated as tokens are yielded)."""

    prompt_tokens: int = 0
    prefill_s: float = 0.0
    tokens: int = 0  # yielded
    decode_s: float = 0.0  # from the first new token's sampling to the last one's yield
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # of them, accepted
    verify_runs: int = 0  # target runs on a block of drafts

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


def check_draft(draft: Any, draft_tokens: Any, engine: Engine, engine_type: type) -> None:
    """`draft` is None, "prompt-lookup" or an engine (an `engine_type`) of `engine`'s vocabulary; `draft_tokens` ≥ 1."""
    if draft is None:
        return
    if isinstance(draft, str):
        if draft != "prompt-lookup":
            raise ConfigError(
                named(
                    f'draft must be None, "prompt-lookup" or an Engine; got {draft!r}',
                    f"--draft must be prompt-lookup or an export directory; got {draft!r}",
                )
            )
    elif not isinstance(draft, engine_type):
        raise ConfigError(f'draft must be None, "prompt-lookup" or an Engine; got {type(draft).__name__}')
    elif draft.vocab_size != engine.vocab_size:
        raise ConfigError(
            f"the draft model's vocabulary ({draft.manifest.arch}, {draft.vocab_size} tokens) is not the "
            f"target's ({engine.manifest.arch}, {engine.vocab_size}): a draft must share the vocabulary"
        )
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, (int, np.integer)) or draft_tokens < 1:
        raise ConfigError(
            named(
                f"draft_tokens must be a positive integer (tokens proposed per round); got {draft_tokens!r}",
                f"--draft-tokens must be at least 1; got {draft_tokens!r}",
            )
        )


class PromptLookup:
    """Drafts from the context itself: the tokens that followed the latest earlier occurrence of its last
    n tokens (n = NGRAM down to 1). An index of every n-gram's latest continuation keeps a lookup O(1)."""

    def __init__(self, context: Sequence[int]):
        self.context: list[int] = []
        self._next: list[dict[tuple[int, ...], int]] = [{} for _ in range(NGRAM)]  # n-gram → index after it
        self.extend(context)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            end = len(self.context)  # the n-grams ending here are followed by `token`
            for n in range(1, NGRAM + 1):
                if end >= n:
                    self._next[n - 1][tuple(self.context[end - n : end])] = end
            self.context.append(token)

    def propose(self, token: int, k: int) -> list[int]:
        """Up to `k` tokens to follow the context and then `token` (which joins the context)."""
        self.extend([token])
        for n in range(NGRAM, 0, -1):
            if len(self.context) > n:
                at = self._next[n - 1].get(tuple(self.context[-n:]))
                if at is not None:
                    return self.context[at : at + k]
        return []


def _accept(
    drafts: list[int], q: list[np.ndarray] | None, rows: np.ndarray, sampling: tuple, rng: np.random.Generator
) -> tuple[int, int]:
    """(accepted drafts m, the target's next token after them) for target logits `rows` [k + 1, V]."""
    temperature = sampling[0]
    for i, d in enumerate(drafts):
        if temperature == 0:
            best = int(np.argmax(rows[i]))
            if best != d:
                return i, best
            continue
        p = distribution(rows[i], *sampling)
        if q is None:  # prompt lookup: a point mass on d
            if rng.random() < p[d]:
                continue
            residual = p.copy()
            residual[d] = 0.0
        else:
            if rng.random() * q[i][d] < p[d]:  # u < p/q without dividing by a zero q
                continue
            residual = np.maximum(p - q[i], 0.0)
        total = residual.sum()
        return i, int(rng.choice(p.size, p=residual / total)) if total > 0 else sample(rows[i], *sampling, rng)
    return len(drafts), sample(rows[len(drafts)], *sampling, rng)


def speculate(
    stream: Stream,
    logits: np.ndarray,
    drafter: PromptLookup | Stream,
    k: int,
    max_new_tokens: int,
    sampling: tuple,
    rng: np.random.Generator,
    stats: GenerationStats,
) -> Iterator[int]:
    """`generate_iter`'s loop with a drafter (see the module docstring); `logits`: the target's next-token logits."""
    engine = stream._engine
    model = None if isinstance(drafter, PromptLookup) else drafter
    limit = min(
        k, engine.chunk_size - 1 if engine.has_prefill else k, (engine._max_tokens or k + 1) - 1
    )  # t and the drafts in one prefill run
    start = time.perf_counter()
    token = sample(logits, *sampling, rng)
    done = 0
    while done < max_new_tokens:
        n = min(limit, max_new_tokens - done - 1)
        rooms = [engine._room(stream.position), model.engine._room(model.position) if model is not None else None]
        for room in rooms:  # t and n drafts fit in a preallocated KV cache (the draft's takes one more step)
            if room is not None:
                n = min(n, room - 1)
        q: list[np.ndarray] | None = None
        mark = None
        if model is None:
            drafts = drafter.propose(token, max(n, 0))  # `token` joins the context
        elif n > 0:
            drafts, q, mark = _draft(model, token, n, sampling, rng)
        else:
            drafts = []
        block = [token, *drafts]
        with stream._lock:
            if drafts:
                before = stream._mark(len(block), one_run=engine.has_prefill)
                rows = stream._run_block(block)
                accepted, after = _accept(drafts, q, rows, sampling, rng)
                if accepted < len(drafts):
                    stream._rollback(before)
                    _reapply(stream, block[: accepted + 1])
                stats.verify_runs += 1
            else:
                accepted, after = 0, sample(stream.step(token), *sampling, rng)
        if model is not None:
            _follow(model, block, accepted, mark)
        else:
            drafter.extend(drafts[:accepted])
        stats.drafted += len(drafts)
        stats.accepted += accepted
        for emitted in block[: accepted + 1]:
            done += 1
            stats.tokens += 1
            stats.decode_s = time.perf_counter() - start
            yield emitted
        token = after


def _draft(
    model: Stream, token: int, n: int, sampling: tuple, rng: np.random.Generator
) -> tuple[list[int], list[np.ndarray] | None, Any]:
    """n tokens from the draft model after `token`, the distributions they were drawn from (None: greedy)
    and the draft stream's mark before `token`."""
    mark = model._mark(n, one_run=False)
    drafts: list[int] = []
    q: list[np.ndarray] = []
    logits = model.step(token)
    for i in range(n):
        if sampling[0] == 0:
            drafts.append(int(np.argmax(logits)))
        else:
            q.append(distribution(logits, *sampling))
            drafts.append(int(rng.choice(q[-1].size, p=q[-1])))
        if i < n - 1:
            logits = model.step(drafts[-1])
    return drafts, (q if sampling[0] != 0 else None), mark


def _follow(model: Stream, block: list[int], accepted: int, mark: Any) -> None:
    """Bring the draft stream to the target's tokens: it consumed block[:-1]; the target kept block[:accepted + 1]."""
    if mark is None:  # no drafts this round: the target stepped block[0] alone
        model.step(block[0])
    elif accepted == len(block) - 1:
        model.step(block[-1])
    elif accepted < len(block) - 2:
        model._rollback(mark)
        _reapply(model, block[: accepted + 1])


def _reapply(stream: Stream, tokens: list[int]) -> None:
    """Feed the accepted tokens again after a rollback: step by step up to REAPPLY_STEPS tokens, else in one
    prefill-graph run (a prefill run of a few tokens costs several steps on the CPU: benchmarks/README.md)."""
    if len(tokens) <= REAPPLY_STEPS:
        for token in tokens:
            stream.step(token)
    else:
        stream._run_block(tokens)

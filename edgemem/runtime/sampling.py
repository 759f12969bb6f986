"""Next-token sampling from logits: greedy, temperature, top-k, top-p (nucleus). numpy only."""

from __future__ import annotations

import numpy as np

from edgemem.errors import ConfigError


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not temperature >= 0:  # also refuses NaN
        raise ConfigError(f"temperature must be >= 0 (0 is greedy); got {temperature}")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"top_k must be >= 1; got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ConfigError(f"top_p must be in (0, 1]; got {top_p}")


def distribution(
    logits: np.ndarray, temperature: float, top_k: int | None = None, top_p: float | None = None
) -> np.ndarray:
    """The probabilities [V] (float64) that `sample` draws from at `temperature` > 0 with top-k / top-p."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    if top_k is not None and top_k < x.size:
        kth = np.partition(x, -top_k)[-top_k]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p is not None and top_p < 1:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]  # mass of the more likely tokens
        keep = np.zeros(p.size, dtype=bool)
        keep[order[before < top_p]] = True  # the smallest set reaching top_p (at least the best token)
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def sample(
    logits: np.ndarray,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    rng: np.random.Generator | None = None,
) -> int:
    """One token id from `logits` [V]. Temperature 0 is greedy (argmax; top-k/top-p then do nothing)."""
    if temperature == 0:
        return int(np.argmax(logits))
    p = distribution(logits, temperature, top_k, top_p)
    rng = rng if rng is not None else np.random.default_rng()
    return int(rng.choice(p.size, p=p))

"""The dtype ops and layers compute and keep state in."""

from __future__ import annotations

import torch


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32: state never accumulates in half."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32

"""Small building blocks shared by the layers: short causal convolution, RoPE, L2 norm, RMSNorm variants."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgemem.ops.dtypes import compute_dtype


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class OffsetRMSNorm(nn.Module):
    """RMSNorm whose scale is 1 + weight (weight starts at 0), computed in fp32 (Gemma, Qwen3.5)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float() if x.dtype != torch.float64 else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.to(h.dtype))).to(x.dtype)


def rms_norm(dim: int, eps: float, unit_offset: bool = False) -> nn.Module:
    """RMSNorm with scale `weight` (nn.RMSNorm) or, with `unit_offset`, `1 + weight`."""
    return OffsetRMSNorm(dim, eps) if unit_offset else nn.RMSNorm(dim, eps=eps)


class ShortConv(nn.Module):
    """Depthwise causal conv over time (kernel K) followed by SiLU; state = last K−1 inputs."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def init_state(self, batch: int, device: torch.device | None, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(batch, self.weight.shape[0], self.kernel - 1, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[B, T, C]`, state `[B, C, K−1]` → (y `[B, T, C]`, new state)."""
        t = x.shape[1]
        window = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=2)
        # K shifted multiply-adds: cheaper than a conv call for decode, and plain ops in ONNX
        y = sum(self.weight[:, :, k] * window[:, :, k : k + t] for k in range(self.kernel))
        return F.silu(y.transpose(1, 2)), window[:, :, t:].to(state.dtype)


def rope(
    x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0, rotary_dim: int | None = None
) -> torch.Tensor:
    """Rotary embedding (Su et al. 2021), rotate-half form, on the first `rotary_dim` channels
    (default all; the rest pass through). x `[B, H, T, D]`, positions `[T]` or `[B, T]`."""
    if rotary_dim is not None and rotary_dim < x.shape[-1]:
        return torch.cat([rope(x[..., :rotary_dim], positions, base), x[..., rotary_dim:]], dim=-1)
    half = x.shape[-1] // 2
    dtype = compute_dtype(x)
    freqs = base ** (-torch.arange(half, device=x.device, dtype=dtype) / half)
    angles = positions.to(dtype)[..., None] * freqs
    if angles.dim() == 3:  # per-stream positions: broadcast over heads
        angles = angles[:, None]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

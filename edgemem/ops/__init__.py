"""edgemem ops. Each op lives in one package: reference (naive), fast form, custom op."""

from edgemem.ops.linear_attention import linear_attention

__all__ = ["linear_attention"]

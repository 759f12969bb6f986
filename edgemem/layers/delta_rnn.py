"""Delta RNN (Irie, Schlag, Csordás & Schmidhuber 2021, "Going Beyond Linear Transformers with
Recurrent Fast Weight Programmers"): a delta-rule fast weight W plus a recurrent fast weight R
that reads the layer's own previous output, per head (head size D):

    W_t = W_{t−1} + β_t φ(k_t) (v_t − W_{t−1}ᵀ φ(k_t))ᵀ
    R_t = R_{t−1} + γ_t φ(r_t) (u_t − R_{t−1}ᵀ φ(r_t))ᵀ
    y_t = W_tᵀ φ(q_t) + R_tᵀ softmax(y_{t−1})

q, k, v, r, u, β = σ(·), γ = σ(·) are linear in x_t (the slow weights). Because y_t feeds the
next read through a softmax, the step is nonlinear in the state and the prefill is a sequential
loop: `prefill` runs the W part through the `linear_attention` op (delta rule, chunk-parallel,
one `edgemem::LinearAttention` node under export) and loops over tokens for the R part only; traced
for a symbolic length (the exported prefill graph) that loop is `torch._higher_order_ops.scan`, an
ONNX `Scan` inside the graph, while the one-token step graph has none. The R loop is plugin-free:
the Scan is standard ONNX with no edgemem node or TensorRT plugin of its own (the W part is the
LinearAttention node, as in DeltaNet).

Choices the paper leaves open, as made here:
- φ is a softmax over the head's D channels for q, k and r (positive and normalised, as the seed
  note asks): ‖φ(k)‖₂ ≤ 1, so with β, γ ∈ (0, 1) both delta updates are contractions and the
  state stays bounded on any input. Other feature maps (DPFP, ELU + 1) are not offered.
- R gets its own key r, value u and rate γ from x_t (the seed note reuses W's v − v̄ and k for R;
  separate projections can learn that and more); its update is thus linear, only its read recurs.
- f(y_{t−1}) = softmax over the head's D channels of the previous raw head output; y_0 = 0.
- The recurrence runs on raw head outputs; the layer output is a per-head RMSNorm of y_t (this
  layer's addition, as in DeltaNet, to keep the residual stream scaled), then the output projection.
- One set of heads, d_k = d_v = D = d_model / num_heads; no short convolution.
States: `recurrent_state` W `[B, H, D, D]`, `feedback_state` R `[B, H, D, D]` (both as
`[d_k, d_v]`, the `linear_attention` layout) and `last_output` y_{t−1} `[B, H, D]`.
"""

from __future__ import annotations

import torch
from torch import nn

from edgemem.errors import ConfigError
from edgemem.layers.base import State, StatefulLayer
from edgemem.ops import linear_attention
from edgemem.ops.dtypes import compute_dtype


def feedback_step(
    carry: tuple[torch.Tensor, torch.Tensor], token: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One token of the R recurrence. carry: R `[B, H, D, D]`, y_{t−1} `[B, H, D]`; token: the W
    read `[B, H, D]`, φ(r) `[B, H, D]`, u `[B, H, D]`, γ `[B, H, 1]`. Returns ((R_t, y_t), y_t)."""
    feedback, last = carry
    read, key, value, rate = token
    error = value - (feedback * key[..., :, None]).sum(-2)
    feedback = feedback + rate[..., None] * key[..., :, None] * error[..., None, :]
    y = read + (feedback * torch.softmax(last, dim=-1)[..., :, None]).sum(-2)
    return (feedback, y), y.clone()  # a scan output may not alias its carry


class DeltaRNN(StatefulLayer):
    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        if d_model % num_heads:
            raise ConfigError(f"d_model ({d_model}) is not divisible by num_heads ({num_heads})")
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.proj = nn.Linear(d_model, 5 * d_model, bias=False)  # q, k, v for W; r, u for R
        self.rates = nn.Linear(d_model, 2 * num_heads, bias=False)  # β, γ
        self.norm = nn.RMSNorm(self.head_dim, eps=1e-5)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype | None = None) -> State:
        dtype = self.state_dtype(dtype)
        h, d = self.num_heads, self.head_dim
        return {
            "recurrent_state": torch.zeros(batch, h, d, d, device=device, dtype=dtype),
            "feedback_state": torch.zeros(batch, h, d, d, device=device, dtype=dtype),
            "last_output": torch.zeros(batch, h, d, device=device, dtype=dtype),
        }

    def prefill(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        q, k, v, r, u = self.proj(x).unflatten(2, (5, self.num_heads, self.head_dim)).unbind(2)
        beta, gamma = torch.sigmoid(self.rates(x)).chunk(2, dim=-1)
        read, memory = linear_attention(
            q.softmax(-1),
            k.softmax(-1),
            v,
            state["recurrent_state"],
            None,
            beta,
            update_rule="delta",
            scale=1.0,
            q_num_heads=self.num_heads,
            kv_num_heads=self.num_heads,
        )
        dtype = compute_dtype(read)  # the recurrence runs in float32 (float64) whatever the weights
        carry = (state["feedback_state"].to(dtype), state["last_output"].to(dtype))
        tokens = tuple(t.to(dtype).transpose(0, 1) for t in (read, r.softmax(-1), u, gamma[..., None]))  # time first
        if isinstance(x.shape[1], int):  # eager, or a traced step: a known number of tokens
            outputs = []
            for t in range(x.shape[1]):
                carry, y = feedback_step(carry, tuple(s[t] for s in tokens))
                outputs.append(y)
            (feedback, last), ys = carry, torch.stack(outputs)
        else:  # traced for any length: a Scan node in the graph
            from torch._higher_order_ops.scan import scan

            # contiguous: scan does not trace strided views of one buffer for a symbolic T
            carry, tokens = tuple(t.contiguous() for t in carry), tuple(t.contiguous() for t in tokens)
            (feedback, last), ys = scan(feedback_step, carry, tokens)
        y = self.out(self.norm(ys.transpose(0, 1).to(x.dtype)).flatten(2))
        sdtype = state["feedback_state"].dtype
        return y, {"recurrent_state": memory, "feedback_state": feedback.to(sdtype), "last_output": last.to(sdtype)}

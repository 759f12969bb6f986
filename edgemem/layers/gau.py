"""Gated attention unit with causal mixed-chunk attention: FLASH (Hua et al. 2022, "Transformer
Quality in Linear Time", §2 GAU and §3.2 mixed chunk attention)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgemem.config import positive_int
from edgemem.layers.base import State, StatefulLayer
from edgemem.ops import linear_attention


class GAU(StatefulLayer):
    """FLASH's causal GAU layer: one head, e = expansion·d_model, shared representation of size s.

    Paper equations, as implemented (token t at absolute position p_t, chunk g(t) = p_t // C):

        U, V = φ(X W_u), φ(X W_v)  ∈ R^{T×e},    Z = φ(X W_z)  ∈ R^{T×s},   φ = SiLU      (GAU, §2)
        Q_quad, K_quad, Q_lin, K_lin = Z ⊙ γ_i + β_i   (per-dim scale and offset, i = 1…4)
        V̂_quad[t] = Σ_{j ≤ t, g(j) = g(t)} relu²(Q_quad[t]·K_quad[j] / C + b_{t−j}) V[j]     (quad, §3.2)
        V̂_lin[t]  = Q_lin[t] · (1/C) Σ_{j: g(j) < g(t)} K_lin[j]ᵀ V[j]                    (lin, causal)
        O = (U ⊙ (V̂_quad + V̂_lin)) W_o

    Choices where the paper leaves room:
    - W_u, W_v, W_z are one bias-free projection (the paper's code fuses them; its equations have
      no biases); γ ~ N(0, 0.02²), β = 0 as in the paper's code.
    - Chunks are aligned to absolute positions 0, C, 2C, … so a stream's output never depends on
      how its tokens were split into calls.
    - Scores are scaled by 1/C inside relu² (the paper's `relu(qk / n + bias)²` with n the chunk
      length) and the linear term by 1/C too, so both sums are on a per-chunk scale.
    - b is a learned scalar per in-chunk offset t−j ∈ [0, C), zero-initialised: offsets never
      reach C, so no T5 bucketing is needed, and it depends only on t−j, so it streams. No RoPE.
    - Defaults e = 2·d_model and s = 128 as in the paper; C = 64 instead of 256, since decode
      costs O(C·(s + e)) per token.
    - No norm or residual inside: the surrounding block provides them.

    Streaming (exact for any split of the stream): a key at least C positions back is always in an
    earlier chunk, so V̂_lin[t] = Q_lin[t]·S + the keys j ∈ (p_t − C, chunk start) of the previous
    chunk, where S = (1/C) Σ K_lin[j]ᵀ V[j] over positions j ≤ p_t − C is a causal linear attention
    (the `linear_attention` op). Each token therefore reads S plus a window of the last C tokens:
    relu² weights for the keys of its own chunk, Q_lin·K_lin / C for the rest. State:
    `linear_state` `[B, s, e]` (S over the tokens that left the window), `key` `[B, C, s]` (Z of the
    last C tokens, from which K_quad and K_lin follow), `value` `[B, C, e]` and `position` `[B]`
    (int64, per stream). The oldest token moves into S as each new one arrives, so every step costs
    the same O(C·(s + e) + s·e) with no branch on the position; empty slots of a fresh stream have
    V = 0 and add nothing.
    """

    def __init__(self, d_model: int, expansion: int = 2, s: int = 128, chunk_size: int = 64):
        super().__init__()
        for name, value in (("d_model", d_model), ("expansion", expansion), ("s", s), ("chunk_size", chunk_size)):
            positive_int(value, f"GAU {name}")
        self.e, self.s, self.chunk_size = expansion * d_model, s, chunk_size
        self.proj = nn.Linear(d_model, 2 * self.e + s, bias=False)
        self.gamma = nn.Parameter(torch.randn(4, s) * 0.02)  # rows: Q_quad, Q_lin, K_quad, K_lin
        self.beta = nn.Parameter(torch.zeros(4, s))
        self.rel_bias = nn.Parameter(torch.zeros(chunk_size))
        self.out = nn.Linear(self.e, d_model, bias=False)

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype | None = None) -> State:
        dtype, c = self.state_dtype(dtype), self.chunk_size
        return {
            "linear_state": torch.zeros(batch, self.s, self.e, device=device, dtype=dtype),
            "key": torch.zeros(batch, c, self.s, device=device, dtype=dtype),
            "value": torch.zeros(batch, c, self.e, device=device, dtype=dtype),
            "position": torch.zeros(batch, device=device, dtype=torch.int64),
        }

    def prefill(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        t, c = x.shape[1], self.chunk_size
        u, v, z = F.silu(self.proj(x)).split([self.e, self.e, self.s], dim=-1)
        # the last C tokens of the stream, then the new ones: positions p − C … p + T − 1
        zs = torch.cat([state["key"].to(z.dtype), z], dim=1)
        vs = torch.cat([state["value"].to(v.dtype), v], dim=1)
        q_quad, q_lin = (z[:, :, None] * self.gamma[:2] + self.beta[:2]).unbind(2)
        k_quad, k_lin = (zs[:, :, None] * self.gamma[2:] + self.beta[2:]).unbind(2)
        # token i reads S plus keys at positions ≤ p_i − C, i.e. zs[: i + 1]: a causal linear attention
        far, linear_state = linear_attention(
            q_lin[:, :, None],
            k_lin[:, :t, None],
            vs[:, :t, None],
            state["linear_state"][:, None],
            update_rule="linear",
            scale=1.0 / c,
            q_num_heads=1,
            kv_num_heads=1,
        )
        near = self._window(q_quad, q_lin, k_quad, k_lin, vs, state["position"])
        y = self.out(u * (far[:, :, 0] + near))
        return y, {
            "linear_state": linear_state[:, 0],
            "key": zs[:, t:].to(state["key"].dtype),
            "value": vs[:, t:].to(state["value"].dtype),
            "position": state["position"] + t,
        }

    def _window(
        self,
        q_quad: torch.Tensor,
        q_lin: torch.Tensor,
        k_quad: torch.Tensor,
        k_lin: torch.Tensor,
        values: torch.Tensor,
        position: torch.Tensor,
    ) -> torch.Tensor:
        """Σ over the last C positions (p_i − C, p_i] of each new token i: relu² for its own chunk
        (quad), Q_lin·K_lin / C for the previous one (lin). Keys/values hold C older tokens first."""
        b, t, _ = q_quad.shape
        c = self.chunk_size
        if not isinstance(t, int):  # symbolic length under export: the same sum, offset by offset
            return self._window_by_offset(q_quad, q_lin, k_quad, k_lin, values, position)
        block = min(t, c)
        blocks = (t + block - 1) // block
        pad = blocks * block - t

        def queries(x: torch.Tensor) -> torch.Tensor:  # [B, N, block, D]
            return F.pad(x, (0, 0, 0, pad)).unflatten(1, (-1, block))

        def keys(x: torch.Tensor) -> torch.Tensor:  # query block n sees x[n·block : n·block + block + C]
            return F.pad(x, (0, 0, 0, pad)).unfold(1, block + c, block).transpose(2, 3)

        rows = torch.arange(block, device=q_quad.device)
        offset = c + rows[:, None] - torch.arange(block + c, device=q_quad.device)  # p_query − p_key
        in_window = (offset >= 0) & (offset < c)
        phase = (position[:, None] + torch.arange(blocks * block, device=q_quad.device)) % c  # p_query − chunk start
        same_chunk = offset <= phase.unflatten(1, (-1, block))[..., None]
        bias = self.rel_bias[offset.clamp(0, c - 1)]
        quad = F.relu(torch.einsum("bnqs,bnks->bnqk", queries(q_quad), keys(k_quad)) / c + bias) ** 2
        lin = torch.einsum("bnqs,bnks->bnqk", queries(q_lin), keys(k_lin)) / c
        weights = quad * (in_window & same_chunk) + lin * (in_window & ~same_chunk)
        return torch.einsum("bnqk,bnke->bnqe", weights, keys(values)).flatten(1, 2)[:, :t]

    def _window_by_offset(
        self,
        q_quad: torch.Tensor,
        q_lin: torch.Tensor,
        k_quad: torch.Tensor,
        k_lin: torch.Tensor,
        values: torch.Tensor,
        position: torch.Tensor,
    ) -> torch.Tensor:
        """`_window` indexed by offset o = p_i − p_key instead of by block: gathers only, so it
        traces for a symbolic T (the blocked form's reshapes do not). Values are gathered 16
        offsets at a time to bound memory at O(16·T·e)."""
        t, c = q_quad.shape[1], self.chunk_size
        offsets = torch.arange(c, device=q_quad.device)
        index = c + torch.arange(t, device=q_quad.device)[:, None] - offsets  # [T, C] into the keys
        quad = F.relu(torch.einsum("bts,btos->bto", q_quad, k_quad[:, index]) / c + self.rel_bias) ** 2
        lin = torch.einsum("bts,btos->bto", q_lin, k_lin[:, index]) / c
        phase = (position[:, None] + torch.arange(t, device=q_quad.device)) % c  # p_query − chunk start
        weights = torch.where(offsets <= phase[..., None], quad, lin)
        return sum(
            torch.einsum("bto,btoe->bte", weights[..., g : g + 16], values[:, index[:, g : g + 16]])
            for g in range(0, c, 16)
        )

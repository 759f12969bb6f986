"""The stateful protocol every edgemem layer follows (DESIGN: "The stateful protocol").

A layer implements `init_state` and `prefill`; `forward` and `step` follow from them, so
`forward(x) ≡ prefill(x, init_state)` and `step` is a one-token prefill. Tensors are
`[B, T, d_model]`; states are flat dicts `kind → tensor` (kinds as in the ONNX names:
`recurrent_state`, `conv_state`, `key`, `value`, …) and are never modified in place.
"""

from __future__ import annotations

import torch
from torch import nn

from edgemem.ops.dtypes import compute_dtype

State = dict[str, torch.Tensor]


class StatefulLayer(nn.Module):
    streaming = True  # False for bidirectional layers: prefill of a whole input only
    parallel_prefill = True  # False when prefill is a data-dependent loop no graph of any length can hold
    # > 0 (with parallel_prefill False): prefill is one graph on blocks that stay within one segment of
    # this many positions (segments aligned to the stream start; a traced prefill is such a block);
    # the exported prefill graph loops over segments (edgemem.export.segments)
    prefill_segment = 0
    # False when the prefill form does much more work than `step` on one token: a runtime that serves steps
    # with the last-position prefill graph (one session, one packed copy of the weights) keeps the step graph
    prefill_steps = True

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype | None = None) -> State:
        """Fixed-size state of a fresh stream (fp32 unless the layer runs in fp64)."""
        raise NotImplementedError

    def prefill(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        """A block of tokens `[B, T, d_model]` continuing from `state`."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.prefill(x, self.init_state(x.shape[0], x.device))[0]

    def step(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        """One token `[B, d_model]`."""
        y, state = self.prefill(x[:, None], state)
        return y[:, 0], state

    def state_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        if dtype is not None:
            return dtype
        return compute_dtype(next(self.parameters()))

"""Every streaming preset, as shipped (default sizes, random init), stays finite over a long
prompt of real and of adversarially repetitive text: a constant-memory model that streams
forever must not let its state blow up before it is even trained (Titans' online memory with
a large inner learning rate diverged within a few hundred tokens of repeated keys)."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

from edgemem.models import LMConfig, archs, build, load_config

LENGTH = 1024
LMS = [a for a in archs() if isinstance(load_config(a), LMConfig)]  # encoder-decoders: test_led_preset.py
STREAMING = [a for a in LMS if build(a, seed=0, d_model=32, mlp_hidden=32).streaming]


def _streams() -> torch.Tensor:
    text = open(inspect.getsourcefile(os), "rb").read()[:LENGTH]  # Python's own os.py: real text
    padding = b" " * LENGTH  # one key over and over: the worst case for an online-learned memory
    lines = (b"            '<dinsdale@example.com (foo)>',\n" * (LENGTH // 44 + 1))[:LENGTH]
    return torch.tensor([list(text), list(padding), list(lines)])


@pytest.mark.parametrize("arch", STREAMING)
def test_preset_state_stays_finite_over_a_long_prompt(arch):
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = build(arch, seed=0).eval()
    with torch.no_grad():
        logits, state = model.prefill(_streams(), model.init_state(3))
    assert torch.isfinite(logits).all(), f"{arch}: non-finite logits"
    bad = [name for name, value in state.items() if value.is_floating_point() and not torch.isfinite(value).all()]
    assert not bad, f"{arch}: non-finite state after {LENGTH} tokens: {bad}"

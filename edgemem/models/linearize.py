"""`linearize`: a softmax-attention LM → the same LM with LiZA mixers (TPTT's recipe), in constant memory.

Every weight of the original is kept: embeddings, norms, MLPs, head and each attention layer's
q/k/v/output projections; only the LiZA gate and the linear branch's β / decay projections are new
(initialised as in `edgemem.layers.liza`). The result streams with a fixed-size state: the window's
ring buffer plus one linear-attention state per layer. Fine-tuning it is the user's (`edgemem.train`).
"""

from __future__ import annotations

import dataclasses
import logging

from edgemem.errors import ConfigError
from edgemem.layers.liza import LiZA
from edgemem.models.lm import LM

log = logging.getLogger(__name__)


def linearize(model: LM, *, window: int = 64, update_rule: str = "gated_delta", gate_init: float = 0.5) -> LM:
    """A new LM whose softmax attention layers are LiZA layers (sliding `window`, linear attention
    with `update_rule`, initial linear share `gate_init`) carrying `model`'s weights; `model` is unchanged."""
    if not isinstance(model, LM):
        raise ConfigError(f"linearize takes an edgemem LM; got {type(model).__name__}")
    if model.config.mixer != "softmax":
        raise ConfigError(f"linearize turns softmax attention into LiZA; this model's mixer is {model.config.mixer!r}")
    options = {
        **model.config.mixer_options, "window": window, "update_rule": update_rule, "gate_init": gate_init,
    }
    arch = f"{model.config.arch}-linearized"
    config = dataclasses.replace(model.config, arch=arch, mixer="liza", mixer_options=options)
    new = LM(config).to(next(model.parameters()).device, next(model.parameters()).dtype)
    missing, unexpected = new.load_state_dict(model.state_dict(), strict=False)
    added = {name for name, _ in new.named_parameters()} - set(model.state_dict())
    if unexpected or set(missing) != added or any(not isinstance(b.mixer, LiZA) for b in new.blocks):
        raise ConfigError(f"{model.config.arch}: weights do not map onto LiZA layers (left over: {unexpected})")
    log.info("linearized %s: %d new parameters", model.config.arch, sum(new.get_parameter(n).numel() for n in added))
    return new.train(model.training)

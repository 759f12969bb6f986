"""`linearize`: a softmax-attention LM → the same LM with LiZA mixers (TPTT's recipe), in constant memory.

Works on a model of softmax layers (the `softmax` preset) and on hybrids whose `layer_types` mix
softmax attention with recurrent layers (imported Qwen3.5): only the softmax layers change. Every
weight of the original is kept: embeddings, norms, MLPs, head, the other layers and each attention
layer's q/k/v/output projections and q/k norms; only the LiZA gate and the linear branch's β /
decay projections are new (initialised as in `edgemem.layers.liza`). The result streams with a fixed-size state: the window's
ring buffer plus one linear-attention state per layer. Fine-tuning it is the user's (`edgemem.train`).
"""  # noqa: E501

from __future__ import annotations

import dataclasses
import logging

from edgemem.errors import ConfigError
from edgemem.models.lm import LM

log = logging.getLogger(__name__)


def linearize(model: LM, *, window: int = 64, update_rule: str = "gated_delta", gate_init: float = 0.5) -> LM:
    """A new LM whose softmax attention layers (every layer, or those `layer_types` names
    "softmax" in a hybrid) are LiZA layers (sliding `window`, linear attention with `update_rule`,
    initial linear share `gate_init`) carrying `model`'s weights; `model` is unchanged."""
    if not isinstance(model, LM):
        raise ConfigError(f"linearize takes an edgemem LM; got {type(model).__name__}")
    config = model.config
    kinds = [config.mixer_of(i)[0] for i in range(config.n_layers)]
    if "softmax" not in kinds:
        raise ConfigError(
            f"linearize turns softmax attention into LiZA; {config.arch} has none (mixers: "
            f"{', '.join(sorted(set(kinds)))})"
        )
    projections = {
        k: v for k, v in config.mixer_of(kinds.index("softmax"))[1].items() if k not in ("max_length", "sinks")
    }  # a KV-cache layout: LiZA keeps none
    softmax = {**projections, "window": window, "update_rule": update_rule, "gate_init": gate_init}
    rename = lambda kind: "liza" if kind == "softmax" else kind  # noqa: E731
    config = dataclasses.replace(
        config,
        arch=f"{config.arch}-linearized",
        mixer=rename(config.mixer),
        mixer_options=softmax if config.mixer == "softmax" else config.mixer_options,
        layer_types=[rename(k) for k in config.layer_types],
        layer_type_options={rename(k): softmax if k == "softmax" else v for k, v in config.layer_type_options.items()},
    )
    new = LM(config).to(next(model.parameters()).device, next(model.parameters()).dtype)
    missing, unexpected = new.load_state_dict(model.state_dict(), strict=False)
    added = {name for name, _ in new.named_parameters()} - set(model.state_dict())
    if unexpected or set(missing) != added:
        raise ConfigError(f"{model.config.arch}: weights do not map onto LiZA layers (left over: {unexpected})")
    log.info("linearized %s: %d new parameters", model.config.arch, sum(new.get_parameter(n).numel() for n in added))
    return new.train(model.training)

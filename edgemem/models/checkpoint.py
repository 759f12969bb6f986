"""Model checkpoints: weights in safetensors, the config in its metadata (never pickle)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from edgemem.errors import ConfigError, EdgememError
from edgemem.files import write_atomic
from edgemem.models.lm import LM, LMConfig

FORMAT = "edgemem-checkpoint/1"


def save_checkpoint(model: LM, path: str | Path) -> None:
    """Write `model`'s weights and config to `path` atomically."""
    metadata = {"format": FORMAT, "config": json.dumps(model.config.to_dict())}
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    write_atomic(Path(path), save_safetensors(tensors, metadata=metadata))


def load_checkpoint(path: str | Path) -> LM:
    """The model saved at `path`; a clear EdgememError for anything else."""
    path = Path(path)
    try:
        data = path.read_bytes()
        tensors = load_safetensors(data)
        header_len = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8 : 8 + header_len]).get("__metadata__", {})
    except (OSError, SafetensorError, ValueError) as e:
        raise EdgememError(f"cannot read checkpoint {path}: {e}") from None
    if metadata.get("format") != FORMAT:
        raise EdgememError(f"{path} is not an edgemem checkpoint (no {FORMAT!r} metadata)")
    try:
        model = LM(LMConfig(**json.loads(metadata["config"])))
        model.load_state_dict(tensors)
    except (TypeError, KeyError, ValueError, RuntimeError, ConfigError) as e:
        raise EdgememError(f"checkpoint {path} does not fit its own config: {str(e).splitlines()[0]}") from None
    return model

"""Model checkpoints: weights in safetensors, the config in its metadata (never pickle)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn

from edgemem import kinds
from edgemem.errors import ConfigError, EdgememError
from edgemem.files import OutputError, as_path, sha256, staged_directory, write_atomic

FORMAT = "edgemem-checkpoint/1"


def tokenizer_dir(path: str | Path) -> Path:
    """Where the tokenizer files of the checkpoint `path` go: `NAME.tokenizer/` beside `NAME.safetensors`."""
    path = Path(path)
    return path.with_name(f"{path.stem}.tokenizer")


def save_checkpoint(model: nn.Module, path: str | Path, tokenizer: Sequence[str | Path] = ()) -> None:
    """Write `model`'s weights and config to `path` atomically; `tokenizer` files (of the model it came
    from) go to `tokenizer_dir(path)`, and the checkpoint records their sha256."""
    metadata = {"format": FORMAT, "kind": kinds.of(model).name, "config": json.dumps(model.config.to_dict())}
    if tokenizer:
        metadata["tokenizer"] = json.dumps(_save_tokenizer([Path(p) for p in tokenizer], Path(path)))
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    write_atomic(Path(path), save_safetensors(tensors, metadata=metadata))


def _save_tokenizer(files: list[Path], path: Path) -> dict[str, str]:
    from edgemem.models.hf.importer import TOKENIZER_FILES

    folder = tokenizer_dir(path)
    if folder.exists() and (not folder.is_dir() or any(p.name not in TOKENIZER_FILES for p in folder.iterdir())):
        raise OutputError(
            f"{folder} (where the tokenizer of {path.name} goes) exists and holds other files; "
            "move it or write the checkpoint elsewhere"
        )
    with staged_directory(folder) as tmp:
        for file in files:
            shutil.copyfile(file, tmp / file.name)
        return {file.name: sha256(tmp / file.name) for file in files}


def checkpoint_tokenizer(path: str | Path) -> list[Path]:
    """The tokenizer files saved with the checkpoint `path` ([] when it has none), checked against its record."""
    path = Path(path)
    recorded = json.loads(_metadata(path).get("tokenizer", "{}"))
    folder = tokenizer_dir(path)
    for name, digest in recorded.items():
        if not (folder / name).is_file() or sha256(folder / name) != digest:
            state = "changed" if (folder / name).is_file() else "missing"
            raise EdgememError(
                f"{folder / name} is {state}: {path.name} was saved with this tokenizer file beside "
                f"it (keep {folder.name}/ next to the checkpoint)"
            )
    return [folder / name for name in recorded]


def _metadata(path: Path, data: bytes | None = None) -> dict[str, str]:
    try:
        if data is None:
            with path.open("rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                header = f.read(header_len)
        else:
            header_len = int.from_bytes(data[:8], "little")
            header = data[8 : 8 + header_len]
        return json.loads(header).get("__metadata__", None) or {}
    except (OSError, ValueError, AttributeError) as e:
        raise EdgememError(f"cannot read checkpoint {path}: {e}") from None


_LAYERS = {"blocks": "n_layers", "encoder": "encoder_layers", "decoder": "decoder_layers"}  # weight prefix: count


def _check_layers(config: object, tensors: dict) -> None:
    """The layer counts the config states are the ones the weights hold (before a model of that many layers
    is made): an LM's `n_layers`, an encoder-decoder's `encoder_layers` and `decoder_layers`."""
    for prefix, name in _LAYERS.items():
        if not hasattr(config, name):
            continue
        stated = getattr(config, name)
        held = {int(k.split(".")[1]) for k in tensors if k.startswith(f"{prefix}.") and k.split(".")[1].isdigit()}
        if not isinstance(stated, int) or len(held) != stated or held != set(range(len(held))):
            layers = f"{len(held)} {'' if prefix == 'blocks' else prefix + ' '}layer{'' if len(held) == 1 else 's'}"
            raise ConfigError(f"its config says {name}={stated!r} but it holds the weights of {layers}")


def load_checkpoint(path: str | Path) -> nn.Module:
    """The model saved at `path`, of the kind it records (`edgemem.kinds`; an LM when it names none);
    a clear EdgememError for anything else."""
    path = as_path(path, "a checkpoint")
    try:
        data = path.read_bytes()
        tensors = load_safetensors(data)
    except (OSError, SafetensorError, ValueError) as e:
        raise EdgememError(f"cannot read checkpoint {path}: {e}") from None
    metadata = _metadata(path, data)
    if metadata.get("format") != FORMAT:
        raise EdgememError(f"{path} is not an edgemem checkpoint (no {FORMAT!r} metadata)")
    kind = kinds.get(metadata.get("kind", kinds.DEFAULT))
    try:
        config = kind.config_class()(**json.loads(metadata["config"]))
        _check_layers(config, tensors)
        model = kind.model_class()(config)
        model.load_state_dict(tensors)
    except (TypeError, KeyError, ValueError, RuntimeError, AttributeError, ArithmeticError, ConfigError) as e:
        raise EdgememError(f"checkpoint {path} does not fit its own config: {str(e).splitlines()[0]}") from None
    return model

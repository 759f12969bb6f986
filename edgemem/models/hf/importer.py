"""Import a local Hugging Face / flash-linear-attention checkpoint directory as an edgemem model.

    model = from_hf("path/to/dir")      # config.json + *.safetensors (sharded or not), no transformers

Reads `config.json` and the safetensors weights (one file, or the shards listed in
`model.safetensors.index.json`), dispatches on `model_type` to a family module, and returns an
`nn.Module` following the stateful protocol (an `edgemem.models.LM` for decoder families). A
family module has `MODEL_TYPES` and `build(config, weights)`; it describes its model with
edgemem's own layers and a table from edgemem parameter names to checkpoint names
(`load_table`). Anything unexpected — an unknown `model_type`, a missing shard, a tensor of the
wrong shape, a config that disagrees with the weights — is one `ConfigError` line.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from edgemem.errors import ConfigError

if TYPE_CHECKING:
    from edgemem.models.lm import LM, LMConfig

log = logging.getLogger(__name__)

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# model_type → family module (imported when used; a family missing from an install is an error only for its types)
FAMILIES = {
    "qwen3_5_text": "qwen3_5",
    "qwen3_5": "qwen3_5",
    "gated_deltanet": "fla",
    "delta_net": "fla",
    "longformer": "longformer",
    "led": "led",
}

Table = Mapping[str, str | tuple[str, ...]]  # edgemem name → checkpoint name(s), concatenated along dim 0


def read_config(directory: str | Path) -> dict[str, Any]:
    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError(f"{directory} is not a directory (expected a save_pretrained directory with {CONFIG})")
    path = directory / CONFIG
    if not path.is_file():
        raise ConfigError(f"{directory} has no {CONFIG} (expected a save_pretrained directory)")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return config


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint: `model.safetensors`, or the shards named by its index."""
    directory = Path(directory)
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"{index} is not a valid safetensors index: {e}") from None
        files = sorted(set(weight_map.values()))
    elif (directory / WEIGHTS).is_file():
        weight_map, files = None, [WEIGHTS]
    else:
        found = sorted(p.name for p in directory.glob("*.safetensors"))
        detail = f"found {', '.join(found)} but no {INDEX}" if found else "found no .safetensors file"
        raise ConfigError(f"{directory}: expected {WEIGHTS} or {INDEX} with its shards; {detail}")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        path = directory / name
        if not path.is_file():
            raise ConfigError(f"{directory}: shard {name} listed in {INDEX} is missing")
        try:
            part = load_file(path)
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{path} is not a readable safetensors file: {e}") from None
        if weight_map is not None:
            absent = sorted(k for k, f in weight_map.items() if f == name and k not in part)
            if absent:
                raise ConfigError(f"{path} lacks {absent[0]}, which {INDEX} places there")
        weights.update(part)
    return weights


def family(model_type: str) -> Any:
    """The family module that builds `model_type`."""
    if model_type not in FAMILIES:
        raise ConfigError(f"model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}")
    name = f"{__package__}.{FAMILIES[model_type]}"
    try:
        return import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        raise ConfigError(f"model_type {model_type!r} needs {name}, which this installation lacks") from None


def from_hf(directory: str | Path) -> nn.Module:
    """The model in `directory` (a `save_pretrained` directory) as an edgemem module, in eval mode."""
    config = read_config(directory)
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise ConfigError(f"{Path(directory) / CONFIG} has no model_type; supported: {', '.join(FAMILIES)}")
    module = family(model_type)
    weights = read_weights(directory)
    model = module.build(config, weights)
    log.info("imported %s from %s", model_type, directory)
    return model.eval()


def tokenizer_files(directory: str | Path) -> list[Path]:
    """The tokenizer files of `directory` that travel with an export (tokenizer.json is what the runtime reads)."""
    directory = Path(directory)
    return [directory / name for name in TOKENIZER_FILES if (directory / name).is_file()]


def require(config: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """`config[key]`, checked to be present and of `kind`."""
    if key not in config or config[key] is None:
        raise ConfigError(f"{where}: {key} is missing")
    value = config[key]
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise ConfigError(f"{where}: {key} must be {getattr(kind, '__name__', kind)}; got {value!r}")
    return value


def tied_ignore(weights: Mapping[str, torch.Tensor], head: str, embedding: str) -> list[str]:
    """With tied embeddings a checkpoint may still hold the head: then it must be the embedding again."""
    if head in weights and embedding in weights and not torch.equal(weights[head], weights[embedding]):
        raise ConfigError(f"config.json ties the embeddings but {head} differs from {embedding}")
    return [head]


def load_table(
    model: nn.Module, weights: Mapping[str, torch.Tensor], table: Table, *, ignore: Iterable[str] = ()
) -> None:
    """Fill `model` from `weights` by `table` (edgemem name → checkpoint name, or names concatenated
    along dim 0). Every parameter must be mapped, every checkpoint tensor used (or under an
    `ignore` prefix), and every shape must match what the config implies."""
    params = model.state_dict()
    unmapped = sorted(set(params) - set(table))
    if unmapped:
        raise AssertionError(f"mapping table misses {unmapped}")  # a bug in a family module, not bad input
    used, loaded = set(), {}
    for name, source in table.items():
        sources = (source,) if isinstance(source, str) else tuple(source)
        absent = [s for s in sources if s not in weights]
        if absent:
            raise ConfigError(f"the weights lack {absent[0]}, which config.json implies")
        parts = [weights[s] for s in sources]
        for s, p in zip(sources, parts):
            if p.is_floating_point() and not bool(torch.isfinite(p).all()):
                raise ConfigError(f"the weights' {s} holds NaN or infinite values; nothing was imported")
        want = params[name].shape
        got = torch.Size([sum(p.shape[0] for p in parts), *parts[0].shape[1:]]) if parts[0].dim() else parts[0].shape
        if any(p.shape[1:] != parts[0].shape[1:] for p in parts) or got != want:
            shapes = ", ".join(f"{s} {list(p.shape)}" for s, p in zip(sources, parts))
            raise ConfigError(
                f"tensor shape mismatch: {shapes}; config.json implies {list(want)}"
                + (" (concatenated)" if len(parts) > 1 else "")
            )
        loaded[name] = (torch.cat(parts) if len(parts) > 1 else parts[0]).to(params[name].dtype)
        used.update(sources)
    prefixes = tuple(ignore)
    extra = sorted(k for k in weights if k not in used and not k.startswith(prefixes))
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise ConfigError(
            f"the weights hold {extra[0]}{more}, which config.json does not describe "
            "(more layers or options than configured?)"
        )
    model.load_state_dict(loaded)


__all__ = ["FAMILIES", "from_hf", "load_table", "read_config", "read_weights", "tied_ignore", "tokenizer_files"]


def new_lm(config: LMConfig) -> LM:
    """An `LM` of the `LMConfig` a family read from config.json; what edgemem's layers refuse is a config error."""
    from edgemem.models.lm import LM

    try:
        return LM(config)
    except ConfigError as e:
        raise ConfigError(f"config.json: {e}") from None

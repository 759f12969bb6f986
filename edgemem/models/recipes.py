"""Presets: one TOML recipe per `--arch` in `edgemem/presets/` (or a recipe file of the user's,
such as the examples in the top-level `export/` folder), turned into a config with validated
overrides: an `LMConfig` from `[model]` and `[mixer]`, or, for a recipe that says
`kind = "encoder_decoder"`, a `Seq2SeqConfig` from `[model]` alone."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

from edgemem import presets
from edgemem.config import check_settings, read_toml
from edgemem.errors import ConfigError
from edgemem.models.lm import MIXERS, LMConfig
from edgemem.models.seq2seq import Seq2SeqConfig

_MODEL_KEYS = ("d_model", "n_layers", "mlp_hidden", "vocab_size", "norm_eps")


def _options(cls: type) -> dict[str, inspect.Parameter]:
    """Constructor options of a mixer; `**kwargs` stand for those of `cls.forwards_options_to`."""
    options = {}
    for name, p in inspect.signature(cls).parameters.items():
        if p.kind == inspect.Parameter.VAR_KEYWORD:
            options.update(_options(cls.forwards_options_to))
        elif name != "d_model":
            options[name] = p
    return options


def _check_type(key: str, value: Any, expected: Any) -> Any:
    if isinstance(expected, bool) or isinstance(value, bool):
        ok = isinstance(value, bool) and isinstance(expected, bool)
    elif isinstance(expected, float):
        ok = isinstance(value, (int, float))
        value = float(value) if ok else value
    elif isinstance(expected, list):
        ok = isinstance(value, list) and all(isinstance(v, type(expected[0])) for v in value)
    else:
        ok = isinstance(value, type(expected))
    if not ok:
        raise ConfigError(f"{key} must be of type {type(expected).__name__}; got {value!r} ({type(value).__name__})")
    return value


def load_config(arch: str, **overrides: Any) -> LMConfig | Seq2SeqConfig:
    """The preset `arch` with `overrides` applied (model keys and the mixer's own options; an
    encoder-decoder's keys are the fields of `Seq2SeqConfig`).

    `arch` is a preset name or the path of a recipe file (`*.toml`, same format; its stem names it)."""
    files = presets.files()
    if arch.endswith(".toml"):
        path = Path(arch)
        if not path.is_file():
            raise ConfigError(f"recipe file {arch} does not exist")
        recipe, arch = read_toml(path.read_text(), arch), path.stem
    elif arch in files:
        recipe = read_toml(files[arch].read_text(), f"preset {arch}")
    else:
        raise ConfigError(f"unknown arch {arch!r}; known: {', '.join(sorted(files))} (or a recipe file, *.toml)")
    kind = recipe.pop("kind", "lm")
    if kind == "encoder_decoder":
        return _seq2seq_config(arch, recipe, overrides)
    if kind != "lm":
        raise ConfigError(f"recipe {arch}: kind {kind!r} is not one of lm, encoder_decoder")
    unknown = set(recipe) - {"model", "mixer"}
    if unknown:
        raise ConfigError(
            f"recipe {arch}: unknown section(s) {', '.join(sorted(unknown))}; expected [model] and [mixer]"
        )
    model, mixer = dict(recipe.get("model", {})), dict(recipe.get("mixer", {}))
    mixer_type = mixer.pop("type", None)
    if mixer_type not in MIXERS:
        raise ConfigError(f"recipe {arch}: mixer type {mixer_type!r} is not one of {', '.join(MIXERS)}")
    options = _options(MIXERS[mixer_type])
    defaults = {**{k: p.default for k, p in options.items()}, **mixer}
    for key, value in overrides.items():
        if key in _MODEL_KEYS:
            expected = model.get(key, LMConfig.__dataclass_fields__[key].default)
            model[key] = _check_type(key, value, expected)
        elif key in options:
            expected = defaults[key]
            untyped = expected is inspect.Parameter.empty or expected is None  # the layer checks it
            mixer[key] = value if untyped else _check_type(key, value, expected)
        else:
            known = ", ".join([*_MODEL_KEYS, *options])
            raise ConfigError(f"unknown override {key!r} for arch {arch}; valid keys: {known}")
    for key in ("d_model", "n_layers", "vocab_size"):
        if key in model and model[key] <= 0:
            raise ConfigError(f"{key} must be positive; got {model[key]}")
    if model.get("mlp_hidden", 0) < 0:
        raise ConfigError(f"mlp_hidden must be ≥ 0 (0: no MLP); got {model['mlp_hidden']}")
    check_settings({**model, **mixer}, f"arch {arch}")
    try:
        return LMConfig(arch=arch, mixer=mixer_type, mixer_options=mixer, **model)
    except TypeError as e:
        raise ConfigError(f"recipe {arch}: {e}") from None


_SEQ2SEQ_FIXED = ("arch", "max_length")  # the name, and the KV cache (`edgemem export --max-length`)
_EXAMPLES = {"int": 0, "float": 0.0, "bool": False, "list[int]": [0]}  # a value of each field type, for _check_type


def _seq2seq_config(arch: str, recipe: dict[str, Any], overrides: dict[str, Any]) -> Seq2SeqConfig:
    """An encoder-decoder's config: `[model]` holds `Seq2SeqConfig`'s fields, overrides any of them."""
    unknown = set(recipe) - {"model"}
    if unknown:
        raise ConfigError(
            f"recipe {arch}: unknown section(s) {', '.join(sorted(unknown))}; an encoder-decoder has [model] only"
        )
    fields = {k: f for k, f in Seq2SeqConfig.__dataclass_fields__.items() if k not in _SEQ2SEQ_FIXED}
    model = dict(recipe.get("model", {}))
    for key, value in [*model.items(), *overrides.items()]:
        if key not in fields:
            raise ConfigError(
                f"unknown {'key' if key in model and key not in overrides else 'override'} {key!r} "
                f"for arch {arch}; valid keys: {', '.join(fields)}"
            )
        model[key] = _check_type(key, value, _EXAMPLES[fields[key].type])
    missing = [k for k, f in fields.items() if k not in model and f.default is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"recipe {arch}: [model] lacks {', '.join(missing)}")
    check_settings(model, f"arch {arch}")
    for key in ("pad_token_id", "decoder_start_token_id", "eos_token_id"):
        if key in model and not model[key] < model["vocab_size"]:
            raise ConfigError(f"{key} ({model[key]}) must be a token id below vocab_size ({model['vocab_size']})")
    return Seq2SeqConfig(arch=arch, **model)

"""Models built from edgemem layers: the presets declared in `edgemem/presets/`, checkpoints, imports.

lm          LM: a language model of blocks with one mixer each (LMConfig, MIXERS)
encoder     the bidirectional (encoder) models
seq2seq     EncoderDecoder: LED's shape (the `led` preset and the LED import)
recipes     a preset's config from its recipe (load_config)
preset      build(arch): a preset by name (an LM or an EncoderDecoder), randomly initialised;
            describe / write_sizes: its sizes
checkpoint  save_checkpoint / load_checkpoint, and the tokenizer beside a checkpoint
linearize   a softmax model turned into a hybrid (LiZA) one
hf          from_hf: a Hugging Face / flash-linear-attention directory as an edgemem model
"""

from edgemem.models.checkpoint import checkpoint_tokenizer, load_checkpoint, save_checkpoint, tokenizer_dir
from edgemem.models.hf import from_hf
from edgemem.models.linearize import linearize
from edgemem.models.lm import LM, MIXERS, LMConfig
from edgemem.models.preset import archs, build, describe, state_bytes, write_sizes
from edgemem.models.recipes import load_config

__all__ = [
    "LM",
    "LMConfig",
    "MIXERS",
    "archs",
    "build",
    "describe",
    "from_hf",
    "linearize",
    "write_sizes",
    "checkpoint_tokenizer",
    "load_checkpoint",
    "load_config",
    "save_checkpoint",
    "tokenizer_dir",
    "state_bytes",
]

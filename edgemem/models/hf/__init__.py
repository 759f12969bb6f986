"""Hugging Face / flash-linear-attention checkpoint directories as edgemem models.

importer    from_hf(directory): reads config.json and the safetensors weights, dispatches on
            model_type to a family module; the helpers the families describe their models with
qwen3_5, fla, longformer   the families (MODEL_TYPES, build(config, weights))
cache       the KV cache of hybrid models' attention layers
"""

from edgemem.models.hf.importer import FAMILIES, TOKENIZER_FILES, from_hf, read_config, read_weights, tokenizer_files

__all__ = ["FAMILIES", "TOKENIZER_FILES", "from_hf", "read_config", "read_weights", "tokenizer_files"]

"""edgemem: constant-memory sequence models from PyTorch to edge GPUs and CPUs.

Importing the package is cheap and pulls in neither torch nor onnx; the heavy
subpackages (`edgemem.ops`, `edgemem.layers`, `edgemem.models`) import torch themselves.
"""

from edgemem.errors import ConfigError, EdgememError, ShapeError

__version__ = "0.1.0"

__all__ = ["ConfigError", "EdgememError", "ShapeError", "__version__"]

"""edgemem's stateful streaming runtime: run an export step by step in fixed memory.

    from edgemem.runtime import Engine

    engine = Engine.load("out/gated-deltanet", threads=1)     # reads edgemem.json
    stream = engine.new_stream()
    logits = stream.prefill(b"Hello")                       # [T, V]
    logits = stream.step(int(logits[-1].argmax()))          # [V]
    stream.save("s.safetensors")                            # checkpoint (atomic, verified on load)
    stream = engine.load_stream("s.safetensors")
    print(stream.generate(b"", max_new_tokens=32))          # continue from the checkpoint

Needs numpy, safetensors and a backend's library only (onnxruntime, or TensorRT and cuda-python):
importing it pulls in neither torch nor onnx, and `Engine.load` imports the backend it is asked for.
What every backend shares is described in `edgemem.runtime.base`; each backend in its module
(`edgemem.runtime.ort`, `edgemem.runtime.trt`); the checkpoint format in `edgemem.runtime.state`.
"""

from edgemem.errors import EdgememError
from edgemem.runtime.base import BACKENDS, Engine, Stream
from edgemem.runtime.errors import BackendError, BatchError, StateFileError, TokenError
from edgemem.runtime.prefix import PrefixCache
from edgemem.runtime.sampling import sample
from edgemem.runtime.speculative import GenerationStats
from edgemem.runtime.state import initial_state

__all__ = [
    "BACKENDS",
    "BackendError",
    "BatchError",
    "EdgememError",
    "Engine",
    "GenerationStats",
    "PrefixCache",
    "StateFileError",
    "Stream",
    "TokenError",
    "initial_state",
    "sample",
]

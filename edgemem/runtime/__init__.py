"""edgemem's stateful streaming runtime: run an export step by step in fixed memory.

    from edgemem.runtime import Engine

    engine = Engine.load("out/gated-deltanet", threads=1)     # reads edgemem.json
    stream = engine.new_stream()
    logits = stream.prefill(b"Hello")                       # [T, V]
    logits = stream.step(int(logits[-1].argmax()))          # [V]
    stream.save("s.safetensors")                            # checkpoint (atomic, verified on load)
    stream = engine.load_stream("s.safetensors")
    print(stream.generate(b"", max_new_tokens=32))          # continue from the checkpoint

Needs numpy, onnxruntime and safetensors only: importing it pulls in neither torch nor onnx.
The state and IOBinding design is described in `edgemem.runtime.engine`, the checkpoint
format in `edgemem.runtime.state`.
"""

from edgemem.errors import EdgememError
from edgemem.runtime.engine import BACKENDS, Engine, Stream
from edgemem.runtime.errors import BackendError, BatchError, StateFileError, TokenError
from edgemem.runtime.sampling import sample
from edgemem.runtime.state import initial_state

__all__ = [
    "BACKENDS",
    "BackendError",
    "BatchError",
    "EdgememError",
    "Engine",
    "StateFileError",
    "Stream",
    "TokenError",
    "initial_state",
    "sample",
]

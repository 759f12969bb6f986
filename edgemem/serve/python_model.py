"""The Triton Python-backend model that `edgemem triton` writes: every export, through edgemem.runtime.

The repository's `model.py` imports `TritonPythonModel` from here (Triton's Python backend loads
it; `triton_python_backend_utils` exists only inside that backend). Parameters come from
`config.pbtxt`: `export` (the export directory, relative to the model directory), `checkpoints`
(where idle sequences go), `max_live`, `idle_seconds`, `threads` and `prefix_cache_bytes` (the engine's
prefix state cache: sequences that start with the same prompt, or a common prefix of it, restore its
state instead of prefilling it again; `edgemem.runtime.prefix`).

A request: input `TOKENS` (int64 [n]; n = 0 asks for the current logits again), the sequence id (Triton's correlation id) and the
sequence START / END flags, as `tritonclient`'s `infer(..., sequence_id=, sequence_start=,
sequence_end=)` sends them. The response: `LOGITS` (float32 [vocab], the next-token logits after the
last token) and `POSITION` (int64 [1], tokens the sequence has consumed). A request that cannot be
served (unknown sequence, bad token ids) gets an error response; the model keeps serving. Idle
sequences are checkpointed after each batch of requests; all live ones when Triton unloads the model.
"""  # noqa: E501

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from edgemem.errors import EdgememError
from edgemem.runtime import Engine
from edgemem.serve.sequences import Sequences

log = logging.getLogger(__name__)

START, END = 1, 2  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_START / _END


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        model_dir = Path(args["model_repository"])
        cache = params.get("prefix_cache_bytes")
        engine = Engine.load(
            model_dir / params["export"],
            threads=int(params.get("threads", "1")),
            prefix_cache_bytes=int(cache) if cache else None,
        )
        self.sequences = Sequences(
            engine,
            model_dir / params["checkpoints"],
            max_live=int(params["max_live"]),
            idle_seconds=float(params["idle_seconds"]),
        )

    def execute(self, requests: list[Any]) -> list[Any]:
        import triton_python_backend_utils as pb_utils

        responses = []
        for request in requests:
            try:
                tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS").as_numpy()
                sequence_id = request.correlation_id()
                if sequence_id in (0, ""):
                    raise EdgememError("the request has no sequence id: pass sequence_id (Triton's correlation id)")
                flags = request.flags()
                logits, position = self.sequences.run(
                    sequence_id, tokens.reshape(-1), start=bool(flags & START), end=bool(flags & END)
                )
                responses.append(
                    pb_utils.InferenceResponse(
                        output_tensors=[
                            pb_utils.Tensor("LOGITS", np.ascontiguousarray(logits, dtype=np.float32)),
                            pb_utils.Tensor("POSITION", np.array([position], dtype=np.int64)),
                        ]
                    )
                )
            except EdgememError as e:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))))
        self.sequences.evict_idle()
        return responses

    def finalize(self) -> None:
        saved = self.sequences.checkpoint_all()
        log.info("checkpointed %d live sequence(s) to %s", saved, self.sequences.checkpoints)

"""Export: any module following the stateful protocol → an export directory of ONNX graphs and a manifest.

exporter   export(): the directory (graphs of every target, weights, state init, tokenizer, edgemem.json)
graphs     one graph (prefill or step) traced from the model, its inputs and outputs
segments   a prefill over segments (a Loop), for models whose prompts run in segments
lower      the targets: generic, ort, onnx27, trt
genai      onnxruntime-genai's genai_config.json, where the graphs fit its contract
verify     an export against the model it came from
"""

from edgemem.export.exporter import DTYPES, OPSET, check_cache_length, export, state_specs

__all__ = ["DTYPES", "OPSET", "check_cache_length", "export", "state_specs"]

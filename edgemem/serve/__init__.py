"""Serving an export with NVIDIA Triton Inference Server.

- `edgemem.serve.repository.write_repository` (`edgemem triton DIR --out REPO`) writes a model
  repository: a Python-backend model on edgemem.runtime for every export, and an
  onnxruntime-backend model with the sequence batcher's implicit state when the graph allows it;
- `edgemem.serve.server.TritonServer` (`edgemem serve REPO`) runs the `tritonserver` of the
  nvidia-pytriton wheel on loopback ports;
- `edgemem.serve.python_model` is that Python-backend model and `edgemem.serve.sequences.Sequences`
  its store of live streams. These two import only the runtime (numpy, onnxruntime,
  safetensors): the server's Python needs no torch or onnx.
"""

"""Triton Inference Server as a consumer: the model repository `edgemem triton` writes, checked against
Triton's own model-config schema, and a real `tritonserver` (nvidia-pytriton wheel) serving the
Python-backend model over gRPC, compared bit for bit with the same streams run alone in edgemem.runtime."""

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from edgemem.cli import main
from edgemem.export import export, state_specs
from edgemem.manifest import STATE_INIT, Manifest
from edgemem.manifest import load as load_manifest
from edgemem.models import build
from edgemem.runtime import Engine, TokenError
from edgemem.serve.repository import CONTROLS, onnx_reasons, write_repository
from edgemem.serve.sequences import SequenceError, Sequences
from edgemem.serve.server import ServerError, TritonServer

grpcclient = pytest.importorskip(
    "tritonclient.grpc", reason="tritonclient is not installed (pip install 'edgemem-toolkit[serve]')"
)
from google.protobuf import text_format  # noqa: E402  (comes with tritonclient[grpc])
from tritonclient.grpc import model_config_pb2  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

SMALL = {"d_model": 32, "mlp_hidden": 32, "n_layers": 2, "num_heads": 2}
MODEL = "gated-deltanet"
MAX_LIVE = 4  # fewer than the 8 interleaved sequences: the server evicts and restores all along


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("triton") / "gdn"
    export(build(MODEL, seed=0, **SMALL), out, targets=["generic"], extra_config={"seed": 0})
    return out


@pytest.fixture(scope="module")
def engine(export_dir):
    return Engine.load(export_dir, threads=1)


@pytest.fixture(scope="module")
def repo(export_dir, tmp_path_factory):
    return write_repository(export_dir, tmp_path_factory.mktemp("repo") / "models", max_live=MAX_LIVE)


@pytest.fixture(scope="module")
def server(repo, tmp_path_factory):
    pytest.importorskip(
        "pytriton", reason="tritonserver comes from the nvidia-pytriton wheel (pip install 'edgemem-toolkit[serve]')"
    )
    server = TritonServer(repo.path, log_file=tmp_path_factory.mktemp("log") / "tritonserver.log")
    with server:
        yield server


def _infer(client, sequence_id, tokens, start=False, end=False):
    tokens = np.asarray(tokens, dtype=np.int64)
    request = grpcclient.InferInput("TOKENS", list(tokens.shape), "INT64")
    request.set_data_from_numpy(tokens)
    result = client.infer(MODEL, [request], sequence_id=sequence_id, sequence_start=start, sequence_end=end)
    return result.as_numpy("LOGITS"), int(result.as_numpy("POSITION")[0])


def _alone(engine, prompt, tokens):
    """Logits after the prompt and after each following token, in one stream of edgemem.runtime."""
    stream = engine.new_stream()
    out = [stream.prefill(prompt, all_logits=False)]
    out += [stream.step(t) for t in tokens]
    return out


def _prompt(seed, n=None):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, n or int(rng.integers(2, 12))).tolist()


# ---------------------------------------------------------------- the repository


def test_onnx_backend_config_is_valid_triton_config_with_the_manifest_state(repo, export_dir):
    import onnxruntime as ort

    manifest = load_manifest(export_dir)
    config = text_format.Parse(
        (repo.path / repo.onnx_model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig()
    )
    assert config.backend == "onnxruntime" and config.max_batch_size >= 1
    fp32 = model_config_pb2.DataType.Value("TYPE_FP32")
    states = [(s.input_name, s.output_name, s.data_type, list(s.dims)) for s in config.sequence_batching.state]
    assert states == [(s.input, s.output, fp32, s.shape[1:]) for s in manifest.state]
    for s in config.sequence_batching.state:
        assert (
            len(s.initial_state) == 1 and s.initial_state[0].zero_data and list(s.initial_state[0].dims) == list(s.dims)
        )
    controls = {
        c.name: model_config_pb2.ModelSequenceBatching.Control.Kind.Name(c.control[0].kind)
        for c in config.sequence_batching.control_input
    }
    assert controls == dict(CONTROLS)
    assert [i.name for i in config.input] == ["input_ids"] and [o.name for o in config.output] == ["logits"]

    # the model file takes exactly what Triton will feed it: inputs, states and controls; and computes the export's graph  # noqa: E501
    model = ort.InferenceSession(
        str(repo.path / repo.onnx_model / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    original = ort.InferenceSession(str(export_dir / "generic" / "prefill.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in model.get_inputs()] == [i.name for i in original.get_inputs()] + [n for n, _ in CONTROLS]
    feeds = {"input_ids": np.array([_prompt(1, 5), _prompt(2, 5)], dtype=np.int64)}
    feeds |= {
        s.input: np.random.default_rng(3).standard_normal([2, *s.shape[1:]]).astype(np.float32) for s in manifest.state
    }
    controls = {n: np.ones([2, 1], dtype=np.uint64 if n == "CORRID" else np.int32) for n, _ in CONTROLS}
    for got, expected in zip(model.run(None, feeds | controls), original.run(None, feeds)):
        np.testing.assert_array_equal(got, expected)


def test_python_backend_config_is_valid_triton_config(repo, export_dir):
    config = text_format.Parse((repo.path / MODEL / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert config.backend == "python" and not config.HasField("sequence_batching")
    assert {k: v.string_value for k, v in config.parameters.items()}["max_live"] == str(MAX_LIVE)
    assert load_manifest(repo.path / MODEL / "export").identity() == load_manifest(export_dir).identity()


@pytest.mark.slow
def test_onnx_backend_initial_state_from_state_init_as_raw_data(tmp_path):
    from safetensors.numpy import load_file

    export(build("aft", seed=0, d_model=32, mlp_hidden=32, n_layers=1), tmp_path / "aft", targets=["generic"])
    manifest = load_manifest(tmp_path / "aft")
    repo = write_repository(tmp_path / "aft", tmp_path / "repo")
    model = tmp_path / "repo" / repo.onnx_model
    config = text_format.Parse((model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    stored = load_file(str(tmp_path / "aft" / STATE_INIT))
    from_file = [s for s in config.sequence_batching.state if s.initial_state[0].data_file]
    assert len(from_file) == sum(s.init == "file" for s in manifest.state) > 0
    for s in from_file:
        raw = (model / "initial_state" / s.initial_state[0].data_file).read_bytes()
        assert raw == stored[s.input_name][0].astype("<f4").tobytes()


def test_no_onnx_backend_model_where_implicit_state_cannot_hold_the_state():
    def manifest(arch, **overrides):
        model = build(arch, seed=0, **{**SMALL, **overrides})
        return Manifest(
            arch=arch,
            config={"vocab_size": 256},
            opset=20,
            targets=["generic"],
            state=state_specs(model),
            graphs={"prefill": True, "step": True},
        )

    assert onnx_reasons(manifest("gated-deltanet")) == []
    assert any("grows with the position" in r for r in onnx_reasons(manifest("softmax")))
    assert any("one scalar per row" in r for r in onnx_reasons(manifest("titans-mag", window=8, chunk_size=4)))


def test_cli_writes_a_repository_and_refuses_to_overwrite(export_dir, tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["triton", str(export_dir), "--out", str(tmp_path / "r"), "--max-live", "2"])
    assert result.exit_code == 0, result.output
    assert f"{MODEL}-onnx (onnxruntime backend" in result.output
    assert (tmp_path / "r" / MODEL / "1" / "model.py").is_file()
    again = runner.invoke(main, ["triton", str(export_dir), "--out", str(tmp_path / "r")])
    assert again.exit_code == 2 and "not empty" in again.output


def test_the_served_model_needs_only_the_runtime():
    code = (
        "import sys, edgemem.serve.python_model, edgemem.serve.server; "
        "bad = {'torch', 'onnx', 'onnxscript'} & set(sys.modules); assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_server_refuses_a_directory_without_models(tmp_path):
    with pytest.raises(ServerError, match="edgemem triton"):
        TritonServer(tmp_path)


# ---------------------------------------------------------------- the sequence store (no server)


def test_sequences_evict_least_recently_used_and_idle_then_restore_identically(engine, tmp_path):
    now = [0.0]
    seqs = Sequences(engine, tmp_path, max_live=2, idle_seconds=10, clock=lambda: now[0])
    a, b, c = _prompt(10), _prompt(11), _prompt(12)
    seqs.run(1, a, start=True)
    seqs.run(2, b, start=True)
    seqs.run(1, [7])  # sequence 2 is now the least recently used
    seqs.run(3, c, start=True)
    assert seqs.live == ["1", "3"] and seqs.path(2).is_file()
    now[0] = 20.0
    assert seqs.evict_idle() == ["1", "3"] and seqs.live == []
    logits, position = seqs.run(2, [9])  # restored from its checkpoint
    expected = _alone(engine, b, [9])
    np.testing.assert_array_equal(logits, expected[-1])
    assert position == len(b) + 1
    with pytest.raises(TokenError):  # a bad START does not replace the sequence
        seqs.run(1, [256], start=True)
    np.testing.assert_array_equal(seqs.run(1, [8])[0], _alone(engine, a, [7, 8])[-1])
    seqs.run(2, [5], end=True)
    assert "2" not in seqs.live and not seqs.path(2).exists()
    with pytest.raises(SequenceError, match="START"):
        seqs.run(2, [5])
    with pytest.raises(SequenceError):
        seqs.run("../x", [5], start=True)


# ---------------------------------------------------------------- a real tritonserver


def test_interleaved_sequences_over_grpc_match_streams_run_alone(server, engine):
    sequences = list(range(101, 109))  # 8 sequences, 4 client threads, each interleaving 2
    steps = 12
    results, errors = {}, []

    def client_thread(mine):
        try:
            client = grpcclient.InferenceServerClient(server.grpc_url)
            out = {s: [_infer(client, s, _prompt(s), start=True)] for s in mine}
            for i in range(steps):
                for s in mine:
                    out[s].append(_infer(client, s, [int(out[s][-1][0].argmax())], end=i == steps - 1))
            results.update(out)
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=client_thread, args=(sequences[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for s in sequences:
        served = results[s]
        tokens = [int(logits.argmax()) for logits, _ in served[:-1]]
        expected = _alone(engine, _prompt(s), tokens)
        assert [p for _, p in served] == [len(_prompt(s)) + i for i in range(steps + 1)]
        for (logits, _), ref in zip(served, expected):
            assert logits.dtype == np.float32 and np.array_equal(logits, ref)  # bit-identical


def test_evicted_sequence_is_restored_and_continues_bit_identically(server, repo, engine):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    prompt = _prompt(201)
    _infer(client, 201, prompt, start=True)
    _infer(client, 201, [3])
    others = range(202, 202 + MAX_LIVE)  # the fourth of these pushes 201, least recently used, out of memory
    for other in others:
        _infer(client, other, _prompt(other), start=True)
    checkpoint = repo.path / MODEL / "checkpoints" / "201.safetensors"
    assert checkpoint.is_file()
    logits, position = _infer(client, 201, [4])
    assert position == len(prompt) + 2
    assert np.array_equal(logits, _alone(engine, prompt, [3, 4])[-1])
    for s in [201, *others]:
        _infer(client, s, [5], end=True)
    assert not checkpoint.exists() and not list(checkpoint.parent.iterdir())


def test_bad_requests_get_error_responses_and_the_model_keeps_serving(server, engine):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException, match="not live and has no checkpoint"):
        _infer(client, 401, [1])
    prompt = _prompt(402)
    _infer(client, 402, prompt, start=True)
    with pytest.raises(InferenceServerException, match="outside the vocabulary"):
        _infer(client, 402, [256])
    with pytest.raises(InferenceServerException, match="outside the vocabulary"):
        _infer(client, 402, [5, -1])
    with pytest.raises(InferenceServerException, match="empty"):
        _infer(client, 403, [], start=True)
    with pytest.raises(InferenceServerException, match="no sequence id"):
        _infer(client, 0, [1], start=True)
    with pytest.raises(InferenceServerException, match="sequence id"):
        _infer(client, "../x", [1], start=True)
    assert _infer(client, "chat-1", prompt, start=True, end=True)[1] == len(prompt)  # string ids work too
    assert client.is_model_ready(MODEL)
    # the failed requests left the stream as it was; no tokens: its next-token logits again
    assert np.array_equal(_infer(client, 402, [])[0], _alone(engine, prompt, [])[-1])
    logits, position = _infer(client, 402, [6], end=True)
    assert position == len(prompt) + 1 and np.array_equal(logits, _alone(engine, prompt, [6])[-1])


def test_server_restart_loses_no_sequence(server, repo, engine):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    sequences = [301, 302, 303]
    for s in sequences:
        _infer(client, s, _prompt(s), start=True)
        _infer(client, s, [s % 256])
    client.close()
    assert server.stop() == 0
    assert all((repo.path / MODEL / "checkpoints" / f"{s}.safetensors").is_file() for s in sequences)
    server.start()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    for s in sequences:
        logits, position = _infer(client, s, [1], end=True)
        assert position == len(_prompt(s)) + 2
        assert np.array_equal(logits, _alone(engine, _prompt(s), [s % 256, 1])[-1])


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_edgemem_serve_and_the_sample_client_stream_greedy_bytes(export_dir, engine, tmp_path):
    pytest.importorskip(
        "pytriton", reason="tritonserver comes from the nvidia-pytriton wheel (pip install 'edgemem-toolkit[serve]')"
    )
    write_repository(export_dir, tmp_path / "models", name="mine")  # the client asks the server for the name
    grpc_port = _free_port()
    cli = [sys.executable, "-c", "from edgemem.cli import main; main()"]
    serve = subprocess.Popen(
        [*cli, "serve", str(tmp_path / "models"), "--grpc-port", str(grpc_port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        deadline = time.monotonic() + 120
        while not _ready(client, "mine"):
            assert serve.poll() is None and time.monotonic() < deadline, serve.stdout.read().decode()[-2000:]
            time.sleep(0.3)
        sample = Path(__file__).resolve().parents[1] / "samples" / "triton-server" / "stream_client.py"
        run = subprocess.run(
            [
                sys.executable,
                str(sample),
                "--url",
                f"127.0.0.1:{grpc_port}",
                "--sequence",
                "7",
                "--prompt",
                "Once upon",
                "--max-new-tokens",
                "8",
            ],
            capture_output=True,
            timeout=60,
        )
        assert run.returncode == 0, run.stderr.decode()
        assert run.stdout == engine.generate(b"Once upon", max_new_tokens=8)
    finally:
        serve.send_signal(signal.SIGTERM)
        output = serve.communicate(timeout=90)[0].decode()
    assert serve.returncode == 0 and "tritonserver stopped (exit code 0)" in output, output[-2000:]
    assert (tmp_path / "models" / "mine" / "checkpoints" / "7.safetensors").is_file()  # live at the stop


def _ready(client, model):
    try:
        return client.is_model_ready(model)
    except InferenceServerException:
        return False

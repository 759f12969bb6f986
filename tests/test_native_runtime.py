"""The native runtime (`native/`, libedgemem's C API) against the Python runtime, on the same exports.

The library and its check program `em_check` (native/tests/em_check.cpp) are built once with CMake,
with AddressSanitizer and UndefinedBehaviorSanitizer, in pytest's cache (an incremental build
afterwards). `em_check` streams an export through the C API and writes its logits; these tests
compare them with `edgemem.runtime` on the same export: a 40-token prefill and 24 greedy steps, a batch
of streams at positions 5 and 11, checkpoints handed over both ways. `em_check` itself checks that a
fork steps like its parent and that misuse is refused with a message, leaving the stream as it was.

Backend "trt" (`em_check --load`): engines.json over placeholder engines, as `edgemem build --rtx`
writes it (edgemem-engines/3) or as /2 wrote it, is refused as the Python trt backend refuses it, and
without TensorRT or a GPU the load is one line naming what is missing; its GPU run needs a GPU,
TensorRT and the plugins.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import _sources_key

from edgemem.manifest import MANIFEST, ManifestError
from edgemem.runtime import Engine

ROOT = Path(__file__).resolve().parents[1]
NATIVE = ROOT / "native"
HEADERS = ROOT.parent / "shared" / "third_party" / "onnxruntime" / "v1.24.4" / "include"
MAX_LENGTH = 96

# Exports of their own: softmax with a preallocated cache (--max-length) and a tiny random Qwen3.5
# hybrid import with one; the presets come from conftest's `small_exports`.
_EXPORT = textwrap.dedent("""
    import sys, torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    from edgemem.export import export
    from edgemem.models import build, from_hf
    from edgemem.models.lm import set_kv_cache
    root, length = sys.argv[1], int(sys.argv[2])
    model = build("softmax", seed=0, d_model=64, n_layers=1)
    set_kv_cache(model, length)
    export(model, f"{root}/softmax-max-length", targets=["ort"])
    config = Qwen3_5TextConfig(
        vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, rms_norm_eps=1e-6, eos_token_id=None, pad_token_id=None,
        bos_token_id=None)
    torch.manual_seed(3)
    hf = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn(p.shape) * 0.2 + (1.0 if "linear_attn.norm" in name else 0.0))
    hf.save_pretrained(f"{root}/qwen3.5-hf")
    model = from_hf(f"{root}/qwen3.5-hf")
    set_kv_cache(model, length)
    export(model, f"{root}/qwen3.5", targets=["ort"])
""")


def _locked_cache(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, name: str):
    cache = getattr(request.config, "cache", None)
    folder = cache.mkdir(name) if cache is not None else tmp_path_factory.mktemp(name)
    lock = open(folder.parent / f"{folder.name}.lock", "w")  # noqa: SIM115 — held until the caller closes it
    fcntl.flock(lock, fcntl.LOCK_EX)
    return folder, lock


@pytest.fixture(scope="session")
def em_check(request, tmp_path_factory) -> list[str]:
    """native/ built with ASan and UBSan (in pytest's cache: later sessions rebuild what changed), or the
    command in $EDGEMEM_EM_CHECK (e.g. an aarch64 build under qemu-user: native/scripts/aarch64.sh)."""
    if os.environ.get("EDGEMEM_EM_CHECK"):
        return os.environ["EDGEMEM_EM_CHECK"].split()
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"the native runtime needs {' and '.join(missing)} to build")
    if not HEADERS.is_dir():
        pytest.skip(f"the native runtime needs onnxruntime's C API headers ({HEADERS} is missing)")
    folder, lock = _locked_cache(request, tmp_path_factory, "edgemem-native-asan")
    with lock:
        build = folder / "build"
        # Debug: a quarter of the compile time of an optimised build; the graphs run in onnxruntime's own code
        subprocess.run(
            [
                "cmake",
                "-S",
                NATIVE,
                "-B",
                build,
                "-DEDGEMEM_SANITIZE=ON",
                "-DCMAKE_BUILD_TYPE=Debug",
                f"-DPython3_EXECUTABLE={sys.executable}",
                f"-DONNXRUNTIME_INCLUDE_DIR={HEADERS}",
            ],
            check=True,
            capture_output=True,
        )
        result = subprocess.run(
            ["cmake", "--build", build, "--target", "em_check", "-j", "2"], capture_output=True, text=True
        )
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return [str(build / "em_check")]


@pytest.fixture(scope="session")
def native_exports(request, tmp_path_factory, small_exports) -> dict[str, Path]:
    folder, lock = _locked_cache(request, tmp_path_factory, "edgemem-native-exports")
    with lock:
        key = hashlib.sha256((_sources_key("native", MAX_LENGTH) + _EXPORT).encode()).hexdigest()[:16]
        root = folder / key
        if not (root / "complete").is_file():
            shutil.rmtree(root, ignore_errors=True)
            result = subprocess.run(
                [sys.executable, "-c", _EXPORT, root, str(MAX_LENGTH)], capture_output=True, text=True
            )
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            (root / "complete").touch()
    return {
        "deltanet": small_exports["deltanet"],
        "titans-mag": small_exports["titans-mag"],
        "softmax": small_exports["softmax"],
        "softmax-max-length": root / "softmax-max-length",
        "qwen3.5": root / "qwen3.5",
    }


EXPORTS = ["deltanet", "titans-mag", "softmax", "softmax-max-length", "qwen3.5"]


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


class Run:
    """One `em_check` run on an export: its work folder, the prompt, and the Python engine beside it."""

    def __init__(self, directory: Path, work: Path, em_check: list[str], backend: str = "ort"):
        self.engine = Engine.load(directory, threads=1) if backend == "ort" else Engine.load(directory, backend=backend)
        self.vocab = self.engine.vocab_size
        self.work = work
        self.prompt = np.random.default_rng(0).integers(0, self.vocab, 40).astype(np.int64)
        self.prompt.tofile(work / "prompt.i64")
        python = self.engine.new_stream()
        python.prefill(self.prompt[:17])
        python.save(work / "py.state")
        env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0", "UBSAN_OPTIONS": "print_stacktrace=1"}
        self.result = subprocess.run(
            [*em_check, directory, work, backend], capture_output=True, text=True, env=env, timeout=600
        )

    def read(self, name: str, *shape: int) -> np.ndarray:
        dtype = np.int64 if name.endswith(".i64") else np.float32
        return np.fromfile(self.work / name, dtype=dtype).reshape(*shape)


_runs: dict[str, Run] = {}


@pytest.fixture(params=EXPORTS)
def run(request, em_check, native_exports, tmp_path_factory) -> Run:
    name = request.param
    if name not in _runs:
        _runs[name] = Run(native_exports[name], tmp_path_factory.mktemp(f"native-{name}"), em_check)
    return _runs[name]


def test_the_c_checks_pass_clean_under_asan_and_ubsan(run):
    """em_check's own checks: fork ≡ parent, batch member continues alone, and every misuse (missing directory,
    token -1 or >= vocab, empty prefill, garbage, missing, truncated or flipped state files, a stream twice in
    a batch, saving onto a directory) is refused with a code and a message and leaves the stream as it was."""
    output = run.result.stdout + run.result.stderr
    assert run.result.returncode == 0 and "all checks passed" in output, output[-6000:]
    assert "AddressSanitizer" not in output and "runtime error" not in output and "LeakSanitizer" not in output
    assert output.count("ok   ") >= 18


def test_c_logits_equal_python_after_a_40_token_prefill_and_24_greedy_steps(run):
    greedy, tokens = run.read("greedy.f32", 25, run.vocab), run.read("greedy.i64", 24)
    stream = run.engine.new_stream()
    python = [stream.prefill(run.prompt, all_logits=False)]
    for token in tokens:
        assert int(np.argmax(python[-1])) == token  # the same greedy choice
        python.append(stream.step(int(token)))
    assert max(_rel(c, p) for c, p in zip(greedy, python)) <= 1e-5


def test_a_batch_at_positions_5_and_11_equals_each_stream_alone_and_python(run):
    batch, alone = run.read("batch.f32", 3, 2, run.vocab), run.read("alone.f32", 3, 2, run.vocab)
    assert _rel(batch, alone) <= 1e-5
    a, b = run.engine.new_stream(), run.engine.new_stream()
    a.prefill(run.prompt[:5])
    b.prefill(run.prompt[6:11] if run.engine.grows else run.prompt[:11])  # a growing cache batches equal lengths only
    python = [run.engine.step_batch([a, b], [int(run.prompt[20 + k]), int(run.prompt[30 + k])]) for k in range(3)]
    assert _rel(batch, np.stack(python)) <= 1e-5


def test_a_checkpoint_written_by_c_continues_in_python_and_one_written_by_python_in_c(run):
    greedy, continued = run.read("greedy.f32", 25, run.vocab), run.read("c_cont.f32", 8, run.vocab)
    restored = run.engine.load_stream(run.work / "c.state")
    assert restored.position == 64 and _rel(restored.logits, greedy[-1]) == 0
    assert _rel(np.stack([restored.step(int(t)) for t in run.prompt[:8]]), continued) <= 1e-5
    python = run.engine.load_stream(run.work / "py.state")
    expected = [python.logits] + [python.step(int(t)) for t in run.prompt[:8]]
    assert _rel(run.read("from_py.f32", 9, run.vocab), np.stack(expected)) <= 1e-5


def test_the_sample_app_builds_on_the_installed_package_and_generates_what_python_does(
    em_check, native_exports, tmp_path
):
    """`cmake --install` gives headers, the library and a CMake package that samples/native builds against
    (find_package(edgemem)); its greedy tokens, before and after resuming from its checkpoint, are the Python
    runtime's."""
    if os.environ.get("EDGEMEM_EM_CHECK"):
        pytest.skip("builds for this machine only")
    build = Path(em_check[0]).parent
    prefix = tmp_path / "prefix"
    subprocess.run(["cmake", "--install", build, "--prefix", prefix], check=True, capture_output=True)
    assert (prefix / "include" / "edgemem" / "edgemem.h").is_file() and (prefix / "lib" / "libedgemem.so").exists()
    assert (prefix / "lib" / "cmake" / "edgemem" / "edgememConfig.cmake").is_file()
    sample = tmp_path / "sample"
    for command in (
        ["cmake", "-S", ROOT / "samples" / "native", "-B", sample, f"-DCMAKE_PREFIX_PATH={prefix}"],
        ["cmake", "--build", sample],
    ):
        result = subprocess.run(command, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env["ASAN_OPTIONS"] = "detect_leaks=1"
    directory, prompt = native_exports["deltanet"], [72, 101, 108, 108, 111]
    out = subprocess.run(
        [sample / "generate", directory, tmp_path / "s.state", *map(str, prompt), "--tokens", "8"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = {
        line.split(":")[0].split(";")[-1].strip(): line.split(":")[-1].split()
        for line in out.stdout.splitlines()
        if ":" in line
    }
    tokens = [int(t) for t in lines["generated"] + lines["resumed"]]
    assert tokens == list(Engine.load(directory, threads=1).generate(prompt, max_new_tokens=16))


# ---------------------------------------------------------------------- backend "trt": what runs without a GPU
def _load(em_check: list[str], directory: Path, backend: str, plugins: Path | None = None, env=None) -> str:
    """em_check --load: "loaded", or the refusal's code and message."""
    command = [*em_check, "--load", directory, backend, *([plugins] if plugins else [])]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    clean = not any(word in result.stderr for word in ("AddressSanitizer", "LeakSanitizer", "runtime error"))
    assert result.returncode == 0 and clean, result.stdout + result.stderr
    return result.stdout.strip()


def test_trt_backend_refuses_what_the_python_backend_refuses_before_tensorrt(
    em_check, small_exports, tmp_path, monkeypatch
):
    """em_engine_load_ex(backend "trt") checks engines.json as edgemem.runtime.engines does, before opening
    TensorRT: the same refusals (code EM_ERR_BACKEND = 3) with the same messages as the Python backend, for
    engines.json as `edgemem build` writes it (edgemem-engines/3: one engine, a profile per graph)."""
    from test_trt_runtime import RTX, _fake_engines

    from edgemem.errors import EdgememError
    from edgemem.trt_build import ENGINE

    if os.environ.get("EDGEMEM_EM_CHECK"):
        pytest.skip("the placeholder engines are made on this machine")
    env = {k: v for k, v in os.environ.items() if k not in ("EDGEMEM_TRT_PLUGINS", "LD_LIBRARY_PATH")}
    export = tmp_path / "deltanet"
    shutil.copytree(small_exports["deltanet"], export)
    folder = export / "engines"

    def both(pattern: str, plugins: Path | None = None) -> None:
        c = _load(em_check, export, "trt", plugins, env)
        assert c.splitlines()[0] == "code 3" and re.search(pattern, c), c
        with pytest.raises(EdgememError, match=pattern):
            Engine.load(export, backend="trt", plugins=plugins)

    monkeypatch.delenv("EDGEMEM_TRT_PLUGINS", raising=False)
    both(r"engines: no TensorRT engines; build them with `edgemem build")
    library = _fake_engines(export, folder, toolkit=RTX)  # engines.json as `edgemem build --rtx` writes it
    both(
        r"no plugin library: .* EDGEMEM_TRT_PLUGINS=PATH, PATH being libedgemem_trt_plugins.so; "
        r"the engines were built with"
    )
    both(r"plugin library .*missing.so does not exist", tmp_path / "missing.so")
    other = tmp_path / "other.so"
    other.write_bytes(b"another build")
    both(r"plugin library .*other.so is not the one the engines were built with", other)

    good = json.loads((folder / "engines.json").read_text())
    refused = [
        (lambda i: i.update(format="edgemem-engines/1"), "format 'edgemem-engines/1', expected 'edgemem-engines/3'"),
        (lambda i: i.pop("format"), "format None, expected 'edgemem-engines/3'"),
        (lambda i: i["engines"]["prefill"].update(profile_index=0), f"the graphs that {ENGINE} serves need distinct"),
        (lambda i: i["engines"]["prefill"].update(sha256="0" * 64), f"the graphs that {ENGINE} serves need distinct"),
        (lambda i: i["engines"]["step"].pop("profile_index"), "engine 'step' needs a profile_index (0, 1, ...)"),
        (lambda i: i["engines"]["prefill"].update(profile_index=-1), "engine 'prefill' needs a profile_index"),
        (lambda i: i["engines"]["prefill"].update(profile_index=True), "engine 'prefill' needs a profile_index"),
        (lambda i: i.update(shared="none"), "'shared' is 'none' for 1 engine file(s)"),
        (lambda i: i.pop("shared"), "'shared' is None for 1 engine file(s)"),
    ]
    for change, message in refused:
        info = json.loads(json.dumps(good))
        change(info)
        (folder / "engines.json").write_text(json.dumps(info))
        both(rf"is not a valid engines.json \(.*{re.escape(message)}.*\); rebuild with", library)
    (folder / "engines.json").write_text(json.dumps(good))

    (folder / ENGINE).write_bytes(b"changed")
    both(rf"{ENGINE} does not match its sha256 in engines.json .*--rtx", library)
    (folder / ENGINE).unlink()
    both(rf"the step engine {ENGINE} listed in engines.json is missing", library)  # the first record, in both
    _fake_engines(small_exports["titans-mag"], folder, toolkit=RTX)
    both(r"holds engines built from another export \(arch titans-mag.*is deltanet.*rebuild with", library)
    (folder / "engines.json").write_text("{")
    both(r"is not a valid engines.json", library)
    (folder / "engines.json").unlink()
    both(r"has no engines.json", library)

    growing = _load(em_check, small_exports["softmax"], "trt", None, env)
    assert growing.splitlines()[0] == "code 3" and re.search(
        r"state grows .*backend 'trt' runs fixed-size state only", growing
    )
    with pytest.raises(EdgememError, match=r"state grows .*backend 'trt' runs fixed-size state only"):
        Engine.load(small_exports["softmax"], backend="trt")


def test_an_encoder_decoder_export_is_refused_with_one_line(em_check, small_exports):
    """libedgemem streams decoder-only exports: an LED export, whose streams start from its encoder, is refused at
    load on either backend, naming what it is and what runs it."""
    for backend in ("ort", "trt"):
        refused = _load(em_check, small_exports["led"], backend)
        assert refused.splitlines()[0] == "code 3" and "led is an encoder-decoder" in refused, refused
        assert "use the Python runtime" in refused and len(refused.splitlines()) == 2


def test_a_manifest_steps_value_it_does_not_know_is_refused_as_python_refuses_it(em_check, small_exports, tmp_path):
    """`steps` other than "step", or "prefill_last" where the export has that graph: the line
    `edgemem.manifest.load` gives (the value in JSON quotes), with code EM_ERR_MANIFEST."""
    shutil.copytree(small_exports["gated-deltanet"], tmp_path / "x")
    manifest = json.loads((tmp_path / "x" / MANIFEST).read_text())
    manifest["steps"] = "prefill"
    (tmp_path / "x" / MANIFEST).write_text(json.dumps(manifest))
    refused = _load(em_check, tmp_path / "x", "ort")
    assert refused.splitlines()[0] == "code 2", refused
    expected = "expected 'step', or 'prefill_last' where graphs has it"
    assert f'steps is "prefill"; {expected}' in refused
    with pytest.raises(ManifestError, match=f"steps is 'prefill'; {expected}"):
        Engine.load(tmp_path / "x", check_files=False)


def test_trt_backend_without_tensorrt_or_a_gpu_is_one_line_naming_what_to_install(em_check, small_exports, tmp_path):
    """Every check passed, the library engines.json names is opened at run time: missing, it is one line naming
    the package; present (the tensorrt_rtx wheel's libtensorrt_rtx.so.1), another version is refused, and the
    same version goes on to the CUDA driver, which a machine without a GPU lacks."""
    from test_trt_runtime import RTX, _fake_engines, _separate_engines

    from edgemem.runtime import engines

    if os.environ.get("EDGEMEM_EM_CHECK"):
        pytest.skip("the placeholder engines are made on this machine")
    env = {k: v for k, v in os.environ.items() if k not in ("EDGEMEM_TRT_PLUGINS", "LD_LIBRARY_PATH")}
    export = tmp_path / "deltanet"
    shutil.copytree(small_exports["deltanet"], export)
    library = _fake_engines(export, export / "engines", toolkit=RTX)
    missing = _load(em_check, export, "trt", library, env)
    lines = missing.splitlines()
    assert len(lines) == 2 and lines[0] == "code 3", missing
    assert re.search(
        r"needs TensorRT for RTX 1.7.1.116: libtensorrt_rtx.so.1 cannot be loaded "
        r".*pip install tensorrt-rtx-cu13==1.7.1.116",
        lines[1],
    )
    _separate_engines(export, export / "engines")  # edgemem-engines/2 (a step and a prefill engine) gets as far
    assert _load(em_check, export, "trt", library, env) == missing
    (export / "engines" / "prefill.engine").write_bytes(b"changed")  # and its second engine file is checked
    assert "prefill.engine does not match its sha256 in engines.json" in _load(em_check, export, "trt", library, env)

    spec = importlib.util.find_spec("tensorrt_rtx_libs")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the tensorrt_rtx wheel's libraries (pip install tensorrt-rtx-cu13) are not installed")
    import tensorrt_rtx

    env["LD_LIBRARY_PATH"] = list(spec.submodule_search_locations)[0]
    _fake_engines(
        export, export / "engines", toolkit=engines.Toolkit("tensorrt_rtx", "1.0.0.1", RTX.compute_capabilities)
    )
    older = _load(em_check, export, "trt", library, env)
    version = tensorrt_rtx.__version__
    assert f"built by TensorRT for RTX 1.0.0.1, this is TensorRT for RTX {version}; rebuild them with" in older
    _fake_engines(export, export / "engines", toolkit=engines.Toolkit("tensorrt_rtx", tensorrt_rtx.__version__, []))
    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip(
            "this machine has the CUDA driver: the engines here are placeholders "
            "(a GPU run needs `edgemem build --rtx`)"
        )
    except OSError:
        pass
    gpu = _load(em_check, export, "trt", library, env)
    assert gpu.splitlines() == ["code 3", gpu.splitlines()[1]], gpu
    assert "backend 'trt' needs an NVIDIA GPU and its driver: libcuda.so.1 cannot be loaded" in gpu


def _gpu_reason() -> str | None:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no NVIDIA driver (libcuda.so.1)"
    if importlib.util.find_spec("tensorrt") is None:
        return "TensorRT's Python package is not installed (edgemem build needs it)"
    if not os.environ.get("EDGEMEM_TRT_PLUGINS"):
        return "EDGEMEM_TRT_PLUGINS does not name a plugin library built from plugins/"
    return None


@pytest.mark.skipif(_gpu_reason() is not None, reason=f"needs a GPU, TensorRT and the plugins: {_gpu_reason()}")
def test_trt_backend_streams_like_the_python_trt_backend_on_a_gpu(em_check, small_exports, tmp_path):
    """The same engines in C and in Python (backend trt): the C checks pass, greedy logits agree, and a
    checkpoint written by C continues in Python. libtensorrt and libcuda come from the loader's path."""
    from edgemem.trt_build import build_engines

    export = tmp_path / "deltanet"
    shutil.copytree(small_exports["deltanet"], export)
    build_engines(export, max_batch=2, max_sequence=64)
    work = tmp_path / "work"
    work.mkdir()
    run = Run(export, work, em_check, backend="trt")
    output = run.result.stdout + run.result.stderr
    assert run.result.returncode == 0 and "all checks passed" in output, output[-6000:]
    greedy, tokens = run.read("greedy.f32", 25, run.vocab), run.read("greedy.i64", 24)
    stream = run.engine.new_stream()
    python = [stream.prefill(run.prompt, all_logits=False)] + [stream.step(int(t)) for t in tokens]
    assert max(_rel(c, p) for c, p in zip(greedy, python)) <= 1e-4
    restored = run.engine.load_stream(work / "c.state")
    assert restored.position == 64 and _rel(restored.logits, greedy[-1]) == 0

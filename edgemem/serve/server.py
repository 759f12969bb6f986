"""Start and stop `tritonserver` from the `nvidia-pytriton` wheel on loopback ports.

    with TritonServer("repo") as server:          # or: edgemem serve repo
        client = tritonclient.grpc.InferenceServerClient(server.grpc_url)

What the wheel's server needs and edgemem arranges (the user does not):
- a backend directory whose `python/` holds the Python backend and the stub built for this
  interpreter's version (the wheel ships one stub per Python version beside the backend); it is
  made of links in a temporary directory that `stop` removes;
- `LD_LIBRARY_PATH` with this interpreter's own `lib/` first (else the stub loads another
  libpython of the same version, e.g. Debian's, and fails inside threading) and the wheel's
  bundled libraries;
- `EDGEMEM_PYTHONPATH` with this environment's site-packages and edgemem's source root, which the
  repository's `model.py` puts first on `sys.path` (the stub's embedded interpreter ignores
  PYTHONPATH), so it imports edgemem, numpy and onnxruntime from the environment that started it.

Ports are free loopback ports chosen at start; addresses are 127.0.0.1 only. The wheel's server has the Python
backend only: `start` loads the repository's Python-backend models (explicit model control) and
waits (bounded) until the server and each of them are ready; `stop` sends SIGTERM,
which unloads the models (the Python model checkpoints its live sequences), and kills the server
if it has not exited in time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from importlib.util import find_spec
from pathlib import Path
from types import TracebackType

import edgemem
from edgemem.errors import EdgememError, named

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
BACKENDS = ("python",)  # the backends the nvidia-pytriton wheel ships


class ServerError(EdgememError):
    """tritonserver is not installed, did not start, or did not become ready in time."""


def _pytriton() -> Path:
    spec = find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("tritonserver comes from the nvidia-pytriton wheel: pip install 'edgemem-toolkit[serve]'")
    return Path(next(iter(spec.submodule_search_locations)))


def _backend(config: Path) -> str:
    match = re.search(r'^\s*backend\s*:\s*"([^"]+)"', config.read_text(), re.MULTILINE)
    return match.group(1) if match else ""


def _check_port(port: int, option: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server would: closed connections do not count
        try:
            s.bind((HOST, port))
        except OSError as e:
            raise ServerError(
                f"port {port} on {HOST} is not free ({e.strerror}): give another {option}, "
                "or leave it out for a free one"
            ) from None


_LOAD_FAILED = re.compile(r"failed to load '([^']+)'[^:]*:\s*(.*)")
_PORT_IN_USE = re.compile(r"(?i)(address already in use|already in use|failed to bind|bind.*fail)")


def failure_cause(text: str) -> str:
    """What tritonserver's log says went wrong while starting: a model that failed to load, a port in use, ..."""
    loads = [m for m in map(_LOAD_FAILED.search, text.splitlines()) if m]
    if loads:
        name, reason = loads[0].groups()
        reason = reason.split("\\n")[0].strip().rstrip('"').strip()  # the log escapes a traceback's newlines
        reason = re.sub(r"^(Internal|Invalid argument|Unavailable)\s*[-:]\s*", "", reason)
        return f"model {name!r} failed to load: {reason[:400] or 'no reason given'}"
    for line in text.splitlines():
        if _PORT_IN_USE.search(line):
            return f"a port is in use ({line.strip()[:200]})"
    errors = [line.strip() for line in text.splitlines() if line.startswith("E") or "error" in line.lower()]
    return errors[-1][:400] if errors else "its log names no cause"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class TritonServer:
    """One tritonserver process serving `repository` (see the module docstring)."""

    def __init__(
        self,
        repository: str | Path,
        *,
        http_port: int | None = None,
        grpc_port: int | None = None,
        log_file: str | Path | None = None,
    ):
        self.repository = Path(repository).resolve()
        if not self.repository.is_dir():
            raise ServerError(f"{self.repository} is not a model repository (write one with `edgemem triton`)")
        configs = {p.name: p / "config.pbtxt" for p in self.repository.iterdir() if (p / "config.pbtxt").is_file()}
        backends = {name: _backend(path) for name, path in configs.items()}
        self.models = sorted(name for name, backend in backends.items() if backend in BACKENDS)
        self.skipped = sorted(set(configs) - set(self.models))  # e.g. onnxruntime: not in the wheel's server
        if not self.models:
            raise ServerError(
                f"{self.repository} holds no model for the {', '.join(BACKENDS)} backend "
                "(write the repository with `edgemem triton`)"
            )
        self.http_port, self.grpc_port = http_port or _free_port(), grpc_port or _free_port()
        self.log_file = Path(log_file) if log_file else None
        self._process: subprocess.Popen | None = None
        self._workdir: Path | None = None
        self._log, self._log_start = self.log_file, 0

    @property
    def grpc_url(self) -> str:
        return f"{HOST}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{HOST}:{self.http_port}"

    def command(self, backends: Path) -> list[str]:
        return [
            str(_pytriton() / "tritonserver" / "bin" / "tritonserver"),
            f"--model-repository={self.repository}",
            f"--backend-directory={backends}",
            f"--http-address={HOST}",
            f"--http-port={self.http_port}",
            f"--grpc-address={HOST}",
            f"--grpc-port={self.grpc_port}",
            "--allow-metrics=false",
            "--allow-sagemaker=false",
            "--allow-vertex-ai=false",
            "--exit-timeout-secs=30",
            "--strict-readiness=true",
            "--model-control-mode=explicit",
            *(f"--load-model={m}" for m in self.models),
        ]

    def environment(self) -> dict[str, str]:
        root = _pytriton()
        env = dict(os.environ)
        libs = [sysconfig.get_config_var("LIBDIR") or "", str(root.parent / "nvidia_pytriton.libs")]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in [*libs, env.get("LD_LIBRARY_PATH", "")] if p)
        paths = [
            str(Path(edgemem.__file__).parents[1]),
            sysconfig.get_paths()["purelib"],
            sysconfig.get_paths()["platlib"],
        ]
        env["EDGEMEM_PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))  # this edgemem first, then its environment
        return env

    def _backends(self, workdir: Path) -> Path:
        """`workdir/backends/python`: links to the wheel's Python backend and this interpreter's stub."""
        root = _pytriton() / "tritonserver"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
        if not stub.is_file():
            raise ServerError(f"nvidia-pytriton has no Python backend stub for Python {version}")
        python = workdir / "backends" / "python"
        python.mkdir(parents=True)
        for source in [*(root / "backends" / "python").iterdir(), stub]:
            if source.is_file():
                (python / source.name).symlink_to(source)
        return python.parent

    def start(self, timeout: float = 120.0) -> TritonServer:
        """Start the server and wait until it and every model are ready (at most `timeout` seconds)."""
        if self._process is not None:
            raise ServerError("this server is already started")
        for port, option in ((self.http_port, "--http-port"), (self.grpc_port, "--grpc-port")):
            _check_port(port, named(option[2:].replace("-", "_"), option))
        self._workdir = Path(tempfile.mkdtemp(prefix="edgemem-triton-"))
        self._log = self.log_file or self._workdir / "tritonserver.log"  # read back when the start fails
        self._log_start = self._log.stat().st_size if self._log.is_file() else 0
        out = open(self._log, "ab")
        try:
            self._process = subprocess.Popen(
                self.command(self._backends(self._workdir)),
                env=self.environment(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            out.close()
        try:
            self._wait_ready(timeout)
        except BaseException:  # Ctrl-C or a failed start: no server left running, no temporary directory left
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        """Until the server and its models are ready; a model that fails to load (its backend crashed) or a server
        that exits ends the wait at once with the cause from the log, and the wait reports progress meanwhile."""
        from edgemem.progress import track

        deadline = time.monotonic() + timeout
        with track(f"starting tritonserver ({', '.join(self.models)})"):
            while time.monotonic() < deadline:
                if self._process.poll() is not None:
                    code = self._process.returncode
                    raise ServerError(
                        f"tritonserver exited with code {code} while starting: {self._failure()}"
                        + (f" (its log: {self.log_file})" if self.log_file else "")
                    )
                if any(map(_LOAD_FAILED.search, self._log_text().splitlines())):
                    raise ServerError(
                        f"tritonserver could not start: {self._failure()}"
                        + (f" (its log: {self.log_file})" if self.log_file else "")
                    )
                if self._ready("/v2/health/ready") and all(self._ready(f"/v2/models/{m}/ready") for m in self.models):
                    log.info("tritonserver ready: grpc %s, http %s", self.grpc_url, self.http_url)
                    return
                time.sleep(0.2)
        raise ServerError(
            f"tritonserver was not ready within {timeout:.0f} s: {self._failure()}"
            + (f" (its log: {self.log_file})" if self.log_file else "")
        )

    def _log_text(self) -> str:
        """What this start wrote to the log so far ("" when it cannot be read)."""
        try:
            with open(self._log, "rb") as f:
                f.seek(self._log_start)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _failure(self, lines: int = 15) -> str:
        """The cause of a failed start as read from this start's log; its last lines go to the log at WARNING."""
        text = self._log_text()
        if not text:
            return "its log is empty or cannot be read"
        tail = [line for line in text.splitlines() if line.strip() and not line.startswith(("|", "+-"))][-lines:]
        if tail:
            log.warning("tritonserver's last log lines:\n%s", "\n".join(f"  {line}" for line in tail))
        return failure_cause(text)

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _ready(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(self.http_url + path, timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, wait up to `timeout` seconds (models unload, sequences are checkpointed), then SIGKILL; a
        Ctrl-C while waiting kills it at once. The temporary directory goes in any case."""
        process, self._process = self._process, None
        try:
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout)
                except subprocess.TimeoutExpired:
                    log.warning("tritonserver did not stop within %.0f s: killing it", timeout)
                    self._kill(process)
                except KeyboardInterrupt:
                    self._kill(process)
                    raise
            return None if process is None else process.returncode
        finally:
            if self._workdir is not None:
                shutil.rmtree(self._workdir, ignore_errors=True)
                self._workdir = None

    @staticmethod
    def _kill(process: subprocess.Popen) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)

    def __enter__(self) -> TritonServer:
        return self.start() if self._process is None else self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


__all__ = ["HOST", "ServerError", "TritonServer"]

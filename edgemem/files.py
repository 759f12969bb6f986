"""Files every tool writes or checks: sha256 of a file, atomic writes of a file or a whole directory,
and the checks an output path goes through before the work it will receive.

Pure Python: the runtime uses these without torch or onnx.

Safety rules (one place for every command):
- an output is checked for writability before long work (`check_output_dir`, `check_output_file`);
- `force` replaces only a directory edgemem wrote (it holds `edgemem.json`), never a command's own input;
- files and directories get the user's umask, like any other tool's (not mkstemp's 0600 / mkdtemp's 0700);
- temporary names carry the writer's pid; ones left by a killed process are removed by the next writer
  (a directory moved aside just before a kill is put back if its replacement never arrived).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from edgemem.errors import EdgememError, named

EXPORT_MARKER = "edgemem.json"  # edgemem.manifest.MANIFEST: the file that makes a directory edgemem's own


class OutputError(EdgememError):
    """An output path that cannot or must not be written."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def umask() -> int:
    """The process umask, read without changing it where the system allows (Linux), else by setting it back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale(folder: Path, pattern: re.Pattern[str]) -> Iterator[Path]:
    """Entries of `folder` matching `pattern` (its group 1 a pid) whose writer is no longer running."""
    try:
        entries = list(folder.iterdir())
    except OSError:
        return
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match and int(match.group(1)) != os.getpid() and not _alive(int(match.group(1))):
            yield entry


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, fsync, rename: readers never see half a file.
    The file gets the user's umask; temporary files of killed writers of `path` are removed."""
    path = Path(path)
    for stale in _stale(path.parent, re.compile(rf"\.{re.escape(path.name)}\.(\d+)\.[^.]+\.tmp")):
        stale.unlink(missing_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror}") from None
    try:
        os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


PROTOBUF_LIMIT = 2**31 - 2**20  # a protobuf message (an .onnx file) must stay under 2 GiB; keep a margin


def save_onnx(model: Any, path: Path) -> list[Path]:
    """Write an onnx.ModelProto to `path` (inside a staged directory); a model past protobuf's 2 GiB limit keeps
    its weights in `<name>.data` beside it (ONNX external data, which onnxruntime finds by the graph's path).
    Returns the files written. Modifies `model` when it moves weights out."""
    import onnx

    if model.ByteSize() < PROTOBUF_LIMIT:
        onnx.save(model, path)
        return [path]
    data = path.with_name(path.name + ".data")
    onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location=data.name, size_threshold=1024)
    data.chmod(0o666 & ~umask())  # onnx creates it 0600
    return [path, data]


def _writable_ancestor(path: Path, what: str) -> Path:
    """The nearest existing ancestor of `path`, checked to be a directory we can create entries in."""
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"{what} {path}: {parent} is a file, not a directory")
    for stale in _stale(parent, re.compile(r"\.edgemem-probe-(\d+)-.+")):
        with contextlib.suppress(OSError):
            stale.rmdir()
    try:  # a real probe: os.access says yes to root even on read-only or virtual file systems
        os.rmdir(tempfile.mkdtemp(dir=parent, prefix=f".edgemem-probe-{os.getpid()}-"))
    except OSError as e:
        raise OutputError(f"{what} {path}: cannot write in {parent} ({e.strerror})") from None
    return parent


def _inside(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_output_file(path: str | Path, what: str = "output") -> Path:
    """Before long work: `path` can be written as a file (its folder exists or can be made, writably)."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{what} {path} is a directory; give a file name")
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputError(f"{what} {path} exists and is not writable")
    _writable_ancestor(path.absolute(), what)
    return path


def check_output_dir(out: str | Path, *, force: bool, inputs: Iterable[str | Path] = (), what: str = "output",
                     marker: str = EXPORT_MARKER) -> Path:
    """Before long work: `out` may receive a new export directory.

    It must not be (or hold) the current directory or any of `inputs`, nor lie inside an input; an
    existing non-empty `out` is replaced only with `force`, and only if it is edgemem's own (it holds
    a file matching `marker`: `edgemem.json` for an export). Returns `out` resolved."""
    given, out = Path(out), Path(out).resolve()
    if _inside(Path.cwd().resolve(), out):
        raise OutputError(f"{what} {given} is the current directory or holds it; give a new directory name")
    for source in inputs:
        source = Path(source).resolve()
        if _inside(source, out) or _inside(out, source):
            raise OutputError(f"{what} {given} would overwrite or sit inside the command's own input {source}; "
                              "choose another directory")
    if out.exists() and not out.is_dir():
        raise OutputError(f"{what} {given} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise OutputError(f"{what} {given} is not empty; pass {named('force=True', '--force')} to replace an earlier export")
        if not any(p.is_file() for p in out.glob(marker)):
            raise OutputError(f"{what} {given} holds files edgemem did not write (no {marker}); --force only "
                              "replaces what edgemem wrote: remove it yourself or choose another directory")
    _writable_ancestor(out, what)
    return out


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where the system cannot."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _sweep(out: Path) -> None:
    """Remove temporary directories of killed writers of `out`; put back an `out` moved aside by one."""
    for stale in _stale(out.parent, re.compile(rf"\.{re.escape(out.name)}\.old-(\d+)-.+")):
        if not out.exists():
            stale.rename(out)
        else:
            shutil.rmtree(stale, ignore_errors=True)
    for stale in _stale(out.parent, re.compile(rf"\.{re.escape(out.name)}\.tmp-(\d+)-.+")):
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def staged_directory(out: Path) -> Iterator[Path]:
    """A temporary directory beside `out` to write an export into; on success it replaces `out`
    (swapped with an existing one in one step where the system can, else moved aside first; the old one
    is then removed), on any error it is removed: readers see the old directory or the whole new one,
    never a half-written one."""
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _sweep(out)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-{os.getpid()}-"))
        os.chmod(tmp, 0o777 & ~umask())
    except OSError as e:
        raise OutputError(f"cannot write {out}: {e.strerror}") from None
    try:
        yield tmp
        if out.is_dir() and _exchange(tmp, out):
            shutil.rmtree(tmp, ignore_errors=True)  # now the old directory
            return
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}-{tmp.name.rsplit('-', 1)[-1]}")
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

"""Files every tool writes or checks: sha256 of a file, atomic writes of a file or a whole directory,
and the checks an output path goes through before the work it will receive.

Pure Python: the runtime uses these without torch or onnx.

Safety rules (one place for every command):
- an output is checked for writability before long work (`check_output_dir`, `check_output_file`), and
  is never a command's own input nor inside one;
- `force` replaces only a directory whose every entry edgemem wrote (`export_files`, `engine_files`, or
  a command's own listing): anything else in it is named and the command refuses;
- a staged directory replaces only what its output was when the work began: one that appeared or changed
  meanwhile (another command writing the same output) is left alone and the command fails;
- files and directories get the user's umask, like any other tool's (not mkstemp's 0600 / mkdtemp's 0700);
- temporary names carry the writer's pid; ones left by a killed process are removed by the next writer
  (a directory moved aside just before a kill is put back if its replacement never arrived).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from edgemem.errors import ConfigError, EdgememError, named

EXPORT_MARKER = "edgemem.json"  # edgemem.manifest.MANIFEST: the file that makes a directory edgemem's own
ENGINES_JSON = "engines.json"  # edgemem.runtime.engines.ENGINES_JSON: the record of an engine set
TEMPORARY = re.compile(r"\..+\.\d+\.[^.]+\.tmp")  # write_atomic's temporary files


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
    """Write to a temporary file beside `path` (its folder made if need be), fsync, rename: readers never
    see half a file. The file gets the user's umask; temporary files of killed writers of `path` are removed."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror}") from None
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


def save_figure(figure: Any, path: str | Path) -> None:
    """A matplotlib figure as PNG, written like every other output (`write_atomic`)."""
    import io

    data = io.BytesIO()
    figure.savefig(data, format="png", dpi=120)
    write_atomic(Path(path), data.getvalue())


def as_path(value: Any, what: str) -> Path:
    """`value` (a str or os.PathLike) as a Path; anything else is a ConfigError naming `what`."""
    if isinstance(value, (str, os.PathLike)) and str(value):
        return Path(value)
    raise ConfigError(f"{what} must be a path (a str or os.PathLike); got {value!r}")


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
    onnx.save(
        model, path, save_as_external_data=True, all_tensors_to_one_file=True, location=data.name, size_threshold=1024
    )
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


def _same(a: Path, b: Path) -> bool:
    """One file under two names: the same path once resolved, or hard links of one file."""
    try:
        return a.resolve() == b.resolve() or os.path.samefile(a, b)
    except OSError:
        return False


def one_name(name: str, what: str) -> str:
    """`name` if it is one path component (no separator, not '.' or '..'), the name of a file inside an output."""
    if not name or name in (".", "..") or any(c in name for c in ("/", "\\", "\0")):
        raise OutputError(f"{what} {name!r} must be one file name (no '/' or '\\', not '.' or '..')")
    return name


def check_output_file(path: str | Path, what: str = "output", inputs: Iterable[str | Path] = ()) -> Path:
    """Before long work: `path` can be written as a file (its folder exists or can be made, writably), and
    it is none of `inputs` (nor a hard link of one) and lies inside none of them."""
    path = as_path(path, what)
    for source in map(Path, inputs):
        if _same(path, source) or _inside(path.resolve(), source.resolve()):
            raise OutputError(f"{what} {path} would overwrite the command's own input {source}; write to a new file")
    if path.is_dir():
        raise OutputError(f"{what} {path} is a directory; give a file name")
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputError(f"{what} {path} exists and is not writable")
    _writable_ancestor(path.absolute(), what)
    return path


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def engine_files(folder: Path) -> set[str] | None:
    """What `edgemem build` wrote in `folder`: engines.json and the engines it lists; None if it holds no engines.json."""  # noqa: E501
    info = _read_json(Path(folder) / ENGINES_JSON)
    if info is None or not isinstance(info.get("engines"), dict):
        return None
    return {ENGINES_JSON, *(str(r["file"]) for r in info["engines"].values() if isinstance(r, dict) and "file" in r)}


def export_files(folder: Path) -> set[str] | None:
    """What edgemem wrote in the export directory `folder` ('/'-separated paths): edgemem.json, the files it
    lists, and each engine set in a subdirectory (`engine_files`); None if it holds no edgemem.json."""
    folder = Path(folder)
    info = _read_json(folder / EXPORT_MARKER)
    if info is None or not isinstance(info.get("files"), dict):
        return None
    own = {EXPORT_MARKER, *map(str, info["files"])}
    for sub in folder.iterdir():
        if sub.is_dir() and not sub.is_symlink() and (engines := engine_files(sub)) is not None:
            own |= {f"{sub.name}/{name}" for name in engines}
    return own


def foreign_files(folder: Path, own: set[str] | None) -> list[str]:
    """The entries of `folder` ('/'-separated paths) that are not in `own` (edgemem's files and folders there)
    nor a folder of them: every top-level entry when `own` is None. Links count as foreign; write_atomic's temporary files do not."""  # noqa: E501
    folder = Path(folder)
    if own is None:
        return sorted(p.name for p in folder.iterdir())
    parents = {p.as_posix() for name in own for p in Path(name).parents}
    found = []
    for root, dirs, files in os.walk(folder):
        base = Path(root).relative_to(folder)
        for name in files:
            rel = (base / name).as_posix()
            if Path(root, name).is_symlink() or (rel not in own and not TEMPORARY.fullmatch(name)):
                found.append(rel)
        kept = []
        for name in dirs:
            rel = (base / name).as_posix()
            if Path(root, name).is_symlink() or (rel not in parents and rel not in own):
                found.append(rel)
            else:
                kept.append(name)
        dirs[:] = kept
    return sorted(found)


def _listing(names: list[str], most: int = 5) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def check_output_dir(
    out: str | Path,
    *,
    force: bool,
    inputs: Iterable[str | Path] = (),
    what: str = "output",
    own: Callable[[Path], set[str] | None] = export_files,
) -> Path:
    """Before long work: `out` may receive a new directory (an export unless `own` says otherwise).

    It must not be (or hold) the current directory or any of `inputs`, nor lie inside an input, nor be a
    mount point; an existing non-empty `out` is replaced only with `force`, and only if edgemem wrote every
    entry in it (`own(out)`: the paths it wrote there, None for a directory it did not write). Returns `out` resolved."""  # noqa: E501
    given = as_path(out, what)
    out = given.resolve()
    if _inside(Path.cwd().resolve(), out):
        raise OutputError(f"{what} {given} is the current directory or holds it; give a new directory name")
    for source in inputs:
        source = Path(source).resolve()
        if _inside(source, out) or _inside(out, source):
            raise OutputError(
                f"{what} {given} would overwrite or sit inside the command's own input {source}; "
                "choose another directory"
            )
    if out.exists() and not out.is_dir():
        raise OutputError(f"{what} {given} exists and is not a directory")
    if out.is_dir() and os.path.ismount(out):
        raise OutputError(f"{what} {given} is a mount point, which cannot be replaced; give a directory inside it")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise OutputError(
                f"{what} {given} is not empty; pass {named('force=True', '--force')} to replace what "
                "edgemem wrote there"
            )
        foreign = foreign_files(out, own(out))
        if foreign:
            raise OutputError(
                f"{what} {given} holds files edgemem did not write ({_listing(foreign)}); "
                f"{named('force', '--force')} only replaces what edgemem wrote: move them or choose "
                "another directory"
            )
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


def _identity(path: Path) -> tuple[int, int, bool] | None:
    """What is at `path`: device, inode and whether it is a non-empty directory; None when nothing is."""
    try:
        st = os.lstat(path)
        full = path.is_dir() and not path.is_symlink() and any(path.iterdir())
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, full


def _place(tmp: Path, out: Path, before: tuple[int, int, bool] | None) -> None:
    """Move the directory `tmp` to `out`, replacing only what was there when the work began (`before`)."""
    changed = OutputError(
        f"{out} appeared or changed while this command wrote it (another command writing the "
        "same output?); it was left as it is and nothing was written"
    )
    if before is None or not before[2]:  # nothing, or an empty directory: rename replaces no more than that
        try:
            os.rename(tmp, out)
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise changed from None
            raise OutputError(f"cannot put {out} in place: {e.strerror}") from None
        return
    if _exchange(tmp, out):
        if _identity(tmp)[:2] != before[:2]:  # tmp now holds what was at `out`: not the directory checked
            _exchange(tmp, out)
            raise changed
        shutil.rmtree(tmp, ignore_errors=True)
        return
    now = _identity(out)
    if now is None or now[:2] != before[:2]:
        raise changed
    old = out.with_name(f".{out.name}.old-{os.getpid()}-{tmp.name.rsplit('-', 1)[-1]}")
    try:
        out.rename(old)
        tmp.rename(out)
    except OSError as e:
        raise OutputError(f"cannot put {out} in place: {e.strerror}") from None
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_directory(out: Path) -> Iterator[Path]:
    """A temporary directory beside `out` to write into; on success it replaces `out` (swapped with an
    existing one in one step where the system can, else moved aside first; the old one is then removed),
    on any error it is removed: readers see the old directory or the whole new one, never a half-written
    one. Only what `out` was on entry is replaced: a directory that appeared or changed meanwhile (another
    command writing `out`) is left alone and this raises an OutputError."""
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _sweep(out)
        before = _identity(out)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-{os.getpid()}-"))
        os.chmod(tmp, 0o777 & ~umask())
        mine = _identity(tmp)
    except OSError as e:
        raise OutputError(f"cannot write {out}: {e.strerror}") from None
    try:
        yield tmp
        _place(tmp, out, before)
    except BaseException:
        if (now := _identity(tmp)) is not None and now[:2] == mine[:2]:  # never another writer's directory
            shutil.rmtree(tmp, ignore_errors=True)
        raise

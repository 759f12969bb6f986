"""Files every tool writes or checks: sha256 of a file, atomic writes of a file or a whole directory.

Pure Python: the runtime uses these without torch or onnx.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, fsync, rename: readers never see half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def staged_directory(out: Path) -> Iterator[Path]:
    """A temporary directory beside `out` to write an export into; on success it replaces `out`
    (an existing one is moved aside first, then removed), on any error it is removed: readers see
    the old directory or the whole new one, never a half-written one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        yield tmp
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{tmp.name.rsplit('-', 1)[-1]}")
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

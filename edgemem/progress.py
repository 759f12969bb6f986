"""Progress of long work: rich's live bar on a terminal; elsewhere (CI logs, pipes, nohup) a log line on
`edgemem.progress` at the start, then every INTERVAL seconds (less often as the work goes on: at most
a tenth of the time so far between lines), and at the end.

    with track("training linear on mqar", total=1000) as bar:
        for step in range(1000):
            ...
            bar.update(advance=1, loss=f"{loss:.4f}")
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

INTERVAL = 10.0


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds // 60 % 60:02d} min"


class Tracker:
    """What the work has done so far; `update` it, the display follows."""

    def __init__(self, description: str, total: float | None):
        self.title = self.description = description
        self.total, self.completed = total, 0.0
        self.fields: dict[str, Any] = {}
        self.start = time.monotonic()
        self._lock = threading.Lock()

    def update(
        self, description: str | None = None, *, advance: float = 0, completed: float | None = None, **fields: Any
    ) -> None:
        with self._lock:
            if description is not None:
                self.description = description
            self.completed = completed if completed is not None else self.completed + advance
            self.fields.update(fields)
        self._changed()

    def _changed(self) -> None:
        pass

    def line(self, done: bool = False) -> str:
        """The status as one log line."""
        with self._lock:
            parts = [self.title if done else self.description]
            elapsed = time.monotonic() - self.start
            if self.total:
                share = self.completed / self.total
                parts.append(f"{self.completed:,.0f}/{self.total:,.0f} ({100 * share:.0f}%)")
            parts += [f"{k} {v}" for k, v in self.fields.items()]
            if done:
                parts.append(f"done in {_duration(elapsed)}")
            else:
                parts.append(_duration(elapsed))
                if self.total and 0 < self.completed < self.total and elapsed >= 1:
                    parts.append(f"about {_duration(elapsed * (self.total - self.completed) / self.completed)} left")
        return ", ".join(parts)


class _Bar(Tracker):
    def __init__(self, description: str, total: float | None, progress: Any):
        super().__init__(description, total)
        self._progress = progress
        self._task = progress.add_task(description, total=total, extra="")

    def _changed(self) -> None:
        extra = "  ".join(f"{k} {v}" for k, v in self.fields.items())
        self._progress.update(self._task, description=self.description, completed=self.completed, extra=extra)


class _Lines(Tracker):
    """Logs the status from a thread of its own, so a long single stage is not silent either."""

    def __init__(self, description: str, total: float | None):
        super().__init__(description, total)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="edgemem-progress", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(max(INTERVAL, 0.1 * (time.monotonic() - self.start))):
            log.info("%s", self.line())

    def __enter__(self) -> _Lines:
        log.info("%s", self.line())
        self._thread.start()
        return self

    def close(self, ok: bool) -> None:
        self._stop.set()
        self._thread.join()
        if ok:
            log.info("%s", self.line(done=True))


@contextlib.contextmanager
def track(description: str, total: float | None = None, *, terminal: bool | None = None) -> Iterator[Tracker]:
    """A live bar on stderr when it is a terminal (`terminal` overrides the check), else periodic log lines."""
    from rich.console import Console

    console = Console(stderr=True)
    if terminal is None:
        terminal = console.is_terminal
    if terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        columns = (
            [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()]
            if total
            else [SpinnerColumn(), TextColumn("{task.description}")]
        )
        with Progress(
            *columns, TextColumn("{task.fields[extra]}"), TimeElapsedColumn(), console=console, transient=True
        ) as progress:
            yield _Bar(description, total, progress)
        return
    lines = _Lines(description, total).__enter__()
    ok = False
    try:
        yield lines
        ok = True
    finally:
        lines.close(ok)


__all__ = ["INTERVAL", "Tracker", "track"]

"""What a load shows a person: a progress bar per phase (rich, on a terminal) and its times.

`LoadProgress` has one task per phase — "read" (the checkpoint's bytes, or the random experts
generated), "pin" (registering the expert store with CUDA) — each with bytes and bytes/s. On a
terminal the bars are live on stderr; elsewhere nothing is drawn. `LoadTimes` keeps each phase's
seconds and bytes for the caller to report (`moecache generate` prints them).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


@dataclass
class LoadTimes:
    """Seconds and bytes of each phase of one load, and the whole."""

    phases: dict[str, tuple[float, int]] = field(default_factory=dict)
    total_s: float = 0.0

    def line(self) -> str:
        parts = [
            f"{name} {nbytes / 1e9:.2f} GB in {seconds:.2f} s ({nbytes / 1e9 / max(seconds, 1e-9):.2f} GB/s)"
            for name, (seconds, nbytes) in self.phases.items()
        ]
        return f"load: {self.total_s:.2f} s" + (f" ({'; '.join(parts)})" if parts else "")


class LoadProgress:
    """Progress bars for a load (module docstring); `enabled=None` draws them only on a terminal."""

    def __init__(self, label: str, enabled: bool | None = None):
        console = Console(file=sys.stderr)
        self.times = LoadTimes()
        self._start = time.perf_counter()
        self._progress = Progress(
            TextColumn(f"{label} {{task.description}}"), BarColumn(), DownloadColumn(binary_units=True),
            TransferSpeedColumn(), TimeRemainingColumn(), console=console, transient=False,
            disable=not (console.is_terminal if enabled is None else enabled),
        )  # fmt: skip

    def __enter__(self) -> LoadProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()
        self.times.total_s = time.perf_counter() - self._start

    @contextlib.contextmanager
    def phase(self, name: str, total: int):
        """A phase of `total` bytes: yields `advance(nbytes)` (thread-safe); its time is recorded."""
        task = self._progress.add_task(name, total=total)
        start = time.perf_counter()
        done, lock = [0], threading.Lock()

        def advance(nbytes: int) -> None:
            with lock:
                done[0] += nbytes
            self._progress.advance(task, nbytes)

        yield advance
        self.times.phases[name] = (time.perf_counter() - start, done[0] or total)

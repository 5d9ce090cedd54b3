"""Peak memory of one measured run: host RSS (Linux `VmHWM`, reset through /proc/self/clear_refs) and
CUDA memory (torch's allocator peak). Either is None where it cannot be measured for the run alone."""

from __future__ import annotations

from pathlib import Path

import torch

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def _hwm_bytes() -> int | None:
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class PeakMemory:
    """`start()` resets both peaks; `stop()` returns (peak RSS bytes, peak CUDA bytes)."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.rss_reset = False

    def start(self) -> None:
        try:
            CLEAR_REFS.write_text("5")  # resets the peak resident set size to the current one
            self.rss_reset = True
        except OSError:
            self.rss_reset = False  # the process-lifetime peak is not the run's: reported as None
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def stop(self) -> tuple[int | None, int | None]:
        rss = _hwm_bytes() if self.rss_reset else None
        cuda = None
        if self.cuda:
            torch.cuda.synchronize()
            cuda = int(torch.cuda.max_memory_allocated())
        return rss, cuda

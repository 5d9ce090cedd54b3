"""Host buffers for expert weights in transparent huge pages (2 MiB) where the kernel offers them.

The CPU expert path streams whole experts (6 MiB each on Qwen3.6) from tens of gigabytes picked at random:
in 4 KiB pages every 4 KiB of a streamed expert costs a TLB miss and a page walk, in 2 MiB pages one in
512 does. torch's CPU allocator asks for no huge pages, so on a kernel whose THP mode is "madvise" (the
usual default; /sys/kernel/mm/transparent_hugepage/enabled) a torch.empty of the expert store gets 4 KiB
pages. `huge_page_bytes` maps anonymous memory aligned to 2 MiB and asks for huge pages with
madvise(MADV_HUGEPAGE) before the first touch, so the filling faults them in as huge pages; under THP
"always" that changes nothing, under "never" (or without MADV_HUGEPAGE) the buffer is plain pages.

`pages="base"` gives torch.empty's memory instead (benchmarks/bench_cpu_experts.py's A/B).
"""

from __future__ import annotations

import mmap

import torch

from moecache.errors import MoecacheError

HUGE_PAGE = 2 << 20
PAGE_KINDS = ("huge", "base")


def huge_page_bytes(nbytes: int, pages: str = "huge") -> torch.Tensor:
    """An uninitialized uint8 tensor of `nbytes` bytes: 2 MiB-aligned, madvised for huge pages
    (`pages="huge"`; module docstring), or torch.empty's (`pages="base"`)."""
    if pages not in PAGE_KINDS:
        raise MoecacheError(f"host pages {pages!r}: expected one of {list(PAGE_KINDS)}")
    if pages == "base" or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    # over-map by one huge page so that an aligned start exists; the tensor keeps the mapping alive
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    except OSError:  # a kernel without THP: plain pages
        pass
    return whole[start : start + nbytes]


def huge_pages_of(tensor: torch.Tensor) -> int | None:
    """Bytes of `tensor`'s mapping backed by huge pages (/proc/self/smaps' AnonHugePages of the mapping
    holding its first byte), or None where that cannot be read."""
    ptr = tensor.data_ptr()
    try:
        with open("/proc/self/smaps") as smaps:
            inside = False
            for line in smaps:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    low, high = (int(v, 16) for v in head.split("-"))
                    inside = low <= ptr < high
                elif inside and head == "AnonHugePages:":
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None

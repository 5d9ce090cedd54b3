"""Host time of one host-to-device expert copy's enqueue, by source memory and size (CUDA only).

What an admission costs the cache manager's host point before any byte moves: `dst.copy_(src,
non_blocking=True)` on a side stream (the transfer engine's call), the device drained before each
enqueue (an idle copy stream), from the expert store's registered memory (`ExpertStore.pin`, one
`cudaHostRegister` at its exact size) at an expert's size and smaller, and from torch's own pinned
memory; the same row through the driver's `cuMemcpyAsync` on the rows' addresses (the engine's call on
CUDA, moecache/runtime/device.py); then one event record and one event query (what the engine adds per
copy). Median of 25 after 5 untimed. Prints a table and ends with one JSON line.

    python benchmarks/bench_copy_enqueue.py [--hidden 2048 --inter 1408 --experts 16]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from moecache.models.expert_store import ExpertStore
from moecache.runtime.device import CudaDevice

REPS, WARM = 30, 5


def enqueue_us(rows, dst, side) -> float:
    """Median host us of `dst.copy_(row, non_blocking=True)` on `side`, the device idle before each."""
    times = []
    for n in range(REPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        with side:
            dst.copy_(rows[n % len(rows)], non_blocking=True)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    torch.cuda.synchronize()
    return float(np.median(times[WARM:]))


def driver_enqueue_us(driver, rows, dst, side) -> float:
    """Median host us of the driver's copy of a row into `dst` on `side`, the device idle before each."""
    ptrs, dst_ptr, nbytes, handle = [r.data_ptr() for r in rows], dst.data_ptr(), dst.nbytes, side.cuda_stream
    times = []
    for n in range(REPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        driver.copy(dst_ptr, ptrs[n % len(ptrs)], nbytes, handle)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    torch.cuda.synchronize()
    return float(np.median(times[WARM:]))


def call_us(fn) -> float:
    times = []
    for _ in range(REPS + 20):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return float(np.median(times[WARM:]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=1408)
    p.add_argument("--experts", type=int, default=16)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_copy_enqueue: needs CUDA (torch.cuda.is_available() is false)", file=sys.stderr)
        return 2
    if a.hidden < 1 or a.inter < 1 or a.experts < 1:
        print("bench_copy_enqueue: --hidden, --inter and --experts must be >= 1", file=sys.stderr)
        return 2
    side = torch.cuda.Stream()
    store = ExpertStore.allocate(1, a.experts, a.hidden, a.inter, torch.bfloat16)
    store.pin("auto")
    nbytes = store.expert_bytes
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rows = list(store.flat_GB.unbind(0))
    torch_pinned = torch.empty(a.experts, nbytes, dtype=torch.uint8, pin_memory=True)
    out = {
        f"registered store, one expert ({nbytes} B)": enqueue_us(rows, dst, side),
        "registered store, 1 MiB": enqueue_us([r[: 1 << 20] for r in rows], dst[: 1 << 20], side),
        "registered store, 64 KiB": enqueue_us([r[:65536] for r in rows], dst[:65536], side),
        "torch pin_memory, one expert": enqueue_us(list(torch_pinned.unbind(0)), dst, side),
    }
    driver = CudaDevice().driver
    if driver is not None:
        out["registered store, one expert, driver cuMemcpyAsync"] = driver_enqueue_us(driver, rows, dst, side)
        check = torch.empty_like(dst)
        rows[1].copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))  # not zeros: a real check
        driver.copy(check.data_ptr(), rows[1].data_ptr(), nbytes, side.cuda_stream)
        torch.cuda.synchronize()
        if not torch.equal(check.cpu(), rows[1]):
            print("bench_copy_enqueue: the driver's copy did not land the row's bytes", file=sys.stderr)
            return 1
    event = torch.cuda.Event()
    out["event record"] = call_us(lambda: event.record(side))
    out["event query"] = call_us(event.query)
    print(f"copy enqueue on {torch.cuda.get_device_name()} (store pinned: {store.pinned})")
    for name, us in out.items():
        print(f"{name:48s} | {us:8.2f} us")
    print(json.dumps({"bench": "copy_enqueue", "device": torch.cuda.get_device_name(), "args": vars(a),
                      "pinned": store.pinned, "host_us": out}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""on_miss="split": which misses of a layer step wait for their copy, and which run on the CPU.

A miss whose expert's copy is already in flight (admitted by this very visit, or earlier and late) can
be served two ways: on the CPU now, from the host store, or on the device once its copy has landed,
while the CPU computes the other misses. Of those candidates, in the order their copies land (the copy
engine is FIFO), the step waits for the first w, w minimising its expert time:

    cpu(w)  = cpu_call + the CPU costs of the misses left on the CPU     (0 when none is left)
    gpu(w)  = max(hits' kernel, ready time of the w-th candidate + the waiting kernel over the first w)
    step(w) = max(cpu(w), gpu(w)) + wait_host   (w > 0)                    (serial: the sum of the two)

the smallest such w (w = 0 is the on_miss="cpu" step). wait_host is the host time a waiting step costs
before its CPU part starts (the compute stream's wait, the wait row's upload, the wait call's launch:
`moecache calibrate` measures it in the fast loop, the profile's runtime.split_host). Both sides call this one function with their
own estimate of when each copy lands: the timed replay its copy timeline (moecache/sim/timed.py), the
runtime's manager the same timeline kept on the host clock (moecache/runtime/transfer.py). Hits,
misses and placements are those of on_miss="cpu": only where a miss runs changes.

Legend: J candidates (misses whose copy is in flight), W = 0..J candidates waited for.
"""

from __future__ import annotations

import numba as nb

ON_MISS_CODES = {"cpu": 0, "wait": 1, "split": 2}  # the timed replay's argument


@nb.njit(cache=True, nogil=True)
def split_waits(
    ready_us_J, cpu_us_J, gpu_wait_us_W, n, n_rest, cpu_rest_us, cpu_call_us, gpu_hits_us, serial,
    wait_host_us,
):  # fmt: skip
    """w (module docstring). ready_us_J: when candidate j's copy lands, from the step's routing time,
    ascending; cpu_us_J: its CPU cost; gpu_wait_us_W[w]: the waiting kernel's time over the first w
    candidates' entries (index 0 unused); n candidates; n_rest other misses costing cpu_rest_us;
    wait_host_us: the host time of a waiting step (w > 0)."""
    best_w = 0
    best = 0.0
    for w in range(n + 1):
        cpu = 0.0
        if n_rest + n - w > 0:
            cpu = cpu_call_us + cpu_rest_us
            for j in range(w, n):
                cpu += cpu_us_J[j]
        gpu = gpu_hits_us
        if w > 0:
            gpu = max(gpu, ready_us_J[w - 1] + gpu_wait_us_W[w])
        total = cpu + gpu if serial else max(cpu, gpu)
        if w > 0:
            total += wait_host_us
        if w == 0 or total < best:
            best, best_w = total, w
    return best_w

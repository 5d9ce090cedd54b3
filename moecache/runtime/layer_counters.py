"""What the layer steps of an offloaded model count (`LayerCounters`), and the host-point figures made of
them (`LayerCounters.rates`, keys HOST_RATES): one definition for the runtime, validate and the benchmarks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class LayerCounters:
    """What the layer steps count, whichever driver runs them (the eager call, `ExpertsRuntime.run`, or
    the fast loop's host points, moecache/runtime/segments.py); the manager counts hits, misses and
    copies (ManagerStats). `since(start)`: the counts between two snapshots (`copy()`)."""

    visits: int = 0  # layer visits (manager.visit calls)
    gpu_entries: int = 0  # (token, k) entries computed from the slot pool (hits and waited copies)
    cpu_entries: int = 0  # (token, k) entries computed on the CPU (fallbacks)
    cpu_calls: int = 0  # visits with CPU entries (CPU-half calls)
    # many-token visits' missed experts run on the device (moecache/runtime/streamed_misses.py): experts
    # copied into the staging pools, and their (token, k) entries
    streamed_experts: int = 0
    streamed_entries: int = 0
    manager_ns: int = 0  # host ns in the manager's calls: prepare, visit, commit, a split's waits
    readback_wait_ns: int = 0  # host ns waiting for a routing read-back to land (the fast loop on CUDA)
    cpu_ns: int = 0  # host ns of the CPU half: gather, CpuExperts.run, the sum placed on the device
    cpu_exec_ns: int = 0  # of cpu_ns, the fast loop's bound executor calls alone (BoundCall.last_ns)
    # the fast loop's deferred visits that enqueued copies, and the host ns from each one's last copy
    # enqueue to the next layer's publication (moecache/runtime/segments.py, `_route`)
    publish_lags: int = 0
    publish_lag_ns: int = 0

    def copy(self) -> LayerCounters:
        return dataclasses.replace(self)

    def since(self, start: LayerCounters) -> LayerCounters:
        return LayerCounters(
            **{f.name: getattr(self, f.name) - getattr(start, f.name) for f in dataclasses.fields(self)}
        )

    def __add__(self, other: LayerCounters) -> LayerCounters:
        return LayerCounters(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)}
        )

    def rates(self) -> dict:
        """The host-point figures validate and the benchmarks report (keys: HOST_RATES): the manager's and
        the routing read-back wait's microseconds per visit, the CPU path's and, of it, the executor's per
        call, the CPU entries per call, and the mean publish lag of the deferred visits with copies; None
        where there was no visit, call or such visit."""

        def per(ns: int, n: int) -> float | None:
            return ns / 1e3 / n if n else None

        visits, calls = self.visits, self.cpu_calls
        return {
            "manager_us_per_visit": per(self.manager_ns, visits),
            "readback_wait_us_per_visit": per(self.readback_wait_ns, visits),
            "cpu_path_us_per_call": per(self.cpu_ns, calls),
            "cpu_exec_us_per_call": per(self.cpu_exec_ns, calls),
            "cpu_entries_per_call": self.cpu_entries / calls if calls else None,
            "publish_lag_us": per(self.publish_lag_ns, self.publish_lags),
        }


HOST_RATES = tuple(LayerCounters().rates())  # the keys of LayerCounters.rates

"""The cache manager: policy, counters, slot table, loading set and per-slot events, one layer visit at a time.

Per layer visit (`visit(layer, topk_ids_TK)`, called after the router, before the layer's experts run):
1. publication: every copy of this layer in flight whose ready event has completed (queried, never
   waited on) makes its expert resident; the layer's mapping `slot_of_E` (int32 [E], -1 = not
   resident) is pushed to its fixed-address device row, ordered on the compute stream before the
   layer's kernels. Experts still loading stay -1: this visit runs them on the CPU. `prepare(layer)`
   does this step alone, so an executor can enqueue the layer's kernels before the routing is back.
2. hits: an entry of topk_ids_TK is a hit iff its expert is in that snapshot (`hit_TK`); the others
   go to the CPU path (`miss_experts`).
3. the policy: `apply_step` of moecache/sim/visit.py (the same `step` the simulator replays) updates
   the counters and returns admissions and evictions. The policy counts a key that holds a slot as
   resident even while its copy is in flight (the timed simulator's rule). Steps 2-4 and the slot
   bookkeeping are one compiled call (moecache/runtime/manager_visit.py); Python enqueues the copies.
4. evictions forget a slot (CPU weights are never touched); admissions take a free slot and their copy
   is enqueued at once (transfer.py), after the slot's last reader (below). A slot freed by this visit's
   eviction of an expert this very visit runs on the GPU is safe only after this layer's kernels: such
   an admission's copy is enqueued by `commit` (below), right after those kernels.
`commit()` (the executor calls it once the layer's GPU work is enqueued; otherwise the next visit does)
makes this visit the last reader of the slots it read, and enqueues deferred copies.

Last readers are visit serials, not events: a copy into a slot waits for nothing once its last reader is
past the fence (the caller of a visit saw the compute stream finish the work before it:
`visit(compute_done=True)`, or the stand-in ran everything), else on ONE covering event recorded on the
compute stream when such a wait is first needed. Mapping rows' staging buffers are reused the same way.

`on_miss` says what a miss does: "cpu" (the default, the design above) runs it on the CPU while its copy
(if admitted) is in flight; "wait" (synchronous on-demand copies, the mixtral-offloading baseline) makes
the visit wait for its own admissions' copies (host wait on their ready events; at once on the CPU
stand-in) and publish them, so those entries run on the device. Misses the policy does not admit, and
admissions whose slot is freed by this visit's own kernels (deferred, see 4.), still run on the CPU. The
counters (hits, misses) and the logged `cache_hit` are the cache's state when the visit began either way.
"split" (moecache/sim/miss_split.py, the simulator's rule; needs a cost model, `cost`) weighs, for the
visit's misses whose copy is in flight (admitted now or late), waiting on the device against the CPU:
the first `split_waits` of them (in landing order) are waited for by the compute stream (a stream wait
on the last one's ready event, `enqueue_waits`, which the executor calls after enqueueing the hits: the
host never waits) and run there by one more operator call over the visit's `wait_slot_of_E` row
(those experts only, `VisitResult.waited`); the CPU runs the other misses meanwhile.
`stats.late_copies` counts copies still in flight at the next use of their expert (that use ran on the
CPU); `stats.waited_copies` the copies a "wait" or "split" visit waited for.

Updates are serialised by one lock. Counters and residency are session state: `reset`, `export_state`
/ `import_state`, `warm_from_trace` (replay a trace through the policy, then load its residents).

Legend: T tokens, K top-k, E experts, L layers, G global keys (layer_id * E + expert_id), U a visit's
distinct experts (in access order), S slots.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from moecache.capacity import parse_capacity
from moecache.errors import MoecacheError
from moecache.runtime.manager_visit import ADMIT_DEFERRED, BAD_ROUTING, FREE, HELD, TALLY, CompiledVisit
from moecache.runtime.miss_split import SplitCosts
from moecache.runtime.slot_pool import SlotPool
from moecache.runtime.transfer import Copy, TransferEngine
from moecache.sim.miss_split import ON_MISS_CODES
from moecache.sim.policy import Policy, make_policy
from moecache.sim.replay import replay_from
from moecache.sim.shape import ModelShape

CAPACITY_KEY = "gpu_expert_capacity"
# A visit's empty result arrays: shared, read-only (an empty array holds nothing to change).
_NONE_I64 = np.empty(0, np.int64)
_NONE_I32 = np.empty(0, np.int32)
_NONE_I64.flags.writeable = False
_NONE_I32.flags.writeable = False
ON_MISS = tuple(ON_MISS_CODES)  # what a miss does (module docstring): cpu, wait, split
ROW_UPLOADS = ("manager", "executor")  # who copies a published mapping row to the device (row_uploads)


@dataclass(slots=True)
class VisitResult:
    """What one layer visit gives the MoE layer. Arrays are the visit's own (safe to keep)."""

    layer: int
    slot_of_E: torch.Tensor  # device int32 [E]: the published snapshot (a fixed-address row)
    snapshot_E: np.ndarray  # host int32 [E]: the same snapshot
    hit_TK: np.ndarray  # bool: entry runs on the GPU (its expert is in the snapshot)
    miss_experts: np.ndarray  # int64: distinct experts of the visit run on the CPU, in access order
    admitted: np.ndarray  # int32 keys admitted by the policy at this visit
    evicted: np.ndarray  # int32 keys evicted
    copies: list[Copy] = field(default_factory=list)  # this visit's admissions' copies (deferred ones too)
    # Filled by the executors: execution time of the CPU part of the layer, and of the GPU part, given
    # either as a number or (with `CacheManager.time_gpu`) as the (start, end) timing events recorded
    # around its kernels on the compute stream, resolved when the record is written (`cache_fields`).
    cpu_duration_ns: int | None = None
    cuda_duration_ns: int | None = None
    gpu_events: tuple | None = None
    # on_miss="wait" only: the snapshot and hit mask when the visit began, before it waited for its
    # copies (snapshot_E / hit_TK are then what the device ran). None: the same as snapshot_E / hit_TK.
    cache_snapshot_E: np.ndarray | None = None
    cache_hit_TK: np.ndarray | None = None
    # on_miss="split": the copies the compute stream waits for (empty: none), and the device row
    # mapping only their experts, for the executor's second operator call
    waited: list[Copy] = field(default_factory=list)
    wait_slot_of_E: torch.Tensor | None = None

    def cache_fields(self, num_experts: int) -> list[dict]:
        """The routing record's cache columns (moecache/trace/schema.py) for each of the visit's T rows.
        Placement changes and copy totals belong to the visit, so they are on its first row only (the
        other rows: empty lists, null). copy_ready_ns stays null until every copy has been seen
        complete; copy_duration_ns is null where the device does not time copies."""
        base = self.layer * num_experts
        snapshot_E = self.snapshot_E if self.cache_snapshot_E is None else self.cache_snapshot_E
        hit_TK = self.hit_TK if self.cache_hit_TK is None else self.cache_hit_TK
        resident = (base + np.flatnonzero(snapshot_E >= 0)).astype(np.int32).tolist()
        if self.cuda_duration_ns is None and self.gpu_events is not None:
            start, end = self.gpu_events
            self.cuda_duration_ns = end.elapsed_ns(start)
        ready = [c.ready_ns for c in self.copies]
        durations = [c.duration_ns for c in self.copies]
        rows = []
        for t in range(hit_TK.shape[0]):
            first = t == 0
            rows.append(
                {
                    "resident_experts": resident,
                    "cache_hit": hit_TK[t].tolist(),
                    "admitted": self.admitted.tolist() if first else [],
                    "evicted": self.evicted.tolist() if first else [],
                    "copy_enqueued_ns": min(c.enqueued_ns for c in self.copies)
                    if first and self.copies
                    else None,
                    "copy_ready_ns": max(ready) if first and ready and None not in ready else None,
                    "copy_bytes": sum(c.nbytes for c in self.copies) if first else None,
                    "copy_duration_ns": sum(durations)
                    if first and durations and None not in durations
                    else None,
                    "cpu_duration_ns": self.cpu_duration_ns if first else None,
                    "cuda_duration_ns": self.cuda_duration_ns if first else None,
                }
            )
        return rows


@dataclass
class ManagerStats:
    visits: int = 0
    hits: int = 0  # distinct experts of a visit run on the GPU
    misses: int = 0
    admissions: int = 0
    evictions: int = 0
    copies: int = 0
    deferred_copies: int = 0  # copies that had to wait for the visit's own kernels (see commit)
    wasted_copies: int = 0  # keys evicted before their copy was published
    publish_waits: int = 0  # times a mapping row's previous upload had not run yet (see _push_row)
    late_copies: int = 0  # copies in flight at their expert's next use (it ran on the CPU, or split waited)
    waited_copies: int = 0  # "wait" / "split": copies a visit waited for before running them on the device
    # "split": visits that weighed candidates (misses with a copy in flight), the host ns of those
    # decisions, visits that waited, and the host ns of a waiting visit's row (enqueue_waits' included)
    split_decisions: int = 0
    split_decide_ns: int = 0
    split_waits: int = 0
    split_wait_ns: int = 0


class CacheManager:
    def __init__(
        self,
        store,
        device,
        capacity,
        policy: Policy,
        *,
        top_k: int,
        synchronous: bool = False,
        on_miss: str = "cpu",
        cost=None,
    ):
        self.store, self.device = store, device
        self.shape = ModelShape(store.num_layers, store.num_experts, int(top_k), store.expert_bytes)
        self.capacity = parse_capacity(
            capacity, key=CAPACITY_KEY, num_keys=self.shape.num_keys, expert_bytes=store.expert_bytes
        )
        if not isinstance(policy, Policy):
            raise MoecacheError(f"cache manager: policy must be a Policy, got {type(policy).__name__}")
        if policy.offline:
            raise MoecacheError(
                f"policy {policy.name} is offline (it reads the whole future trace) and exists only in the "
                "simulator; the runtime takes an online policy (e.g. lfu, lru, static_cold)"
            )
        if cost is not None and policy.cost is None:
            policy.bind_cost(cost)  # a policy that weighs costs reads the manager's (impact)
        if policy.weighs_costs and policy.cost is None:
            raise MoecacheError(
                f"cache manager: policy {policy.name} weighs measured costs (CPU, GPU, copy time): give the"
                " manager a cost model (cost=, from a moecache calibrate profile)"
            )
        self.policy = policy
        self._core = CompiledVisit(type(policy))  # the whole layer visit, compiled (manager_visit.py)
        self.pool = SlotPool.for_store(device, self.capacity, store)
        # Copies are timed on the device (copy_duration_ns) only while time_gpu is set (below), so the hot
        # path records one event per copy, not two.
        self.engine = TransferEngine(device, store, self.pool, synchronous=synchronous, timing=False)
        self.cost = cost
        self.on_miss = on_miss
        self.compute = device.compute_stream()
        self._on_visit = device.on_visit
        self._lock = threading.RLock()
        L, E, G = self.shape.num_layers, self.shape.num_experts, self.shape.num_keys
        self._num_layers = L
        self._num_experts = E
        # The published mapping: host rows (the truth), pinned staging rows, fixed-address device rows.
        self.published_LE = np.full((L, E), -1, np.int32)
        self._staging_LE = torch.full((L, E), -1, dtype=torch.int32, pin_memory=device.is_cuda)
        self._staging_np = self._staging_LE.numpy()
        self.slot_of_LE = torch.full((L, E), -1, dtype=torch.int32, device=device.torch_device)
        self._device_rows = list(self.slot_of_LE.unbind(0))  # per-layer views, made once
        self._staging_rows = list(self._staging_LE.unbind(0))
        self._dirty_L = np.zeros(L, bool)
        # on_miss="split": each layer's row of waited experts (pinned staging, fixed-address device row)
        self._wait_staging_LE = torch.full((L, E), -1, dtype=torch.int32, pin_memory=device.is_cuda)
        self._wait_staging_np = self._wait_staging_LE.numpy()
        self.wait_slot_of_LE = torch.full((L, E), -1, dtype=torch.int32, device=device.torch_device)
        self._wait_rows = list(self.wait_slot_of_LE.unbind(0))
        self._wait_staging_rows = list(self._wait_staging_LE.unbind(0))
        self._wait_upload_serial_L = [0] * L
        self._row_uploads = "manager"  # who copies a staging row to its device row (row_uploads)
        # What the compute stream has done, in visit serials (every visit, prepared or not, has one; the
        # kernels and row uploads a visit enqueues carry its serial). `_fence`: every visit up to it is
        # known complete on the device (the caller saw the routing read back, `visit(compute_done=True)`,
        # or the stand-in ran everything). `_covering`: ONE event, recorded on the compute stream only
        # when something must wait for work past the fence; it covers every visit up to
        # `_covering_serial` (a stream wait captures the record it is given, so re-recording is safe).
        # A slot's last reader (`last_read_S`) and a row's last upload (`_upload_serial_L`) need no
        # event at all once the fence passes them: in the fast loop, no event is recorded per visit.
        self.last_read_S = np.zeros(self.capacity, np.int64)
        self._upload_serial_L = [0] * L
        self._covering = device.new_event()
        self._serial = 0  # the current visit's serial (0: none yet)
        self._committed = 0  # visits up to this serial have their kernels enqueued
        self._fence = 0
        self._covering_serial = -1
        # Scratch of the compiled visit (no allocation per visit beyond the result's own arrays).
        self._admit_out = np.empty(G, np.int32)
        self._evict_out = np.empty(G, np.int32)
        self._slot_out = np.empty(G, np.int32)  # the admissions' slots
        self._flag_out = np.zeros(2 * G, np.int8)  # admissions' flags, then evictions' wasted flags
        self._hit_U = np.empty(E, np.bool_)
        self._key_U = np.empty(E, np.int32)
        self._uses_U = np.empty(E, np.int32)
        self._slot_U = np.empty(E, np.int32)
        self._miss_U = np.empty(E, np.int64)
        self._stamp_E = np.zeros(E, np.int64)  # serial of the visit that last saw each expert
        self._pos_E = np.zeros(E, np.int64)  # its index in that visit's key_U
        self._freed_S = np.empty(self.capacity, np.int32)  # slots freed busy by a visit (scratch)
        # keys holding a slot, capacity, free slots (the top of free_S): manager_visit.py's counts_X
        self._counts_X = np.array([0, self.capacity, 0], np.int64)
        self._routing_views: dict = {}  # pinned read-back buffers of device routing, by shape
        self._stats = ManagerStats()
        self._tally_X = np.zeros(len(TALLY), np.int64)  # the compiled visit's share of the stats
        self._copies = 0  # copies started by visits (stats.copies)
        self.last_visit: VisitResult | None = None  # the latest visit's result (the routing logger's)
        self.time_gpu = False
        self._init_session()
        self._warm_compiled()

    @property
    def stats(self) -> ManagerStats:
        """The running totals (never reset by `reset`): the compiled visit's (TALLY) and the copies are
        brought up to date on each read; the other fields are counted where they happen."""
        stats = self._stats
        for name, value in zip(TALLY, self._tally_X.tolist(), strict=True):
            setattr(stats, name, value)
        stats.copies = self._copies
        return stats

    @property
    def time_gpu(self) -> bool:
        """Set by the routing logger's recorder: the executors time each visit's GPU part with a pair of
        timing events (VisitResult.gpu_events) and the copy engine times its copies. It is the engine's
        `timing` itself, so the two cannot disagree."""
        return self.engine.timing

    @time_gpu.setter
    def time_gpu(self, on: bool) -> None:
        self.engine.timing = bool(on)

    @property
    def row_uploads(self) -> str:
        """Who copies a layer's staging row (pinned) to its device row `slot_of_LE[layer]`: "manager" (the
        default: `prepare` / `visit` enqueue the copy on the compute stream when the row changed) or
        "executor" (the fast loop on CUDA: its captured segment B(l) copies `staging_row(l)` before the
        layer's kernels on every replay, so the host point makes no CUDA call for it). Either way the
        staging row is rewritten only once the compute stream is past the previous visit of the layer
        (the fence, else the covering event), so the copy B(l) makes is of its own visit's row. Back to
        "manager", every row is uploaded again at its next visit."""
        return self._row_uploads

    @row_uploads.setter
    def row_uploads(self, who: str) -> None:
        if who not in ROW_UPLOADS:
            raise MoecacheError(f"cache manager: row_uploads={who!r}: expected one of {list(ROW_UPLOADS)}")
        with self._lock:
            if who == "manager" and self._row_uploads != "manager":
                self._dirty_L[:] = True
            self._row_uploads = who

    def staging_row(self, layer: int) -> torch.Tensor:
        """The layer's pinned staging row (int32 [E], fixed address): what the executor copies to
        `slot_of_LE[layer]` with row_uploads="executor"."""
        return self._staging_rows[layer]

    @property
    def on_miss(self) -> str:
        """What a miss does: "cpu" or "wait" (module docstring); may be changed between visits."""
        return self._on_miss

    @on_miss.setter
    def on_miss(self, mode: str) -> None:
        if mode not in ON_MISS:
            raise MoecacheError(f"cache manager: on_miss={mode!r}: expected one of {list(ON_MISS)}")
        if mode == "split" and self._split is None:
            if self._cost is None:
                raise MoecacheError(
                    'cache manager: on_miss="split" weighs copies against the CPU with a cost profile: give'
                    " the manager one (cost=, from moecache calibrate)"
                )
            SplitCosts(self._cost)  # refuses, in one line, a cost model without the runtime's costs
        self._on_miss = mode

    @property
    def cost(self):
        """The cost model (moecache/sim/cost_model.py, of this model's expert; None: none) that
        on_miss="split" weighs (one with the runtime's costs) and the policy may read (impact)."""
        return self._cost

    @cost.setter
    def cost(self, cost) -> None:
        self._cost = cost
        self._split = None if cost is None or cost.runtime is None else SplitCosts(cost)
        self.engine.copy_estimate_ns = None if self._split is None else self._split.copy_ns

    # ---- construction from the configuration -----------------------------------------------------

    @classmethod
    def from_policy(
        cls, store, device, capacity, name: str, params: dict | None = None, *, top_k: int, cost=None, **kw
    ):
        """From a policy name and parameters (the Hydra `policy` group: name, params)."""
        policy = make_policy(name, **dict(params or {}))
        return cls(store, device, capacity, policy, top_k=top_k, cost=cost, **kw)

    @classmethod
    def from_decision(cls, path, store, device, capacity, *, top_k: int, cost=None, **kw):
        """From a decide stage's decision.json: its `selected: {policy, params}` (docs/decision.md)."""
        from moecache.sim.policy_spec import PolicySpec

        spec = PolicySpec.selected_in(path)
        return cls.from_policy(store, device, capacity, spec.name, spec.params, top_k=top_k, cost=cost, **kw)

    # ---- session state ---------------------------------------------------------------------------

    def _init_session(self, initial_residents: bool = True) -> None:
        """Fresh counters and an empty cache, then (unless told not to) the policy's initial residents
        (static placements)."""
        G = self.shape.num_keys
        self._core.retype()  # new state and bookkeeping arrays
        self.state = self.policy.named_state(self.policy.init_state(self.shape, self.capacity))
        self.resident_G = np.zeros(G, np.bool_)  # the policy's view: holds a slot (loading or not)
        self.slot_of_G = np.full(G, -1, np.int32)
        # free slots, a stack: free_S[:_held_capacity[FREE]], slot 0 on top at first
        self.free_S = np.arange(self.capacity - 1, -1, -1, dtype=np.int32)
        self._counts_X[HELD] = 0
        self._counts_X[FREE] = self.capacity
        # copies in flight: per layer {key: Copy} in enqueue order, and as a mask over keys
        self.loading_L: list[dict[int, Copy]] = [{} for _ in range(self.shape.num_layers)]
        self._loading_G = np.zeros(G, np.bool_)
        self._seq_G = np.zeros(G, np.int64)  # a loading key's copy: its FIFO position, estimated landing
        self._est_ready_G = np.zeros(G, np.int64)
        self._late_G = np.zeros(G, np.bool_)  # loading keys whose copy was already counted late
        self.published_LE.fill(-1)
        self._dirty_L[:] = True
        self._pending: tuple | None = None  # (serial, deferred (key, slot), result) awaiting commit
        self._prepared: int | None = None  # the layer `prepare` published for, until its visit
        self.a0 = 0  # accesses so far (the step's access clock)
        self.clock = 0  # tokens of earlier forward steps
        self.request = 0
        self._step_tokens = 0
        self._last_layer: int | None = None
        if not initial_residents:
            return
        initial = np.asarray(self.policy.initial_residents(self.state, self.shape, self.capacity), np.int64)
        if len(initial) > self.capacity:
            raise MoecacheError(
                f"policy {self.policy.label()} starts with {len(initial)} residents > capacity {self.capacity}"
            )
        self._load_residents(initial)

    def _load_residents(self, keys: np.ndarray) -> None:
        """Give `keys` slots, copy them and publish them before returning (setup, not the hot path)."""
        copies = []
        for k in keys.tolist():
            if self.resident_G[k]:
                raise MoecacheError(f"cache manager: key {k} listed twice among the residents")
            self.resident_G[k] = True
            self._counts_X[FREE] -= 1
            slot = int(self.free_S[self._counts_X[FREE]])
            self.slot_of_G[k] = slot
            copies.append(self.engine.enqueue(k, slot, after=self._slot_free_after(slot)))
        self._counts_X[HELD] = int(self.resident_G.sum())
        for copy in copies:
            copy.ready_event.synchronize()
            copy.observe()
            self._publish(copy)
            self.engine.release(copy)

    def reset(self) -> None:
        """Counters and residency back to the start (before a benchmark repetition). Slots keep their
        last readers: a copy into a slot still read by queued work still waits for it."""
        with self._lock:
            self.commit()
            self._init_session()

    def export_state(self) -> dict:
        """The session state, JSON-able apart from numpy arrays: policy, counters, residents, clocks."""
        with self._lock:
            self.commit()
            return {
                "policy": self.policy.label(),
                "shape": [self.shape.num_layers, self.shape.num_experts],
                "capacity": self.capacity,
                "state": {name: np.array(value, copy=True) for name, value in self.state._asdict().items()},
                "resident_keys": np.flatnonzero(self.resident_G).astype(np.int64),
                "clocks": {
                    "a0": self.a0,
                    "clock": self.clock,
                    "request": self.request,
                    "step_tokens": self._step_tokens,
                    "last_layer": self._last_layer,
                },
            }

    def import_state(self, exported: dict) -> None:
        """Continue from `export_state`'s result (same policy, shape and capacity): the residents' weights
        are copied and published before returning."""
        with self._lock:
            want = {
                "policy": self.policy.label(),
                "shape": [self.shape.num_layers, self.shape.num_experts],
                "capacity": self.capacity,
            }
            for key, value in want.items():
                if exported.get(key) != value:
                    raise MoecacheError(
                        f"cache manager import: {key}={exported.get(key)!r}, this manager has {value!r}"
                    )
            self.commit()
            self._init_session(initial_residents=False)
            fields = exported["state"]
            self.state = type(self.state)(*(np.array(fields[name], copy=True) for name in self.state._fields))
            self._core.retype()
            self._load_residents(np.asarray(exported["resident_keys"], np.int64))
            clocks = exported["clocks"]
            self.a0, self.clock, self.request = (
                int(clocks["a0"]),
                int(clocks["clock"]),
                int(clocks["request"]),
            )
            self._step_tokens, self._last_layer = int(clocks["step_tokens"]), clocks["last_layer"]

    def warm_from_trace(self, trace) -> None:
        """Initialise counters and residency by replaying `trace` (a TraceArrays of this model's shape)
        through the policy, then load the residents it ends with. The clocks continue after the trace."""
        if (trace.num_layers, trace.num_experts) != (self.shape.num_layers, self.shape.num_experts):
            raise MoecacheError(
                f"warm_from_trace: trace {trace.name} is {trace.num_layers} x {trace.num_experts}, the model "
                f"{self.shape.num_layers} x {self.shape.num_experts}"
            )
        with self._lock:
            self.commit()
            self._init_session(initial_residents=False)
            resident_G = np.zeros(self.shape.num_keys, np.bool_)
            replay_from(trace, self.policy, self.state, resident_G, self.capacity)
            self._load_residents(np.flatnonzero(resident_G).astype(np.int64))
            self.a0 = trace.num_accesses
            last = trace.num_steps - 1
            self.clock = int(trace.clock_V[last]) if last >= 0 else 0
            self._step_tokens = int(trace.tokens_V[last]) if last >= 0 else 0
            self.request = int(trace.request_V[last]) + 1 if last >= 0 else 0
            self._last_layer = None

    def _warm_compiled(self) -> None:
        """Compile (or load from numba's cache) the visit's compiled functions now, on throwaway copies of
        the session state, so that the first visit of a run does not pay for it (a few ms from the
        cache, ~0.3-1 s when the code changed: a cold run's first token would carry it)."""
        K, E = self.shape.top_k, self.shape.num_experts
        state = type(self.state)(*(np.array(field, copy=True) for field in self.state))
        self._core(
            state, np.zeros((0, K), np.int64), 0, 0, 0, 0, 0, np.zeros(E, np.int64), self._pos_E, self._key_U,
            self._uses_U, self._slot_U, self._miss_U, self._hit_U, np.empty((0, K), np.bool_),
            np.empty(E, np.int32), self.resident_G.copy(), self._loading_G.copy(), self._late_G.copy(),
            self._counts_X.copy(), self._admit_out, self._evict_out, self._slot_out, self._flag_out,
            self.slot_of_G.copy(), self.published_LE.copy(), self._dirty_L.copy(), self.free_S.copy(),
            self._freed_S, self.last_read_S.copy(), self._tally_X.copy(),
        )  # fmt: skip

    # ---- the hot path ----------------------------------------------------------------------------

    def begin_request(self) -> None:
        """The next visits belong to a new request (policies with per-request state read it)."""
        with self._lock:
            if self._last_layer is not None or self.a0:
                self.request += 1
            self._last_layer = None

    def prepare(self, layer: int) -> torch.Tensor:
        """Step 1 of the layer's next visit on its own, before its routing is known: publish the layer's
        completed copies and enqueue its mapping row's upload. The executor may then enqueue the layer's
        kernels (they read the returned fixed-address device row) before it reads the routing back and
        calls `visit`, which runs on exactly this snapshot (nothing is published in between). Not with
        on_miss="wait": a waiting visit changes the row its kernels read."""
        with self._lock:
            if self._on_miss == "wait":
                raise MoecacheError(
                    'cache manager: prepare() is not for on_miss="wait" (a waiting visit sets its row)'
                )
            self._begin_visit(layer)
            self._publish_ready(layer)
            self._push_row(layer)
            self._prepared = layer
            return self._device_rows[layer]

    @property
    def prepared(self) -> int | None:
        """The layer `prepare` published for, until its visit (None: none pending)."""
        return self._prepared

    def prepared_hits(self, layer: int, ids_TK: np.ndarray) -> np.ndarray | None:
        """The hit mask (bool [T, K]) of the layer's published row for `ids_TK`: after `prepare(layer)`,
        exactly the `hit_TK` of the visit that follows (it runs on that snapshot); None for an id outside
        0..E-1 (the visit refuses it)."""
        E = self.shape.num_experts
        if ids_TK.size and (ids_TK.min() < 0 or ids_TK.max() >= E):
            return None
        return self.published_LE[layer][ids_TK] >= 0

    def covers(self, layer: int, ids_TK: np.ndarray) -> bool:
        """Whether every entry of `ids_TK` is in the layer's published row: after `prepare(layer)`, the
        visit that follows would run all of them on the device (an id outside 0..E-1: False)."""
        hit_TK = self.prepared_hits(layer, ids_TK)
        return hit_TK is not None and bool(hit_TK.all())

    def cancel_prepare(self) -> None:
        """Forget a `prepare` whose visit will not come (its step was abandoned); the publication stays."""
        with self._lock:
            self._prepared = None

    def _begin_visit(self, layer: int) -> None:
        if not 0 <= layer < self._num_layers:
            raise MoecacheError(f"cache manager: layer {layer} outside 0..{self._num_layers - 1}")
        if self._pending is not None:
            self.commit()
        self._committed = self._serial
        if self._on_visit():  # the stand-in ran everything queued
            self._fence = self._serial
        self._serial += 1

    def visit(self, layer: int, topk_ids_TK, *, compute_done: bool = False) -> VisitResult:
        """One MoE layer's routing (int [T, K], host or device) -> the snapshot, hits, misses and the
        placement changes (module docstring). A visit to a layer not above the previous visit's layer
        starts a new forward step of T tokens. After `prepare(layer)` the visit uses that publication.
        `compute_done`: the caller has seen the compute stream complete all work enqueued before this
        visit (before its `prepare`), e.g. by a blocking read of the routing: no event is then needed
        to reuse the slots and rows that work read."""
        with self._lock:
            prepared = self._prepared == layer
            if self._prepared is not None and not prepared:
                raise MoecacheError(
                    f"cache manager: visit of layer {layer} after prepare({self._prepared}): visit that layer first"
                )
            self._prepared = None
            if not prepared:
                self._begin_visit(layer)
            ids_TK = self._read_routing(topk_ids_TK)
            if compute_done:
                self._fence = self._serial - 1
            T = ids_TK.shape[0]
            if self._last_layer is None or layer <= self._last_layer:
                self.clock += self._step_tokens
                self._step_tokens = T
            else:
                self._step_tokens = max(self._step_tokens, T)
            self._last_layer = layer
            wait = self._on_miss == "wait"
            if not prepared:
                self._publish_ready(layer)
                if not wait:  # with waits, the row this visit runs is known only after its copies
                    self._push_row(layer)
            hit_TK = np.empty(ids_TK.shape, np.bool_)
            snapshot_E = np.empty(self.shape.num_experts, np.int32)
            try:
                U, n_miss, n_admit, n_evict, _late, n_wasted = self._core(
                    self.state, ids_TK, layer, self._serial, self.a0, self.clock, self.request,
                    self._stamp_E, self._pos_E, self._key_U, self._uses_U, self._slot_U, self._miss_U,
                    self._hit_U, hit_TK, snapshot_E, self.resident_G, self._loading_G, self._late_G,
                    self._counts_X, self._admit_out, self._evict_out, self._slot_out, self._flag_out,
                    self.slot_of_G, self.published_LE, self._dirty_L, self.free_S, self._freed_S,
                    self.last_read_S, self._tally_X,
                )  # fmt: skip
            except ValueError as exc:
                raise MoecacheError(
                    f"policy {self.policy.label()} at capacity {self.capacity}: {exc}"
                ) from exc
            if U == BAD_ROUTING:
                raise MoecacheError(
                    f"cache manager: layer {layer} routing: an expert id outside 0..{self.shape.num_experts - 1}"
                )
            self.a0 += U
            result = VisitResult(
                layer,
                self._device_rows[layer],
                snapshot_E,
                hit_TK,
                self._miss_U[:n_miss].copy() if n_miss else _NONE_I64,
                self._admit_out[:n_admit].copy() if n_admit else _NONE_I32,
                self._evict_out[:n_evict].copy() if n_evict else _NONE_I32,
            )
            if n_wasted:
                self._drop_wasted(result.evicted, n_evict)
            deferred = []
            if n_admit:
                deferred = self._enqueue_admitted(result, n_admit)
            if wait:
                busy = set(self._slot_U[: U - n_miss].tolist())
                self._wait_for_copies(layer, ids_TK, result, busy)
            elif n_miss and self._on_miss == "split" and self.loading_L[layer]:
                self._split_misses(layer, ids_TK, result)
            self._pending = (self._serial, deferred, result)
            self.last_visit = result
            return result

    def commit(self) -> None:
        """The executor has enqueued the last visit's GPU work on the compute stream: the copies into
        slots it read (deferred) are enqueued behind an event recorded now (the visit itself made
        itself those slots' last reader). Idempotent."""
        with self._lock:
            if self._pending is None:
                return
            serial, deferred, result = self._pending
            self._pending = None
            self._committed = serial
            for key, slot in deferred:
                self._start_copy(key, slot, result)

    def count_resident_visits(self, visits: int, hits: int) -> None:
        """Layer visits the fast decode loop ran with no visit call (a fused layer: every expert resident
        under a placement that cannot change), counted as visits and their `hits`."""
        with self._lock:
            self._tally_X[TALLY.index("visits")] += visits
            self._tally_X[TALLY.index("hits")] += hits

    def _covering_event(self, serial: int):
        """An event that completes once every visit up to `serial` has run on the compute stream."""
        if self._covering_serial < serial:
            self._covering.record(self.compute)
            self._covering_serial = self._committed
        return self._covering

    def _slot_free_after(self, slot: int):
        """What a copy into `slot` must wait for: None when its last reader is past the fence."""
        last = self.last_read_S[slot]
        return None if last <= self._fence else self._covering_event(last)

    def _wait_for_copies(self, layer: int, ids_TK: np.ndarray, result: VisitResult, busy) -> None:
        """on_miss="wait": wait for this visit's enqueued copies, publish them, and give the visit the
        row it runs: the snapshot it began with, its evicted experts that it does not read cleared, its
        waited copies added. That row is uploaded now (the published row, without this visit's
        evictions of experts it reads, follows at the layer's next visit)."""
        E = self.shape.num_experts
        base = layer * E
        result.cache_snapshot_E = result.snapshot_E.copy()
        result.cache_hit_TK = result.hit_TK
        visit_row = result.snapshot_E  # the visit's own copy
        for key in result.evicted.tolist():
            slot = visit_row[key - base]
            if slot >= 0 and slot not in busy:
                visit_row[key - base] = -1
        loading = self.loading_L[layer]
        for copy in list(result.copies):
            copy.ready_event.synchronize()
            copy.observe()
            loading.pop(copy.key, None)
            self._publish(copy)
            self.engine.release(copy)
            visit_row[copy.key - base] = copy.slot
            self.stats.waited_copies += 1
        result.hit_TK = visit_row[ids_TK] >= 0
        result.miss_experts = np.array(
            [e for e in result.miss_experts.tolist() if visit_row[e] < 0], np.int64
        )
        self._push_row(layer, visit_row)
        self._dirty_L[layer] = True  # the next visit uploads the published row

    def _split_misses(self, layer: int, ids_TK: np.ndarray, result: VisitResult) -> None:
        """on_miss="split" (module docstring): the misses whose copy is in flight, in landing order,
        weighed by the simulator's rule; the first `w` are waited for on the compute stream and mapped
        in the visit's wait row, the visit's hit mask and misses updated (the cache's view kept in
        cache_snapshot_E / cache_hit_TK)."""
        started = time.perf_counter_ns()
        base = layer * self.shape.num_experts
        miss_E = result.miss_experts
        w, n_cand, keys_J = self._split.decide(
            miss_E, self._uses_U[self._pos_E[miss_E]], base, self._loading_G, self._seq_G,
            self._est_ready_G, ids_TK.size, ids_TK.shape[0],
        )  # fmt: skip
        if n_cand == 0:
            return
        decided = time.perf_counter_ns()
        self.stats.split_decisions += 1
        self.stats.split_decide_ns += decided - started
        if w == 0:
            return
        loading = self.loading_L[layer]
        waited = [loading[key] for key in keys_J[:w].tolist()]  # the first w, in landing order
        row = self._wait_staging_np[layer]
        self._await_upload(self._wait_upload_serial_L[layer])
        row.fill(-1)
        for copy in waited:
            row[copy.key - base] = copy.slot
            self.last_read_S[copy.slot] = self._serial  # the wait call reads it after this visit's hits
        result.cache_snapshot_E = result.snapshot_E
        result.cache_hit_TK = result.hit_TK
        waited_E = row >= 0
        result.hit_TK = result.hit_TK | waited_E[ids_TK]
        result.miss_experts = miss_E[~waited_E[miss_E]]
        result.waited = waited
        result.wait_slot_of_E = self._wait_rows[layer]
        self.stats.waited_copies += w
        self.stats.split_waits += 1
        self.stats.split_wait_ns += time.perf_counter_ns() - decided

    def enqueue_waits(self, result: VisitResult) -> torch.Tensor:
        """on_miss="split", for the executor once the visit's hits are enqueued (before `commit`): the
        compute stream waits for the visit's waited copies (the last one's ready event: the copy stream
        is FIFO), then the visit's wait row is uploaded; returns that device row for the wait call."""
        with self._lock:
            started = time.perf_counter_ns()
            layer = result.layer
            self.compute.wait_event(result.waited[-1].ready_event)
            self.device.copy(self._wait_rows[layer], self._wait_staging_rows[layer], self.compute)
            self._wait_upload_serial_L[layer] = self._serial
            self.stats.split_wait_ns += time.perf_counter_ns() - started
            return result.wait_slot_of_E

    # ---- helpers ---------------------------------------------------------------------------------

    def _read_routing(self, topk_ids_TK) -> np.ndarray:
        """The routing as host int64 [T, K], C-contiguous (the compiled visit's argument type): the one
        device-to-host read of the hot path (into a reused pinned buffer for a CUDA tensor)."""
        if (
            type(topk_ids_TK) is np.ndarray
            and topk_ids_TK.dtype == np.int64
            and topk_ids_TK.ndim == 2
            and topk_ids_TK.flags.c_contiguous
        ):
            return topk_ids_TK  # the fast loop's read-back view
        if isinstance(topk_ids_TK, np.ndarray):
            return np.ascontiguousarray(topk_ids_TK, np.int64).reshape(topk_ids_TK.shape[0], -1)
        if topk_ids_TK.device.type == "cpu":
            return np.ascontiguousarray(topk_ids_TK.numpy(), np.int64)
        host = self._routing_views.get(topk_ids_TK.shape)
        if host is None:  # one pinned buffer per routing shape, made on first use
            host = torch.empty(topk_ids_TK.shape, dtype=topk_ids_TK.dtype, pin_memory=True)
            self._routing_views[topk_ids_TK.shape] = host
        host.copy_(topk_ids_TK, non_blocking=True)
        self.compute.stream.synchronize()  # the routing was computed on the compute stream
        self._fence = self._serial - 1  # and with it everything before this visit
        return np.ascontiguousarray(host.numpy(), np.int64)

    def _publish(self, copy: Copy) -> None:
        """The copy is complete and no longer in flight (the caller removed it from loading_L)."""
        layer, expert = divmod(copy.key, self.shape.num_experts)
        self.published_LE[layer, expert] = copy.slot
        self._dirty_L[layer] = True
        self._loading_G[copy.key] = False
        self._late_G[copy.key] = False

    def _publish_ready(self, layer: int) -> None:
        """Publish the layer's completed copies. `loading_L[layer]` is in enqueue order (an admission's
        copy is enqueued when it is inserted), so the engine queries up to the first incomplete one."""
        loading = self.loading_L[layer]
        if loading:
            for copy in self.engine.observe_in_order(list(loading.values())):
                del loading[copy.key]
                self._publish(copy)
                self.engine.release(copy)

    def _push_row(self, layer: int, row_E: np.ndarray | None = None) -> None:
        """Upload the layer's mapping row (or `row_E`), ordered on the compute stream before its kernels
        (row_uploads="executor": write its staging row only; the executor's B(l) copies it). The staging
        row is rewritten only once the previous upload has run: known past the fence, else checked on
        the covering event (and waited for: `publish_waits`)."""
        executor = self._row_uploads == "executor"
        if row_E is None and not self._dirty_L[layer]:
            if executor:  # this visit's B(l) copies the staging row again: its last reader now
                self._upload_serial_L[layer] = self._serial
            return
        self._await_upload(self._upload_serial_L[layer])
        self._staging_np[layer] = self.published_LE[layer] if row_E is None else row_E
        if not executor:
            self.device.copy(self._device_rows[layer], self._staging_rows[layer], self.compute)
        self._upload_serial_L[layer] = self._serial
        self._dirty_L[layer] = False

    def _await_upload(self, serial: int) -> None:
        """Before a pinned staging row is rewritten: the upload that visit `serial` enqueued from it has
        run (known past the fence, else checked on the covering event and waited for: `publish_waits`)."""
        if serial > self._fence:
            event = self._covering_event(serial)
            if not event.query():
                self.stats.publish_waits += 1
                event.synchronize()

    def _drop_wasted(self, evicted: np.ndarray, n_evict: int) -> None:
        """Evicted keys whose copy was still in flight (the compiled visit flagged them): no longer loading."""
        G = self.shape.num_keys
        E = self.shape.num_experts
        for j in np.flatnonzero(self._flag_out[G : G + n_evict]).tolist():
            key = int(evicted[j])
            self.loading_L[key // E].pop(key).wasted = True

    def _enqueue_admitted(self, result: VisitResult, n_admit: int) -> list:
        """Enqueue the copies of the visit's admissions into the slots the compiled visit gave them, now;
        returns [(key, slot)] of those that must follow this visit's own kernels (see commit)."""
        deferred = []
        slots, flags = self._slot_out[:n_admit].tolist(), self._flag_out[:n_admit].tolist()
        for key, slot, flag in zip(result.admitted.tolist(), slots, flags, strict=True):
            if flag == ADMIT_DEFERRED:
                self._stats.deferred_copies += 1
                deferred.append((key, slot))
            else:
                self._start_copy(key, slot, result)
        return deferred

    def _start_copy(self, key: int, slot: int, result: VisitResult) -> None:
        """Enqueue `key`'s copy into `slot` after the slot's last reader; the key is loading from now."""
        copy = self.engine.enqueue(key, slot, self._slot_free_after(slot))
        self.loading_L[key // self._num_experts][key] = copy
        self._loading_G[key] = True
        self._seq_G[key] = copy.seq  # the split's decision reads these (moecache/runtime/miss_split.py)
        self._est_ready_G[key] = copy.est_ready_ns
        result.copies.append(copy)
        self._copies += 1

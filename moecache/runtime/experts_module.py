"""The experts module of an offloaded model: stands in for a sparse MoE block's `.experts`.

Every supported model (transformers 5: Qwen3.5/3.6-MoE, DeepSeek-V2, Mixtral, Qwen3-MoE, OLMoE) calls its
experts as `experts(hidden_states_TH, top_k_index_TK, top_k_weights_TK) -> y_TH` after its own router;
the shared expert, if any, is added by the block itself. `OffloadedExperts` keeps that signature, so it is
swapped in by assigning `block.experts` (transformers is not edited): the router and the shared expert
stay the model's, and the module holds no parameters at all (the dense expert weights are gone from the
compute device; every expert lives in the host store, some in the slot pool).

One call is one layer visit of the cache manager (docs/runtime.md):
1. the routing is read to the host once (ids and weights: the manager and the CPU path need them);
2. `manager.visit(layer, ids)` publishes the layer's finished copies and says which entries hit; with
   misses, x and the router weights are read to the host now (on CUDA: read after step 3's enqueue, they
   would wait for its kernels, and the halves would run one after the other);
3. the hits run from the slot pool on the compute device (`slot_moe` on CUDA, its torch reference on the
   CPU stand-in), reading the mapping `slot_of_E` of this very visit; with on_miss="split", the
   experts whose copies the visit waits for by one more call over its wait row; then `manager.commit()`;
4. the misses run on the CPU from the store (`CpuExperts.run`, keys = layer * E + expert) and are added;
   with `stream_misses` on, a many-token visit's experts that enough of its misses use are enqueued on
   the device first instead (copied into staging slots: moecache/runtime/streamed_misses.py), and the
   CPU runs the rest while they fly.
Both halves sum only their own entries, so y = GPU part + CPU part is every entry's weighted sum.

Each step is a public method of `ExpertsRuntime` (`visit`, `resident`, `waited`, `commit`, `cpu_half`;
`prepare` publishes a mapping ahead of the routing) with its counting in one `LayerCounters`. `run` is
the eager driver: the whole sequence in one call. The fast decode loop (moecache/runtime/segments.py)
runs the same methods, cut at the host points of a step captured as CUDA graphs; the device differences
(a stand-in runs its queued work when a result is read) are the device's (`Device.launch`, `drain`).

One rounding: a visit whose entries run in more than one part (hits and misses, or hits and waited
copies) has every part write its float32 sums (the kernel into a float32 `out`, the CPU path into a
float32 buffer), added in float32 and rounded to x's dtype once, so the result is the float32 sum over
all K entries rounded once, as one all-resident kernel call gives. A visit run by one part alone writes
x's dtype directly (that part's own single rounding). Each entry's own arithmetic is the same in every
part: transformers' roundings (moecache_kernels/expert_reference.py), the weighted product rounded when
the router's weights are in x's dtype (`rounds_product`; the fast loop holds them widened to float32,
so it passes the router's dtype's answer explicitly).

Legend: T tokens, H hidden, K top-k, E experts, M (token, expert) entries run on the CPU.
"""

from __future__ import annotations

import time

import numba as nb
import numpy as np
import torch
from moecache_kernels import rounds_product
from torch import nn

from moecache.errors import MoecacheError
from moecache.runtime.cpu_experts import CpuExperts
from moecache.runtime.decode_stream import check_share
from moecache.runtime.layer_counters import LayerCounters
from moecache.runtime.manager import CacheManager
from moecache.runtime.streamed_misses import DEFAULT_CHUNK, StreamedMisses, check_settings


def miss_entries(layer: int, num_experts: int, ids_host_TK: np.ndarray, weights_TK: torch.Tensor, hit_TK):
    """The (token, k) entries a visit runs on the CPU, as the CPU executor's triples: (global keys int64
    [M], tokens int64 [M], weights float32 [M]), in token then k order. Both decode loops (here and
    moecache/runtime/segments.py) gather them this way: one compiled pass (`_gather_misses`; at the fast
    loop's deferred host point `route_misses`, which looks the hit mask up in the same pass)."""
    ids_TK = np.ascontiguousarray(ids_host_TK, np.int64)
    w_TK = weights_TK.detach().to("cpu", torch.float32).contiguous().numpy()
    n = ids_TK.size
    keys_M, token_M, weight_M = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.float32)
    m = _gather_misses(
        layer * num_experts, ids_TK, w_TK, np.ascontiguousarray(hit_TK, np.bool_), keys_M, token_M, weight_M
    )
    return torch.from_numpy(keys_M[:m]), torch.from_numpy(token_M[:m]), torch.from_numpy(weight_M[:m])


def log_cpu_call(log: list, tokens: int, keys_M, ns: int) -> None:
    """One CPU-path call into a CPU-path log (both loops' `cpu_log`: calibrate's in-loop rows):
    (tokens, entries, ns, uses: the token count of each of its experts). `keys_M`: 1-D, CPU tensor or
    numpy."""
    uses = tuple(np.unique(np.asarray(keys_M), return_counts=True)[1].tolist())
    log.append((int(tokens), len(keys_M), int(ns), uses))


@nb.njit(cache=True, nogil=True)
def _gather_misses(base, ids_TK, w_TK, hit_TK, keys_M, token_M, weight_M):
    m = 0
    for t in range(ids_TK.shape[0]):
        for k in range(ids_TK.shape[1]):
            if not hit_TK[t, k]:
                keys_M[m] = base + ids_TK[t, k]
                token_M[m] = t
                weight_M[m] = w_TK[t, k]
                m += 1
    return m


@nb.njit(cache=True, nogil=True)
def route_misses(base, row_E, ids_TK, w_TK, hit_TK, keys_M, token_M, weight_M, ids_copy_TK):
    """The fast loop's host point in one compiled call: `hit_TK[t, k]` (bool, written) is whether expert
    `ids_TK[t, k]` is in the mapping row `row_E` (int32 [E], -1: not resident), the misses are gathered
    as `_gather_misses` does (keys `base` + id), and `ids_copy_TK` receives a copy of `ids_TK`. Returns
    the misses' count m, or -1 if an id is outside 0..E-1 (what was written is then meaningless)."""
    E = row_E.shape[0]
    m = 0
    for t in range(ids_TK.shape[0]):
        for k in range(ids_TK.shape[1]):
            e = ids_TK[t, k]
            if e < 0 or e >= E:
                return -1
            ids_copy_TK[t, k] = e
            hit = row_E[e] >= 0
            hit_TK[t, k] = hit
            if not hit:
                keys_M[m] = base + e
                token_M[m] = t
                weight_M[m] = w_TK[t, k]
                m += 1
    return m


class ExpertsRuntime:
    """What every layer's experts module shares: the manager (its store and slot pool), the CPU executor
    and the counters; the pieces of one layer visit (module docstring), public so that both drivers run
    the same ones: `visit`, `prepare`, `resident`, `waited`, `commit`, `cpu_half`; and `run`, the eager
    driver (one whole visit per call). Calls are serialised by the model's forward (one layer after the
    other)."""

    def __init__(self, manager: CacheManager, cpu: CpuExperts):
        self.manager = manager
        self.cpu = cpu
        self.device = manager.device
        self.pool = manager.pool
        self.num_experts = manager.shape.num_experts
        self.counters = LayerCounters()
        # When a list: one (tokens, entries, ns, uses) per CPU-half call, uses the token count of each of
        # its experts (calibrate's in-loop CPU-path rows, from the prefill's calls and the fast loop's)
        self.cpu_log: list[tuple[int, int, int, tuple]] | None = None
        if self.device.is_cuda:
            from moecache_kernels import slot_moe

            self.kernel = slot_moe
        else:
            from moecache_kernels import slot_moe_reference

            self.kernel = slot_moe_reference
        # many-token visits' missed experts on the device (`stream_misses`); None: every miss on the CPU
        self.streamed: StreamedMisses | None = None
        # the share of a fast-loop decode visit's misses run on the device (`stream_decode`); 0: none
        self.decode_share = 0.0

    def stream_decode(self, share) -> None:
        """The fast decode loop's split layers run `share` of each visit's missed entries (rounded down,
        at least one left to the CPU) on the device, copied while the CPU runs the rest
        (moecache/runtime/decode_stream.py); 0: none. Taken by the loop's next taps (a new decode loop).
        Needs on_miss="cpu" (the visit deferred past the CPU half)."""
        check_share(share, self.manager.on_miss)
        self.decode_share = float(share)

    def stream_misses(self, min_tokens: int, chunk: int) -> None:
        """From the next visit on, run on the compute device every missed expert that at least
        `min_tokens` of a visit's entries use, staged through two pools of `chunk` slots
        (moecache/runtime/streamed_misses.py); `min_tokens` 0: none (every miss on the CPU)."""
        check_settings(min_tokens, chunk)
        self.streamed = None
        if min_tokens:
            self.streamed = StreamedMisses(
                self.device, self.manager.store, self.manager.compute, self.kernel, min_tokens=min_tokens,
                chunk=chunk,
            )  # fmt: skip

    @property
    def stream_settings(self) -> tuple[int, int]:
        """(min_tokens, chunk) as `stream_misses` takes them: the current ones; (0, the default) when off."""
        s = self.streamed
        return (0, DEFAULT_CHUNK) if s is None else (s.min_tokens, s.chunk)

    # ---- the eager driver ------------------------------------------------------------------------

    def run(self, layer: int, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor):
        """y_TH for one layer visit (module docstring), in x's dtype, on x's device."""
        ids_host_TK = ids_TK.detach().to("cpu", torch.int64).numpy()  # a blocking read on CUDA
        rounds = rounds_product(x_TH.dtype, weights_TK.dtype)
        visit = self.visit(layer, ids_host_TK)
        hit_TK = visit.hit_TK  # with waited copies (on_miss="split"): their entries too
        streamed_U, cpu_skip_TK = None, hit_TK  # experts run from the staging pools; what the CPU skips
        if self.streamed is not None and not hit_TK.all():
            streamed_U = self.streamed.select(ids_host_TK, ~hit_TK)
            if streamed_U.size:
                cpu_skip_TK = hit_TK | np.isin(ids_host_TK, streamed_U)
            else:
                streamed_U = None
        cpu_part = not cpu_skip_TK.all()
        x_host_TH, w_host_TK = None, weights_TK
        if cpu_part and x_TH.is_cuda:
            # the CPU half's inputs read now, before the GPU half is enqueued: read after it, they would
            # wait for it (the hits' kernel, the waited copies), and the two halves would not overlap
            x_host_TH = x_TH.detach().to("cpu")
            w_host_TK = weights_TK.detach().to("cpu", torch.float32)
        cache_hits = bool((visit.cache_hit_TK if visit.waited else hit_TK).any())
        # more than one part: each writes float32, summed in float32, rounded once (module docstring)
        wide = cache_hits + bool(visit.waited) + (streamed_U is not None) + cpu_part > 1

        def out_TH(device):
            return torch.empty(x_TH.shape, dtype=torch.float32, device=device) if wide else None

        y_TH = None
        if cache_hits:
            timed = self.manager.time_gpu
            if timed:
                visit.gpu_events = self._record_event(None)
            y_TH = self.resident(x_TH, ids_TK, weights_TK, visit.slot_of_E, out_TH(x_TH.device), rounds)
            if timed:
                visit.gpu_events = self._record_event(visit.gpu_events[0])
        if visit.waited:  # after the hits: they do not wait for the copies
            y_wait_TH = self.waited(
                visit, x_TH, ids_TK, weights_TK, out_TH(x_TH.device), round_product=rounds
            )
            y_TH = y_wait_TH if y_TH is None else y_TH.add_(y_wait_TH)
        self.commit()  # the GPU half is enqueued: this visit is the last reader of its slots
        if streamed_U is not None:  # enqueued before the CPU half, which runs while its copies fly
            y_str_TH = self.streamed.run(layer, x_TH, ids_TK, weights_TK, streamed_U, round_product=rounds)
            y_TH = y_str_TH if y_TH is None else y_TH.add_(y_str_TH)
            self.counters.streamed_experts += int(streamed_U.size)
            self.counters.streamed_entries += int((cpu_skip_TK & ~hit_TK).sum())
        if cpu_part:
            if x_host_TH is None:
                x_host_TH = x_TH.detach().to("cpu")
            cpu_TH, visit.cpu_duration_ns = self.cpu_half(
                layer, x_host_TH, ids_host_TK, w_host_TK, cpu_skip_TK, out_TH("cpu"),
                place=lambda y_host_TH: y_host_TH.to(x_TH.device, non_blocking=False), round_product=rounds,
            )  # fmt: skip
            y_TH = cpu_TH if y_TH is None else y_TH.add_(cpu_TH)
        if y_TH is None:
            return torch.zeros_like(x_TH)
        return y_TH.to(x_TH.dtype)  # the one rounding (a no-op for a part that wrote x's dtype)

    def _record_event(self, start):
        """A timing event recorded now on the compute stream: (event,) or, given `start`, (start, event).
        On the stand-in it completes at once (its kernels ran when enqueued)."""
        event = self.device.new_event(timing=True)
        event.record(self.manager.compute)
        self.device.drain(self.manager.compute)
        return (event,) if start is None else (start, event)

    # ---- the pieces of a layer visit ---------------------------------------------------------------

    def prepare(self, layer: int) -> None:
        """Publish the layer's mapping before its routing is known (`manager.prepare`; the fast loop)."""
        started = time.perf_counter_ns()
        self.manager.prepare(layer)
        self.counters.manager_ns += time.perf_counter_ns() - started
        self.device.drain(self.manager.compute)  # the stand-in: the row's upload, before a kernel reads it

    def visit(self, layer: int, ids_host_TK: np.ndarray):
        """The manager's visit on the layer's routing (host int64 [T, K]): the VisitResult."""
        started = time.perf_counter_ns()
        visit = self.manager.visit(layer, ids_host_TK, compute_done=self.device.is_cuda)
        counters = self.counters
        counters.manager_ns += time.perf_counter_ns() - started
        counters.visits += 1
        counters.gpu_entries += int(visit.hit_TK.sum())
        self.device.drain(self.manager.compute)  # the stand-in: the row's upload, before a kernel reads it
        return visit

    def count_resident_visits(self, visits: int, tokens: int) -> None:
        """`visits` layer steps of one token each run from the slot pool with no visit call (the fast
        loop's fused layers): each a visit whose K distinct experts hit, K entries from the slot pool."""
        if tokens != 1:
            raise MoecacheError(f"fused layer steps of {tokens} tokens: their distinct experts are not known")
        K = self.manager.shape.top_k
        self.manager.count_resident_visits(visits, visits * K)
        self.counters.gpu_entries += visits * K

    def commit(self) -> None:
        """The visit's kernels are enqueued: the manager may reuse its slots (`manager.commit`)."""
        started = time.perf_counter_ns()
        self.manager.commit()
        self.counters.manager_ns += time.perf_counter_ns() - started

    def resident(self, x_TH, ids_TK, weights_TK, slot_of_E, out_TH=None, round_product=None) -> torch.Tensor:
        """The entries resident in mapping row `slot_of_E`, from the slot pool, on the compute stream after
        the row's upload: float32 into `out_TH` when given, else x's dtype. `round_product`: the kernel's
        (default: from x's and the weights' dtypes)."""
        pool, kernel = self.pool, self.kernel
        return self.device.launch(
            self.manager.compute,
            lambda: kernel(
                x_TH, ids_TK, weights_TK, slot_of_E, pool.w13_SIH, pool.w2_SHI, out=out_TH,
                round_product=round_product,
            ),
        )  # fmt: skip

    def waited(self, visit, x_TH, ids_TK, weights_TK, out_TH=None, replay=None, round_product=None):
        """on_miss="split": the entries whose copies the visit waits for. The manager enqueues the compute
        stream's wait on those copies and their mapping row; then one more operator call over that row,
        or `replay()` (the same call captured as a graph, writing its own buffer: returns None). On CUDA
        the launch is the visit's host time, counted in the split's (the stand-in's is its compute)."""
        started = time.perf_counter_ns()
        row_E = self.manager.enqueue_waits(visit)  # counts its own host time in the split's stats
        launched = time.perf_counter_ns()
        if replay is not None:
            replay()
            y_TH = None
        else:
            pool, kernel = self.pool, self.kernel
            y_TH = self.device.launch(
                self.manager.compute,
                lambda: kernel(
                    x_TH, ids_TK, weights_TK, row_E, pool.w13_SIH, pool.w2_SHI, out=out_TH,
                    round_product=round_product,
                ),
                after_copies=True,
            )  # fmt: skip
        done = time.perf_counter_ns()
        if self.device.is_cuda:
            self.manager.stats.split_wait_ns += done - launched
        self.counters.manager_ns += done - started
        return y_TH

    def cpu_half(
        self, layer, x_host_TH, ids_host_TK, weights_TK, hit_TK, out_TH=None, *, place, round_product=None
    ):
        """The entries a visit leaves to the CPU (`hit_TK` False) from the host store: `CpuExperts.run`
        over their gathered (key, token, weight) triples on the host `x_host_TH` (float32 into `out_TH`
        when given), then `place(y_host_TH)` (onto the device, or into a buffer there). Returns
        (place's result, the host ns of it all: the visit's `cpu_duration_ns`). `round_product`: the
        executor's (default: from x's and `weights_TK`'s dtypes)."""
        started = time.perf_counter_ns()
        if round_product is None:
            round_product = rounds_product(x_host_TH.dtype, weights_TK.dtype)
        keys_M, token_M, weights_M = miss_entries(layer, self.num_experts, ids_host_TK, weights_TK, hit_TK)
        y_TH = place(self.cpu.run(x_host_TH, keys_M, token_M, weights_M, out_TH, round_product))
        spent_ns = time.perf_counter_ns() - started
        self._count_cpu_call(hit_TK.shape[0], keys_M, spent_ns)
        return y_TH, spent_ns

    def cpu_half_bound(
        self,
        layer,
        call,
        ids_host_TK: np.ndarray,
        w_host_TK: np.ndarray,
        hit_TK,
        *,
        round_product: bool,
    ):
        """`cpu_half` through `call`, a `CpuExperts.bind` on the caller's fixed host buffers (x in, the
        float32 sum out, where the caller takes it: the fast loop's host points): the misses gathered
        straight into the call's arrays (`ids_host_TK` int64, `w_host_TK` float32, contiguous: widened
        router weights, so the caller says whether products round), nothing allocated or checked again
        per call. Returns (the call's output buffer, the host ns of it all)."""
        started = time.perf_counter_ns()
        m = _gather_misses(
            layer * self.num_experts, ids_host_TK, w_host_TK, hit_TK, call.keys_M, call.token_M, call.weight_M
        )
        y_TH, spent_ns = self.cpu_half_gathered(call, m, started, round_product=round_product)
        self.count_cpu_half(call, m, hit_TK.shape[0], spent_ns)
        return y_TH, spent_ns

    def cpu_half_gathered(self, call, m: int, started_ns: int, *, round_product: bool):
        """The call once `m` misses are in the call's arrays (gathered by the caller since `started_ns`, a
        perf_counter_ns: `cpu_half_bound`, or the fast loop's `route_misses`). Not counted: the caller
        runs `count_cpu_half` before the bound call runs again (the fast loop's deferred visit, off the
        step's critical path). Returns (the call's output buffer, the host ns since `started_ns`)."""
        y_TH = call(m, round_product)
        return y_TH, time.perf_counter_ns() - started_ns

    def count_cpu_half(self, call, m: int, tokens: int, spent_ns: int) -> None:
        """Count the bound call's last run, `m` entries of `tokens` tokens in `spent_ns` host ns: the
        counters and the CPU-path log (its keys and executor time are read from the call)."""
        self.counters.cpu_exec_ns += call.last_ns
        self._count_cpu_call(tokens, call.keys_M[:m], spent_ns)

    def _count_cpu_call(self, tokens: int, keys_M, spent_ns: int) -> None:
        counters = self.counters
        counters.cpu_ns += spent_ns
        counters.cpu_calls += 1
        counters.cpu_entries += len(keys_M)
        if self.cpu_log is not None:
            log_cpu_call(self.cpu_log, tokens, keys_M, spent_ns)


class OffloadedExperts(nn.Module):
    """`forward(hidden_states, top_k_index, top_k_weights)`: the replaced experts module's signature and
    result, computed by the runtime for MoE layer `layer_id` (module docstring). No parameters.

    `tap`: None (a whole layer visit per call), or, while the fast decode loop steps, its callable
    `tap(layer_id, hidden_states, top_k_index, top_k_weights)` (moecache/runtime/segments.py), which cuts
    the step at the layer's host points."""

    def __init__(self, layer_id: int, runtime: ExpertsRuntime):
        super().__init__()
        self.layer_id = layer_id
        self.num_experts = runtime.num_experts
        self._runtime = runtime  # a plain attribute: not a submodule, not in the state dict
        self.tap = None

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.tap is not None:
            return self.tap(self.layer_id, hidden_states, top_k_index, top_k_weights)
        return self._runtime.run(self.layer_id, hidden_states, top_k_index, top_k_weights)

    def extra_repr(self) -> str:
        return f"layer_id={self.layer_id}, num_experts={self.num_experts}, offloaded"

"""One decode step cut into segments at the expert path's host points, and the taps that cut it.

The fast decode loop (moecache/runtime/decode_loop.py) runs the Hugging Face model's own forward; only the
experts modules of an offloaded model (`OffloadedExperts.tap`) are switched to one of two tap modes:

- "split" (any mapping that may still change): the experts call of MoE layer l becomes
      copy (x_TH, ids_TK, weights_TK) into ONE static buffer              | segment A(l): the end of
      (CUDA) that buffer's copy to pinned host memory; a device counter   |  the forward so far (in
          bumped, its copy to pinned memory after it                      |  its graph when capturing)
      host point `_route(l)`: `manager.prepare(l)` publishes the layer's mapping (nothing of it
          depends on the routing): on CUDA into its pinned staging row (row_uploads="executor")
      (CUDA) slot_of_LE[l] <- the staging row; y_TH (float32) = slot_moe(  | segment B(l): the
          static buffers, slot_of_LE[l], pool)                            |  resident experts
      host point `_combine(l)`: wait for the read-back (a spin on the counter's host copy: no CUDA
          call); the CPU misses (the entries outside the prepared row, which is the visit's snapshot)
          computed (float32 sums) while B(l) runs, into pinned memory (zeros when the layer had no
          miss); the host enqueues nothing after them
      (CUDA) that sum copied into a static buffer; y_TH += it (float32)   | the next segment
      return y_TH rounded to x's dtype                                    |
      `manager.visit(l)` (the policy, copies) and `commit()`: at the next host point (`flush`), while
          the GPU computes the next segment
  The layer's output is rounded once, from the float32 sum of both halves (docs/runtime.md, "One
  rounding"); the CPU half's copy, its add and the rounding are the first kernels of the next segment
  (captured with it: after the CPU half the host only replays).
  So B(l) is replayed right behind A(l): the GPU computes the resident experts while the host reads the
  routing back and runs the CPU half. With on_miss="cpu" the visit never changes what layer l computes
  (its hits are the prepared row's), so it runs at the next host point, on a copy of its routing, after
  the next segment has been replayed (`flush`; the decode loop flushes after its last step): the host's
  ~30-60 us of policy and bookkeeping per layer (its caches cold from the CPU path's weights) is spent
  while the GPU computes, not between the GPU's segments. With on_miss="wait" (synchronous copies) the
  visit runs at `_route` instead, before B(l), which reads the row it sets. With on_miss="split" the
  visit runs at `_combine`, before the CPU misses (it decides which copies the layer waits for), except
  where every entry is in the prepared row (then it is deferred as above); a visit that waits
  for some copies (VisitResult.waited) gets one more operator call at `_combine` over its wait row (a
  graph of its own once the step is captured, `capture_waits`), behind the compute stream's wait on
  those copies, added into y_TH before the CPU misses are. With no slots (capacity 0) segment B is empty,
  both host points are one and the CPU half, copied in by the next segment, is the layer's output. On
  the CPU (the stand-in device) there is no read-back (the tap buffer is host memory), the executor
  writes `cpu_TH` itself and the manager uploads rows itself.
- "fused" (every expert resident and the mapping frozen: capacity = all experts, all published): the
  experts call is `slot_moe` on the fixed mapping, no host point at all, so a step is one segment.
- split under a fixed placement (`Policy.fixed_placement`: the residents never change, the step being `static_step`; `layer_kinds`):
  a layer with every expert resident runs as in "fused" (no host point), a layer with none has one host
  point (`_route_and_combine`: the CPU half alone is its output, no B(l)); the others split as above.
  The layers run without a visit call are counted as visits whose experts all hit (`count_fused_step`).

The read-back is ordered by the stream, not by an event: A(l)'s copies run in order, so once the
counter's copy has landed (its host value is the one `_route` expects) the routing and x before it have
too. The host's only cost is the spin; ordering by an event instead (a copy, an event record, a
synchronize) costs 9-13 us of CUDA calls per visit on the H200 host.

Trace-forced routing (`ExpertsTaps.forced`, a ForcedRouting, split mode only): at `_route(l)` the layer's
next forced rows (`forced.take(l, T)`, weights rounded to the dtype the router gave the experts call) are
written into a pinned buffer of their own (not the read-back's, which A's copy may still be writing) and,
on CUDA, copied into the device buffer in place (one host-to-device copy on the compute stream), before
B(l) is replayed; the visit and the CPU misses read them from that buffer: the manager, the resident
experts and the CPU misses all see the forced ids. Segment A's own router output is only overwritten, so
nothing of the trace is baked into a graph.

`Segments` does the cutting. Eager (`cut` runs the host point at once: the CPU path of CI, the warm-up
step) or capturing (`cut` ends the CUDA graph being captured and begins the next one, in one private
memory pool; the host point is kept to run between the replays). `replay()` then replays the graphs in
capture order with the host points between them. A graph reads the mapping from its fixed-address row,
so whatever `prepare` / `visit` publishes between replays is what the next kernel sees.

Legend: T tokens, H hidden, K top-k, E experts, M (token, k) entries run on the CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
from moecache_kernels import rounds_product

from moecache.errors import MoecacheError
from moecache.runtime.decode_stream import DecodeStream
from moecache.runtime.experts_module import route_misses

# Host-side spins on the read-back counter before `_wait_readback` falls back to synchronizing the compute
# stream (a device busy with other work): ~100 us of polling on the H200 host, far above a read-back's
# usual latency (a few us behind segment A's last kernel).
READBACK_SPINS = 100_000


class Segments:
    """The cut points of one step: eager, or capturing CUDA graphs (module docstring)."""

    def __init__(self):
        self.capturing = False
        self.graphs: list[tuple[torch.cuda.CUDAGraph, Callable[[], None] | None]] = []
        self._graph: torch.cuda.CUDAGraph | None = None
        self._pool = None

    def cut(self, host_point: Callable[[], None]) -> None:
        """End the segment here: eager, run `host_point` now; capturing, close the graph and open the next."""
        if not self.capturing:
            host_point()
            return
        self._graph.capture_end()
        self.graphs.append((self._graph, host_point))
        self._begin()

    def capture(self, step: Callable[[], None], pool=None) -> None:
        """Capture `step` (one decode step, cut by the taps) as graphs on a side stream. The caller has
        run it eagerly at least once (warm-up: lazy buffers, kernel compilation)."""
        self.graphs = []
        self._pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.capturing = True
            try:
                self._begin()
                step()
                self._graph.capture_end()
                self.graphs.append((self._graph, None))
            except MoecacheError:
                self._abandon()  # e.g. a router hook refusing to run inside the capture
                raise
            except RuntimeError as exc:
                self._abandon()
                raise MoecacheError(
                    f"fast decode: the decode step could not be captured as CUDA graphs ({_one_line(exc)}); "
                    "every kernel of the step must be capturable (an unmodified model's experts: "
                    "experts_implementation=batched_mm or grouped_mm), or decode with graphs=off"
                ) from exc
            finally:
                self.capturing = False
                self._graph = None
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def replay(self) -> None:
        for graph, host_point in self.graphs:
            graph.replay()
            if host_point is not None:
                host_point()

    def _abandon(self) -> None:
        """A failed capture: end the open capture if any, drop every graph of this step."""
        if self._graph is not None:
            try:
                self._graph.capture_end()
            except RuntimeError:
                pass  # the capture was already invalidated by the failure
        self.graphs = []

    def _begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self._pool)


class ExpertsTaps:
    """The offloaded experts' side of the fast loop: static buffers, host points, the tap function.

    One instance serves every MoE layer of one offloaded model (layers run one after the other, so the
    buffers are shared). `runtime` is the model's `ExpertsRuntime`: the pieces of a layer visit (visit,
    prepare, resident, waited, commit, cpu_half) and their counters, which the eager call runs too; the
    taps only cut them at the host points."""

    def __init__(self, runtime, segments: Segments, num_tokens: int = 1):
        self.runtime, self.segments = runtime, segments
        self.manager, self.device = runtime.manager, runtime.device
        self.pool = runtime.pool
        self.num_slots = self.pool.capacity
        self.is_cuda = self.device.is_cuda
        store, top_k = self.manager.store, self.manager.shape.top_k
        T, K, H = num_tokens, top_k, store.hidden_size
        dtype, where = store.dtype, self.device.torch_device
        # Routing, weights and x in ONE byte buffer: the host point reads them back with one copy.
        ids_bytes, w_bytes, x_bytes = 8 * T * K, 4 * T * K, T * H * dtype.itemsize
        w_at = ids_bytes
        x_at = -(-(w_at + w_bytes) // 8) * 8
        total = x_at + x_bytes
        self.tap_B = torch.zeros(total, dtype=torch.uint8, device=where)
        # the read-back's destination; on the stand-in the tap buffer is host memory already
        self.host_B = self.device.host_buffer(total, torch.uint8) if self.is_cuda else self.tap_B

        def views(buf):
            return (
                buf[:ids_bytes].view(torch.int64).view(T, K),
                buf[w_at : w_at + w_bytes].view(torch.float32).view(T, K),
                buf[x_at:total].view(dtype).view(T, H),
            )

        self.ids_TK, self.weights_TK, self.x_TH = views(self.tap_B)
        self.host_ids_TK, self.host_weights_TK, self.host_x_TH = views(self.host_B)
        # The routing the host point hands the manager and the CPU path, as numpy views (made once per
        # buffer, not per host point): the read-back's, or forced rows (`_substitute`).
        self._host_np = (self.host_ids_TK.numpy(), self.host_weights_TK.numpy())
        self._ids_np_TK, self._w_np_TK = self._host_np
        self._hit_TK = np.zeros((T, K), np.bool_)  # the deferred visit's hit mask (`_defer_visit`), reused
        # The deferred visit's copy of its routing (`_defer_visit`: the next read-back rewrites the host
        # buffer); rewritten at the next deferral, after `flush` has run the visit that read it (the
        # manager keeps no reference to a visit's routing).
        self._deferred_ids_TK = np.zeros((T, K), np.int64)
        # The parts of a layer's output, float32 (each part's sums unrounded; module docstring): the
        # resident experts' (into which the others are added), the CPU misses', on_miss="split": the waited
        wide = torch.float32
        self.y_TH = torch.zeros((T, H), dtype=wide, device=where)
        self.cpu_TH = torch.zeros((T, H), dtype=wide, device=where)
        self.wait_TH = torch.zeros((T, H), dtype=wide, device=where)
        # runtime.decode_stream_share > 0: some of a split layer's misses run on the device
        # (moecache/runtime/decode_stream.py), their sum in stream_TH, added into y_TH at `_combine`
        self.decode_stream = None
        if runtime.decode_share:
            self.decode_stream = DecodeStream(
                self.device, store, self.manager.compute, runtime.kernel, share=runtime.decode_share,
                max_entries=T * K,
            )  # fmt: skip
            self.stream_TH = torch.zeros((T, H), dtype=wide, device=where)
        self._staging_TH = self.device.host_buffer((T, H), wide) if self.is_cuda else None
        # Where the executor writes the CPU half (the staging buffer; `cpu_TH` itself on the stand-in), as
        # numpy: the next segment adds it into y_TH whatever the layer ran, so a layer with no CPU half
        # zeroes it (`_no_cpu_half`).
        self._cpu_out_np = (self._staging_TH if self.is_cuda else self.cpu_TH).numpy()
        self._cpu_call = None  # the CPU path bound to host_x_TH and the staging buffer (`_cpu_half`)
        self._visit_result = None
        # (layer, its routing, its CPU half's ns or None, that CPU half's uncounted run or None) whose
        # visit `_combine` left to the next host point: the routing copied out (`_deferred_ids_TK`)
        self._deferred: tuple | None = None
        if self.is_cuda:  # the read-back's step counter: bumped on the device, copied after the routing
            self._count_dev = torch.zeros(1, dtype=torch.int64, device=where)
            self._count_host = self.device.host_buffer(1, torch.int64)
            self._count_np = self._count_host.numpy()
        self._expected = 0  # read-backs the host points have asked for (the counter's value to wait for)
        self.mode = "split"
        # Split mode under a fixed placement (`layer_kinds`): MoE layers run without the split's two host
        # points, "fused" (every expert resident: the slot-pool kernel inline, no host point) or "cpu" (no
        # expert resident: one host point, the CPU half alone). Every other layer is split.
        self.kind_L: dict[int, str] = {}
        # Trace-forced routing (module docstring): a ForcedRouting whose rows replace the router's at
        # each host point; the routing bytes (ids, weights: the buffer's head) go back to the device.
        self.forced = None
        self._routing_bytes = w_at + w_bytes
        self._weights_dtype_L: dict[int, torch.dtype] = {}
        # Two pinned buffers of forced rows, used in turn: the one written at a host point was last
        # uploaded two layer visits ago, and the read-back waited for since then ran behind that upload.
        self._forced_B = [self.device.host_buffer(self._routing_bytes, torch.uint8) for _ in range(2)]
        self._forced_views = [
            (buf[:ids_bytes].view(torch.int64).view(T, K), buf[w_at:].view(torch.float32).view(T, K))
            for buf in self._forced_B
        ]
        self._forced_np = [(ids.numpy(), w.numpy()) for ids, w in self._forced_views]
        self._forced_turn = 0
        # on_miss="split" on CUDA: per MoE layer, the wait call (operator over the layer's wait row, added
        # into y_TH) as a CUDA graph of its own pool (capture_waits), replayed instead of launched eagerly
        self._wait_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # when a list: every publish lag (`_route`, ns) is appended to it (calibrate's runtime.publish_lag)
        self.publish_lag_log: list[int] | None = None

    # ---- the experts call ------------------------------------------------------------------------

    @torch.compiler.disable  # a compiled step breaks here: the cuts and host points stay Python
    def __call__(self, layer: int, x_TH, ids_TK, weights_TK) -> torch.Tensor:
        kind = self.kind_L.get(layer)
        if self.mode == "fused" or kind == "fused":
            return self._resident(x_TH, ids_TK, weights_TK, layer)
        self._weights_dtype_L[layer] = weights_TK.dtype  # what forced weights are rounded to
        self.ids_TK.copy_(ids_TK)
        self.weights_TK.copy_(weights_TK)
        self.x_TH.copy_(x_TH)
        self._enqueue_readback()
        if not self._resident_half(layer):  # nothing resident: the CPU computes every entry
            self.segments.cut(lambda: self._route_and_combine(layer))
            self._take_cpu_half()
            return self.cpu_TH.to(x_TH.dtype, copy=True)
        self.segments.cut(lambda: self._route(layer))
        manager = self.manager
        if manager.row_uploads == "executor":  # the row as `_route`'s prepare (or visit) left it
            manager.slot_of_LE[layer].copy_(manager.staging_row(layer), non_blocking=True)
        self.runtime.resident(
            *self._operands(manager.slot_of_LE[layer]), out_TH=self.y_TH, round_product=self._rounds(layer)
        )
        self.segments.cut(lambda: self._combine(layer))
        # the CPU misses' sum (zeros where the layer had none) added into y_TH, then the one rounding, in
        # the next segment (a float32 model gets the static buffer itself)
        self._take_cpu_half()
        self.y_TH.add_(self.cpu_TH)
        return self.y_TH.to(x_TH.dtype)

    def frozen(self) -> bool:
        """Every expert resident and published, nothing loading: the mapping can no longer change."""
        m = self.manager
        if m.capacity < m.shape.num_keys or any(m.loading_L):
            return False
        return bool(self._rows_in_place_L().all())

    def layer_kinds(self) -> dict[int, str]:
        """Under a fixed placement (`Policy.fixed_placement`: the residents never change), the MoE layers
        that need no split: "fused" where every expert is resident, published, and its device row is the
        published one; "cpu" where none is. {} under any other policy, or while a copy is in flight."""
        m = self.manager
        if not m.policy.fixed_placement or any(m.loading_L):
            return {}
        kinds = {int(layer): "fused" for layer in np.flatnonzero(self._rows_in_place_L())}
        kinds.update({int(layer): "cpu" for layer in np.flatnonzero((m.published_LE < 0).all(axis=1))})
        return kinds

    def _rows_in_place_L(self) -> np.ndarray:
        """bool [L]: each MoE layer's every expert published and its device row the published one (once the
        rows' uploads have landed)."""
        m = self.manager
        m.device.synchronize()
        published_LE = m.published_LE
        return (published_LE >= 0).all(axis=1) & (m.slot_of_LE.cpu().numpy() == published_LE).all(axis=1)

    def count_fused_step(self) -> int:
        """One decode step's layers that ran fused (the whole step in "fused" mode, else the "fused" layers
        of `kind_L`) counted as the visits they stand for: each of its one token's K distinct experts a
        hit. Returns how many layers."""
        if self.mode == "fused":
            n = self.manager.shape.num_layers
        else:
            n = sum(kind == "fused" for kind in self.kind_L.values())
        if n:
            self.runtime.count_resident_visits(n, self.ids_TK.shape[0])
        return n

    def _resident_half(self, layer: int) -> bool:
        """Whether a split-mode layer has resident experts (segment B, y_TH): not with no slots, nor a fixed
        placement's CPU layer (`layer_kinds`), whose CPU half is its whole output."""
        return self.num_slots > 0 and self.kind_L.get(layer) != "cpu"

    def _operands(self, slot_of_E: torch.Tensor):
        """The resident call's arguments over the static buffers and the mapping row `slot_of_E`."""
        return self.x_TH, self.ids_TK, self.weights_TK, slot_of_E

    def _rounds(self, layer: int) -> bool:
        """Whether the layer's weighted products round to x's dtype: the router's weights' dtype decides
        (`rounds_product`); the static buffer holds them widened to float32."""
        return rounds_product(self.x_TH.dtype, self._weights_dtype_L[layer])

    def _resident(self, x_TH, ids_TK, weights_TK, layer: int) -> torch.Tensor:
        return self.runtime.resident(x_TH, ids_TK, weights_TK, self.manager.slot_of_LE[layer])

    # ---- host points -----------------------------------------------------------------------------

    def _enqueue_readback(self) -> None:
        """Still in segment A (captured with it): copy the tap buffer (ids, weights, x: a few KiB) to
        pinned host memory on the compute stream, then bump the device counter and copy it after them.
        The host point waits for the counter's host copy (`_wait_readback`), not for the stream, so B(l),
        replayed next, is not waited for."""
        if self.is_cuda:
            self.host_B.copy_(self.tap_B, non_blocking=True)
            self._count_dev.add_(1)
            self._count_host.copy_(self._count_dev, non_blocking=True)

    def _wait_readback(self) -> None:
        """Spin until the read-back `_route` asked for has landed (module docstring). If it takes long
        (a device busy with other work), synchronize the compute stream once. Every wait comes before the
        next segment's replay (a deferred visit keeps its own copy of the routing), so a counter that is
        then behind, or ahead (a later read-back has overwritten the buffer), is a bug: an error, never
        a stale routing."""
        if not self.is_cuda:
            return
        count, expected = self._count_np, self._expected
        started = time.perf_counter_ns()
        for _ in range(READBACK_SPINS):
            if count[0] >= expected:
                break
        else:
            self.manager.compute.stream.synchronize()
        self.runtime.counters.readback_wait_ns += time.perf_counter_ns() - started
        if count[0] != expected:
            raise MoecacheError(
                f"fast decode: read-back counter {int(count[0])}, expected {expected}: a segment ran "
                "without its host point"
            )

    def _route(self, layer: int) -> None:
        """Host point after A(l): the previous layer's deferred visit (if any), the forced rows in (if
        any). With on_miss="cpu" the layer's mapping is published now (`manager.prepare`) and B(l) is
        replayed at once: the visit waits for the read-back in `_combine` while the GPU runs the
        resident experts. With waits the visit runs here: B(l) reads the row that visit sets."""
        copied = self.flush()
        self._expected += 1  # A(l), just run, bumped the device counter
        self._ids_np_TK, self._w_np_TK = self._host_np  # the read-back's, unless forced rows replace it
        if self.forced is not None:
            self._substitute(layer)
        if self.manager.on_miss != "wait":
            if copied:  # the deferred visit's copies may land before this publication (timed.py, 7.)
                lag_ns = time.monotonic_ns() - self.manager.engine.last_enqueued_ns
                counters = self.runtime.counters
                counters.publish_lags += 1
                counters.publish_lag_ns += lag_ns
                if self.publish_lag_log is not None:
                    self.publish_lag_log.append(lag_ns)
            self.runtime.prepare(layer)
            return
        self._visit(layer)

    def abandon(self) -> None:
        """Forget a visit left half done by a step that did not finish (an error between the host points):
        the manager's pending prepare and a deferred visit (its CPU half, which ran, is counted). After a
        complete step (flushed) a no-op."""
        deferred, self._deferred = self._deferred, None
        if deferred is not None and deferred[3] is not None:
            self.runtime.count_cpu_half(*deferred[3])
        self._visit_result = None
        self.manager.cancel_prepare()

    def flush(self) -> bool:
        """Run the visit `_combine` deferred (if any): the decode loop calls it after its last step.
        Returns whether it enqueued copies."""
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            return False
        layer, ids_TK, cpu_ns, uncounted = deferred
        if uncounted is not None:  # the CPU half's counters, left by `_defer_visit` to here
            self.runtime.count_cpu_half(*uncounted)
        self._visit(layer, ids_TK)
        visit = self._visit_result
        visit.cpu_duration_ns = cpu_ns  # its CPU half ran at `_combine`
        self.runtime.commit()
        self._visit_result = None
        return bool(visit.copies)

    def _visit(self, layer: int, ids_TK: np.ndarray | None = None) -> None:
        """The layer's visit on the read-back routing (`ids_TK`: the caller has it already, waited for,
        or a deferred visit's copy of it)."""
        if ids_TK is None:
            self._wait_readback()
            ids_TK = self._ids_np_TK
        self._visit_result = self.runtime.visit(layer, ids_TK)  # the read-back waited for A

    def _substitute(self, layer: int) -> None:
        """The layer's forced rows into the next forced buffer and (in place) into the device buffer, on
        the compute stream: ordered before B(l)'s replay (module docstring)."""
        T = self.host_ids_TK.shape[0]
        ids_TK, w_TK = self.forced.take(layer, T)
        if w_TK is None:
            raise MoecacheError(
                "fast decode: forced routing at a host point needs the trace's router_weights"
            )
        turn = self._forced_turn
        self._forced_turn = 1 - turn
        forced_ids_TK, forced_w_TK = self._forced_views[turn]
        forced_ids_TK.copy_(torch.as_tensor(np.array(ids_TK)))  # the trace's views are read-only
        dtype = self._weights_dtype_L.get(layer, torch.float32)
        forced_w_TK.copy_(torch.as_tensor(np.array(w_TK)).to(dtype))
        self.tap_B[: self._routing_bytes].copy_(self._forced_B[turn], non_blocking=self.is_cuda)
        self._ids_np_TK, self._w_np_TK = self._forced_np[turn]

    def _combine(self, layer: int) -> None:
        """Segment B is enqueued: the CPU misses (computed while B runs) into the staging buffer (zeros
        without a miss), which the next segment adds into B's `y_TH`; the visit and commit deferred to the
        next host point (`_defer_visit`), or run first where they cannot be (on_miss="split" with misses,
        "wait")."""
        if self.manager.prepared == layer:  # `_route` left the visit to here
            self._wait_readback()
            ids_TK = self._ids_np_TK
            if self._defer_visit(layer, ids_TK):
                return
            self._visit(layer, ids_TK)
        visit = self._visit_result
        if visit.waited:  # before commit: the visit reads those slots until then
            self._run_waited(visit)
        self.runtime.commit()
        if visit.hit_TK.all():
            self._no_cpu_half()
        else:
            visit.cpu_duration_ns = self._cpu_half(layer, self._ids_np_TK, visit.hit_TK)
        self._visit_result = None

    def _defer_visit(self, layer: int, ids_TK: np.ndarray) -> bool:
        """Leave the prepared visit to the next host point (`flush`), after the layer's CPU half (if
        any) has run on the prepared row's hit mask, which is the visit's own (it runs on that
        snapshot). The visit (policy, copies: ~30-60 us per layer with the caches cold from the CPU
        path's weights) then runs while the GPU computes the next segment, off the step's critical path.
        With on_miss="cpu" always; with "split" (the visit decides which copies to wait for) only where
        every entry hits. False: the visit runs now (an id outside 0..E-1 too: it refuses it). With a
        decode stream and a resident half (y_TH is then the layer's sum), some misses leave the CPU call
        for the device first (`_stream_some`)."""
        manager = self.manager
        started = time.perf_counter_ns()
        call = self._bound_call(ids_TK.size)
        ids_copy_TK = self._deferred_ids_TK
        # the prepared row's hit mask (`manager.prepared_hits`), the misses gathered and the routing
        # copied out, in one compiled call
        m = route_misses(
            layer * self.runtime.num_experts, manager.published_LE[layer], ids_TK, self._w_np_TK, self._hit_TK,
            call.keys_M, call.token_M, call.weight_M, ids_copy_TK,
        )  # fmt: skip
        if m < 0 or (m and manager.on_miss != "cpu"):
            return False
        cpu_ns = uncounted = None
        if m and self.decode_stream is not None and self._resident_half(layer):
            m = self._stream_some(layer, call, m)
        if m:  # counted at `flush`, while the GPU computes the next segment
            T, rounds = ids_TK.shape[0], self._rounds(layer)
            _, cpu_ns = self.runtime.cpu_half_gathered(call, m, started, round_product=rounds)
            uncounted = (call, m, T, cpu_ns)
        else:
            self._no_cpu_half()
        self._deferred = (layer, ids_copy_TK, cpu_ns, uncounted)
        return True

    def _stream_some(self, layer: int, call, m: int) -> int:
        """A share of the gathered misses to the device (moecache/runtime/decode_stream.py): their entries
        leave the call's arrays, their experts' copies and kernel are enqueued (the kernel adds into y_TH
        after B(l)) before the CPU call runs. Returns the entries left to the CPU."""
        stream = self.decode_stream
        left, experts_U, taken = stream.take(layer * self.runtime.num_experts, call.keys_M, call.token_M,
                                             call.weight_M, m, self.x_TH.shape[0])  # fmt: skip
        if experts_U.size:
            stream.enqueue(layer, experts_U)
            stream.run(self.x_TH, self.ids_TK, self.weights_TK, self.stream_TH, self.y_TH,
                       round_product=self._rounds(layer))  # fmt: skip
            counters = self.runtime.counters
            counters.streamed_experts += int(experts_U.size)
            counters.streamed_entries += taken
        return left

    def capture_streams(self) -> None:
        """With a decode stream on CUDA, after the step's capture: its kernel and add as graphs, one per
        rounding the step's MoE layers use (`DecodeStream.capture`)."""
        if self.decode_stream is not None:
            roundings = {self._rounds(layer) for layer in self._weights_dtype_L}
            self.decode_stream.capture(self.x_TH, self.ids_TK, self.weights_TK, self.stream_TH, self.y_TH,
                                       roundings)  # fmt: skip

    def _bound_call(self, max_entries: int):
        """The CPU executor bound to the host copy of x and the float32 staging buffer (`cpu_TH` on the
        stand-in), `CpuExperts.bind`: once, again if the runtime's executor changed."""
        call = self._cpu_call
        if call is None or call.executor is not self.runtime.cpu:
            out_TH = self._staging_TH if self.is_cuda else self.cpu_TH
            call = self._cpu_call = self.runtime.cpu.bind(self.host_x_TH, out_TH, max_entries)
        return call

    def _cpu_half(self, layer: int, ids_TK: np.ndarray, hit_TK: np.ndarray) -> int:
        """The layer's entries outside `hit_TK` on the CPU, from the host copy of x into the float32
        staging buffer (`cpu_TH` on the stand-in), where the next segment takes it (`_take_cpu_half`);
        returns its host ns. The executor is bound to those buffers once (`CpuExperts.bind`), again if
        the runtime's changed."""
        _, spent_ns = self.runtime.cpu_half_bound(
            layer, self._bound_call(ids_TK.size), ids_TK, self._w_np_TK, hit_TK, round_product=self._rounds(layer)
        )  # fmt: skip
        return spent_ns

    def _no_cpu_half(self) -> None:
        """A layer with no CPU half: its sum is zeros (the next segment adds it all the same; T x H
        float32, 8 KiB on Qwen3.6)."""
        self._cpu_out_np.fill(0.0)

    def _take_cpu_half(self) -> None:
        """In the segment after the host point (captured with it): on CUDA the CPU half's sum copied from
        the pinned staging buffer into `cpu_TH`; after the executor returns the host only replays."""
        if self.is_cuda:
            self.cpu_TH.copy_(self._staging_TH, non_blocking=True)

    def _run_waited(self, visit) -> None:
        """on_miss="split": the experts whose copies the compute stream waits for, one more operator call
        over their row (`ExpertsRuntime.waited`; its captured graph once there is one), added into y_TH;
        the host goes on to the CPU misses at once."""
        graph = self._wait_graphs.get(visit.layer)
        if graph is not None:  # the graph adds into y_TH itself
            self.runtime.waited(visit, None, None, None, replay=graph.replay)
            return
        self.y_TH.add_(
            self.runtime.waited(
                visit, self.x_TH, self.ids_TK, self.weights_TK, out_TH=self.wait_TH,
                round_product=self._rounds(visit.layer),
            )
        )  # fmt: skip

    def capture_waits(self) -> None:
        """on_miss="split" on CUDA, after the step's capture: each MoE layer's wait call (`_run_waited`) as
        a CUDA graph reading the layer's fixed-address wait row and the static buffers, in a pool of its
        own (it replays between the step's segments, whose pool holds tensors live across them). The
        eager call costs the H200 host ~180 us per waiting visit (two Triton launches and an add)."""
        if not self.is_cuda or self.manager.on_miss != "split" or not self.num_slots:
            return
        rows, pool = self.manager.wait_slot_of_LE, self.pool
        handle = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        for layer in sorted(self._weights_dtype_L):  # the MoE layers the step ran
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=handle, stream=stream):
                self.runtime.kernel(
                    *self._operands(rows[layer]), pool.w13_SIH, pool.w2_SHI, out=self.wait_TH,
                    round_product=self._rounds(layer),
                )  # fmt: skip
                self.y_TH.add_(self.wait_TH)
            self._wait_graphs[layer] = graph
        torch.cuda.current_stream().wait_stream(stream)

    def _route_and_combine(self, layer: int) -> None:
        self._route(layer)
        self._combine(layer)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]

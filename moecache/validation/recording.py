"""The routing trace of an offloaded model, with the cache columns filled from the runtime's visits.

`RoutingRecorder` (moecache/trace/hooks.py) logs from router hooks, before the experts run, so it has no
visit to give the logger. `CacheRecorder` keeps its step tracking (one forward call = one step) and logs
from a forward hook on each `OffloadedExperts` module instead: by then the layer's visit is done, and the
record carries `cache=manager.last_visit`, whose `cache_fields` fill every cache column
(docs/runtime.md, "Logging seam"). The routing logged is exactly what the experts module was called
with (the model's own router output).
"""

from __future__ import annotations

from moecache.errors import MoecacheError
from moecache.trace.hooks import RoutingRecorder
from moecache.trace.logger import RoutingLogger


class CacheRecorder(RoutingRecorder):
    """Step tracking as RoutingRecorder; one record per layer visit with the visit's cache fields."""

    def __init__(self, model, logger: RoutingLogger):
        session = getattr(model, "moecache", None)
        if session is None:
            raise MoecacheError("cache recorder: the model is not offloaded (it has no model.moecache)")
        super().__init__(model, adapter=None, logger=logger)
        self.manager = session.manager

    def attach(self) -> CacheRecorder:
        from moecache.runtime.experts_module import OffloadedExperts

        self._handles.append(self.model.register_forward_pre_hook(self._on_step, with_kwargs=True))
        for module in self.model.modules():
            if isinstance(module, OffloadedExperts):
                self._handles.append(module.register_forward_hook(self._experts_hook, with_kwargs=True))
        if len(self._handles) == 1:
            self.detach()
            raise MoecacheError("cache recorder: the model has no OffloadedExperts module")
        self.manager.time_gpu = True  # cuda_duration_ns: the experts time their GPU part
        return self

    def detach(self) -> None:
        self.manager.time_gpu = False
        super().detach()

    def _experts_hook(self, module, args, kwargs, output):
        ids_TK = args[1] if len(args) > 1 else kwargs["top_k_index"]
        weights_TK = args[2] if len(args) > 2 else kwargs["top_k_weights"]
        visit = self.manager.last_visit
        if visit is None or visit.layer != module.layer_id:
            raise MoecacheError(f"cache recorder: MoE layer {module.layer_id} ran without a cache visit")
        self.logger.log(module.layer_id, ids_TK, weights_TK, cache=visit)

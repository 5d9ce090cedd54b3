"""The one small interface every placement policy implements, and the registry of policies.

A policy is one file in `moecache/sim/policies/`: a `Policy` subclass registered by name, whose
state is a named tuple of numpy arrays (`State`, made from `state_fields`) and whose `step` is a numba
`@njit` function. The same `step` runs inside the compiled replay loops of the simulator and, one
layer visit at a time, in the runtime: all of them go through `moecache.sim.visit` (`apply_step`;
`visit_entry` for one visit called from Python), compiled once per policy and cached on disk (jit.py).

What the replay driver does at every layer step (docs/simulator.md; moecache/sim/visit.py):
1. hit_U = which of the step's distinct experts hold a slot in the snapshot taken before the step
   (in timed mode a hit also needs the slot's copy to be complete);
2. calls `step(...)`: the policy first updates its state with the whole step (recency, counts, next
   use of every hit), then decides admissions (keys that get a slot; `loading` until their copy
   completes, never usable by this step) and evictions for the step's misses;
3. cancels every admission that the same step evicts again, and every eviction of a key the step
   then admits again (visit.apply_step, once for every policy), applies the evictions, then the
   admissions, and checks that at most `capacity` keys hold slots.

`step(state, key_U, uses_U, hit_U, a0, clock, request, resident_G, admit_out, evict_out)
   -> (n_admit, n_evict)`
  key_U int32: the step's distinct keys in access order; uses_U int32: tokens selecting each;
  hit_U bool; a0: index of the step's first access in the whole trace (a monotone access clock);
  clock: tokens of the trace processed before this forward step; request: request index;
  resident_G bool: keys holding a slot before the step (read only); the policy writes keys into
  admit_out[:n_admit] and evict_out[:n_evict] (each holds num_keys entries), in the order it decides
  them. It lists every admission and every victim, even a victim it admitted itself earlier in the
  same step: apply_step removes that key's first admission (the others keep their order) and the
  eviction, so the two cancel out (no copy, no eviction); the policy keeps no bookkeeping for it.
  Likewise a key it evicts while it holds a slot and then admits again keeps its slot (neither an
  eviction nor a copy). Otherwise an evicted key must hold a slot before the step, no key may be
  evicted twice, and an admitted key must not hold a slot (after the step's evictions); apply_step
  raises ValueError else.

How to add a policy: see docs/simulator.md, "Adding a policy".
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any, ClassVar

import numba as nb
import numpy as np

from moecache.errors import MoecacheError

POLICIES: dict[str, type[Policy]] = {}


@nb.njit(_nrt=False)
def static_step(state, key_U, uses_U, hit_U, a0, clock, request, resident_G, admit_out, evict_out):
    """The step of a placement that never changes: no admission, no eviction (the static policies')."""
    return 0, 0


class Policy:
    """Base class. Subclasses set `name`, `cold_start`, `step` and implement `init_state`."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.fixed_placement = getattr(cls, "step", None) is static_step

    name: ClassVar[str]
    # True: starts with no resident experts (a demand policy). False: starts with
    # `initial_residents` resident, free of charge (static placements, warm Belady).
    cold_start: ClassVar[bool] = True
    # Parameter names and defaults; `params` holds the values of one instance.
    defaults: ClassVar[dict[str, Any]] = {}
    step: ClassVar[Any]  # the @njit step function
    # True: the residents are the initial ones for good; derived (`__init_subclass__`): the policy's step
    # is `static_step`, which never admits or evicts. The fast decode loop runs a layer whose experts are
    # all resident with no host point (moecache/runtime/segments.py).
    fixed_placement: ClassVar[bool] = False
    # True: the policy may admit keys the step did not access (prefetch), so it can beat demand
    # caching's compulsory misses; the demand-only properties of the tests skip it.
    prefetches: ClassVar[bool] = False
    # True: `init_state` reads the whole trace to be replayed (its future: Belady, hindsight static), so
    # the policy exists only in the simulator (the runtime refuses it); an online policy needs only the
    # model's shape (a ModelShape, moecache/sim/shape.py).
    offline: ClassVar[bool] = False
    # The replay's CostModel (set by `bind_cost`; the simulator binds it before every replay). A policy
    # that weighs CPU, GPU or copy time reads it in `init_state` through `require_cost`, and says so:
    # the runtime then needs a cost profile for it whatever its on_miss (moecache/offloading.py).
    cost: Any = None
    weighs_costs: ClassVar[bool] = False
    # Names of the state's members, in the order `init_state` returns them (a registered policy must
    # give them). The replay drivers receive the state as an instance of `State`, a named tuple class
    # of this policy alone: its type tells the compiled drivers which `step` to call (visit.py).
    state_fields: ClassVar[tuple[str, ...] | None] = None

    def __init__(self, **params: Any):
        unknown = sorted(set(params) - set(self.defaults))
        if unknown:
            raise MoecacheError(
                f"policy {self.name}: unknown parameter(s) {unknown}; it takes {sorted(self.defaults) or 'none'}"
            )
        self.params = {**self.defaults, **params}

    def bind_cost(self, cost) -> Policy:
        """Use `cost` (a CostModel) for the next `init_state`; returns self."""
        self.cost = cost
        return self

    def require_cost(self):
        """The bound CostModel; a named error when there is none (a cost-aware policy replayed
        without a cost profile, e.g. an instant replay outside the sweep)."""
        if self.cost is None:
            raise MoecacheError(
                f"policy {self.name} weighs measured costs: replay it through the sweep or simulate "
                "stage (which bind the cost profile), or call bind_cost(CostModel) first"
            )
        return self.cost

    def init_state(self, trace, capacity: int) -> tuple:
        """Fresh state for `capacity` slots. An online policy reads only the model's shape from `trace`
        (num_layers, num_experts, top_k, expert_bytes, num_keys): the runtime passes a
        `moecache.sim.shape.ModelShape`, the simulator the TraceArrays it replays. Only an `offline`
        policy may read the trace's accesses."""
        raise NotImplementedError

    def initial_residents(self, state: tuple, trace, capacity: int) -> np.ndarray:
        """Keys resident before the first step (int32); empty for cold-start policies."""
        return np.zeros(0, np.int32)

    @classmethod
    def state_class(cls, num_fields: int | None = None) -> type:
        """The named tuple class of this policy's state (`cls.State`), made on first use and bound to
        `cls.step`. Without `state_fields` (an unregistered test policy) its members are s0, s1, ...
        for a state of `num_fields` members."""
        state_class = cls.__dict__.get("State")
        if state_class is None:
            fields = cls.state_fields
            if fields is None:
                if num_fields is None:
                    raise ValueError(f"policy class {cls.__qualname__} declares no state_fields")
                fields = tuple(f"s{i}" for i in range(num_fields))
            state_class = namedtuple("State", fields)
            # __qualname__: found again by pickle, by name. __name__ too: numba's dispatcher matches a
            # call's argument types by a fingerprint of the tuple's type name and field names, not of
            # its class, so two policies whose states had the same name and fields (and dtypes) would
            # share one, and every visit of the second would pay numba's slow type lookup (~100 us).
            state_class.__name__ = state_class.__qualname__ = f"{cls.__qualname__}.State"
            state_class.__module__ = cls.__module__
            from moecache.sim.visit import bind_step

            bind_step(state_class, cls.step)
            cls.State = state_class
        return state_class

    def named_state(self, state: tuple) -> tuple:
        """`state` (as returned by init_state) as an instance of this policy's State class."""
        state_class = type(self).state_class(len(state))
        if isinstance(state, state_class):
            return state
        if len(state) != len(state_class._fields):
            raise ValueError(
                f"policy {self.name}: init_state returned {len(state)} members, State has "
                f"{len(state_class._fields)} {state_class._fields}"
            )
        return state_class(*state)

    def label(self) -> str:
        inner = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.name}({inner})" if inner else self.name


def register(cls: type[Policy]) -> type[Policy]:
    if cls.name in POLICIES:
        raise ValueError(f"policy {cls.name!r} registered twice")
    if not cls.__dict__.get("state_fields"):
        raise ValueError(f"policy {cls.name!r} must declare its state_fields")
    POLICIES[cls.name] = cls
    cls.state_class()
    return cls


def make_policy(name: str, **params: Any) -> Policy:
    import moecache.sim.policies  # noqa: F401  (registers every policy)

    if name not in POLICIES:
        raise MoecacheError(f"unknown policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name](**params)

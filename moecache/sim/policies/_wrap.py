"""Admission filters over any online base policy (second_touch, prefill_admit): the shared machinery.

A filter decides which of a layer step's misses its base policy may consider. Its compiled step
(`make_view_step`) writes the *view* (the step's hits and the misses it lets through, in access order,
with their uses, which a filter may reweigh) into scratch arrays of its state and calls the base's
`step` on that view. A miss left out of the view is never heard of by the base: it is not counted, not
admitted, and runs on the CPU. The base keeps its own rules for everything it sees (recency, counts,
victims, prefetches).

State: the base's members, in the base's order, then the filter's own (`own_fields`, prefixed with the
filter's name so that filters can be stacked); the step passes `state[:n]` (a plain tuple of the base's
members: every step unpacks its state positionally) to the base's step.

One class per (filter, base class): its State holds that base's members and its step calls that base's
step, compiled once. The registered class is the filter over its default base; `over(base class)`
makes the others on first use and keeps each as an attribute of the filter's module, where another
process finds it again by name (its State is found by pickle, and its driver entry points are cached
on disk like a registered policy's: jit.cache_tag).

Legend: U a step's distinct experts (in access order), G global keys.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, ClassVar

import numba as nb

from moecache.errors import MoecacheError
from moecache.sim.policy import Policy, make_policy


@nb.njit(cache=True, inline="always")
def add_to_view(view_key, view_uses, view_hit, m, k, uses, hit):
    """Put key k, with its uses and hit flag, at index m of the view; returns the view's new length."""
    view_key[m] = k
    view_uses[m] = uses
    view_hit[m] = hit
    return m + 1


def make_view_step(base_step, n: int, i_view: int, fill_view):
    """The compiled step of a filter over the base whose step is `base_step` and whose state has n
    members. `fill_view(state, key_U, uses_U, hit_U, clock, view_key, view_uses, view_hit)`, a compiled
    function inlined into the step, writes the view into the filter's members i_view, i_view + 1 and
    i_view + 2 (keys, uses, hits) and returns its length; the base then steps on that view."""
    i_uses, i_hit = i_view + 1, i_view + 2  # constants: static getitem

    @nb.njit(_nrt=False)  # no reference counting: see lfu.py
    def view_step(state, key_U, uses_U, hit_U, a0, clock, request, resident_G, admit_out, evict_out):
        view_key = state[i_view]
        view_uses = state[i_uses]
        view_hit = state[i_hit]
        m = fill_view(state, key_U, uses_U, hit_U, clock, view_key, view_uses, view_hit)
        return base_step(
            state[:n], view_key[:m], view_uses[:m], view_hit[:m], a0, clock, request, resident_G,
            admit_out, evict_out,
        )  # fmt: skip

    return view_step


def _base_params(value, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise MoecacheError(f"{where}: base_params must be a mapping of the base's parameters, got {value!r}")
    return {str(k): value[k] for k in sorted(value)}  # canonical: keys sorted, a plain dict


class AdmissionFilter(Policy):
    """Base class of the filters. A subclass sets `name`, `defaults` (with `base` and `base_params`),
    `own_fields`, `make_step(base_step, num_base_fields)` and `own_state(trace, capacity)`; it is
    registered over its default base with `register_filter`."""

    own_fields: ClassVar[tuple[str, ...]] = ()
    base_class: ClassVar[type[Policy]]  # the base class this filter class is compiled for

    def __new__(cls, **params: Any):
        root = cls.root()
        where = f"policy {root.name}"
        base_name = params.get("base", root.defaults["base"])
        if not isinstance(base_name, str):
            raise MoecacheError(f"{where}: base must be a policy name, got {base_name!r}")
        base = make_policy(base_name, **_base_params(params.get("base_params"), where))
        if base.offline:
            raise MoecacheError(
                f"{where}: base {base_name} is offline (it reads the replayed trace's future); "
                "a filter takes an online base (lru, lfu, lfu_decay, ...)"
            )
        if isinstance(base, root):
            raise MoecacheError(f"{where}: base {base_name} is {root.name} itself")
        if type(base).state_fields is None:
            raise MoecacheError(f"{where}: base {base_name} declares no state_fields")
        obj = super().__new__(root.over(type(base)))
        obj.base = base
        return obj

    def __init__(self, **params: Any):
        super().__init__(**params)
        self.params["base_params"] = _base_params(self.params["base_params"], f"policy {self.name}")

    def __reduce__(self):
        # pickle and copy rebuild the filter from its parameters: __new__ picks the class over the base
        return (_rebuild, (self.root().name, dict(self.params)))

    @classmethod
    def root(cls) -> type[AdmissionFilter]:
        """The registered filter class (the one that names the policy)."""
        for klass in cls.__mro__:
            if "name" in klass.__dict__:
                return klass
        raise TypeError(f"{cls.__qualname__} names no policy")

    @classmethod
    def make_step(cls, base_step, num_base_fields: int):
        raise NotImplementedError

    @classmethod
    def over(cls, base_cls: type[Policy]) -> type[AdmissionFilter]:
        """The filter class whose step calls `base_cls`'s step (made on first use)."""
        root = cls.root()
        if base_cls is root.base_class:
            return root
        qualname = f"{root.__qualname__}__{base_cls.__qualname__}"
        module = sys.modules[root.__module__]
        made = module.__dict__.get(qualname)
        if made is None:
            made = type(
                qualname,
                (root,),
                {
                    "__module__": root.__module__,
                    "__qualname__": qualname,
                    **_class_attributes(root, base_cls),
                },
            )
            setattr(module, qualname, made)
            made.state_class()
        return made

    # ---- the base's properties, forwarded ------------------------------------------------------------

    def bind_cost(self, cost) -> Policy:
        self.base.bind_cost(cost)
        return super().bind_cost(cost)

    def own_state(self, trace, capacity: int) -> tuple:
        raise NotImplementedError

    def init_state(self, trace, capacity: int) -> tuple:
        return tuple(self.base.init_state(trace, capacity)) + tuple(self.own_state(trace, capacity))

    def initial_residents(self, state: tuple, trace, capacity: int):
        n = len(type(self.base).state_fields)
        return self.base.initial_residents(self.base.named_state(tuple(state[:n])), trace, capacity)


def _rebuild(name: str, params: dict) -> Policy:
    return make_policy(name, **params)


def _class_attributes(root: type[AdmissionFilter], base_cls: type[Policy]) -> dict:
    """What a filter class over `base_cls` takes from it: its step over the base's, its state fields
    (the base's, then the filter's), and the base's properties (prefetches, costs, start)."""
    fields = tuple(base_cls.state_fields) + root.own_fields
    if len(set(fields)) != len(fields):
        raise MoecacheError(f"policy {root.name}: cannot stack {root.name} over itself")
    return {
        "base_class": base_cls,
        "step": root.make_step(base_cls.step, len(base_cls.state_fields)),
        "state_fields": fields,
        "cold_start": base_cls.cold_start,
        "prefetches": base_cls.prefetches,
        "weighs_costs": base_cls.weighs_costs,
    }


def register_filter(cls: type[AdmissionFilter], base_cls: type[Policy]) -> type[AdmissionFilter]:
    """Set the registered filter class `cls` over its default base `base_cls` (before `register`)."""
    for key, value in _class_attributes(cls, base_cls).items():
        setattr(cls, key, value)
    return cls

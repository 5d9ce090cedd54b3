"""One layer visit, compiled once per policy: hit mask -> the policy's `step` -> evictions, then
admissions, checked. The instant replay (replay.py), the timed replay (timed.py) and the runtime's
cache manager all go through `apply_step`; `visit` is the whole visit as one entry point callable
from Python (the runtime's, and benchmarks/bench_step.py's).

The policy is chosen by the type of `state`: a policy's state is a named tuple of its own class
(`Policy.State`), and `call_step` is resolved at compile time to the `step` bound to that class by
`bind_step` (Policy.state_class does it). See jit.py for why the step is not an argument.

Legend: G global expert keys (key = layer_id * num_experts + expert_id), U a visit's distinct
experts, in access order.
"""

from __future__ import annotations

import numba as nb
from numba.core import types
from numba.extending import overload

from moecache.sim.jit import bound

# state class -> the policy's @njit step; filled by bind_step before anything is compiled for it.
STEP_OF_STATE: dict[type, object] = {}


def bind_step(state_class: type, step) -> None:
    """Make `call_step` on a `state_class` state call `step`. One step per state class."""
    known = STEP_OF_STATE.setdefault(state_class, step)
    if known is not step:
        raise ValueError(f"state class {state_class.__qualname__} is already bound to another step")


def call_step(state, key_U, uses_U, hit_U, a0, clock, request, resident_G, admit_out, evict_out):
    """The policy step of `state`'s class (compiled code only; see bind_step)."""
    raise NotImplementedError("call_step runs only inside compiled code")


@overload(call_step, inline="always")
def _call_step(state, key_U, uses_U, hit_U, a0, clock, request, resident_G, admit_out, evict_out):
    if not isinstance(state, types.BaseNamedTuple) or state.instance_class not in STEP_OF_STATE:
        return None
    step = STEP_OF_STATE[state.instance_class]

    def impl(state, key_U, uses_U, hit_U, a0, clock, request, resident_G, admit_out, evict_out):
        return step(state, key_U, uses_U, hit_U, a0, clock, request, resident_G, admit_out, evict_out)

    return impl


@nb.njit(inline="always")
def apply_step(
    state, key_U, uses_U, hit_U, a0, clock, request, resident_G, held, capacity, admit_out, evict_out
):  # fmt: skip
    """The policy's step, then its evictions and admissions applied to resident_G (each checked: an
    evicted key held a slot, an admitted one did not, at most `capacity` keys hold slots after).
    Raises ValueError naming the broken rule. Returns (n_admit, n_evict, keys holding a slot)."""
    n_admit, n_evict = call_step(
        state, key_U, uses_U, hit_U, a0, clock, request, resident_G, admit_out, evict_out
    )
    for j in range(n_evict):
        g = evict_out[j]
        if not resident_G[g]:
            raise ValueError("policy evicted a key that holds no slot")
        resident_G[g] = False
    for j in range(n_admit):
        g = admit_out[j]
        if resident_G[g]:
            raise ValueError("policy admitted a key that already holds a slot")
        resident_G[g] = True
    held += n_admit - n_evict
    if held > capacity:
        raise ValueError("policy holds more keys than the capacity")
    return n_admit, n_evict, held


def _visit(state, key_U, uses_U, a0, clock, request, resident_G, held_capacity, hit_U, admit_out, evict_out):
    """One layer visit: hit_U[i] = key_U[i] holds a slot (before the visit), the policy's step, its
    evictions and admissions applied to resident_G. held_capacity (int64 [2]): keys holding a slot
    (updated) and the capacity. Returns (n_admit, n_evict); the keys are admit_out[:n_admit] and
    evict_out[:n_evict]."""
    for i in range(key_U.shape[0]):
        hit_U[i] = resident_G[key_U[i]]
    n_admit, n_evict, held = apply_step(
        state, key_U, uses_U, hit_U, a0, clock, request, resident_G, held_capacity[0], held_capacity[1],
        admit_out, evict_out,
    )  # fmt: skip
    held_capacity[0] = held
    return n_admit, n_evict


def visit_entry(policy_cls: type):
    """The compiled `visit` of one policy class (cached on disk for registered policies)."""
    return bound(_visit, policy_cls)

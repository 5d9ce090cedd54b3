"""One layer visit, compiled once per policy: hit mask -> the policy's `step` -> same-step
cancellations -> evictions, then admissions, checked. The instant replay (replay.py), the timed
replay (timed.py) and the runtime's cache manager all go through `apply_step`; `visit` is the whole
visit as one entry point callable from Python (the runtime's, and benchmarks/bench_step.py's).

Cancellation is done here, once, for every policy: a step lists every admission it decides and every
victim it picks, even a victim it admitted itself earlier in the same step (a later miss of the step
found it the victim). Such a key held no slot before the visit, so `apply_step` recognises it by
`not resident_G[key]`, removes its first admission from the list (the others keep their order) and
drops the eviction: the two cancel out, no copy is made and nothing is evicted. This is the test
oracle's `cancel_or_evict` (tests/sim/reference.py, list.remove) applied to the step's whole output. The
reverse also cancels: a key the step evicted while it held a slot and then admitted again (a
prefetch of a key a demand admission had just evicted) keeps its slot: neither an eviction nor a
copy (the reference's RefTransitionPrefetch does the same).

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
def _cancel_admission(admit_out, n_admit, evict_out, j, g):
    """evict_out[j] = g holds no slot (before the visit, or any more): a double eviction if g is
    already among evict_out[:j] (kept: g, cancelled: ~g), else the step must have admitted g; its
    first admission is removed, the later ones moved up one place (order kept), and evict_out[j]
    marked cancelled (~g, negative). Returns the new n_admit."""
    twice = False
    for i in range(j):
        e = evict_out[i]
        if e == g or e == ~g:
            twice = True
    if twice:
        raise ValueError("policy evicted a key twice in one step")
    at = n_admit
    for i in range(n_admit - 1, -1, -1):  # from the back: ends at the first admission of g
        if admit_out[i] == g:
            at = i
    if at == n_admit:
        raise ValueError("policy evicted a key that holds no slot")
    for i in range(at + 1, n_admit):
        admit_out[i - 1] = admit_out[i]
    evict_out[j] = ~g
    return n_admit - 1


@nb.njit(inline="always")
def _drop_marked(evict_out, n_evict):
    """Drop the evictions marked cancelled (~key, negative), keeping the others' order; returns the count."""
    kept = 0
    for j in range(n_evict):
        g = evict_out[j]
        if g >= 0:
            evict_out[kept] = g
            kept += 1
    return kept


@nb.njit(inline="always")
def apply_step(
    state, key_U, uses_U, hit_U, a0, clock, request, resident_G, held, capacity, admit_out, evict_out
):  # fmt: skip
    """The policy's step, its same-step cancellations (an evicted key that held no slot before the
    visit was admitted by the step: that admission and the eviction both go; an admitted key the step
    evicted while it held a slot keeps that slot: both go too; see the module doc), then its
    evictions and admissions applied to resident_G (each checked: no key evicted twice, an
    evicted key held a slot or was admitted by the step, an admitted one did not hold a slot, at most
    `capacity` keys hold slots after). admit_out[:n_admit] and evict_out[:n_evict] are left holding
    the net admissions (in the step's order) and evictions. Raises ValueError naming the broken rule.
    Returns (n_admit, n_evict, keys holding a slot)."""
    n_admit, n_evict = call_step(
        state, key_U, uses_U, hit_U, a0, clock, request, resident_G, admit_out, evict_out
    )
    n_cancel = 0
    for j in range(n_evict):
        g = evict_out[j]
        if resident_G[g]:
            resident_G[g] = False
        else:
            n_admit = _cancel_admission(admit_out, n_admit, evict_out, j, g)
            n_cancel += 1
    if n_cancel > 0:
        n_evict = _drop_marked(evict_out, n_evict)
    n_back = 0  # keys the step evicted (they held a slot) and admitted again: they keep their slot
    kept = 0
    for j in range(n_admit):
        g = admit_out[j]
        if resident_G[g]:
            raise ValueError("policy admitted a key that already holds a slot")
        resident_G[g] = True
        back = -1
        for i in range(n_evict):
            if evict_out[i] == g:
                back = i
        if back >= 0:
            evict_out[back] = ~g
            n_back += 1
        else:
            admit_out[kept] = g
            kept += 1
    n_admit = kept
    if n_back > 0:
        n_evict = _drop_marked(evict_out, n_evict)
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

"""Second-touch admission over any online base policy (lk-moe's "second-touch window LRU").

A miss is let through to the base (which then admits it by its own rule) only when the same key
missed before, at most `window_tokens` tokens earlier (token clock: a decode step is one token, a
prefill step its tokens); the first touch of a key, or one after a longer gap, only records the touch
and runs on the CPU, and the base never hears of it (moecache/sim/policies/_wrap.py). Every miss, let
through or not, records its touch. Hits always reach the base. A one-off expert therefore never
displaces a resident; an expert touched twice in the window is admitted like under the base alone.
Ties: none of the filter's own (the base's tie rules apply to what it sees).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from moecache.sim.policies._params import require_ints
from moecache.sim.policies._wrap import AdmissionFilter, add_to_view, make_view_step, register_filter
from moecache.sim.policies.lru import LRU
from moecache.sim.policy import register


def make_second_touch_step(base_step, n):
    """The step of second_touch over the base whose step is `base_step` and state has n members."""
    i_meta = n + 4  # after touch_G (n) and the view (n + 1 .. n + 3); a constant: static getitem

    @nb.njit(inline="always")
    def second_touch_view(state, key_U, uses_U, hit_U, clock, view_key, view_uses, view_hit):
        touch_G = state[n]  # clock of each key's last miss (-1: none)
        window = state[i_meta][0]
        m = 0
        for i in range(key_U.shape[0]):
            k = key_U[i]
            keep = hit_U[i]
            if not keep:
                last = touch_G[k]
                keep = last >= 0 and clock - last <= window
                touch_G[k] = clock
            if keep:
                m = add_to_view(view_key, view_uses, view_hit, m, k, uses_U[i], hit_U[i])
        return m

    return make_view_step(base_step, n, n + 1, second_touch_view)


class SecondTouch(AdmissionFilter):
    name = "second_touch"
    defaults = {"base": "lru", "base_params": {}, "window_tokens": 32}
    own_fields = (
        "second_touch_touch_G",
        "second_touch_view_key",
        "second_touch_view_uses",
        "second_touch_view_hit",
        "second_touch_meta",
    )
    make_step = staticmethod(make_second_touch_step)

    def __init__(self, **params):
        super().__init__(**params)
        require_ints(self, window_tokens=0)

    def own_state(self, trace, capacity: int) -> tuple:
        n = trace.num_keys
        return (
            np.full(n, -1, np.int64),
            np.zeros(n, np.int32),
            np.zeros(n, np.int32),
            np.zeros(n, np.bool_),
            np.array([int(self.params["window_tokens"])], np.int64),
        )


register(register_filter(SecondTouch, LRU))

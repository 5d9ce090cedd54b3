"""Profiled static placement: the experts most used by a *profile* trace (another run, another
workload: a recorded routing profile, as llama.cpp forks and KTransformers load one), resident from
the start free of charge, never changed. Online: it reads the profile, never the replayed trace.

`profile` (required): a canonical trace (a Parquet file or a trace artifact folder) of the same layers
and experts; its per-key uses (tokens selecting the key) rank the keys by (-count, layer_id, expert_id).
Without one the tie rule alone would place the keys (static_cold's placement, not a profile's), so
null, an empty path and a path that does not exist are refused when the policy is made: `moecache
simulate` and `sweep` make it before reading a trace, `generate` and `validate` before loading the model.
`split`:
- global: the `capacity` best keys of the whole model;
- per_layer: floor(capacity / layers) best keys of every layer, then the remaining slots to the best
  keys not yet chosen, ranked over the whole model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moecache.errors import MoecacheError
from moecache.sim.policies._params import trace_file
from moecache.sim.policies.lfu import load_init_counts
from moecache.sim.policies.static_hindsight import top_keys
from moecache.sim.policy import Policy, register, static_step

SPLITS = ("global", "per_layer")


def profile_keys(count_G: np.ndarray, num_layers: int, capacity: int, split: str) -> np.ndarray:
    """The resident keys (int64, sorted) of a profile's per-key counts."""
    if split == "global":
        return top_keys(count_G, capacity).astype(np.int64)
    E = count_G.shape[0] // num_layers
    per_layer = capacity // num_layers
    chosen = np.zeros(count_G.shape[0], np.bool_)
    for layer in range(num_layers):
        chosen[layer * E + top_keys(count_G[layer * E : (layer + 1) * E], per_layer)] = True
    rest = np.flatnonzero(~chosen)
    chosen[rest[top_keys(count_G[rest], capacity - per_layer * num_layers)]] = True
    return np.flatnonzero(chosen).astype(np.int64)


@register
class ProfileStatic(Policy):
    name = "profile_static"
    cold_start = False
    step = static_step
    state_fields = ("profile_keys",)
    # null: not given (the conf/policy file's value, the class's default); refused below
    defaults = {"profile": None, "split": "global"}

    def __init__(self, **params):
        super().__init__(**params)
        profile, split = self.params["profile"], self.params["split"]
        if profile is None:
            raise MoecacheError(
                "policy profile_static: profile=null: give the trace whose most used experts it places, a"
                " trace artifact folder or Parquet file of the same model (policy.params.profile=PATH; in a"
                " sweep, sweep.policies.profile_static=[{profile: PATH}])"
            )
        if not isinstance(profile, str | Path) or not str(profile):
            raise MoecacheError(f"policy profile_static: profile must be a path, got {profile!r}")
        trace_file(profile, "policy profile_static: profile")
        if split not in SPLITS:
            raise MoecacheError(f"policy profile_static: split must be one of {list(SPLITS)}, got {split!r}")

    def counts(self, trace) -> np.ndarray:
        """The profile's per-key uses, loaded once per model shape."""
        shape = (trace.num_layers, trace.num_experts)
        cached = self.__dict__.setdefault("_counts", {})
        if shape not in cached:
            cached[shape] = load_init_counts(self.params["profile"], trace, "profile_static profile")
        return cached[shape]

    def init_state(self, trace, capacity: int) -> tuple:
        return (profile_keys(self.counts(trace), trace.num_layers, capacity, self.params["split"]),)

    def initial_residents(self, state: tuple, trace, capacity: int) -> np.ndarray:
        return state[0].astype(np.int32)

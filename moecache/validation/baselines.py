"""The strategies `moecache validate` runs beside the selected policy (issue 13), and how each is built.

| strategy | capacity | runtime policy | on a miss | simulator replays |
| --- | --- | --- | --- | --- |
| `all_resident` | every expert | static_cold (every key resident) | - | static_cold at all keys |
| `all_cpu` | 0 (llama.cpp `--cpu-moe`) | static_cold at 0 | CPU | static_cold at 0 |
| `n_cpu_moe` | each of validate.capacities | static_layers: the last whole layers resident, the first layers' experts on the CPU (`--n-cpu-moe`) | CPU | static_layers |
| `lru_sync` | each | lru_per_layer (split equal) | wait for the copy, run on the device (mixtral-offloading) | lru_per_layer, timed mode waiting for its copies (moecache/sim/timed.py, 5.) |
| `hindsight_static` | each | the `capacity` most used experts of the workload's own trace, fixed (see below) | CPU | static_hindsight |
| `selected` | each | the decision's `selected` policy | CPU, or (validate.on_miss=split) split between waiting for its copy and the CPU | the same policy (and on_miss) |

The hindsight placement is the plan's oracle: the keys ranked by (-uses, key) over the routing trace of the
unmodified model on the very requests of the run (`static_hindsight.top_keys`). The runtime refuses the
offline `static_hindsight` (its init_state reads the future), so the set is installed into an online
static policy: `static_cold`'s state (a fixed key list, a step that never changes it) imported with those
keys as its residents (`CacheManager.import_state`). Whichever runs, nothing moves during the run. A
decision whose `selected` is `static_hindsight` (the rule's baseline, kept when no candidate is
competitive) runs as this same placement.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moecache.errors import MoecacheError
from moecache.sim.policy_spec import PolicySpec

STRATEGIES = ("all_resident", "all_cpu", "n_cpu_moe", "lru_sync", "hindsight_static", "selected")
FIXED_CAPACITY = {"all_resident": "all", "all_cpu": "0"}  # the others run at every validate capacity
HINDSIGHT = "static_hindsight"
SELECTED_ON_MISS = ("cpu", "split")  # validate.on_miss: the selected policy's (manager.py)


@dataclass(frozen=True)
class Strategy:
    name: str
    policy: PolicySpec  # what the runtime runs
    on_miss: str  # the manager's on_miss
    sim_policy: PolicySpec  # what the simulator replays for the prediction
    hindsight: bool = False  # install the hindsight placement into `policy` (static_cold)

    @property
    def fixed_capacity(self) -> str | None:
        return FIXED_CAPACITY.get(self.name)


def check_names(names, key: str = "validate.strategies") -> list[str]:
    if not isinstance(names, list | tuple) or not names:
        raise MoecacheError(f"{key}={names!r}: expected a non-empty list of {', '.join(STRATEGIES)}")
    for name in names:
        if name not in STRATEGIES:
            raise MoecacheError(f"{key}: unknown strategy {name!r}; known: {', '.join(STRATEGIES)}")
    if len(set(names)) != len(names):
        raise MoecacheError(f"{key}={list(names)}: a strategy is listed twice")
    return list(names)


def build(names: list[str], selected: PolicySpec, on_miss: str = "cpu") -> list[Strategy]:
    """The strategies `names` (in STRATEGIES order), `selected` being the decision's policy run with
    `on_miss` (SELECTED_ON_MISS; a placement that never moves makes no copies: "cpu")."""
    if on_miss not in SELECTED_ON_MISS:
        raise MoecacheError(f"validate.on_miss={on_miss!r}: expected one of {', '.join(SELECTED_ON_MISS)}")
    cold = PolicySpec.of("static_cold")
    made = {
        "all_resident": Strategy("all_resident", cold, "cpu", cold),
        "all_cpu": Strategy("all_cpu", cold, "cpu", cold),
        "n_cpu_moe": Strategy(
            "n_cpu_moe", PolicySpec.of("static_layers"), "cpu", PolicySpec.of("static_layers")
        ),
        "lru_sync": Strategy(
            "lru_sync",
            PolicySpec.of("lru_per_layer", {"split": "equal"}),
            "wait",
            PolicySpec.of("lru_per_layer", {"split": "equal"}),
        ),  # fmt: skip
        "hindsight_static": Strategy(
            "hindsight_static", cold, "cpu", PolicySpec.of(HINDSIGHT), hindsight=True
        ),
        "selected": (
            Strategy("selected", cold, "cpu", selected, hindsight=True)
            if selected.name == HINDSIGHT
            else Strategy("selected", selected, on_miss, selected)
        ),
    }
    return [made[n] for n in STRATEGIES if n in names]


def hindsight_keys(count_G: np.ndarray, slots: int) -> np.ndarray:
    """The `slots` most used keys by (-uses, key), int64, sorted (static_hindsight's ranking)."""
    from moecache.sim.policies.static_hindsight import top_keys

    return top_keys(np.asarray(count_G, np.int64), slots).astype(np.int64)


def install_hindsight(manager, keys_G: np.ndarray) -> None:
    """Make a static_cold manager hold exactly `keys_G` for the rest of the session (module docstring)."""
    if manager.policy.name != "static_cold":
        raise MoecacheError(f"hindsight placement: needs a static_cold manager, got {manager.policy.label()}")
    if len(keys_G) != manager.capacity:
        raise MoecacheError(f"hindsight placement: {len(keys_G)} keys for {manager.capacity} slots")
    state = manager.export_state()
    state["state"]["keys"] = np.asarray(keys_G, np.int64)
    state["resident_keys"] = np.asarray(keys_G, np.int64)
    manager.import_state(state)

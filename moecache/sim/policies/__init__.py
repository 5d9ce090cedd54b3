"""Every placement policy, one file each; importing this package registers them all."""

import moecache.sim.policies.activation_match  # noqa: F401
import moecache.sim.policies.belady  # noqa: F401
import moecache.sim.policies.impact  # noqa: F401
import moecache.sim.policies.lfu  # noqa: F401
import moecache.sim.policies.lfu_decay  # noqa: F401
import moecache.sim.policies.lfu_hysteresis  # noqa: F401
import moecache.sim.policies.lfu_per_layer  # noqa: F401
import moecache.sim.policies.lfu_window  # noqa: F401
import moecache.sim.policies.lrfu  # noqa: F401
import moecache.sim.policies.lru  # noqa: F401
import moecache.sim.policies.lru_per_layer  # noqa: F401
import moecache.sim.policies.prefill_admit  # noqa: F401
import moecache.sim.policies.profile_static  # noqa: F401
import moecache.sim.policies.second_touch  # noqa: F401
import moecache.sim.policies.static_cold  # noqa: F401
import moecache.sim.policies.static_hindsight  # noqa: F401
import moecache.sim.policies.static_layers  # noqa: F401
import moecache.sim.policies.transition_prefetch  # noqa: F401

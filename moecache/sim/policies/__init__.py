"""Every placement policy, one file each; importing this package registers them all."""

from moecache.sim.policies import (
    belady,  # noqa: F401
    lfu,  # noqa: F401
    lfu_decay,  # noqa: F401
    lfu_per_layer,  # noqa: F401
    lfu_window,  # noqa: F401
    lrfu,  # noqa: F401
    lru,  # noqa: F401
    lru_per_layer,  # noqa: F401
    static_cold,  # noqa: F401
    static_hindsight,  # noqa: F401
)

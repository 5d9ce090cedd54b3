"""Every placement policy, one file each; importing this package registers them all."""

from moecache.sim.policies import lru  # noqa: F401

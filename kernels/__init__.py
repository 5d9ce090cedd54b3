"""Expert kernels for moecache, installed as `moecache_kernels`.

`expert_reference` holds the plain torch reference (the test oracle); fused Triton kernels come beside it.
"""

from .expert_reference import expert_forward, moe_reference

__all__ = ["expert_forward", "moe_reference"]

"""Expert kernels for moecache, installed as `moecache_kernels`.

`expert_reference` and `slot_moe_reference` hold the plain torch references (the test oracles);
`slot_moe` is the fused Triton slot-pool MoE operator (docs/kernels.md). Without Triton installed the
references still import, and calling `slot_moe` raises ImportError saying so.
"""

from .expert_reference import expert_forward, moe_reference, rounded, rounds_product, weighted_expert
from .slot_moe_reference import slot_moe_reference

try:
    # Imported eagerly: the function must shadow the submodule of the same name, which a later
    # `import moecache_kernels.slot_moe` would otherwise bind here.
    from .slot_moe import slot_moe
except ImportError as _err:  # triton is absent (it is an optional dependency: the `kernels` extra)
    _TRITON_ERROR = _err

    def slot_moe(*args, **kwargs):
        """Stands in for the Triton kernel where triton cannot be imported."""
        raise ImportError(f"moecache_kernels.slot_moe needs triton: {_TRITON_ERROR}")


__all__ = [
    "expert_forward",
    "moe_reference",
    "rounded",
    "rounds_product",
    "slot_moe",
    "slot_moe_reference",
    "weighted_expert",
]

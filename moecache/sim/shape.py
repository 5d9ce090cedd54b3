"""The model's shape: all an online policy needs to start (the runtime has no trace to give it).

`Policy.init_state(shape, capacity)` receives a `ModelShape` in the runtime and a `TraceArrays` in the
simulator; both have these attributes (and `num_keys`), so an online policy reads only them. Offline
policies (`Policy.offline = True`: Belady, hindsight static) read the whole trace instead and exist only
in the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass

from moecache.errors import MoecacheError


@dataclass(frozen=True)
class ModelShape:
    """MoE layers, routed experts per layer, experts chosen per token, and bytes of one expert's weights."""

    num_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int

    def __post_init__(self):
        for name in ("num_layers", "num_experts", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MoecacheError(f"model shape: {name} must be a positive integer, got {value!r}")
        if (
            isinstance(self.expert_bytes, bool)
            or not isinstance(self.expert_bytes, int)
            or self.expert_bytes < 0
        ):
            raise MoecacheError(
                f"model shape: expert_bytes must be an integer >= 0, got {self.expert_bytes!r}"
            )
        if self.top_k > self.num_experts:
            raise MoecacheError(f"model shape: top_k {self.top_k} > num_experts {self.num_experts}")

    @property
    def num_keys(self) -> int:
        """Global expert keys (key = layer_id * num_experts + expert_id)."""
        return self.num_layers * self.num_experts

    @classmethod
    def of(cls, shaped) -> ModelShape:
        """The shape of anything with these attributes (a TraceArrays, a TraceMeta)."""
        return cls(
            int(shaped.num_layers), int(shaped.num_experts), int(shaped.top_k), int(shaped.expert_bytes)
        )

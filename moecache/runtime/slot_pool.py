"""The GPU expert cache's memory: `capacity` preallocated slots, each holding one expert's weights.

One device allocation `flat_SB` uint8 [S, expert_bytes], laid out like the expert store's rows (w13
then w2), so that filling a slot is one contiguous copy of one store row. `w13_SIH` [S, 2I, H] (gate
rows, then up rows) and `w2_SHI` [S, H, I] are dtype views of it: each slot's matrices are contiguous,
and the slot stride is expert_bytes (a kernel takes the strides). Allocated once and never
reallocated: the addresses stay fixed (the decode step will be captured in CUDA graphs); which expert
a slot holds is the cache manager's business (slot table, `slot_of_E`). Capacity 0 (no GPU experts)
and capacity = every expert both work.

Legend: S slots, H hidden, I intermediate.
"""

from __future__ import annotations

import torch

from moecache.errors import MoecacheError


class SlotPool:
    def __init__(self, device, capacity: int, hidden: int, inter: int, dtype):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise MoecacheError(f"slot pool: capacity must be an integer >= 0, got {capacity!r}")
        self.device = device
        self.capacity = capacity
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self.expert_bytes = 3 * inter * hidden * itemsize
        self.flat_SB = torch.empty(
            (capacity, self.expert_bytes), dtype=torch.uint8, device=device.torch_device
        )
        elements_SN = self.flat_SB.view(dtype)
        n13 = 2 * inter * hidden
        self.w13_SIH = elements_SN[:, :n13].view(capacity, 2 * inter, hidden)
        self.w2_SHI = elements_SN[:, n13:].view(capacity, hidden, inter)

    @classmethod
    def for_store(cls, device, capacity: int, store) -> SlotPool:
        return cls(device, capacity, store.hidden_size, store.intermediate_size, store.dtype)

    @property
    def nbytes(self) -> int:
        return (
            self.w13_SIH.numel() * self.w13_SIH.element_size()
            + self.w2_SHI.numel() * self.w2_SHI.element_size()
        )

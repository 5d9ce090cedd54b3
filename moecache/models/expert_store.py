"""Every expert's weights in one host allocation, expert-major, pinned once at its exact size.

Layout: `flat_GB` uint8 [G, expert_bytes] with G = L x E global keys (key = layer_id * E + expert_id);
row g holds expert g's `w13` [2I, H] (gate rows, then up rows, as transformers' gate_up_proj) followed
by its `w2` [H, I] (down_proj), in one dtype. `w13_GIH` [G, 2I, H] and `w2_GHI` [G, H, I] are dtype
views of the same bytes. These are the canonical CPU weights: the CPU fallback reads them, the
transfer engine copies rows from them into GPU slots, and nothing ever frees, moves or writes them
after loading (eviction only forgets a slot).

Pages: the allocation asks for 2 MiB pages before it is filled (moecache/models/host_pages.py): the
CPU path streams experts picked at random from all of it.

Pinning: one `cudaHostRegister` of the whole allocation (its exact size), never per-expert
`pin_memory()`, which rounds every allocation up to a power of two (pytorch #95823). `pin="auto"`
warns in one line and keeps pageable memory where registration is impossible (no CUDA, or the call
fails); `pin="strict"` refuses instead; `pin="off"` skips it (tests, CPU-only runs).

A checkpoint's experts are read straight into an allocated store by the streaming loader
(moecache/models/streaming.py), so peak host memory stays ~1x the expert bytes.

Legend: G global expert keys, L layers, E experts, H hidden, I intermediate.
"""

from __future__ import annotations

import ctypes
import time
import warnings
import weakref

import torch

from moecache.errors import MoecacheError
from moecache.models.host_pages import huge_page_bytes

PIN_MODES = ("auto", "strict", "off")


class PinWarning(UserWarning):
    """The store could not be pinned (pin="auto"): copies from it are synchronous and slower."""


def host_register(tensor: torch.Tensor) -> str | None:
    """cudaHostRegister the tensor's bytes (exact size); None on success, else why not (one line)."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return None
    try:
        err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
    except (RuntimeError, AttributeError) as exc:
        return f"cudaHostRegister is unavailable ({' '.join(str(exc).split())})"
    code = int(err.value if hasattr(err, "value") else err)
    if code != 0:
        return f"cudaHostRegister({nbytes} bytes) failed with CUDA error {code}"
    return None


def _host_unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ctypes.c_void_p(ptr).value)
    except Exception:  # interpreter shutdown: the process releases the memory anyway
        pass


class ExpertStore:
    """The pinned expert-major weight store (see the module docstring). Build it with `allocate` (then
    fill it) or `from_tensors`."""

    def __init__(
        self, flat_GB: torch.Tensor, num_layers: int, num_experts: int, hidden: int, inter: int, dtype
    ):
        self.flat_GB = flat_GB
        self.num_layers, self.num_experts = num_layers, num_experts
        self.hidden_size, self.intermediate_size = hidden, inter
        self.dtype = dtype
        self.expert_bytes = flat_GB.shape[1]
        n13 = 2 * inter * hidden
        elements_GN = flat_GB.view(dtype)
        self.w13_GIH = elements_GN[:, :n13].view(self.num_keys, 2 * inter, hidden)
        self.w2_GHI = elements_GN[:, n13:].view(self.num_keys, hidden, inter)
        self.pinned = False
        self.register_seconds: float | None = None
        self._finalizer = None

    @property
    def num_keys(self) -> int:
        return self.num_layers * self.num_experts

    @property
    def nbytes(self) -> int:
        return self.num_keys * self.expert_bytes

    def key(self, layer_id: int, expert_id: int) -> int:
        return layer_id * self.num_experts + expert_id

    # ---- construction ---------------------------------------------------------------------------

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_experts: int,
        hidden: int,
        inter: int,
        dtype=torch.bfloat16,
        pages: str = "huge",
    ) -> ExpertStore:
        """An unfilled, unpinned store (fill it, then call `pin`), in huge pages where the kernel offers
        them (`pages`: moecache/models/host_pages.py)."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        expert_bytes = (3 * inter * hidden) * itemsize
        G = num_layers * num_experts
        flat_GB = huge_page_bytes(G * expert_bytes, pages).view(G, expert_bytes)
        return cls(flat_GB, num_layers, num_experts, hidden, inter, dtype)

    @classmethod
    def from_tensors(cls, gate_up_LEIH, down_LEHI, *, dtype=None, pin: str = "auto") -> ExpertStore:
        """From per-layer tensors in the canonical layout: gate_up [E, 2I, H] and down [E, H, I] per
        layer (sequences of equal length), copied (and converted to `dtype`) into the store."""
        if len(gate_up_LEIH) != len(down_LEHI) or not len(gate_up_LEIH):
            raise MoecacheError(
                "expert store: give one gate_up and one down tensor per layer (at least one layer)"
            )
        E, two_i, H = gate_up_LEIH[0].shape
        store = cls.allocate(len(gate_up_LEIH), E, H, two_i // 2, dtype or gate_up_LEIH[0].dtype)
        for layer, (gate_up_EIH, down_EHI) in enumerate(zip(gate_up_LEIH, down_LEHI, strict=True)):
            if tuple(gate_up_EIH.shape) != (E, two_i, H) or tuple(down_EHI.shape) != (E, H, two_i // 2):
                raise MoecacheError(
                    f"expert store: layer {layer} has shapes {tuple(gate_up_EIH.shape)}, {tuple(down_EHI.shape)}; "
                    f"layer 0 has {(E, two_i, H)}, {(E, H, two_i // 2)}"
                )
            rows = slice(layer * E, (layer + 1) * E)
            store.w13_GIH[rows].copy_(gate_up_EIH)
            store.w2_GHI[rows].copy_(down_EHI)
        store.pin(pin)
        return store

    # ---- pinning --------------------------------------------------------------------------------

    def pin(self, mode: str = "auto") -> bool:
        """Register the whole allocation with CUDA once (see the module docstring for `mode`).
        Returns whether the store is pinned; `register_seconds` holds the time the call took."""
        if mode not in PIN_MODES:
            raise MoecacheError(f"expert store pin={mode!r}: expected one of {list(PIN_MODES)}")
        if self.pinned or mode == "off":
            return self.pinned
        start = time.perf_counter()
        why = host_register(self.flat_GB)
        self.register_seconds = time.perf_counter() - start
        if why is not None:
            message = f"expert store ({self.nbytes} bytes) cannot be pinned: {why}"
            if mode == "strict":
                raise MoecacheError(message + " (pin=strict)")
            warnings.warn(message + "; host-to-device copies will be synchronous", PinWarning, stacklevel=2)
            return False
        self.pinned = True
        if self.nbytes:
            self._finalizer = weakref.finalize(self, _host_unregister, self.flat_GB.data_ptr())
        return True

    def close(self) -> None:
        """Unregister the pinned memory (the store stays readable, pageable)."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self.pinned = False

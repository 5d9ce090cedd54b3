"""Every expert's weights in one host allocation, expert-major, pinned once at its exact size.

Layout: `flat_GB` uint8 [G, expert_bytes] with G = L x E global keys (key = layer_id * E + expert_id);
row g holds expert g's `w13` [2I, H] (gate rows, then up rows, as transformers' gate_up_proj) followed
by its `w2` [H, I] (down_proj), in one dtype. `w13_GIH` [G, 2I, H] and `w2_GHI` [G, H, I] are dtype
views of the same bytes. These are the canonical CPU weights: the CPU fallback reads them, the
transfer engine copies rows from them into GPU slots, and nothing ever frees, moves or writes them
after loading (eviction only forgets a slot).

Pinning: one `cudaHostRegister` of the whole allocation (its exact size), never per-expert
`pin_memory()`, which rounds every allocation up to a power of two (pytorch #95823). `pin="auto"`
warns in one line and keeps pageable memory where registration is impossible (no CUDA, or the call
fails); `pin="strict"` refuses instead; `pin="off"` skips it (tests, CPU-only runs).

Loading from a checkpoint (`from_checkpoint`) reads the safetensors files tensor by tensor
(`safe_open`, one expert slice at a time for fused layouts) straight into the store, so peak host memory
stays ~1x the expert bytes. The MoE structure (which decoder layers are MoE layers, E, H, I) comes
from the model adapters (moecache/models/) applied to the model built on the meta device.

Legend: G global expert keys, L layers, E experts, H hidden, I intermediate.
"""

from __future__ import annotations

import ctypes
import re
import time
import warnings
import weakref
from pathlib import Path

import torch

from moecache.errors import MoecacheError

PIN_MODES = ("auto", "strict", "off")
_PER_EXPERT = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}
_EXPERT_KEY = re.compile(
    r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\."
    r"(?:(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight|(gate_up_proj|down_proj))$"
)


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
    """The pinned expert-major weight store (see the module docstring). Build it with `allocate`,
    `from_tensors` or `from_checkpoint`."""

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
        cls, num_layers: int, num_experts: int, hidden: int, inter: int, dtype=torch.bfloat16
    ) -> ExpertStore:
        """An unfilled, unpinned store (fill it, then call `pin`)."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        expert_bytes = (3 * inter * hidden) * itemsize
        flat_GB = torch.empty((num_layers * num_experts, expert_bytes), dtype=torch.uint8)
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

    @classmethod
    def from_checkpoint(cls, path: str | Path, *, dtype=None, pin: str = "auto") -> ExpertStore:
        """Every routed expert of a Hugging Face checkpoint folder, read from its safetensors files."""
        from safetensors import safe_open

        from moecache.models.loading import check_checkpoint, weight_files

        path = Path(path)
        check_checkpoint(path)
        adapter, prefix = _meta_adapter(path)
        E, H, inter = adapter.num_experts, adapter.hidden_size, adapter.moe_intermediate_size
        layer_of_index = {m.model_layer_index: m.layer_id for m in adapter.moe_layers()}
        store_dtype = dtype or _checkpoint_expert_dtype(path, prefix) or adapter.dtype
        store = cls.allocate(adapter.num_layers, E, H, inter, store_dtype)
        filled_G3 = torch.zeros((store.num_keys, 3), dtype=torch.bool)
        for file in weight_files(path):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name.startswith(prefix) and (m := _EXPERT_KEY.search(name)) is not None:
                        store._load_tensor(f, name, m, layer_of_index, filled_G3)
        missing = (~filled_G3).nonzero()
        if len(missing):
            g, part = (int(v) for v in missing[0])
            raise MoecacheError(
                f"model.path={path}: the safetensors hold no {('gate', 'up', 'down')[part]} weights for "
                f"layer {g // E} expert {g % E} ({len(missing)} expert weights missing in all)"
            )
        store.pin(pin)
        return store

    def _load_tensor(self, f, name: str, m: re.Match, layer_of_index: dict, filled_G3: torch.Tensor) -> None:
        index, expert, part, fused = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if index not in layer_of_index:
            raise MoecacheError(
                f"checkpoint tensor {name}: decoder layer {index} is not an MoE layer of the model"
            )
        E, H, inter = self.num_experts, self.hidden_size, self.intermediate_size
        base = layer_of_index[index] * E
        if expert is not None:  # one expert's gate / up / down matrix
            e, row = int(expert), _PER_EXPERT[part]
            want = (H, inter) if row == 2 else (inter, H)
            tensor = f.get_tensor(name)
            if e >= E or tuple(tensor.shape) != want:
                raise MoecacheError(
                    f"checkpoint tensor {name}: shape {tuple(tensor.shape)}, expected {want} (expert < {E})"
                )
            if row == 2:
                self.w2_GHI[base + e].copy_(tensor)
            else:
                self.w13_GIH[base + e, row * inter : (row + 1) * inter].copy_(tensor)
            filled_G3[base + e, row] = True
            return
        sliced = f.get_slice(name)  # fused [E, 2I, H] or [E, H, I]: one expert at a time
        want = (E, 2 * inter, H) if fused == "gate_up_proj" else (E, H, inter)
        if tuple(sliced.get_shape()) != want:
            raise MoecacheError(
                f"checkpoint tensor {name}: shape {tuple(sliced.get_shape())}, expected {want}"
            )
        target = self.w13_GIH if fused == "gate_up_proj" else self.w2_GHI
        for e in range(E):
            target[base + e].copy_(sliced[e])
        if fused == "gate_up_proj":
            filled_G3[base : base + E, :2] = True
        else:
            filled_G3[base : base + E, 2] = True

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


def _meta_adapter(path: Path):
    """The model adapter of the checkpoint's model built on the meta device (no weights read), and the
    name prefix of its decoder layers' parameters (e.g. "model.language_model.")."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from moecache.models.adapter import adapter_for

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise MoecacheError(f"{path / 'config.json'}: {' '.join(str(exc).split())}") from exc
    adapter = adapter_for(model)
    first = adapter.moe_layers()[0]
    experts_names = {id(p): n for n, p in model.named_parameters()}
    name = experts_names[id(first.experts.gate_up_proj)]
    prefix = name[: name.index(f"layers.{first.model_layer_index}.")]
    return adapter, prefix


def _checkpoint_expert_dtype(path: Path, prefix: str):
    """The dtype of the checkpoint's first expert tensor (what the store keeps by default)."""
    from safetensors import safe_open

    from moecache.models.loading import weight_files

    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.startswith(prefix) and _EXPERT_KEY.search(name):
                    return _DTYPES.get(f.get_slice(name).get_dtype())
    return None


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}

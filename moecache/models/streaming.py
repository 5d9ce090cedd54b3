"""Stream a checkpoint's tensors, each read once, straight to where they are used.

`stream_checkpoint(path, model, store, device)` takes a model skeleton whose parameters are all on the
meta device (moecache/models/skeleton.py) and reads every tensor of the checkpoint's safetensors files
exactly once, with `os.preadv` into its destination:

- a routed expert's weights (per-expert `gate_proj/up_proj/down_proj`, Mixtral `w1/w3/w2`, or the fused
  `gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]`) into its row of the expert store when `store` is
  given (the offloaded model), else into the model's own expert parameters on `device` (the unmodified
  model);
- every other tensor into a host buffer of its size, then onto `device` in the dtype of the parameter
  it fills.

Names are translated to the model's with the renamings transformers itself declares for the model
(`transformers.conversion_mapping.get_model_conversion_mapping`: a multimodal checkpoint's
`model.language_model.` prefix, Mixtral's `block_sparse_moe`); the tensors the text model has no use
for (a vision tower, multi-token-prediction heads) are skipped unread. Reads run on a pool of threads
(`os.preadv` releases the GIL), in file order. Nothing maps the files, so the page cache never counts in
the process's resident memory, and no tensor is materialised twice on the host.

Every defect is one line naming the file and the tensor: a truncated file (moecache/models/
safetensors_index.py), a tensor of the wrong shape, a parameter no file holds.

Legend: G global expert keys (layer x expert), E experts, H hidden, I intermediate.
"""

from __future__ import annotations

import collections
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from moecache.errors import MoecacheError
from moecache.models.safetensors_index import TensorEntry, index_files
from moecache.models.skeleton import materialize, meta_names

# A routed expert's tensor, named as in the model (after transformers' renamings): per expert
# (gate / up / down, or Mixtral's w1 / w3 / w2), or fused over the layer's experts.
EXPERT_KEY = re.compile(
    r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\."
    r"(?:(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight|(gate_up_proj|down_proj))$"
)
PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}
# Two readers: a cold read from disk ran at 0.89 of the disk's sequential rate with two, 0.82 with four
# and 0.80 with eight (docs/benchmarks.md, loading); more readers interleave their requests and the
# kernel's readahead no longer sees one sequential stream.
READ_THREADS = 2
# The default's override, for measuring the read rate at other thread counts in whole runs
# (benchmarks/bench_load.py --read-threads).
READ_THREADS_ENV = "MOECACHE_READ_THREADS"
READ_WINDOW_PER_THREAD = 4  # reads queued ahead of the tensors being placed, per reading thread
READ_AHEAD_BYTES = 256 << 20  # host copies of non-expert tensors read but not yet placed


@dataclass
class StreamStats:
    """What one load read and moved, and how long each part took (seconds)."""

    files: int = 0
    bytes_read: int = 0
    expert_bytes: int = 0
    device_bytes: int = 0
    skipped_tensors: list[str] = field(default_factory=list)
    read_s: float = 0.0


def model_renamings(model: nn.Module) -> list[tuple[re.Pattern, str]]:
    """(pattern, replacement) pairs that turn checkpoint names into the model's: the renamings (not
    the tensor converters) transformers declares for this model; none where transformers has no such
    declaration."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return []
    pairs = []
    for item in get_model_conversion_mapping(model):
        sources, targets = getattr(item, "source_patterns", None), getattr(item, "target_patterns", None)
        if type(item).__name__ not in ("WeightRenaming", "PrefixChange") or not sources or not targets:
            continue
        for i, source in enumerate(sources):
            pairs.append((re.compile(source), targets[i] if len(targets) == len(sources) else targets[0]))
    return pairs


def model_name(name: str, renamings: list[tuple[re.Pattern, str]]) -> str:
    for pattern, target in renamings:
        name = pattern.sub(target, name)
    return name


def read_threads() -> int:
    """READ_THREADS, or $MOECACHE_READ_THREADS (a whole number >= 1; anything else is refused)."""
    value = os.environ.get(READ_THREADS_ENV)
    if value is None:
        return READ_THREADS
    if not value.isdigit() or int(value) < 1:
        raise MoecacheError(f"${READ_THREADS_ENV}={value!r}: expected a whole number >= 1")
    return int(value)


def _read_into(fd: int, offset: int, view: memoryview, file: Path, name: str) -> None:
    """Fill `view` from byte `offset` of the open file (short reads continued)."""
    done, total = 0, len(view)
    while done < total:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise MoecacheError(f"{file}: truncated while reading tensor {name}")
        done += got


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, writable."""
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")


class _Reader:
    """Open files and a byte counter shared by the reading threads."""

    def __init__(self, on_bytes):
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        self._on_bytes = on_bytes
        self.bytes_read = 0

    def fd(self, file: Path) -> int:
        with self._lock:
            if file not in self._fds:
                self._fds[file] = os.open(file, os.O_RDONLY)
            return self._fds[file]

    def read(self, entry: TensorEntry, offset: int, dest: torch.Tensor) -> None:
        view = _bytes_of(dest)
        _read_into(self.fd(entry.file), entry.offset + offset, view, entry.file, entry.name)
        with self._lock:
            self.bytes_read += len(view)
        if self._on_bytes is not None:
            self._on_bytes(len(view))

    def tensor(self, entry: TensorEntry) -> torch.Tensor:
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self.read(entry, 0, out)
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class _ExpertTargets:
    """Where each routed expert's tensor goes: the store's rows, or the model's expert parameters."""

    def __init__(self, model: nn.Module, adapter, store, device: torch.device):
        self.layer_of_index = {m.model_layer_index: m.layer_id for m in adapter.moe_layers()}
        self.E, self.H, self.I = adapter.num_experts, adapter.hidden_size, adapter.moe_intermediate_size
        self.store, self.device = store, device
        self.filled_G3 = torch.zeros((len(self.layer_of_index) * self.E, 3), dtype=torch.bool)
        self.dense: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if store is None:  # the model's own [E, 2I, H] / [E, H, I] parameters, allocated on the device
            for layer in adapter.moe_layers():
                experts = layer.experts
                gate_up = torch.empty(
                    experts.gate_up_proj.shape, dtype=experts.gate_up_proj.dtype, device=device
                )
                down = torch.empty(experts.down_proj.shape, dtype=experts.down_proj.dtype, device=device)
                experts._parameters["gate_up_proj"] = nn.Parameter(gate_up, requires_grad=False)
                experts._parameters["down_proj"] = nn.Parameter(down, requires_grad=False)
                self.dense[layer.layer_id] = (gate_up, down)

    def layer(self, index: int, name: str) -> int:
        if index not in self.layer_of_index:
            raise MoecacheError(
                f"checkpoint tensor {name}: decoder layer {index} is not an MoE layer of the model"
            )
        return self.layer_of_index[index]

    def destinations(self, entry: TensorEntry, match: re.Match) -> list[tuple[int, int, int, tuple]]:
        """(layer, expert, part, shape) for each expert slice of the tensor, in file order; part 0 gate,
        1 up, 2 down, 3 gate and up together (a fused slice)."""
        E, H, inter = self.E, self.H, self.I
        layer = self.layer(int(match.group(1)), entry.name)
        expert, part_name, fused = match.group(2), match.group(3), match.group(4)
        if expert is not None:
            part = PART[part_name]
            want = (H, inter) if part == 2 else (inter, H)
            if int(expert) >= E or entry.shape != want:
                raise MoecacheError(
                    f"{entry.file}: tensor {entry.name}: shape {list(entry.shape)}, expected {list(want)} "
                    f"(expert < {E})"
                )
            return [(layer, int(expert), part, want)]
        want = (E, 2 * inter, H) if fused == "gate_up_proj" else (E, H, inter)
        if entry.shape != want:
            raise MoecacheError(
                f"{entry.file}: tensor {entry.name}: shape {list(entry.shape)}, expected {list(want)}"
            )
        part = 3 if fused == "gate_up_proj" else 2
        return [(layer, e, part, want[1:]) for e in range(E)]

    def view(self, layer: int, expert: int, part: int) -> torch.Tensor:
        """The destination of one expert slice (a view into the store or the dense parameter)."""
        inter = self.I
        rows = {0: slice(0, inter), 1: slice(inter, 2 * inter), 3: slice(0, 2 * inter)}
        if self.store is not None:
            g = layer * self.E + expert
            return self.store.w2_GHI[g] if part == 2 else self.store.w13_GIH[g, rows[part]]
        gate_up, down = self.dense[layer]
        return down[expert] if part == 2 else gate_up[expert, rows[part]]

    def mark(self, layer: int, expert: int, part: int) -> None:
        cols = slice(0, 2) if part == 3 else slice(part, part + 1)
        self.filled_G3[layer * self.E + expert, cols] = True

    def check_complete(self, path: Path) -> None:
        missing = (~self.filled_G3).nonzero()
        if len(missing):
            g, part = (int(v) for v in missing[0])
            raise MoecacheError(
                f"model.path={path}: the safetensors hold no {('gate', 'up', 'down')[part]} weights for "
                f"layer {g // self.E} expert {g % self.E} ({len(missing)} expert weights missing in all)"
            )


def _expert_job(reader: _Reader, targets: _ExpertTargets, entry: TensorEntry, slices) -> None:
    """Read one checkpoint tensor's expert slices to their destinations (direct when the destination
    is host memory of the checkpoint's dtype, else through a host buffer and a converting copy)."""
    offset = 0
    for layer, expert, part, shape in slices:
        dest = targets.view(layer, expert, part)
        nbytes = dest.numel() * entry.dtype.itemsize
        if dest.device.type == "cpu" and dest.dtype == entry.dtype and dest.is_contiguous():
            reader.read(entry, offset, dest)
        else:
            staged = torch.empty(shape, dtype=entry.dtype)
            reader.read(entry, offset, staged)
            dest.copy_(staged)
        offset += nbytes


def stream_checkpoint(
    path: Path,
    files: list[Path],
    model: nn.Module,
    adapter,
    store,
    device: torch.device,
    dtype_of,
    progress=None,
) -> tuple[StreamStats, list]:
    """Fill `model` (a skeleton: every parameter on the meta device) and `store` (None: the model's own
    expert parameters) from the checkpoint (module docstring). `dtype_of(name)` is the dtype the model
    keeps the parameter or buffer `name` in; `progress(nbytes)` is called as bytes arrive. Returns the
    statistics and the files' headers (the revision identity hashes them)."""
    threads = read_threads()
    headers, entries = index_files(files)
    renamings = model_renamings(model)
    wanted = set(meta_names(model))
    targets = _ExpertTargets(model, adapter, store, device)
    stats = StreamStats(files=len(files))
    reader = _Reader(progress)
    start = time.perf_counter()
    plan = []  # (entry, model name or None for expert slices, slices), in file order; checked first
    for entry in entries:
        name = model_name(entry.name, renamings)
        match = EXPERT_KEY.search(name)
        if match is not None:
            slices = targets.destinations(entry, match)
            for layer, expert, part, _ in slices:
                targets.mark(layer, expert, part)
            stats.expert_bytes += entry.nbytes
            plan.append((entry, None, slices))
        elif name in wanted:
            _check_shape(model, name, entry)
            plan.append((entry, name, None))
        else:
            stats.skipped_tensors.append(entry.name)
    try:
        window = READ_WINDOW_PER_THREAD * threads
        with ThreadPoolExecutor(threads, thread_name_prefix="moecache-read") as pool:
            pending = collections.deque()  # (future, model name or None, host bytes it holds)
            held = 0

            def place_oldest() -> None:
                nonlocal held
                future, name, nbytes = pending.popleft()
                result = future.result()
                del future
                if name is not None:  # the host copy is dropped once it is on the device
                    tensor = result.to(device=device, dtype=dtype_of(name))
                    materialize(model, name, tensor)
                    stats.device_bytes += tensor.numel() * tensor.element_size()
                    held -= nbytes

            for entry, name, slices in plan:
                # reads run ahead of placing by at most `window` jobs and READ_AHEAD_BYTES of host copies
                while pending and (
                    len(pending) >= window or (name is not None and held + entry.nbytes > READ_AHEAD_BYTES)
                ):
                    place_oldest()
                if name is None:
                    pending.append((pool.submit(_expert_job, reader, targets, entry, slices), None, 0))
                else:
                    pending.append((pool.submit(reader.tensor, entry), name, entry.nbytes))
                    held += entry.nbytes
            while pending:
                place_oldest()
    finally:
        reader.close()
    stats.bytes_read = reader.bytes_read
    stats.read_s = time.perf_counter() - start
    targets.check_complete(path)
    model.tie_weights()
    left = [n for n in meta_names(model) if not (store is not None and _is_expert_param(n))]
    if left:
        raise MoecacheError(
            f"model.path={path}: no tensor for {left[0]} in the checkpoint ({len(left)} missing in all)"
        )
    return stats, headers


def _check_shape(model: nn.Module, name: str, entry: TensorEntry) -> None:
    from moecache.models.skeleton import owner

    module, attr = owner(model, name)
    target = module._parameters.get(attr)
    if target is None:
        target = module._buffers.get(attr)
    if tuple(target.shape) != entry.shape:
        raise MoecacheError(
            f"{entry.file}: tensor {entry.name}: shape {list(entry.shape)}, the model's {name} has "
            f"{list(target.shape)}"
        )


def _is_expert_param(name: str) -> bool:
    return name.rpartition(".")[2] in ("gate_up_proj", "down_proj") and ".experts." in f".{name}"

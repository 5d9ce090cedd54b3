"""The expert store: one expert-major allocation, filled straight from a checkpoint's safetensors by
the streaming loader, pinned once (or refused / warned in one line where it cannot be).

Legend: G global keys, E experts, H hidden, I intermediate.
"""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from moecache.config import compose
from moecache.errors import MoecacheError
from moecache.models import build_tiny, load_model
from moecache.models.expert_store import PinWarning
from moecache.models.loading import OffloadRequest
from tests.runtime.helpers import random_store

NO_CUDA = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("out")
    cfg = compose(["model=tiny", f"output_root={root}"])
    folder = build_tiny(cfg.model, root)
    return folder, load_model(cfg.model, root, "cpu")


def test_layout_is_expert_major_views_of_one_allocation():
    store = random_store(L=2, E=3, H=8, inter=4)
    assert store.flat_GB.dtype == torch.uint8 and store.flat_GB.shape == (6, 3 * 8 * 4 * 4)
    assert store.w13_GIH.shape == (6, 8, 8) and store.w2_GHI.shape == (6, 8, 4)
    base = store.flat_GB.data_ptr()
    for g in range(6):  # row g: w13 then w2, inside row g of flat_GB
        assert store.w13_GIH[g].data_ptr() == base + g * store.expert_bytes
        assert store.w2_GHI[g].data_ptr() == base + g * store.expert_bytes + 2 * 4 * 8 * 4
        assert store.w13_GIH[g].is_contiguous() and store.w2_GHI[g].is_contiguous()


def _offloaded(folder, root, dtype="auto"):
    request = OffloadRequest(capacity=0, headroom=0, pin="off")
    return load_model({"path": str(folder), "dtype": dtype}, root, "cpu", offload=request)


def test_the_streamed_store_equals_the_loaded_model(tiny, tmp_path):
    folder, loaded = tiny
    store = _offloaded(folder, tmp_path).store
    adapter = loaded.adapter
    assert (store.num_layers, store.num_experts) == (adapter.num_layers, adapter.num_experts)
    assert (store.hidden_size, store.intermediate_size) == (
        adapter.hidden_size,
        adapter.moe_intermediate_size,
    )
    assert store.expert_bytes == adapter.expert_bytes and store.dtype == adapter.dtype
    E = store.num_experts
    for layer in range(store.num_layers):
        gate_up_EIH, down_EHI = adapter.expert_weights(layer)
        assert torch.equal(store.w13_GIH[layer * E : (layer + 1) * E], gate_up_EIH)
        assert torch.equal(store.w2_GHI[layer * E : (layer + 1) * E], down_EHI)


def test_the_streamed_store_converts_dtype(tiny, tmp_path):
    folder, loaded = tiny
    store = _offloaded(folder, tmp_path, "bfloat16").store
    gate_up_EIH, _ = loaded.adapter.expert_weights(0)
    assert store.dtype == torch.bfloat16 and store.expert_bytes == loaded.adapter.expert_params * 2
    assert torch.equal(store.w13_GIH[: store.num_experts], gate_up_EIH.to(torch.bfloat16))


def test_a_missing_expert_tensor_is_one_line(tiny, tmp_path):
    folder, _ = tiny
    broken = tmp_path / "ckpt"
    shutil.copytree(folder, broken)
    (weights,) = broken.glob("*.safetensors")
    tensors = load_file(weights)
    name = next(n for n in tensors if n.endswith("layers.1.mlp.experts.5.up_proj.weight"))
    del tensors[name]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(MoecacheError, match="no up weights for layer 1 expert 5") as info:
        _offloaded(broken, tmp_path)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(not NO_CUDA, reason="pinning works here")
def test_pin_without_cuda_warns_once_or_refuses_in_strict_mode():
    store = random_store()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert store.pin("auto") is False
    assert len(caught) == 1 and issubclass(caught[0].category, PinWarning)
    assert "cannot be pinned: CUDA is not available" in str(caught[0].message)
    with pytest.raises(MoecacheError, match="cannot be pinned.*pin=strict") as info:
        store.pin("strict")
    assert "\n" not in str(info.value)
    with pytest.raises(MoecacheError, match="pin='always'"):
        store.pin("always")


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA, reason="needs CUDA")
def test_pin_registers_the_exact_allocation_once():
    store = random_store(L=2, E=4, H=64, inter=32)
    assert store.pin("strict") is True and store.flat_GB.is_pinned()
    assert store.register_seconds is not None
    store.close()
    assert not store.pinned

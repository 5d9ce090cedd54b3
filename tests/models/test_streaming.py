"""The streaming loader: every tensor read once, to the model or the expert store, exactly as
`from_pretrained` would place it; damaged checkpoints refused in one line; host memory bounded.

Legend: E experts, H hidden, I intermediate.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from moecache.errors import MoecacheError
from moecache.models import ADAPTERS, build_byte_tokenizer, load_model
from moecache.models.loading import OffloadRequest
from moecache.models.memory_fit import fit_offload

ROOT = Path(__file__).resolve().parents[2]
MODEL_TYPES = ["qwen3_5_moe", "qwen3_moe", "deepseek_v2", "mixtral", "olmoe"]


def save_checkpoint(folder: Path, model_type: str, shard: str = "20KB", **overrides) -> Path:
    """A tiny random checkpoint of `model_type` written by `save_pretrained` in several shards."""
    config = ADAPTERS[model_type].tiny_config(**overrides)
    torch.manual_seed(0)
    model = getattr(transformers, config.architectures[0])(config)
    model.save_pretrained(folder, max_shard_size=shard)
    build_byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {t: save_checkpoint(root / t, t) for t in MODEL_TYPES}


def offload_request() -> OffloadRequest:
    return OffloadRequest(capacity=0, headroom=0, pin="off")


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tensors_land_as_from_pretrained_places_them(checkpoints, model_type, dtype, tmp_path):
    folder = checkpoints[model_type]
    assert len(list(folder.glob("*.safetensors"))) > 1
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).state_dict()
    dense = load_model({"path": str(folder), "dtype": dtype}, tmp_path, "cpu", progress=False)
    got = dense.model.state_dict()
    assert sorted(got) == sorted(reference)
    for name, tensor in reference.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name

    offloaded = load_model({"path": str(folder), "dtype": dtype}, tmp_path, "cpu", offload_request(), False)
    store, E = offloaded.store, offloaded.adapter.num_experts
    for layer in dense.adapter.moe_layers():
        gate_up_EIH, down_EHI = dense.adapter.expert_weights(layer.layer_id)
        rows = slice(layer.layer_id * E, (layer.layer_id + 1) * E)
        assert torch.equal(store.w13_GIH[rows], gate_up_EIH)
        assert torch.equal(store.w2_GHI[rows], down_EHI)
    assert store.dtype == gate_up_EIH.dtype
    skeleton = offloaded.model.state_dict()
    for name, tensor in reference.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert skeleton[name].device.type == "meta", name  # never materialised
        else:
            assert torch.equal(skeleton[name], tensor), name


def damaged(folder: Path, tmp_path: Path, change) -> tuple[Path, str]:
    """A copy of `folder` with one shard changed by `change(tensors) -> name of the tensor changed`."""
    copy = tmp_path / "damaged"
    shutil.copytree(folder, copy)
    for shard in sorted(copy.glob("*.safetensors")):  # the first shard holding such a tensor
        tensors = load_file(shard)
        try:
            change(tensors)
        except StopIteration:
            continue
        save_file(tensors, shard, metadata={"format": "pt"})
        return copy, shard.name
    raise AssertionError(f"no shard of {folder} has a tensor for {change.__name__}")


def _drop_norm(tensors: dict) -> str:
    name = next(n for n in tensors if n.endswith("layernorm.weight"))
    del tensors[name]
    return name.replace("model.language_model.", "model.")


def _transpose_attention(tensors: dict) -> str:
    name = next(n for n in tensors if n.endswith("proj.weight") and "experts" not in n and "gate" not in n)
    tensors[name] = tensors[name].t().contiguous()
    return name


def _transpose_expert(tensors: dict) -> str:
    name = next(n for n in tensors if ".experts." in n)
    tensors[name] = tensors[name].t().contiguous()
    return name


@pytest.mark.parametrize(
    "change, message",
    [
        (_drop_norm, "no tensor for {name}"),
        (_transpose_attention, "{name}: shape"),
        (_transpose_expert, "{name}: shape"),
    ],
)
@pytest.mark.parametrize("offloaded", [False, True])
def test_a_damaged_checkpoint_is_one_line_naming_file_and_tensor(
    checkpoints, tmp_path, change, message, offloaded
):
    name = {}

    def record(tensors):
        name["name"] = change(tensors)
        return name["name"]

    folder, shard = damaged(checkpoints["qwen3_moe"], tmp_path, record)
    with pytest.raises(MoecacheError) as info:
        load_model({"path": str(folder)}, tmp_path, "cpu", offload_request() if offloaded else None, False)
    text = str(info.value)
    assert "\n" not in text and message.format(name=name["name"]) in text
    if "shape" in message:
        assert shard in text


def test_a_truncated_shard_is_one_line_before_anything_is_read(checkpoints, tmp_path):
    copy = tmp_path / "cut"
    shutil.copytree(checkpoints["deepseek_v2"], copy)
    shard = sorted(copy.glob("*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(MoecacheError, match=rf"{shard.name}: truncated: tensor \S+ ends at byte") as info:
        load_model({"path": str(copy)}, tmp_path, "cpu", offload_request(), False)
    assert "\n" not in str(info.value)


def test_generate_refuses_a_truncated_checkpoint_with_exit_2_and_leaves_nothing(checkpoints, tmp_path):
    copy = tmp_path / "cut"
    shutil.copytree(checkpoints["qwen3_5_moe"], copy)
    shard = sorted(copy.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "moecache.cli", "generate", "model=tiny", f"model.path={copy}", "prompt=Hi",
         "capacity=25%", "generation.max_new_tokens=2", f"output_root={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and shard.name in lines[0] and "truncated" in lines[0], result.stderr
    assert not out.exists() or not any(out.rglob("*"))


def test_capacity_auto_and_what_cannot_fit(monkeypatch):
    from moecache.models import memory_fit

    gib = 1 << 30
    monkeypatch.setattr(memory_fit, "host_available", lambda: 64 * gib)
    monkeypatch.setattr(memory_fit, "device_free", lambda device: 20 * gib)
    cuda = torch.device("cuda", 0)
    kwargs = dict(num_keys=1000, expert_bytes=gib // 100, dense_bytes=4 * gib, device=cuda, headroom=3 * gib)
    fit = fit_offload("auto", **kwargs)
    assert fit.slots == 1000  # 13 GiB of room hold every 10 MiB expert
    fit = fit_offload("auto", **{**kwargs, "dense_bytes": 16 * gib})
    assert fit.slots == 100  # 1 GiB of room: 100 slots of gib // 100 bytes
    with pytest.raises(MoecacheError, match=r"capacity=50%: 500 slots need .* room for 100 .*capacity=auto"):
        fit_offload("50%", **{**kwargs, "dense_bytes": 16 * gib})
    with pytest.raises(MoecacheError, match=r"non-expert weights \(18.0 GiB\) \+ runtime.headroom"):
        fit_offload("auto", **{**kwargs, "dense_bytes": 18 * gib})
    with pytest.raises(
        MoecacheError, match=r"expert store needs 100.0 GiB of host memory .* 64.0 GiB available"
    ):
        fit_offload("auto", **{**kwargs, "num_keys": 10000})


RSS_SCRIPT = """
import json, sys
from moecache.models import load_model
from moecache.models.loading import OffloadRequest, describe_model

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

describe_model({"path": sys.argv[1]}, sys.argv[2])  # transformers' modeling code imported, a meta build
before = status("VmRSS:")
loaded = load_model({"path": sys.argv[1], "dtype": "bfloat16"}, sys.argv[2], "cpu", OffloadRequest(0, 0, "off"), False)
dense = sum(p.numel() * p.element_size() for p in loaded.model.parameters() if p.device.type != "meta")
print(json.dumps({"before": before, "peak": status("VmHWM:"), "store": loaded.store.nbytes, "dense": dense}))
"""


def test_peak_host_memory_of_an_offloaded_load_is_the_store_plus_the_rest(tmp_path):
    folder = save_checkpoint(
        tmp_path / "big", "deepseek_v2", shard="64MB", hidden_size=512, moe_intermediate_size=512,
        n_routed_experts=32, num_hidden_layers=4, vocab_size=32768,
    )  # fmt: skip
    files = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    result = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(folder), str(tmp_path / "out")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    m = json.loads(result.stdout.splitlines()[-1])
    # a float32 checkpoint loaded in bfloat16: every tensor goes through a host copy of its own dtype,
    # which must be dropped once placed (the float32 copies of the non-expert weights alone, 2 x dense,
    # exceed the margin)
    assert (
        m["store"] > 120e6
        and 2 * m["dense"] > (64 << 20)
        and m["store"] + m["dense"] <= files // 2 + (1 << 20)
    )
    margin = 96 << 20  # buffers, the thread pool, the reads in flight, first-call allocations
    assert m["peak"] - m["before"] <= m["store"] + m["dense"] + margin, m


def test_every_entry_point_refuses_a_truncated_checkpoint_in_one_line(checkpoints, tmp_path):
    """moecache.offload(path) and the stages that load a model (collect here) give the loader's line."""
    import moecache

    copy = tmp_path / "cut"
    shutil.copytree(checkpoints["qwen3_5_moe"], copy)
    shard = sorted(copy.glob("*.safetensors"))[2]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(MoecacheError, match=rf"{shard.name}: truncated") as info:
        moecache.offload(copy, capacity="25%", device="cpu", output_root=tmp_path / "out")
    assert "\n" not in str(info.value)
    result = subprocess.run(
        [sys.executable, "-m", "moecache.cli", "collect", "model=tiny", f"model.path={copy}",
         "workload.num_requests=1", "generation.max_new_tokens=2", f"output_root={tmp_path / 'out'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and f"{shard.name}: truncated" in lines[0], (
        result.stderr
    )


@pytest.mark.parametrize("threads", ["1", "3", "8"])
def test_any_number_of_reading_threads_fills_the_store_alike(checkpoints, tmp_path, monkeypatch, threads):
    folder = checkpoints["qwen3_moe"]
    default = load_model({"path": str(folder)}, tmp_path, "cpu", offload_request(), False).store
    monkeypatch.setenv("MOECACHE_READ_THREADS", threads)
    store = load_model({"path": str(folder)}, tmp_path, "cpu", offload_request(), False).store
    assert torch.equal(store.w13_GIH, default.w13_GIH) and torch.equal(store.w2_GHI, default.w2_GHI)


@pytest.mark.parametrize("value", ["0", "-2", "2.5", "many", ""])
def test_a_bad_reading_thread_count_is_refused_in_one_line(checkpoints, tmp_path, monkeypatch, value):
    monkeypatch.setenv("MOECACHE_READ_THREADS", value)
    with pytest.raises(MoecacheError, match=r"^\$MOECACHE_READ_THREADS=.*: expected a whole number >= 1$"):
        load_model({"path": str(checkpoints["qwen3_moe"])}, tmp_path, "cpu", offload_request(), False)

"""slot_moe (the Triton kernel) against slot_moe_reference, on the CPU under Triton's interpreter and on
CUDA at real shapes; plus its launch-config loader, its device-side sort, and ONNX Runtime's MoE."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from moecache_kernels import slot_moe_reference
from moecache_kernels.slot_moe_align import align_by_expert
from moecache_kernels.slot_moe_config import DECODE_MAX_T, default_config, get_config, load_configs
from slot_moe_cases import PATTERNS, make_case

HERE = Path(__file__).resolve().parent
ARGS = ("x_TH", "topk_ids_TK", "topk_weights_TK", "slot_of_E", "w13_SIH", "w2_SHI")
SEED = random.SystemRandom().randrange(2**31)  # fresh inputs each run; printed on failure
CUDA = torch.cuda.is_available()

# CPU: tiny shapes (the interpreter is slow); I = 40 is not a multiple of any block, T = 5, 37, 100 are not
# multiples of BLOCK_I/BLOCK_M. (T, dtype, patterns): decode at T <= 16, prefill above.
SMALL = {"hidden": 64, "inter": 40, "num_experts": 8, "top_k": 3, "num_slots": 6}
CPU_CASES = [(t, torch.float32, p) for t in (1, 5, 16, 17, 37) for p in PATTERNS] + [
    (5, torch.bfloat16, "some"),
    (37, torch.bfloat16, "all"),
    (100, torch.float32, "some"),
]


def _tolerance(dtype: torch.dtype) -> dict:
    return {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


def _assert_matches(got: torch.Tensor, case: dict, what: str) -> None:
    want = slot_moe_reference(*(case[name] for name in ARGS))
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert not got.isnan().any(), f"{what}: NaN left in the output (poisoned rows not written), seed {SEED}"
    tol = _tolerance(want.dtype)
    scale = float(want.float().abs().max()) or 1.0
    torch.testing.assert_close(
        got.float(),
        want.float(),
        rtol=tol["rtol"],
        atol=tol["atol"] * scale,
        msg=lambda m: f"{what}, seed {SEED}: {m}",
    )


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> list[tuple[dict, tuple[torch.Tensor, torch.Tensor]]]:
    """Every CPU case, run by slot_moe under TRITON_INTERPRET=1 in one subprocess."""
    cases = [
        make_case(t, **SMALL, pattern=p, dtype=d, seed=SEED + i) for i, (t, d, p) in enumerate(CPU_CASES)
    ]
    folder = tmp_path_factory.mktemp("slot_moe")
    torch.save(cases, folder / "cases.pt")
    run = subprocess.run(
        [sys.executable, str(HERE / "interpret_slot_moe.py"), str(folder / "cases.pt"), str(folder / "out.pt")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, f"interpreted slot_moe failed:\n{run.stderr[-4000:]}"
    return list(zip(cases, torch.load(folder / "out.pt"), strict=True))


@pytest.mark.parametrize(
    "index", range(len(CPU_CASES)), ids=[f"T{t}-{str(d)[6:]}-{p}" for t, d, p in CPU_CASES]
)
def test_interpreted_kernel_matches_reference(interpreted, index: int) -> None:
    case, (into_out, returned) = interpreted[index]
    _assert_matches(into_out, case, f"case {CPU_CASES[index]} with out=")
    _assert_matches(returned, case, f"case {CPU_CASES[index]} without out=")


def test_none_resident_gives_exact_zeros(interpreted) -> None:
    for (t, _, pattern), (_, (into_out, _)) in zip(CPU_CASES, interpreted, strict=True):
        if pattern == "none":
            assert torch.equal(into_out, torch.zeros_like(into_out)), f"T={t}"


# -- the device-side sort of the prefill path (torch only) ------------------------------------------------


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_by_expert_covers_each_resident_pair_once(pattern: str, block_m: int) -> None:
    case = make_case(23, **SMALL, pattern=pattern, dtype=torch.float32, seed=SEED)
    ids_TK, slot_of_E = case["topk_ids_TK"], case["slot_of_E"]
    num_pairs = ids_TK.numel()
    pair_of_row, slot_of_block = align_by_expert(ids_TK, slot_of_E, case["w13_SIH"].shape[0], block_m)
    assert pair_of_row.shape[0] == slot_of_block.shape[0] * block_m
    resident_P = slot_of_E[ids_TK.reshape(-1)] >= 0
    real = pair_of_row[pair_of_row < num_pairs]
    assert sorted(real.tolist()) == torch.nonzero(resident_P).flatten().tolist(), f"seed {SEED}"
    rows_B = pair_of_row.view(-1, block_m)
    for block, slot in enumerate(slot_of_block.tolist()):
        pairs = rows_B[block][rows_B[block] < num_pairs]
        if slot < 0:
            assert pairs.numel() == 0, f"block {block} of a non-resident/past-the-end run holds pairs"
        else:
            assert pairs.numel() > 0, f"block {block} has slot {slot} but no pairs"
            assert (slot_of_E[ids_TK.reshape(-1)[pairs.long()]] == slot).all(), f"block {block} mixes experts"


# -- launch configurations as data ---------------------------------------------------------------------


def _write(folder: Path, table: dict) -> Path:
    name = "E=8,N=40,device_name=Test_GPU,dtype=float32.json"
    (folder / name).write_text(json.dumps(table))
    load_configs.cache_clear()
    get_config.cache_clear()
    return folder


def test_config_uses_the_nearest_token_count_of_the_same_path(tmp_path) -> None:
    decode = default_config(1) | {"gate_up": {"BLOCK_I": 32, "BLOCK_H": 128, "num_warps": 2}}
    prefill = default_config(512) | {"BLOCK_M": 128}
    folder = _write(tmp_path, {"1": decode, "512": prefill})
    assert get_config(4, 8, 40, torch.float32, "Test_GPU", folder) == decode
    assert get_config(DECODE_MAX_T + 1, 8, 40, torch.float32, "Test_GPU", folder) == prefill
    assert get_config(4, 8, 40, torch.float32, "Other_GPU", folder) == default_config(4)


def test_config_file_with_a_bad_value_is_refused_by_name(tmp_path) -> None:
    bad = default_config(1)
    bad["down"]["BLOCK_H"] = 24
    folder = _write(tmp_path, {"1": bad})
    with pytest.raises(ValueError, match=r"device_name=Test_GPU.*\[1\]\.down\.BLOCK_H.*power of two"):
        get_config(1, 8, 40, torch.float32, "Test_GPU", folder)


def test_shipped_configs_are_valid() -> None:
    from moecache_kernels.slot_moe_config import CONFIG_DIR

    for path in CONFIG_DIR.glob("*.json"):
        assert load_configs(path), path


# -- bad input -------------------------------------------------------------------------------------------


def test_shapes_that_disagree_are_refused() -> None:
    from moecache_kernels.slot_moe import slot_moe

    case = make_case(2, **SMALL, pattern="all", dtype=torch.float32, seed=SEED)
    case["w2_SHI"] = case["w2_SHI"][:, :, :-1]
    with pytest.raises(ValueError, match="w2"):
        slot_moe(*(case[name] for name in ARGS))


# -- ONNX Runtime's MoE contrib operator as a second oracle (all resident) ---------------------------------


def _onnxruntime_moe(case: dict) -> torch.Tensor:
    """ORT's com.microsoft MoE, float32, SwiGLU with interleaved gate/up rows (swiglu_fusion=1), alpha 1
    and beta 0 (= SiLU(gate) * up), routing given as logits whose softmax top-k is the case's routing."""
    ort = pytest.importorskip(
        "onnxruntime", reason="onnxruntime is not installed here (the H200 image has it)"
    )
    from onnx import TensorProto, helper, numpy_helper

    x_TH, ids_TK, w_TK = (
        case["x_TH"].float().cpu(),
        case["topk_ids_TK"].cpu(),
        case["topk_weights_TK"].float().cpu(),
    )
    slot_of_E = case["slot_of_E"].long().cpu()
    num_tokens, hidden = x_TH.shape
    num_experts, top_k = slot_of_E.shape[0], ids_TK.shape[1]
    w13 = case["w13_SIH"].float().cpu()[slot_of_E]  # [E, 2I, H] in expert order
    inter = w13.shape[1] // 2
    fc1 = torch.stack([w13[:, :inter], w13[:, inter:]], dim=2).reshape(num_experts, 2 * inter, hidden)
    fc2 = case["w2_SHI"].float().cpu()[slot_of_E]
    logits_TE = torch.full((num_tokens, num_experts), -1e4)
    logits_TE.scatter_(1, ids_TK.long(), (w_TK / w_TK.sum(-1, keepdim=True)).log())
    node = helper.make_node(
        "MoE", ["input", "router_probs", "fc1", "fc1_bias", "fc2", "fc2_bias"], ["output"], domain="com.microsoft",
        k=top_k, normalize_routing_weights=1, activation_type="swiglu", swiglu_fusion=1,
        activation_alpha=1.0, activation_beta=0.0, swiglu_limit=1e30,
    )  # fmt: skip
    inits = [
        numpy_helper.from_array(fc1.numpy(), "fc1"),
        numpy_helper.from_array(torch.zeros(num_experts, 2 * inter).numpy(), "fc1_bias"),
        numpy_helper.from_array(fc2.numpy(), "fc2"),
        numpy_helper.from_array(torch.zeros(num_experts, hidden).numpy(), "fc2_bias"),
    ]
    graph = helper.make_graph(
        [node], "moe",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [num_tokens, hidden]),
         helper.make_tensor_value_info("router_probs", TensorProto.FLOAT, [num_tokens, num_experts])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [num_tokens, hidden])], inits,
    )  # fmt: skip
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10  # onnx 1.23 writes IR 14; onnxruntime 1.30 reads up to 13
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {"input": x_TH.numpy(), "router_probs": logits_TE.numpy()})
    return torch.from_numpy(out)


@pytest.mark.parametrize("num_tokens", [3, 40])
def test_reference_matches_onnxruntime_moe(num_tokens: int) -> None:
    case = make_case(num_tokens, **SMALL, pattern="all", dtype=torch.float32, seed=SEED)
    case["topk_weights_TK"] /= case["topk_weights_TK"].sum(-1, keepdim=True)
    got = slot_moe_reference(*(case[name] for name in ARGS))
    torch.testing.assert_close(got, _onnxruntime_moe(case), rtol=1e-3, atol=1e-3)


# -- CUDA at real shapes -----------------------------------------------------------------------------------

QWEN36 = {"hidden": 2048, "inter": 512, "num_experts": 256, "top_k": 8, "num_slots": 64}
DSV2 = {"hidden": 2048, "inter": 1408, "num_experts": 64, "top_k": 6, "num_slots": 32}
GPU_T = [1, 5, 16, 17, 600]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("shape", [QWEN36, DSV2], ids=["qwen3.6", "dsv2-lite"])
@pytest.mark.parametrize("num_tokens", GPU_T)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_cuda_kernel_matches_reference(shape: dict, num_tokens: int, pattern: str) -> None:
    from moecache_kernels.slot_moe import slot_moe

    case = make_case(num_tokens, **shape, pattern=pattern, dtype=torch.bfloat16, seed=SEED, device="cuda")
    out = torch.full_like(case["x_TH"], float("nan"))
    assert slot_moe(*(case[name] for name in ARGS), out=out) is out
    _assert_matches(out, case, f"T={num_tokens} {pattern}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_cuda_kernel_replays_in_a_graph(num_tokens: int) -> None:
    """No host sync: the call captures into a CUDA graph, and replays with new routing copied in."""
    from moecache_kernels.slot_moe import slot_moe

    first = make_case(num_tokens, **QWEN36, pattern="some", dtype=torch.bfloat16, seed=SEED, device="cuda")
    static = {name: first[name].clone() for name in ARGS}
    out = torch.empty_like(static["x_TH"])
    slot_moe(*(static[name] for name in ARGS), out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        slot_moe(*(static[name] for name in ARGS), out=out)
    second = make_case(
        num_tokens, **QWEN36, pattern="some", dtype=torch.bfloat16, seed=SEED + 1, device="cuda"
    )
    for name in ("x_TH", "topk_ids_TK", "topk_weights_TK", "slot_of_E"):
        static[name].copy_(second[name])
    out.fill_(float("nan"))
    graph.replay()
    _assert_matches(out, static, f"graph replay T={num_tokens}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_kernel_matches_onnxruntime_moe() -> None:
    from moecache_kernels.slot_moe import slot_moe

    case = make_case(33, **SMALL, pattern="all", dtype=torch.float32, seed=SEED)
    case["topk_weights_TK"] /= case["topk_weights_TK"].sum(-1, keepdim=True)
    want = _onnxruntime_moe(case)
    got = slot_moe(*(case[name].cuda() for name in ARGS)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)

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
from moecache_kernels.slot_moe_config import (
    DECODE_MAX_T,
    DECODE_VARIANTS,
    default_config,
    get_config,
    load_configs,
    validate_entry,
)
from slot_moe_cases import PATTERNS, make_case, out_of_range_case

HERE = Path(__file__).resolve().parent
ARGS = ("x_TH", "topk_ids_TK", "topk_weights_TK", "slot_of_E", "w13_SIH", "w2_SHI")
SEED = random.SystemRandom().randrange(2**31)  # fresh inputs each run; printed on failure
CUDA = torch.cuda.is_available()

# CPU: tiny shapes (the interpreter is slow); I = 40 is not a multiple of any block, T = 5, 37, 100 are not
# multiples of BLOCK_I/BLOCK_M. (T, dtype, pattern, config): decode at T <= 16, prefill above; config None =
# what get_config picks (the two-stage decode on the CPU), "fused" = FUSED_CPU.
SMALL = {"hidden": 64, "inter": 40, "num_experts": 8, "top_k": 3, "num_slots": 6}
# The fused decode with blocks that cut every dimension unevenly: 2 blocks of I (40 = 32 + 8), 2 of H for
# gate/up, 4 of H for down, and a token's K * 2 = 6 partial rows summed in tiles of 4.
FUSED_CPU = {
    "variant": "fused",
    "fused": {"BLOCK_I": 32, "BLOCK_H": 32, "BLOCK_HD": 16, "num_warps": 4},
    "reduce": {"BLOCK_R": 4, "BLOCK_H": 32, "num_warps": 4},
}
# The "pdl" decode in the interpreter (its kernels one after the other, no early launch): 3 blocks of H
# for gate/up's 64 (BLOCK_H 32 would be 2), 4 programs of 16 rows of H for down, its tile [4, 16, 64]
# holding K = 3 experts' rows of I = 40 (padding masked on both).
PDL_CPU = {
    "variant": "pdl",
    "gate_up": {"BLOCK_I": 16, "BLOCK_H": 32, "num_warps": 4},
    "down": {"BLOCK_H": 16, "num_warps": 4},
}
CPU_CASES = (
    [(t, torch.float32, p, None) for t in (1, 5, 16, 17, 37) for p in PATTERNS]
    + [
        (5, torch.bfloat16, "some", None),
        (37, torch.bfloat16, "all", None),
        (100, torch.float32, "some", None),
    ]
    + [(5, torch.float32, p, "fused") for p in PATTERNS]
    + [(1, torch.float32, "some", "fused"), (16, torch.float32, "all", "fused")]
    + [(5, torch.bfloat16, "some", "fused")]
    + [(5, torch.float32, p, "pdl") for p in PATTERNS]
    + [
        (1, torch.float32, "some", "pdl"),
        (16, torch.float32, "all", "pdl"),
        (5, torch.bfloat16, "some", "pdl"),
    ]
)
# ids -1 and E and a slot S count as not resident: (T, config), run on out_of_range_case
OUT_OF_RANGE_CASES = [(5, None), (5, "fused"), (5, "pdl")]
CONFIGS = {None: None, "fused": FUSED_CPU, "pdl": PDL_CPU}


def _tolerance(dtype: torch.dtype) -> dict:
    return {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


def _cuda_run_matches(num_tokens: int, shape: dict, pattern: str, what: str) -> None:
    """slot_moe on CUDA (output poisoned, `out=` honoured) against the reference, one drawn case."""
    from moecache_kernels.slot_moe import slot_moe

    case = make_case(num_tokens, **shape, pattern=pattern, dtype=torch.bfloat16, seed=SEED, device="cuda")
    out = torch.full_like(case["x_TH"], float("nan"))
    assert slot_moe(*(case[name] for name in ARGS), out=out) is out
    _assert_matches(out, case, what)


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
def interpreted(tmp_path_factory) -> dict:
    """Every CPU case (CPU_CASES, then OUT_OF_RANGE_CASES), run by slot_moe under TRITON_INTERPRET=1 in
    one subprocess: {"cases": [(case, (out=, returned))], "out_of_range": [(meant case, (out=, returned))]}."""
    cases = [
        make_case(t, **SMALL, pattern=p, dtype=d, seed=SEED + i) | {"config": CONFIGS[c]}
        for i, (t, d, p, c) in enumerate(CPU_CASES)
    ]
    pairs = [
        out_of_range_case(t, **SMALL, dtype=torch.float32, seed=SEED - i)
        for i, (t, _) in enumerate(OUT_OF_RANGE_CASES)
    ]
    odd = [case | {"config": CONFIGS[c]} for (case, _), (_, c) in zip(pairs, OUT_OF_RANGE_CASES, strict=True)]
    folder = tmp_path_factory.mktemp("slot_moe")
    torch.save(cases + odd, folder / "cases.pt")
    run = subprocess.run(
        [sys.executable, str(HERE / "interpret_slot_moe.py"), str(folder / "cases.pt"), str(folder / "out.pt")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, f"interpreted slot_moe failed:\n{run.stderr[-4000:]}"
    outputs = torch.load(folder / "out.pt")
    return {
        "cases": list(zip(cases, outputs[: len(cases)], strict=True)),
        "out_of_range": list(zip([meant for _, meant in pairs], outputs[len(cases) :], strict=True)),
    }


def _case_id(t: int, dtype: torch.dtype, pattern: str, config: str | None) -> str:
    return f"T{t}-{str(dtype)[6:]}-{pattern}" + (f"-{config}" if config else "")


@pytest.mark.parametrize("index", range(len(CPU_CASES)), ids=[_case_id(*c) for c in CPU_CASES])
def test_interpreted_kernel_matches_reference(interpreted, index: int) -> None:
    case, (into_out, returned) = interpreted["cases"][index]
    _assert_matches(into_out, case, f"case {CPU_CASES[index]} with out=")
    _assert_matches(returned, case, f"case {CPU_CASES[index]} without out=")


def test_none_resident_gives_exact_zeros(interpreted) -> None:
    for (t, _, pattern, config), (_, (into_out, _)) in zip(CPU_CASES, interpreted["cases"], strict=True):
        if pattern == "none":
            assert torch.equal(into_out, torch.zeros_like(into_out)), f"T={t} config {config}"


def test_interpreted_runs_are_bit_identical(interpreted) -> None:
    """The two runs of each case (into a poisoned out=, into a fresh buffer) agree to the bit."""
    for spec, (_, (into_out, returned)) in zip(CPU_CASES, interpreted["cases"], strict=True):
        assert torch.equal(into_out, returned), f"case {spec}: two runs differ"


@pytest.mark.parametrize(
    "index", range(len(OUT_OF_RANGE_CASES)), ids=[f"T{t}-{c or 'picked'}" for t, c in OUT_OF_RANGE_CASES]
)
def test_interpreted_ids_and_slots_out_of_range_add_nothing(interpreted, index: int) -> None:
    meant, (into_out, returned) = interpreted["out_of_range"][index]
    _assert_matches(into_out, meant, f"out-of-range case {OUT_OF_RANGE_CASES[index]} with out=")
    _assert_matches(returned, meant, f"out-of-range case {OUT_OF_RANGE_CASES[index]} without out=")


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


def test_config_picks_a_fused_decode_entry(tmp_path) -> None:
    fused = default_config(1, "fused") | {"reduce": {"BLOCK_R": 64, "BLOCK_H": 16, "num_warps": 2}}
    folder = _write(tmp_path, {"1": fused, "16": default_config(16)})
    assert get_config(2, 8, 40, torch.float32, "Test_GPU", folder) == fused
    assert get_config(12, 8, 40, torch.float32, "Test_GPU", folder) == default_config(16)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            default_config(4) | {"variant": "unrolled"},
            r"\[4\]\.variant: want one of \['fused', 'pdl', 'two_stage'\], got 'unrolled'",
        ),
        (default_config(4) | {"variant": "fused"}, r"\[4\]\.fused: want an object"),
        (
            {"variant": "fused", "fused": default_config(4, "fused")["fused"]},
            r"\[4\]\.reduce: want an object",
        ),
        (
            default_config(4, "fused") | {"reduce": {"BLOCK_R": 24, "BLOCK_H": 32, "num_warps": 4}},
            r"\[4\]\.reduce\.BLOCK_R.*power of two",
        ),
        (
            default_config(4, "fused") | {"fused": {"BLOCK_I": 16, "BLOCK_H": 256, "num_warps": 8}},
            r"\[4\]\.fused\.BLOCK_HD.*None",
        ),
        (default_config(64) | {"variant": "fused"}, r"\[4\]\.variant: only decode entries"),
    ],
    ids=[
        "unknown-variant",
        "fused-without-its-stages",
        "no-reduce",
        "block-not-power-of-two",
        "missing-key",
        "prefill-variant",
    ],
)
def test_config_with_a_bad_decode_variant_is_refused_naming_file_and_T(
    tmp_path, entry: dict, message: str
) -> None:
    folder = _write(tmp_path, {"4": entry})
    with pytest.raises(ValueError, match=r"E=8,N=40,device_name=Test_GPU,dtype=float32\.json" + message):
        get_config(4, 8, 40, torch.float32, "Test_GPU", folder)


@pytest.mark.parametrize("variant", sorted(DECODE_VARIANTS))
@pytest.mark.parametrize("num_tokens", [1, DECODE_MAX_T, DECODE_MAX_T + 1])
def test_default_configs_are_valid_entries(variant: str, num_tokens: int) -> None:
    entry = default_config(num_tokens, variant)
    assert validate_entry(entry, "default") is entry
    assert ("BLOCK_M" in entry) == (num_tokens > DECODE_MAX_T)
    if num_tokens <= DECODE_MAX_T:
        assert set(entry) - {"variant"} == set(DECODE_VARIANTS[variant]), entry


def test_default_decode_variant_is_two_stage_and_unknown_ones_are_refused() -> None:
    from moecache_kernels.slot_moe_config import decode_variant

    assert decode_variant(default_config(1)) == "two_stage"
    assert decode_variant(default_config(1, "fused")) == "fused"
    with pytest.raises(ValueError, match="variant must be one of .*'unrolled'"):
        default_config(1, "unrolled")


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
QWEN3_30B = {"hidden": 2048, "inter": 768, "num_experts": 128, "top_k": 8, "num_slots": 64}
DSV2 = {"hidden": 2048, "inter": 1408, "num_experts": 64, "top_k": 6, "num_slots": 32}
LARGE = {"hidden": 4096, "inter": 1536, "num_experts": 128, "top_k": 8, "num_slots": 32}
GPU_T = [1, 5, 16, 17, 600]
GPU_DECODE_T = [1, 5, 16]
# the fused decode's default and a config with other blocks (16 rows of I, 128-wide gate/up tiles, 64-row
# down tiles, the reduce in 16 x 64 tiles)
FUSED_GPU = {
    "default": default_config(1, "fused"),
    "other": {
        "variant": "fused",
        "fused": {"BLOCK_I": 16, "BLOCK_H": 128, "BLOCK_HD": 64, "num_warps": 8},
        "reduce": {"BLOCK_R": 16, "BLOCK_H": 64, "num_warps": 4},
    },
}
PINNED = {
    "picked": None, "two_stage": default_config(1), "fused": FUSED_GPU["default"], "pdl": default_config(1, "pdl")
}  # fmt: skip


def _pin_config(monkeypatch, config: dict | str) -> None:
    """slot_moe runs `config` (or PINNED[config]) instead of what get_config picks ("picked": as picked)."""
    import importlib

    config = PINNED[config] if isinstance(config, str) else config
    if config is not None:
        kernel = importlib.import_module("moecache_kernels.slot_moe")
        monkeypatch.setattr(kernel, "get_config", lambda *_: config)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("shape", [QWEN36, DSV2], ids=["qwen3.6", "dsv2-lite"])
@pytest.mark.parametrize("num_tokens", GPU_T)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_cuda_kernel_matches_reference(shape: dict, num_tokens: int, pattern: str) -> None:
    _cuda_run_matches(num_tokens, shape, pattern, f"T={num_tokens} {pattern}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("config", sorted(FUSED_GPU))
@pytest.mark.parametrize(
    "shape", [QWEN36, QWEN3_30B, DSV2, LARGE], ids=["qwen3.6", "qwen3-30b", "dsv2-lite", "large"]
)
@pytest.mark.parametrize("num_tokens", GPU_DECODE_T)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_cuda_fused_decode_matches_reference(
    monkeypatch, shape: dict, num_tokens: int, pattern: str, config: str
) -> None:
    _pin_config(monkeypatch, FUSED_GPU[config])
    _cuda_run_matches(num_tokens, shape, pattern, f"fused {config} T={num_tokens} {pattern}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize(
    "shape", [QWEN36, QWEN3_30B, DSV2, LARGE], ids=["qwen3.6", "qwen3-30b", "dsv2-lite", "large"]
)
@pytest.mark.parametrize("num_tokens", GPU_DECODE_T)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_cuda_pdl_decode_matches_reference(monkeypatch, shape: dict, num_tokens: int, pattern: str) -> None:
    """The down launch started early (programmatic dependent launch) waits for gate/up's activations."""
    _pin_config(monkeypatch, "pdl")
    _cuda_run_matches(num_tokens, shape, pattern, f"pdl T={num_tokens} {pattern}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("variant", ["two_stage", "fused", "pdl"])
def test_cuda_ids_and_slots_out_of_range_add_nothing(monkeypatch, variant: str) -> None:
    from moecache_kernels.slot_moe import slot_moe

    _pin_config(monkeypatch, variant)
    case, meant = out_of_range_case(5, **QWEN36, dtype=torch.bfloat16, seed=SEED, device="cuda")
    out = torch.full_like(case["x_TH"], float("nan"))
    slot_moe(*(case[name] for name in ARGS), out=out)
    _assert_matches(out, meant, f"{variant}: ids -1 / E and slot S")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("variant", ["two_stage", "fused", "pdl"])
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_cuda_decode_is_bit_identical_run_to_run(monkeypatch, variant: str, num_tokens: int) -> None:
    """Many programs add into each output element; their order must not depend on scheduling."""
    from moecache_kernels.slot_moe import slot_moe

    _pin_config(monkeypatch, variant)
    case = make_case(num_tokens, **QWEN36, pattern="all", dtype=torch.bfloat16, seed=SEED, device="cuda")
    args = [case[name] for name in ARGS]
    first = slot_moe(*args)
    for run in range(20):
        assert torch.equal(slot_moe(*args), first), (
            f"{variant} T={num_tokens}: run {run + 1} differs, seed {SEED}"
        )


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize(
    ("num_tokens", "variant"),
    [(1, "picked"), (64, "picked"), (1, "two_stage"), (1, "fused"), (16, "fused"), (1, "pdl"), (16, "pdl")],
)
def test_cuda_kernel_replays_in_a_graph(monkeypatch, num_tokens: int, variant: str) -> None:
    """No host sync: the call captures into a CUDA graph, and replays with new routing copied in."""
    from moecache_kernels.slot_moe import slot_moe

    _pin_config(monkeypatch, variant)
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
    _assert_matches(out, static, f"graph replay T={num_tokens} {variant}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_kernel_matches_onnxruntime_moe() -> None:
    from moecache_kernels.slot_moe import slot_moe

    case = make_case(33, **SMALL, pattern="all", dtype=torch.float32, seed=SEED)
    case["topk_weights_TK"] /= case["topk_weights_TK"].sum(-1, keepdim=True)
    want = _onnxruntime_moe(case)
    got = slot_moe(*(case[name].cuda() for name in ARGS)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)

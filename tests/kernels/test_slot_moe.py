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
    DECODE_KEYS,
    DECODE_MAX_T,
    default_config,
    get_config,
    load_configs,
    validate_entry,
)

from tests.kernels.interpreted import run_interpreted
from tests.kernels.slot_moe_cases import PATTERNS, make_case, out_of_range_case

HERE = Path(__file__).resolve().parent
ARGS = ("x_TH", "topk_ids_TK", "topk_weights_TK", "slot_of_E", "w13_SIH", "w2_SHI")
SEED = random.SystemRandom().randrange(2**31)  # fresh inputs each run; printed on failure
CUDA = torch.cuda.is_available()

# CPU: tiny shapes (the interpreter is slow); I = 40 is not a multiple of any block, T = 5, 37, 100 are not
# multiples of BLOCK_I/BLOCK_M. (T, dtype, pattern, config): decode at T <= 16, prefill above; config None =
# what get_config picks (default_config on the CPU), else CONFIGS[config], pinned in the subprocess.
SMALL = {"hidden": 64, "inter": 40, "num_experts": 8, "top_k": 3, "num_slots": 6}
# The decode with blocks that cut every dimension unevenly: gate/up 3 blocks of I (40 = 16 + 16 + 8) and 2
# steps of H, down 4 blocks of H and 3 steps of I (the last 8 wide).
TWO_STAGE_CPU = {
    "gate_up": {"BLOCK_I": 16, "BLOCK_H": 32, "num_warps": 4},
    "down": {"BLOCK_H": 16, "BLOCK_I": 16, "num_warps": 4},
}
# The prefill path's layouts and TMA (kernels/moecache_kernels/slot_moe_config.py), pinned like TWO_STAGE_CPU. Blocks
# that cut every dimension unevenly: gate/up BLOCK_N 16 over I = 40 (the last block 8 wide, its boxes past
# row I), down BLOCK_N 32 over H = 64 and BLOCK_K 16 over I = 40 (a tail step); BLOCK_M 16, so an expert's
# run spans several blocks at T = 100 or with one expert chosen by every token. "sorted_tma" also reads
# gate/up in one BLOCK_K 128 step past H = 64 (zeros from the descriptor's bounds) with BLOCK_M 32.
PREFILL_CPU = {
    "BLOCK_M": 16,
    "gate_up": {"BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 2, "num_warps": 4, "num_stages": 2},
    "down": {"BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 1, "num_warps": 4, "num_stages": 2},
}
PREFILL_CPU_CONFIGS = {
    "sorted": PREFILL_CPU | {"layout": "sorted"},
    "sorted_tma": PREFILL_CPU
    | {"BLOCK_M": 32, "layout": "sorted", "tma": True}
    | {"gate_up": PREFILL_CPU["gate_up"] | {"BLOCK_K": 128}},
    "pairs_tma": PREFILL_CPU | {"tma": True},
}
CPU_CASES = (
    [(t, torch.float32, p, None) for t in (1, 5, 16, 17, 37) for p in PATTERNS]
    + [
        (5, torch.bfloat16, "some", None),
        (37, torch.bfloat16, "all", None),
        (100, torch.float32, "some", None),
    ]
    + [(5, torch.float32, p, "two_stage") for p in PATTERNS]
    + [(16, torch.float32, "all", "two_stage"), (5, torch.bfloat16, "some", "two_stage")]
    + [(5, torch.float32, p, "decode_pairs") for p in PATTERNS]
    + [(16, torch.float32, "all", "decode_pairs"), (5, torch.bfloat16, "some", "decode_pairs")]
    + [(37, torch.float32, p, c) for c in ("sorted", "sorted_tma") for p in PATTERNS]
    + [
        (17, torch.float32, "all", "sorted"),
        (100, torch.float32, "some", "sorted"),
        (100, torch.float32, "one_expert", "sorted_tma"),
        (37, torch.bfloat16, "some", "sorted"),
        (37, torch.bfloat16, "all", "sorted_tma"),
        (37, torch.float32, "some", "pairs_tma"),
        (37, torch.bfloat16, "one_expert", "pairs_tma"),
    ]
)
# ids -1 and E and a slot S count as not resident: (T, config), run on out_of_range_case
OUT_OF_RANGE_CASES = [
    (5, None), (5, "two_stage"), (5, "decode_pairs"), (37, None), (37, "sorted"), (37, "sorted_tma"),
]  # fmt: skip
CONFIGS = {
    None: None, "two_stage": TWO_STAGE_CPU, "decode_pairs": TWO_STAGE_CPU | {"variant": "pairs"},
} | PREFILL_CPU_CONFIGS  # fmt: skip
# bf16 inputs into a float32 `out=` (the runtime's one-rounding combine): every path's last store, (T, config)
# (T, config, router weights' dtype): bf16 weights round each weighted product, float32 ones do not
F32_OUT_CASES = [
    (5, None, torch.bfloat16),
    (5, "two_stage", torch.bfloat16),
    (5, "decode_pairs", torch.bfloat16),
    (5, None, torch.float32),
    (37, None, torch.bfloat16),
    (37, "sorted", torch.bfloat16),
    (37, None, torch.float32),
]


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


INTERPRETERS = 2  # subprocesses sharing the cases (the interpreter is single-threaded; CI has 2 cores)


def _interpret(cases: list[dict], folder: Path) -> list:
    """Run `cases` through interpret_slot_moe.py in INTERPRETERS concurrent subprocesses (case i in
    process i % INTERPRETERS); the outputs in the cases' order."""
    n = min(INTERPRETERS, len(cases))
    procs = []
    for w in range(n):
        torch.save(cases[w::n], folder / f"cases{w}.pt")
        command = [sys.executable, str(HERE / "interpret_slot_moe.py"), str(folder / f"cases{w}.pt"),
                   str(folder / f"out{w}.pt")]  # fmt: skip
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    errors = [proc.communicate(timeout=600)[1] for proc in procs]  # every process waited for
    for proc, err in zip(procs, errors, strict=True):
        assert proc.returncode == 0, f"interpreted slot_moe failed:\n{err[-4000:]}"
    chunks = [torch.load(folder / f"out{w}.pt") for w in range(n)]
    return [chunks[i % n][i // n] for i in range(len(cases))]


def _with_weights(case: dict, dtype: torch.dtype) -> dict:
    return case | {"topk_weights_TK": case["topk_weights_TK"].to(dtype)}


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
    wide = [
        _with_weights(make_case(t, **SMALL, pattern="some", dtype=torch.bfloat16, seed=SEED + 1000 + i), w)
        | {"config": CONFIGS[c], "out_dtype": torch.float32}
        for i, (t, c, w) in enumerate(F32_OUT_CASES)
    ]
    folder = tmp_path_factory.mktemp("slot_moe")
    outputs = _interpret(cases + odd + wide, folder)
    n, m = len(cases), len(cases) + len(odd)
    return {
        "cases": list(zip(cases, outputs[:n], strict=True)),
        "out_of_range": list(zip([meant for _, meant in pairs], outputs[n:m], strict=True)),
        "f32_out": list(zip(wide, outputs[m:], strict=True)),
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


@pytest.mark.parametrize(
    "index",
    range(len(F32_OUT_CASES)),
    ids=[f"T{t}-{c or 'picked'}-{str(w)[6:]}" for t, c, w in F32_OUT_CASES],
)
def test_interpreted_float32_out_holds_the_unrounded_sums(interpreted, index: int) -> None:
    """bf16 inputs, a float32 out=: the bf16 result is that float32 out rounded once (one of its two bf16
    neighbours: Triton 3.9's interpreter truncates where CUDA rounds to nearest even, which the CUDA test
    checks bit for bit). Both paths round where the reference does (gate, up, silu, act, the down
    projection, with bf16 router weights the weighted product: expert_reference.py), so the float32 out
    is the reference's float32 sums up to fp32 summation order, which flips a rounding now and then: most
    sums equal to 1e-6 of the output's scale, all within 2e-3. The same sums without those roundings
    (float32 throughout), or with the product's rounding the other way, miss that by far."""
    case, (into_f32, returned) = interpreted["f32_out"][index]
    what = f"float32 out, case {F32_OUT_CASES[index]}, seed {SEED}"
    assert into_f32.dtype == torch.float32 and returned.dtype == torch.bfloat16, what
    assert not into_f32.isnan().any(), what
    assert ((returned.float() - into_f32).abs() <= into_f32.abs() * 2.0**-7).all(), what
    args = [case[name] for name in ARGS]

    def sums(*args, **kw):
        return slot_moe_reference(*args, out=torch.empty(case["x_TH"].shape, dtype=torch.float32), **kw)

    want = sums(*args)
    scale = float(want.abs().max())
    err = (into_f32 - want).abs() / scale
    assert (err <= 1e-6).float().mean() >= 0.9 and err.max() <= 2e-3, f"{what}: max {float(err.max())}"
    rounds = case["topk_weights_TK"].dtype == torch.bfloat16
    unrounded = sums(*(a.float() if a.is_floating_point() else a for a in args))
    for other in (unrounded, sums(*args, round_product=not rounds)):
        assert ((other - want).abs() / scale > 1e-6).float().mean() > 0.3, what


def test_reference_float32_out_is_the_unrounded_sum() -> None:
    case = make_case(5, **SMALL, pattern="some", dtype=torch.bfloat16, seed=SEED)
    args = [case[name] for name in ARGS]
    out = torch.full(case["x_TH"].shape, float("nan"))
    assert slot_moe_reference(*args, out=out) is out
    assert torch.equal(out.to(torch.bfloat16), slot_moe_reference(*args))
    with pytest.raises(ValueError, match="out must be"):
        slot_moe_reference(*args, out=torch.empty(case["x_TH"].shape, dtype=torch.float16))


# -- the device-side sort of the prefill path (torch only) ------------------------------------------------


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_by_expert_covers_each_resident_pair_once(pattern: str, block_m: int) -> None:
    case = make_case(23, **SMALL, pattern=pattern, dtype=torch.float32, seed=SEED)
    ids_TK, slot_of_E = case["topk_ids_TK"], case["slot_of_E"]
    num_pairs = ids_TK.numel()
    pair_of_row, slot_of_block, *_ = align_by_expert(ids_TK, slot_of_E, case["w13_SIH"].shape[0], block_m)
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


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_by_expert_ranks_invert_the_rows(pattern: str, block_m: int) -> None:
    """A block's real rows hold the pairs of ranks rank_of_block + 0, 1, ...; rank_of_pair is the inverse
    (a permutation of 0 .. resident pairs - 1 over the resident pairs, -1 for the others)."""
    case = make_case(23, **SMALL, pattern=pattern, dtype=torch.float32, seed=SEED)
    ids_TK, slot_of_E = case["topk_ids_TK"], case["slot_of_E"]
    num_pairs = ids_TK.numel()
    aligned = align_by_expert(ids_TK, slot_of_E, case["w13_SIH"].shape[0], block_m)
    assert all(t.dtype == torch.int32 for t in aligned), [t.dtype for t in aligned]
    resident_P = slot_of_E[ids_TK.reshape(-1)] >= 0
    rank_P = aligned.rank_of_pair
    assert (rank_P[~resident_P] == -1).all(), f"seed {SEED}"
    assert sorted(rank_P[resident_P].tolist()) == list(range(int(resident_P.sum()))), f"seed {SEED}"
    rows_B = aligned.pair_of_row.view(-1, block_m)
    for block, slot in enumerate(aligned.slot_of_block.tolist()):
        real = rows_B[block] < num_pairs
        if slot < 0:
            assert int(aligned.rank_of_block[block]) == num_pairs, f"block {block} past the total"
            continue
        want = aligned.rank_of_block[block] + torch.arange(block_m, dtype=torch.int32)
        assert torch.equal(rank_P[rows_B[block][real].long()], want[real]), f"block {block}, seed {SEED}"
        assert real[: int(real.sum())].all(), f"block {block}: padding before a real row"


# The Triton align (`align_by_expert_triton`) against the torch one under the interpreter, in a process of
# its own: cases (T, E, pattern, BLOCK_M, pairs per program; 0 = its own pick, 8 in the interpreter),
# including E = 10 (not a power of two: the key E of left-out pairs is a real column of the padded 16) and
# E = 40 (padded 64: four programs of 16 expert columns; at T = 400, 150 chunks of 8 pairs, so each column
# is summed in two tiles of 128 chunks, and up to 330 blocks of 4 rows in six programs).
ALIGN_CASES = [
    (t, e, p, m, c)
    for t, e in ((1, 8), (23, 8), (37, 10))
    for p in PATTERNS
    for m, c in ((1, 0), (4, 4), (16, 0), (16, 64))
] + [
    (100, 8, "all", 16, 0),
    (100, 8, "one_expert", 4, 32),
    (37, 40, "some", 4, 0),
    (400, 40, "some", 4, 0),
    (400, 40, "all", 16, 0),
]
ALIGN_SCRIPT = """
import sys
import torch
from moecache_kernels.slot_moe_align import align_by_expert_triton
cases = torch.load(sys.argv[1])
torch.save([tuple(align_by_expert_triton(*c)) for c in cases], sys.argv[2])
"""


@pytest.fixture(scope="module")
def aligned_by_triton(tmp_path_factory) -> list:
    """[(case dict, torch Alignment, Triton Alignment)] for ALIGN_CASES."""
    cases, args = [], []
    for i, (t, e, pattern, block_m, chunk) in enumerate(ALIGN_CASES):
        shape = SMALL | {"num_experts": e}
        case = make_case(t, **shape, pattern=pattern, dtype=torch.float32, seed=SEED + 7 * i)
        cases.append((case, block_m))
        args.append((case["topk_ids_TK"], case["slot_of_E"], case["w13_SIH"].shape[0], block_m, chunk))
    got = run_interpreted(ALIGN_SCRIPT, args, tmp_path_factory.mktemp("align"), "align")
    want = [align_by_expert(*a[:4]) for a in args]
    return list(zip(cases, want, got, strict=True))


@pytest.mark.parametrize(
    "index", range(len(ALIGN_CASES)), ids=[f"T{t}-E{e}-{p}-M{m}-C{c}" for t, e, p, m, c in ALIGN_CASES]
)
def test_triton_align_equals_torch_align(aligned_by_triton, index: int) -> None:
    """Element for element, every output (the same stable order: an expert's pairs in pair order)."""
    _, want, got = aligned_by_triton[index]
    for name, w, g in zip(want._fields, want, got, strict=True):
        assert g.dtype == torch.int32 and torch.equal(g, w), f"{ALIGN_CASES[index]} {name}, seed {SEED}"


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
    assert get_config(128, 8, 40, torch.float32, "Test_GPU", folder) == prefill
    assert get_config(4, 8, 40, torch.float32, "Other_GPU", folder) == default_config(4)


def test_config_entries_far_from_the_token_count_are_not_used(tmp_path) -> None:
    """An entry applies within a factor of 4 of its T: beyond, default_config (a T = 4096 tile of BLOCK_M
    128 would pad a short prompt's few rows per expert to 128)."""
    decode = default_config(1) | {"gate_up": {"BLOCK_I": 32, "BLOCK_H": 128, "num_warps": 2}}
    prefill = default_config(4096) | {"BLOCK_M": 128}
    folder = _write(tmp_path, {"1": decode, "4096": prefill})
    assert get_config(5, 8, 40, torch.float32, "Test_GPU", folder) == default_config(5)
    assert get_config(1023, 8, 40, torch.float32, "Test_GPU", folder) == default_config(1023)
    assert get_config(1024, 8, 40, torch.float32, "Test_GPU", folder) == prefill
    assert get_config(DECODE_MAX_T + 1, 8, 40, torch.float32, "Test_GPU", folder) == default_config(17)


def test_config_file_with_a_bad_value_is_refused_by_name(tmp_path) -> None:
    bad = default_config(1)
    bad["down"]["BLOCK_H"] = 24
    folder = _write(tmp_path, {"1": bad})
    with pytest.raises(ValueError, match=r"device_name=Test_GPU.*\[1\]\.down\.BLOCK_H.*power of two"):
        get_config(1, 8, 40, torch.float32, "Test_GPU", folder)


@pytest.mark.parametrize("variant", ["two_stage", "pairs"])
def test_config_picks_a_decode_entry_that_names_its_variant(tmp_path, variant: str) -> None:
    named = default_config(1) | {"variant": variant}
    folder = _write(tmp_path, {"1": named, "16": default_config(16)})
    assert get_config(2, 8, 40, torch.float32, "Test_GPU", folder) == named
    assert get_config(12, 8, 40, torch.float32, "Test_GPU", folder) == default_config(16)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            default_config(4) | {"variant": "unrolled"},
            r"\[4\]\.variant: want one of \['two_stage', 'pairs'\] or none, got 'unrolled'",
        ),
        (
            default_config(4) | {"variant": "pdl"},
            r"\[4\]\.variant: want one of \['two_stage', 'pairs'\] or none, got 'pdl'",
        ),
        (default_config(4) | {"down": {"BLOCK_H": 4, "num_warps": 8}}, r"\[4\]\.down\.BLOCK_I.*None"),
        (default_config(64) | {"variant": "two_stage"}, r"\[4\]\.variant: only decode entries"),
    ],
    ids=["unknown-variant", "removed-variant", "missing-key", "prefill-variant"],
)
def test_config_with_a_bad_decode_entry_is_refused_naming_file_and_T(
    tmp_path, entry: dict, message: str
) -> None:
    folder = _write(tmp_path, {"4": entry})
    with pytest.raises(ValueError, match=r"E=8,N=40,device_name=Test_GPU,dtype=float32\.json" + message):
        get_config(4, 8, 40, torch.float32, "Test_GPU", folder)


@pytest.mark.parametrize("num_tokens", [1, DECODE_MAX_T, DECODE_MAX_T + 1])
def test_default_configs_are_valid_entries(num_tokens: int) -> None:
    entry = default_config(num_tokens)
    assert validate_entry(entry, "default") is entry
    assert ("BLOCK_M" in entry) == (num_tokens > DECODE_MAX_T)
    if num_tokens <= DECODE_MAX_T:
        assert set(entry) == set(DECODE_KEYS), entry


@pytest.mark.parametrize(
    ("num_tokens", "entry", "message"),
    [
        (
            64,
            default_config(64) | {"layout": "rows"},
            r"\[64\]\.layout: want one of \['pairs', 'sorted'\], got 'rows'",
        ),
        (64, default_config(64) | {"tma": 1}, r"\[64\]\.tma: want true or false, got 1"),
        (4, default_config(4) | {"layout": "sorted"}, r"\[4\]\.layout: only prefill entries"),
        (4, default_config(4) | {"tma": True}, r"\[4\]\.tma: only prefill entries"),
    ],
    ids=["unknown-layout", "tma-not-a-bool", "decode-layout", "decode-tma"],
)
def test_config_with_a_bad_prefill_layout_is_refused_naming_file_and_T(
    tmp_path, num_tokens: int, entry: dict, message: str
) -> None:
    folder = _write(tmp_path, {str(num_tokens): entry})
    with pytest.raises(ValueError, match=r"E=8,N=40,device_name=Test_GPU,dtype=float32\.json" + message):
        get_config(num_tokens, 8, 40, torch.float32, "Test_GPU", folder)


def test_prefill_layout_defaults_to_pairs_without_tma_and_a_sorted_entry_is_picked(tmp_path) -> None:
    from moecache_kernels.slot_moe_config import prefill_layout, prefill_tma

    assert (prefill_layout(default_config(64)), prefill_tma(default_config(64))) == ("pairs", False)
    sorted_tma = default_config(512) | {"layout": "sorted", "tma": True}
    folder = _write(tmp_path, {"1": default_config(1), "512": sorted_tma})
    picked = get_config(600, 8, 40, torch.float32, "Test_GPU", folder)
    assert picked == sorted_tma and (prefill_layout(picked), prefill_tma(picked)) == ("sorted", True)


def test_tensor_descriptors_only_where_tma_can_address_the_tensor() -> None:
    """`_descriptor` (host metadata only): a pool's slots as one [S * N, C] matrix, or None (pointers)."""
    import importlib

    kernel = importlib.import_module("moecache_kernels.slot_moe")
    pool = torch.zeros(3, 80, 64, dtype=torch.bfloat16)
    desc = kernel._descriptor(pool, [16, 32])
    assert desc is not None and list(desc.shape) == [240, 64] and list(desc.strides) == [64, 1]
    assert list(desc.block_shape) == [16, 32]
    wide = torch.zeros(3, 80, 128, dtype=torch.bfloat16)[:, :, :64]  # rows 256 bytes apart: still one matrix
    assert kernel._descriptor(wide, [16, 32]) is not None
    assert kernel._descriptor(torch.zeros(6, 80, 64, dtype=torch.bfloat16)[::2], [16, 32]) is None  # gaps
    assert kernel._descriptor(torch.zeros(3, 80, 36, dtype=torch.bfloat16), [16, 32]) is None  # 72-byte rows
    assert kernel._descriptor(pool, [16, 4]) is None  # 8-byte box rows
    flat = torch.zeros(3 * 80 * 64 + 8, dtype=torch.bfloat16)
    assert kernel._descriptor(flat[1 : 1 + 3 * 80 * 64].view(3, 80, 64), [16, 32]) is None  # base + 2 bytes


def test_tuner_tries_prefill_layouts_first_and_spans_the_wide_space() -> None:
    """benchmarks/tune_slot_moe.py's prefill search: layout and TMA first, then BLOCK_M nearest T*K/E, then
    the likeliest tiles in turns for both stages; every candidate a valid entry; the whole space (BLOCK_N
    64-256, BLOCK_K 32-128, warps 4/8, stages 2-5, GROUP_M 1/8/16) reached for both stages."""
    import importlib.util

    path = HERE.parents[1] / "benchmarks" / "tune_slot_moe.py"
    spec = importlib.util.spec_from_file_location("tune_slot_moe", path)
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    start = default_config(4096)
    items = list(tune.candidates(4096, start, 4096 * 8 / 256))
    assert items[:2] == [("layout", "sorted"), ("tma", True)]
    assert items[2:6] == [("BLOCK_M", m) for m in (128, 64, 32, 16)]
    assert [stage for stage, _ in items[6:10]] == ["gate_up", "down", "gate_up", "down"]
    assert [m for stage, m in tune.candidates(512, start, 16.0) if stage == "BLOCK_M"][0] == 16
    for stage, choice in items:
        validate_entry(tune.with_choice(start, stage, choice), f"{stage}={choice}")
    for stage in ("gate_up", "down"):
        reached = {
            json.dumps(tune.with_choice(start, s, c)[stage], sort_keys=True) for s, c in items if s == stage
        }
        assert len(reached) == 3 * 3 * 2 * 4 * 3, stage


def test_tuner_tries_each_decode_variant_before_and_after_the_tiles() -> None:
    import importlib.util

    path = HERE.parents[1] / "benchmarks" / "tune_slot_moe.py"
    spec = importlib.util.spec_from_file_location("tune_slot_moe", path)
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    start = default_config(1)
    items = list(tune.candidates(1, start))
    variants = [("variant", "two_stage"), ("variant", "pairs")]
    assert items[:2] == variants and items[-2:] == variants
    assert {stage for stage, _ in items[2:-2]} == {"gate_up", "down"}
    for stage, choice in items:
        validate_entry(tune.with_choice(start, stage, choice), f"{stage}={choice}")


def test_tuner_skips_prefill_tiles_over_the_shared_memory_limit() -> None:
    """prefill_smem_floor: bf16 tiles x (num_stages - 1) of the larger stage; on the H200 (232,448 bytes) an
    entry the device refused (gate/up BLOCK_M 32, BLOCK_N 128, BLOCK_K 128, 5 stages: it asked 294,976) is
    skipped, the shipped T=4096 entry is not."""
    import importlib.util

    path = HERE.parents[1] / "benchmarks" / "tune_slot_moe.py"
    spec = importlib.util.spec_from_file_location("tune_slot_moe", path)
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    stage = {"BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 5}
    refused = {"BLOCK_M": 32, "gate_up": stage, "down": dict(stage, BLOCK_N=64)}
    assert tune.prefill_smem_floor(refused) == 2 * (32 * 128 + 2 * 128 * 128) * 4 == 294_912 > 232_448
    shipped = {
        "BLOCK_M": 128,
        "gate_up": {"BLOCK_K": 64, "BLOCK_N": 128, "GROUP_M": 8, "num_stages": 4, "num_warps": 8},
        "down": {"BLOCK_K": 64, "BLOCK_N": 128, "GROUP_M": 8, "num_stages": 3, "num_warps": 8},
    }
    assert tune.prefill_smem_floor(shipped) == 2 * (128 * 64 + 2 * 64 * 128) * 3 <= 232_448
    assert tune.prefill_smem_floor(default_config(1)) == 0  # a decode entry


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
# the prefill layouts at real shapes: the default blocks in each layout, and wide TMA tiles as the tuner
# may pick them (BLOCK_M 128, down tiles 256 columns of H)
PREFILL_GPU = {
    "sorted": default_config(600) | {"layout": "sorted"},
    "sorted_tma": default_config(600) | {"layout": "sorted", "tma": True},
    "pairs_tma": default_config(600) | {"tma": True},
    "sorted_tma_wide": {
        "BLOCK_M": 128, "layout": "sorted", "tma": True,
        "gate_up": {"BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4},
        "down": {"BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 16, "num_warps": 8, "num_stages": 3},
    },
}  # fmt: skip
PINNED = {
    "picked": None, "two_stage": default_config(1), "decode_pairs": default_config(1) | {"variant": "pairs"},
} | PREFILL_GPU  # fmt: skip


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
@pytest.mark.parametrize("variant", ["two_stage", "decode_pairs", "prefill"])
def test_cuda_float32_out_rounds_once_to_the_bf16_result(monkeypatch, variant: str) -> None:
    """bf16 inputs into a float32 out= (the runtime's one-rounding combine): its float32 sums, rounded to
    nearest even once, are bit for bit the bf16 result; decode's are the float32 reference's to fp32
    rounding."""
    from moecache_kernels.slot_moe import slot_moe

    num_tokens = 600 if variant == "prefill" else 5
    if variant != "prefill":
        _pin_config(monkeypatch, variant)
    case = make_case(num_tokens, **QWEN36, pattern="some", dtype=torch.bfloat16, seed=SEED, device="cuda")
    args = [case[name] for name in ARGS]
    out32 = torch.full(case["x_TH"].shape, float("nan"), device="cuda")
    assert slot_moe(*args, out=out32) is out32
    assert torch.equal(out32.to(torch.bfloat16), slot_moe(*args)), f"{variant}, seed {SEED}"
    if variant != "prefill":
        want = slot_moe_reference(*args, out=torch.empty_like(out32))
        scale = float(want.abs().max())
        err = (out32 - want).abs() / scale  # the reference's roundings, up to fp32 summation order
        assert (err <= 1e-6).float().mean() >= 0.9 and err.max() <= 2e-3, f"{variant}, seed {SEED}"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 5, 16])
def test_cuda_decode_variants_agree_bit_for_bit(monkeypatch, num_tokens: int) -> None:
    """ "pairs" computes each pair's weighted output as "two_stage" does (the same blocks) and sums a
    token's pairs in the same k order: the same float32 sums."""
    from moecache_kernels.slot_moe import slot_moe

    case = make_case(num_tokens, **QWEN36, pattern="some", dtype=torch.bfloat16, seed=SEED, device="cuda")
    args = [case[name] for name in ARGS]
    outs = []
    for variant in ("two_stage", "decode_pairs"):
        _pin_config(monkeypatch, variant)
        outs.append(slot_moe(*args, out=torch.full(case["x_TH"].shape, float("nan"), device="cuda")))
    assert torch.equal(outs[0], outs[1]), f"T={num_tokens}, seed {SEED}"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("variant", ["two_stage", "decode_pairs"])
def test_cuda_ids_and_slots_out_of_range_add_nothing(monkeypatch, variant: str) -> None:
    from moecache_kernels.slot_moe import slot_moe

    _pin_config(monkeypatch, variant)
    case, meant = out_of_range_case(5, **QWEN36, dtype=torch.bfloat16, seed=SEED, device="cuda")
    out = torch.full_like(case["x_TH"], float("nan"))
    slot_moe(*(case[name] for name in ARGS), out=out)
    _assert_matches(out, meant, "decode: ids -1 / E and slot S")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("variant", ["two_stage", "decode_pairs"])
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_cuda_decode_is_bit_identical_run_to_run(monkeypatch, num_tokens: int, variant: str) -> None:
    """Many programs add into each output element; their order must not depend on scheduling."""
    from moecache_kernels.slot_moe import slot_moe

    _pin_config(monkeypatch, variant)
    case = make_case(num_tokens, **QWEN36, pattern="all", dtype=torch.bfloat16, seed=SEED, device="cuda")
    args = [case[name] for name in ARGS]
    first = slot_moe(*args)
    for run in range(20):
        assert torch.equal(slot_moe(*args), first), f"T={num_tokens}: run {run + 1} differs, seed {SEED}"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize(
    ("num_tokens", "variant"),
    [
        (1, "picked"),
        (64, "picked"),
        (1, "two_stage"),
        (16, "two_stage"),
        (1, "decode_pairs"),
        (16, "decode_pairs"),
        (600, "sorted"),
        (600, "sorted_tma"),
        (600, "pairs_tma"),
        (600, "sorted_tma_wide"),
    ],  # fmt: skip
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
@pytest.mark.parametrize("config", sorted(PREFILL_GPU))
@pytest.mark.parametrize("shape", [QWEN36, DSV2, LARGE], ids=["qwen3.6", "dsv2-lite", "large"])
@pytest.mark.parametrize("num_tokens", [17, 600])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_cuda_prefill_layouts_match_reference(
    monkeypatch, shape: dict, num_tokens: int, pattern: str, config: str
) -> None:
    _pin_config(monkeypatch, config)
    _cuda_run_matches(num_tokens, shape, pattern, f"prefill {config} T={num_tokens} {pattern}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("config", ["picked", *sorted(PREFILL_GPU)])
def test_cuda_prefill_at_4096_tokens_matches_reference_and_is_bit_identical(monkeypatch, config: str) -> None:
    """T = 4096 at the Qwen3.6 shape, half resident: 5 runs equal to the bit (no atomics anywhere)."""
    from moecache_kernels.slot_moe import slot_moe

    _pin_config(monkeypatch, config)
    case = make_case(4096, **QWEN36, pattern="some", dtype=torch.bfloat16, seed=SEED, device="cuda")
    args = [case[name] for name in ARGS]
    first = slot_moe(*args)
    _assert_matches(first, case, f"prefill {config} T=4096")
    for run in range(5):
        assert torch.equal(slot_moe(*args), first), f"prefill {config}: run {run + 1} differs, seed {SEED}"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("block_m", [16, 64, 128])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_cuda_triton_align_equals_torch_align(block_m: int, pattern: str) -> None:
    from moecache_kernels.slot_moe_align import align_by_expert_triton

    case = make_case(4096, **QWEN36, pattern=pattern, dtype=torch.bfloat16, seed=SEED, device="cuda")
    args = (case["topk_ids_TK"].contiguous(), case["slot_of_E"], case["w13_SIH"].shape[0], block_m)
    want, got = align_by_expert(*args), align_by_expert_triton(*args)
    for name, w, g in zip(want._fields, want, got, strict=True):
        assert torch.equal(g, w), f"{name} block_m {block_m} {pattern}, seed {SEED}"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_kernel_matches_onnxruntime_moe() -> None:
    from moecache_kernels.slot_moe import slot_moe

    case = make_case(33, **SMALL, pattern="all", dtype=torch.float32, seed=SEED)
    case["topk_weights_TK"] /= case["topk_weights_TK"].sum(-1, keepdim=True)
    want = _onnxruntime_moe(case)
    got = slot_moe(*(case[name].cuda() for name in ARGS)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)

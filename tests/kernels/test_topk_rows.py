"""topk_rows (the Triton kernel) against topk_rows_reference, on the CPU under Triton's interpreter (in a
subprocess: TRITON_INTERPRET is read when triton is first imported), and on CUDA against torch.topk
itself, ties included; the reference against the CPU's torch.topk where the orders must agree (no equal
scores)."""

from __future__ import annotations

import pytest
import torch
from moecache_kernels.topk_rows_reference import topk_rows_reference

from tests.kernels.interpreted import run_interpreted

CUDA = torch.cuda.is_available()

# (T, E, K): a decode row, a prefill block, E not a power of two, K = E, one expert, K = 32
SHAPES = ((1, 256, 8), (5, 64, 6), (3, 60, 6), (2, 8, 8), (1, 1, 1), (0, 16, 2), (2, 40, 32))
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

INTERPRET_SCRIPT = """
import sys
import torch
from moecache_kernels.topk_rows import topk_rows
cases = torch.load(sys.argv[1])
torch.save([topk_rows(scores, k, by_value) for scores, k, by_value in cases], sys.argv[2])
"""


def _cases() -> list[tuple[torch.Tensor, int, bool]]:
    gen = torch.Generator().manual_seed(0)
    cases = []
    for tokens, experts, k in SHAPES:
        for dtype in DTYPES:
            scores = torch.randn(tokens, experts, generator=gen).to(dtype)
            if tokens and experts >= 4:
                scores[0, 1:4] = scores[0, 0]  # equal scores among the chosen
                scores[-1, :] = scores[-1, 0]  # a whole row tied
            if tokens >= 3:
                scores[1] = torch.randint(0, 3, (experts,), generator=gen).to(dtype)  # ties at the K-th
            for by_value in (True, False):
                cases.append((scores, k, by_value))
    minus_inf = torch.full((2, 16), float("-inf"))
    minus_inf[1, 9] = 0.0
    cases += [(minus_inf, 3, True), (minus_inf, 3, False)]
    return cases


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    cases = _cases()
    outputs = run_interpreted(INTERPRET_SCRIPT, cases, tmp_path_factory.mktemp("topk_rows"), "topk_rows")
    return list(zip(cases, outputs, strict=True))


def test_interpreted_kernel_equals_the_reference(interpreted) -> None:
    """Values (in the scores' dtype) and ids, element for element, in both orders, ties and -inf included."""
    for (scores, k, by_value), (values, ids) in interpreted:
        want_values, want_ids = topk_rows_reference(scores, k, by_value)
        what = f"T{scores.shape[0]} E{scores.shape[1]} K{k} {scores.dtype} by_value={by_value}"
        assert ids.dtype == torch.int64 and values.dtype == scores.dtype, what
        assert torch.equal(ids, want_ids), what
        assert torch.equal(values, want_values), what


def test_reference_orders_ties_as_cuda_does() -> None:
    """Equal scores at the K-th: the lower ids chosen; unsorted, those above the K-th by id, then the
    K-th's by id; sorted, through the bitonic network (which exchanges equal neighbours)."""
    scores = torch.tensor([[0.1, 0.5, 0.5, 0.2, 0.5, 0.7]])
    assert topk_rows_reference(scores, 3, by_value=False)[1].tolist() == [[5, 1, 2]]
    assert topk_rows_reference(scores, 5, by_value=False)[1].tolist() == [[1, 2, 4, 5, 3]]
    assert topk_rows_reference(torch.tensor([[0.1, 0.5, 0.5, 0.2, 0.5]]), 2)[1].tolist() == [[2, 1]]


@pytest.mark.parametrize("by_value", [True, False])
def test_reference_is_torch_topk_without_ties(by_value: bool) -> None:
    """Descending scores as torch.topk(sorted=True); unsorted, the ids above the K-th ascending, the
    K-th last."""
    scores = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
    values, ids = topk_rows_reference(scores, 6, by_value)
    want_values, want_ids = torch.topk(scores, 6)
    if not by_value:
        head_ids, order = torch.sort(want_ids[:, :5], dim=-1)
        want_ids = torch.cat([head_ids, want_ids[:, 5:]], dim=1)
        want_values = torch.cat([torch.gather(want_values[:, :5], 1, order), want_values[:, 5:]], dim=1)
    assert torch.equal(ids, want_ids) and torch.equal(values, want_values)


@pytest.mark.parametrize("bad", ["k0", "k_over_e", "k_over_32", "one_dim", "integer"])
def test_reference_refuses_bad_arguments(bad: str) -> None:
    scores, k = {
        "k0": (torch.zeros(2, 4), 0),
        "k_over_e": (torch.zeros(2, 4), 5),
        "k_over_32": (torch.zeros(2, 40), 33),
        "one_dim": (torch.zeros(4), 2),
        "integer": (torch.zeros(2, 4, dtype=torch.int64), 2),
    }[bad]
    with pytest.raises(ValueError, match="topk_rows"):
        topk_rows_reference(scores, k)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize(
    ("tokens", "experts", "k"), [(1, 256, 8), (512, 256, 8), (1, 64, 6), (300, 64, 6), (4, 40, 32)]
)
@pytest.mark.parametrize("by_value", [True, False])
@pytest.mark.parametrize("logits", ["float32", "bfloat16"])
def test_cuda_kernel_equals_torch_topk(
    tokens: int, experts: int, k: int, by_value: bool, logits: str
) -> None:
    """On CUDA, router scores (the softmax of random logits; bf16 logits tie often, as a bf16 router's
    do): the kernel's values and ids are torch.topk's, in its order, sorted or not."""
    from moecache_kernels.topk_rows import topk_rows

    gen = torch.Generator(device="cuda").manual_seed(2)
    logits_TE = torch.randn(tokens, experts, device="cuda", generator=gen).to(getattr(torch, logits))
    scores = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
    values, ids = topk_rows(scores, k, by_value)
    want_values, want_ids = torch.topk(scores, k, sorted=by_value)
    assert torch.equal(ids, want_ids) and torch.equal(values, want_values)
    ref_values, ref_ids = topk_rows_reference(scores, k, by_value)
    assert torch.equal(ref_ids, want_ids) and torch.equal(ref_values, want_values)

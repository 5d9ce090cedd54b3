"""Plain torch reference of `topk_rows`: the oracle the Triton kernel is tested against.

A router's top-k over one row of scores per token, in the order CUDA's `torch.topk` returns it, ties
included (a bf16 router's logits tie often, and the order of the K ids is the order the experts'
outputs are summed in):
1. The chosen: the K largest scores; of equal scores at the K-th, the lower ids.
2. CUDA's order before sorting (`sorted=False`): the chosen above the K-th score in ascending id order,
   then those equal to it in ascending id order (its gather kernel writes them in two passes over the row).
3. `sorted=True`: that order put through the sorting network torch applies to K <= 32 results (its
   `SmallBitonicSort`: a bitonic network over 32 lanes, the K results in lanes 0..K-1, the rest invalid,
   descending, an exchange on equal scores as its comparator makes them), so equal scores come out in
   the network's order, not by id.

Shape legend: T tokens (rows), E experts (scores per row), K top-k.
"""

from __future__ import annotations

import torch

SORT_LANES = 32  # torch's small sort: K <= 32 results, one bitonic network of 32 lanes
MAX_E = 1024  # the Triton kernel holds a row in one program


def check_topk_args(scores_TE: torch.Tensor, k: int) -> None:
    """The one check of topk_rows' arguments, the kernel's and the reference's: ValueError unless scores
    is a 2-D float tensor with 1 <= k <= min(E, 32) and E <= 1,024."""
    if scores_TE.dim() != 2 or not scores_TE.is_floating_point():
        raise ValueError(
            f"topk_rows: scores must be a 2-D float tensor, got {scores_TE.dtype} {tuple(scores_TE.shape)}"
        )
    num_experts = scores_TE.shape[1]
    if not 1 <= k <= min(num_experts, SORT_LANES) or num_experts > MAX_E:
        raise ValueError(
            f"topk_rows: needs 1 <= k <= min(E, {SORT_LANES}) and E <= {MAX_E}, got k {k}, E {num_experts}"
        )


def topk_rows_reference(scores_TE: torch.Tensor, k: int, by_value: bool = True):
    """(values_TK, ids_TK int64): each row's k largest scores in CUDA torch.topk's order (module
    docstring); `by_value` is topk's `sorted`. Raises ValueError as `check_topk_args`."""
    check_topk_args(scores_TE, k)
    values_TE, ids_TE = torch.sort(scores_TE, dim=-1, descending=True, stable=True)
    values_TK, ids_TK = values_TE[:, :k], ids_TE[:, :k]
    rows = []
    for values, ids in zip(values_TK.tolist(), ids_TK.tolist(), strict=True):
        kth = values[-1]
        chosen = sorted(zip(ids, values, strict=True))  # ascending id
        order = [pair for pair in chosen if pair[1] > kth] + [pair for pair in chosen if pair[1] == kth]
        rows.append(_small_bitonic_sort(order) if by_value else order)
    ids_out = torch.tensor([[i for i, _ in row] for row in rows], dtype=torch.int64).reshape(-1, k)
    values_out = torch.tensor([[v for _, v in row] for row in rows], dtype=torch.float64).reshape(-1, k)
    return values_out.to(scores_TE.dtype).to(scores_TE.device), ids_out.to(scores_TE.device)


def _small_bitonic_sort(pairs: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """torch's descending bitonic network over SORT_LANES lanes (its `bitonicSort` with `bitonicSwap`:
    `swap = (a > b and a valid) or b invalid`, the lanes exchanged where swap equals the phase's
    direction), `pairs` in lanes 0..K-1; returns lanes 0..K-1 after it."""
    lanes = [(v, i, True) for i, v in pairs] + [(0.0, 0, False)] * (SORT_LANES - len(pairs))

    def exchange(stride: int, size: int | None) -> None:
        for lo in range(SORT_LANES):
            if lo & stride:
                continue
            hi = lo + stride
            (k_lo, _, v_lo), (k_hi, _, v_hi) = lanes[lo], lanes[hi]
            swap = (k_lo > k_hi and v_lo) or not v_hi
            direction = bool(lo & size) if size is not None else False
            if swap == direction:
                lanes[lo], lanes[hi] = lanes[hi], lanes[lo]

    size = 2
    while size < SORT_LANES:
        stride = size // 2
        while stride:
            exchange(stride, size)
            stride //= 2
        size *= 2
    stride = SORT_LANES // 2
    while stride:
        exchange(stride, None)
        stride //= 2
    return [(i, v) for v, i, _ in lanes[: len(pairs)]]

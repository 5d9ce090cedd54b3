"""Calibration's CUDA measurements on small sizes: the expert on the GPU and host-to-device copies."""

from __future__ import annotations

import pytest
import torch

from moecache import calibration as cal

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SHAPE = cal.ExpertShape(hidden_size=512, moe_intermediate_size=256)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_expert_times_are_positive(dtype: torch.dtype) -> None:
    pool = cal.make_pool(SHAPE, 4, dtype, device="cuda")
    for tokens in (1, 64):
        t = cal.time_cuda_expert(pool, tokens, repeats=10, warmup=3)
        assert 0 < t.p10_us <= t.median_us <= t.p90_us and t.repeats == 10


def test_h2d_pinned_beats_pageable_at_8_mib() -> None:
    device = torch.device("cuda")
    nbytes = 8 << 20
    pinned = cal.time_h2d_copy(nbytes, pinned=True, repeats=10, warmup=3, device=device)
    pageable = cal.time_h2d_copy(nbytes, pinned=False, repeats=10, warmup=3, device=device)
    assert 0 < pinned.median_us < pageable.median_us
    assert cal.gbps(nbytes, pinned.median_us) > 1.0


def test_pinned_copies_fit_a_positive_latency_and_bandwidth() -> None:
    device = torch.device("cuda")
    points = []
    for nbytes in (1 << 16, 1 << 20, 1 << 23, 1 << 25):
        t = cal.time_h2d_copy(nbytes, pinned=True, repeats=10, warmup=3, device=device)
        points.append((nbytes, t.median_us))
    latency_us, gbps = cal.fit_latency_bandwidth(points)
    assert latency_us >= 0 and gbps > 1.0

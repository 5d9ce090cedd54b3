"""benchmarks/kt_backend.py (kt-kernel as a bench backend) and bench_cpu_experts.py's reference check.

Without kt_kernel (CI, Python 3.11) the backend must say why in one line, and the benchmark's check must
still stop a wrong backend; where kt_kernel imports, `KtExperts` must equal the fp32 oracle.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from moecache.calibration import ExpertShape
from moecache.errors import MoecacheError
from moecache.runtime.cpu_experts import CpuExperts

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    """bench_cpu_experts.py as a module (its directory on sys.path, for `import kt_backend`)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bench_cpu_experts", BENCH / "bench_cpu_experts.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


def kt_imports() -> bool:
    return importlib.util.find_spec("kt_kernel") is not None


def test_float32_is_refused_with_its_reason(bench):
    reason = bench.kt_unavailable_reason(torch.float32)
    assert reason == "kt-kernel's BF16 MoE takes bfloat16 weights, not torch.float32"


def test_missing_kt_kernel_gives_one_line(bench):
    if kt_imports():
        pytest.skip("kt_kernel is installed here")
    reason = bench.kt_unavailable_reason(torch.bfloat16)
    assert reason.startswith("kt_kernel does not import (ModuleNotFoundError") and "\n" not in reason
    w13, w2 = torch.zeros(2, 64, 32, dtype=torch.bfloat16), torch.zeros(2, 32, 32, dtype=torch.bfloat16)
    with pytest.raises(MoecacheError, match="backend 'kt' cannot run here: kt_kernel does not import"):
        bench.KtExperts(w13, w2, threads=1, max_tokens=1, max_per_token=1)


class Scaled:
    """A wrong backend: the torch backend's output times 1.1 (or with its last row left as NaN)."""

    def __init__(self, executor: CpuExperts, scale: float, poison_last: bool = False) -> None:
        self.executor, self.scale, self.poison_last = executor, scale, poison_last

    def run(self, x_TH, keys_M, token_M, weight_M, out_TH):
        y_TH = self.executor.run(x_TH, keys_M, token_M, weight_M, out_TH)
        y_TH.mul_(self.scale)
        if self.poison_last:
            y_TH[-1] = float("nan")
        return y_TH

    def close(self) -> None:
        self.executor.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_check_passes_torch_and_stops_a_wrong_backend(bench, monkeypatch, dtype):
    check = bench.check_cases(ExpertShape(64, 32), dtype, [1, 4])
    bench.check_backend("torch", 1, "tiny", str(dtype), check)  # the real backend passes
    real = bench.make_executor
    for scale, poison, message in ((1.1, False, "differs from the reference"), (1.0, True, "differs")):
        monkeypatch.setattr(
            bench, "make_executor", lambda *a, s=scale, p=poison: Scaled(real("torch", *a[1:]), s, p)
        )
        with pytest.raises(SystemExit, match=message):
            bench.check_backend("torch", 1, "tiny", str(dtype), check)


@pytest.mark.skipif(not kt_imports(), reason="kt_kernel is not installed (needs Python 3.12 and kt-kernel)")
def test_kt_equals_oracle(bench):
    torch.manual_seed(0)
    h, i, g = 256, 128, 6
    w13 = (torch.randn(g, 2 * i, h) * h**-0.5).bfloat16()
    w2 = (torch.randn(g, h, i) * i**-0.5).bfloat16()
    ex = bench.KtExperts(w13, w2, threads=1, max_tokens=5, max_per_token=3)
    for t, keys, toks in (
        (1, [4], [0]),
        (1, [5, 0, 2], [0, 0, 0]),  # the decode path, several experts
        (5, [1, 3, 3, 0, 5, 2], [4, 0, 2, 0, 1, 4]),  # the prefill path; token 3 has none
    ):
        x_TH = torch.randn(t, h).bfloat16()
        keys_M = torch.tensor(keys, dtype=torch.int32)
        token_M = torch.tensor(toks)
        weight_M = torch.rand(len(keys)).bfloat16()
        out_TH = torch.full_like(x_TH, float("nan"))
        got_TH = ex.run(x_TH, keys_M, token_M, weight_M, out_TH)
        want_TH = bench.oracle(x_TH, w13, w2, keys_M, token_M, weight_M.float())
        torch.testing.assert_close(got_TH.float(), want_TH.float(), **bench.TOL[torch.bfloat16])
        untouched = torch.ones(t, dtype=torch.bool)
        untouched[token_M] = False
        assert (got_TH[untouched] == 0).all()
    x_TH = torch.randn(2, h).bfloat16()
    with pytest.raises(MoecacheError, match=r"keys must lie in \[0, 6\)"):
        ex.run(x_TH, torch.tensor([6]), torch.tensor([0]), torch.tensor([1.0]))
    with pytest.raises(MoecacheError, match="exceed the 5 x 3"):
        ex.run(x_TH, torch.tensor([0, 1, 2, 3]), torch.tensor([1, 1, 1, 1]), torch.ones(4))
    ex.close()
    with pytest.raises(MoecacheError, match="run after close"):
        ex.run(x_TH, torch.tensor([0]), torch.tensor([0]), torch.tensor([1.0]))

"""CpuExperts: every backend equals the plain torch reference, one (token, key, weight) triple at a time.

Oracle: `moecache_kernels.expert_forward` for each triple (fp32 sums, rounded to x's dtype where
transformers rounds), times its weight, summed in fp32, cast to x's dtype.
Tolerances: fp32 tight (atol = rtol = 1e-5). bf16: rtol 1e-2 as ONNX Runtime's MoE parity test
(onnxruntime/test/python/transformers/test_moe_cuda.py, `ort_dtype_quant_bits_tolerance_map["BF16:0"]`
= (atol 1.0, rtol 1e-2)). We keep its rtol and take atol 5e-2 (ORT's 1.0 suits its unscaled random
weights; ours give O(1) outputs); both backends round where the oracle does, so a bf16 result differs
from it where fp32 sums in another order round differently (the fp32-out test checks the sums
themselves).
Every output buffer is poisoned with NaN before a run: every row must be written.
"""

from __future__ import annotations

import pytest
import torch
from moecache_kernels import expert_forward, rounded

from moecache.errors import MoecacheError
from moecache.runtime import cpu_experts as ce
from moecache.runtime.cpu_experts import CpuExperts

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 5e-2, "rtol": 1e-2}}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def build_cache(tmp_path_factory):
    """Compile the cpp backend once per test module, into this run's tmp directory."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOECACHE_CPU_EXPERTS_CACHE", str(tmp_path_factory.mktemp("cpu_experts_build")))
        ce._load_library.cache_clear()
        yield
    ce._load_library.cache_clear()


@pytest.fixture(params=["torch", "cpp"])
def backend(request):
    return request.param


def skip_unless_runs(backend: str, dtype: torch.dtype) -> None:
    if backend == "cpp" and (reason := ce.cpp_unavailable_reason(dtype)) is not None:
        pytest.skip(f"cpp backend cannot run {dtype} here: {reason}")


def make_weights(g: int, h: int, i: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(g, 2 * i, h, generator=gen) * h**-0.5).to(dtype)
    w2 = (torch.randn(g, h, i, generator=gen) * i**-0.5).to(dtype)
    return w13, w2


def oracle(x_TH, w13, w2, keys_M, token_M, weight_M):
    return oracle_f32(x_TH, w13, w2, keys_M, token_M, weight_M).to(x_TH.dtype)


def run_poisoned(ex: CpuExperts, x_TH, keys_M, token_M, weight_M):
    out_TH = torch.full_like(x_TH, float("nan"))
    y_TH = ex.run(x_TH, keys_M, token_M, weight_M, out_TH)
    assert y_TH.data_ptr() == out_TH.data_ptr()
    return y_TH


def check(ex: CpuExperts, w13, w2, x_TH, keys_M, token_M, weight_M):
    y_TH = run_poisoned(ex, x_TH, keys_M, token_M, weight_M)
    assert y_TH.dtype == x_TH.dtype and y_TH.shape == x_TH.shape
    torch.testing.assert_close(
        y_TH.float(), oracle(x_TH, w13, w2, keys_M, token_M, weight_M).float(), **TOL[x_TH.dtype]
    )
    untouched = torch.ones(x_TH.shape[0], dtype=torch.bool)
    untouched[token_M] = False
    assert (y_TH[untouched] == 0).all()  # tokens without a miss get exact zeros, not the poison


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,i", [(64, 32), (80, 24), (81, 23)])  # tails of the 32/16-wide vector loops
def test_random_triples_equal_reference(backend, dtype, h, i):
    skip_unless_runs(backend, dtype)
    gen = torch.Generator().manual_seed(h * 1000 + i)
    g = 7
    w13, w2 = make_weights(g, h, i, dtype, seed=h)
    ex = CpuExperts(w13, w2, backend=backend, threads=2)
    assert ex.backend == backend
    for _ in range(4):
        t = int(torch.randint(1, 12, (1,), generator=gen))
        m = int(torch.randint(1, 3 * t + 1, (1,), generator=gen))
        x_TH = torch.randn(t, h, generator=gen).to(dtype)
        keys_M = torch.randint(0, g, (m,), generator=gen)
        token_M = torch.randint(0, t, (m,), generator=gen)
        weight_M = torch.rand(m, generator=gen)
        check(ex, w13, w2, x_TH, keys_M, token_M, weight_M)


@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_cases(backend, dtype):
    skip_unless_runs(backend, dtype)
    g, h, i = 9, 64, 48
    w13, w2 = make_weights(g, h, i, dtype)
    ex = CpuExperts(w13, w2, backend=backend, threads=2)
    gen = torch.Generator().manual_seed(1)
    x1 = torch.randn(1, h, generator=gen).to(dtype)
    x20 = torch.randn(20, h, generator=gen).to(dtype)
    empty = torch.zeros(0, dtype=torch.int64)
    # M = 0: all zeros.
    y = run_poisoned(ex, x20, empty, empty, torch.zeros(0))
    assert (y == 0).all()
    assert run_poisoned(ex, x20[:0], empty, empty, torch.zeros(0)).shape == (0, h)  # no tokens at all
    # One token, every expert (keys 0 .. G-1).
    check(ex, w13, w2, x1, torch.arange(g), torch.zeros(g, dtype=torch.int64), torch.rand(g, generator=gen))
    # Many tokens (more than one register tile of 8), one expert, the last key.
    check(ex, w13, w2, x20, torch.full((20,), g - 1), torch.arange(20), torch.rand(20, generator=gen))
    # Keys at both ends, tokens out of order, int32 indices and bf16 router weights (exact conversions).
    keys = torch.tensor([g - 1, 0, g - 1, 0, 4], dtype=torch.int32)
    tokens = torch.tensor([19, 3, 0, 19, 7], dtype=torch.int32)
    check(ex, w13, w2, x20, keys, tokens, torch.rand(5, generator=gen).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_expert_major_store_views(backend, dtype):
    """The expert store's layout: one buffer, expert-major, w13 then w2 per expert (expert stride 3*I*H)."""
    skip_unless_runs(backend, dtype)
    g, h, i = 5, 96, 40
    w13_dense, w2_dense = make_weights(g, h, i, dtype, seed=3)
    buf = torch.empty(g, 3 * i * h, dtype=dtype)
    w13 = buf[:, : 2 * i * h].view(g, 2 * i, h)
    w2 = buf[:, 2 * i * h :].view(g, h, i)
    w13.copy_(w13_dense)
    w2.copy_(w2_dense)
    before = buf.clone()
    ex = CpuExperts(w13, w2, backend=backend, threads=2)
    gen = torch.Generator().manual_seed(2)
    x_TH = torch.randn(6, h, generator=gen).to(dtype)
    keys_M = torch.tensor([4, 0, 2, 4, 1, 3, 0])
    token_M = torch.tensor([0, 1, 2, 3, 4, 5, 5])
    check(ex, w13_dense, w2_dense, x_TH, keys_M, token_M, torch.rand(7, generator=gen))
    assert torch.equal(buf, before)  # weights are only read


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpp_deterministic_across_thread_counts(dtype):
    skip_unless_runs("cpp", dtype)
    g, h, i = 6, 128, 64
    w13, w2 = make_weights(g, h, i, dtype)
    gen = torch.Generator().manual_seed(5)
    x_TH = torch.randn(10, h, generator=gen).to(dtype)
    keys_M, token_M = torch.randint(0, g, (25,), generator=gen), torch.randint(0, 10, (25,), generator=gen)
    weight_M = torch.rand(25, generator=gen)
    outs = [
        CpuExperts(w13, w2, backend="cpp", threads=n, host_thread=host).run(x_TH, keys_M, token_M, weight_M)
        for n in (1, 2, 3)
        for host in ("work", "idle")  # idle: the calling thread joins the team without a share
    ]
    assert all(torch.equal(outs[0], out) for out in outs[1:])


def test_submit_runs_on_a_worker_thread(backend):
    skip_unless_runs(backend, torch.bfloat16)
    w13, w2 = make_weights(4, 64, 32, torch.bfloat16)
    ex = CpuExperts(w13, w2, backend=backend, threads=2)
    x_TH = torch.randn(3, 64).to(torch.bfloat16)
    keys_M, token_M, weight_M = torch.tensor([0, 3, 1]), torch.tensor([0, 1, 2]), torch.rand(3)
    try:
        future = ex.submit(x_TH, keys_M, token_M, weight_M)
        assert torch.equal(future.result(timeout=30), ex.run(x_TH, keys_M, token_M, weight_M))
    finally:
        ex.close()


def test_bad_input_is_refused(backend):
    skip_unless_runs(backend, torch.float32)
    w13, w2 = make_weights(4, 32, 16, torch.float32)
    ex = CpuExperts(w13, w2, backend=backend)
    x_TH = torch.randn(2, 32)
    one, w = torch.tensor([0]), torch.tensor([1.0])
    with pytest.raises(MoecacheError, match="key 4"):
        ex.run(x_TH, torch.tensor([4]), one, w)
    with pytest.raises(MoecacheError, match="key -1"):
        ex.run(x_TH, torch.tensor([-1]), one, w)
    with pytest.raises(MoecacheError, match="token 2"):
        ex.run(x_TH, one, torch.tensor([2]), w)
    with pytest.raises(MoecacheError, match="x must be"):
        ex.run(x_TH.to(torch.bfloat16), one, one, w)
    with pytest.raises(MoecacheError, match="one length"):
        ex.run(x_TH, torch.tensor([0, 1]), one, w)
    with pytest.raises(MoecacheError, match="out must be"):
        ex.run(x_TH, one, one, w, torch.empty(3, 32))


def test_bad_construction_is_refused():
    w13, w2 = make_weights(4, 32, 16, torch.float32)
    with pytest.raises(MoecacheError, match="backend 'fast'"):
        CpuExperts(w13, w2, backend="fast")
    with pytest.raises(MoecacheError, match="disagree"):
        CpuExperts(w13, w2[:, :, :8])
    with pytest.raises(MoecacheError, match="w2 is torch.bfloat16"):
        CpuExperts(w13, w2.to(torch.bfloat16))
    with pytest.raises(MoecacheError, match="not contiguous"):
        CpuExperts(w13.transpose(1, 2).contiguous().transpose(1, 2), w2)
    with pytest.raises(MoecacheError, match="threads"):
        CpuExperts(w13, w2, threads=0)
    with pytest.raises(MoecacheError, match=r"host_thread='main', expected one of \['work', 'idle'\]"):
        CpuExperts(w13, w2, host_thread="main")


def test_the_host_threads_default_comes_from_the_environment(monkeypatch):
    w13, w2 = make_weights(4, 32, 16, torch.float32)
    assert CpuExperts(w13, w2).host_thread == "work"
    monkeypatch.setenv("MOECACHE_CPU_HOST_THREAD", "idle")
    assert CpuExperts(w13, w2).host_thread == "idle"
    monkeypatch.setenv("MOECACHE_CPU_HOST_THREAD", "none")
    with pytest.raises(MoecacheError, match=r"\$MOECACHE_CPU_HOST_THREAD='none'"):
        CpuExperts(w13, w2)


def test_auto_falls_back_with_one_warning_and_cpp_is_refused(monkeypatch):
    """Where the CPU lacks the flags (or the compiler is missing), auto uses torch and says why, once."""
    w13, w2 = make_weights(3, 32, 16, torch.bfloat16)
    monkeypatch.setattr(ce, "cpu_flags", lambda: frozenset({"sse2"}))
    monkeypatch.setattr(ce, "_warned", set())
    with pytest.warns(UserWarning, match="avx512f.*using torch") as record:
        assert CpuExperts(w13, w2, backend="auto").backend == "torch"
        assert CpuExperts(w13, w2, backend="auto").backend == "torch"
    assert len(record) == 1
    with pytest.raises(MoecacheError, match="cannot run here: CPU lacks"):
        CpuExperts(w13, w2, backend="cpp")


def test_missing_compiler_is_reported(monkeypatch):
    monkeypatch.setattr(ce, "cpu_flags", lambda: frozenset(ce.CPU_FLAGS[torch.bfloat16]))
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    ce._load_library.cache_clear()
    try:
        assert "no C++ compiler '/nonexistent/g++'" in ce.cpp_unavailable_reason(torch.bfloat16)
    finally:
        ce._load_library.cache_clear()


def oracle_f32(x_TH, w13, w2, keys_M, token_M, weight_M, round_product=False):
    """The oracle's fp32 sums, not rounded to x's dtype (each product rounded with `round_product`)."""
    y_TH = torch.zeros(x_TH.shape, dtype=torch.float32)
    for key, tok, w in zip(keys_M.tolist(), token_M.tolist(), weight_M.tolist(), strict=True):
        prod_H = w * expert_forward(x_TH[tok : tok + 1], w13[key], w2[key])[0]
        y_TH[tok] += rounded(prod_H, x_TH.dtype) if round_product else prod_H
    return y_TH


def unrounded_f32(x_TH, w13, w2, keys_M, token_M, weight_M):
    """The same sums with nothing rounded before them (all in fp32): what the numerics must not be."""
    return oracle_f32(x_TH.float(), w13.float(), w2.float(), keys_M, token_M, weight_M)


@pytest.mark.parametrize("round_product", [False, True])
def test_bf16_rounds_where_transformers_does_and_a_float32_out_is_the_unrounded_sum(backend, round_product):
    """bf16 weights and x, a float32 out: the oracle (gate, up, silu, act and the down projection rounded
    to bf16; with round_product each weighted product too) up to fp32 summation order, which flips a
    rounding now and then: most sums equal to 1e-6 of the output's scale, all within 2e-3. Computing
    without those roundings, or skipping only the product's, misses by far more. The same call into a
    bf16 out is the fp32 result rounded once."""
    skip_unless_runs(backend, torch.bfloat16)
    g, h, i = 6, 256, 96
    w13, w2 = make_weights(g, h, i, torch.bfloat16, seed=11)
    ex = CpuExperts(w13, w2, backend=backend, threads=2)
    gen = torch.Generator().manual_seed(12)
    x_TH = torch.randn(9, h, generator=gen).to(torch.bfloat16)
    keys_M = torch.randint(0, g, (20,), generator=gen)
    token_M = torch.randint(0, 9, (20,), generator=gen)
    weight_M = torch.rand(20, generator=gen)
    out32_TH = torch.full(x_TH.shape, float("nan"))
    assert ex.run(x_TH, keys_M, token_M, weight_M, out32_TH, round_product) is out32_TH
    want_TH = oracle_f32(x_TH, w13, w2, keys_M, token_M, weight_M, round_product)
    scale = float(want_TH.abs().max())
    err_TH = (out32_TH - want_TH).abs() / scale
    assert (err_TH <= 1e-6).float().mean() >= 0.9 and err_TH.max() <= 2e-3, float(err_TH.max())
    others = [unrounded_f32(x_TH, w13, w2, keys_M, token_M, weight_M)]
    others.append(oracle_f32(x_TH, w13, w2, keys_M, token_M, weight_M, not round_product))
    for other_TH in others:
        assert ((other_TH - want_TH).abs() / scale > 1e-6).float().mean() > 0.3
    got_TH = ex.run(x_TH, keys_M, token_M, weight_M, round_product=round_product)
    assert torch.equal(got_TH, out32_TH.to(torch.bfloat16))
    # the default: products round exactly when the weights come in x's dtype
    assert torch.equal(ex.run(x_TH, keys_M, token_M, weight_M.to(torch.bfloat16)), ex.run(
        x_TH, keys_M, token_M, weight_M.to(torch.bfloat16).float(), round_product=True
    ))  # fmt: skip
    with pytest.raises(MoecacheError, match="torch.bfloat16 or torch.float32"):
        ex.run(x_TH, keys_M, token_M, weight_M, torch.empty(x_TH.shape, dtype=torch.float16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_bound_call_equals_run_on_its_fixed_buffers(backend, dtype):
    skip_unless_runs(backend, dtype)
    g, h, i, t, k = 7, 80, 24, 3, 4
    w13, w2 = make_weights(g, h, i, dtype, seed=3)
    ex = CpuExperts(w13, w2, backend=backend, threads=2)
    gen = torch.Generator().manual_seed(4)
    x_TH = torch.randn(t, h, generator=gen).to(dtype)
    out_TH = torch.full((t, h), float("nan"))
    call = ex.bind(x_TH, out_TH, t * k)
    for m in (t * k, 1, 5):  # the same buffers, calls of different sizes, new x each time
        x_TH.copy_(torch.randn(t, h, generator=gen).to(dtype))
        keys_M, token_M = torch.randint(0, g, (m,), generator=gen), torch.randint(0, t, (m,), generator=gen)
        weight_M = torch.rand(m, generator=gen)
        call.keys_M[:m], call.token_M[:m], call.weight_M[:m] = keys_M, token_M, weight_M
        out_TH.fill_(float("nan"))
        rounds = m == 5  # both settings of the product's rounding
        assert call(m, rounds) is out_TH
        want_TH = ex.run(x_TH, keys_M, token_M, weight_M, torch.empty(t, h), round_product=rounds)
        assert torch.equal(out_TH, want_TH)  # the same kernel on the same triples: identical sums


def test_a_bound_call_refuses_bad_triples_and_buffers(backend):
    skip_unless_runs(backend, torch.float32)
    w13, w2 = make_weights(4, 32, 16, torch.float32)
    ex = CpuExperts(w13, w2, backend=backend)
    x_TH, out_TH = torch.randn(2, 32), torch.empty(2, 32)
    call = ex.bind(x_TH, out_TH, 4)
    call.keys_M[0], call.token_M[0], call.weight_M[0] = 4, 0, 1.0
    with pytest.raises(MoecacheError, match="key 4"):
        call(1, False)
    call.keys_M[0], call.token_M[0] = 0, 2
    with pytest.raises(MoecacheError, match="token 2"):
        call(1, False)
    with pytest.raises(MoecacheError, match="contiguous"):
        ex.bind(torch.randn(32, 2).t(), out_TH, 4)
    with pytest.raises(MoecacheError, match="max_entries"):
        ex.bind(x_TH, out_TH, 0)
    with pytest.raises(MoecacheError, match="out must be"):
        ex.bind(x_TH, torch.empty(3, 32), 4)

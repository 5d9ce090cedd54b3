"""kt-kernel (KTransformers' CPU MoE kernels) as a backend of bench_cpu_experts.py: `KtExperts.run` has
`CpuExperts.run`'s contract, so the benchmark times and checks it like the project's own backends.

kt-kernel's raw extension API is used, not its SGLang-oriented `KTMoEWrapper` (whose BF16 path reads
safetensors files): a `MOEConfig` holding per-expert weight pointers (gate = w13[g, :I], up = w13[g, I:],
down = w2[g], straight from the store's layout), one `AMXBF16_MOE` (AVX2BF16_MOE on a CPU without
AMX-BF16) over all G keys, one `CPUInfer` worker pool of `threads` threads, and per call one `forward_task`
with a [T, K] table of expert ids (-1 pads: kt skips ids outside [0, G)) and fp32 router weights.

kt repacks every expert into its own tile layout at load time: it copies the weights (pointers are read
once, in the constructor), so this backend holds a second copy of the pool; its forward never reads the
caller's tensors. One call's (token, key) pairs must be distinct, as top-k routing produces them.

Threads (kt-kernel 0.6.1, cpu_backend/worker_pool.cpp): the pool's `threads` threads are bound (hwloc,
strict) to the first `threads` cores of NUMA node 0 among the process's allowed CPUs, the first of them
running each job's share itself, and each spins for 50 ms after a job before it sleeps. Unlike OpenMP
threads they cannot move off a core that another process is using, and at `threads` = every core the
Python thread that submits the call shares a core with a spinning worker.

kt-kernel 0.6.1 cannot free a MoE object safely while the process makes more: its shared scratch buffer
(cpu_backend/shared_mem_buffer.cpp) keeps every object's pointer-setting callbacks and re-runs them all
when a later object needs a larger buffer, writing into freed objects (seen here as glibc's "corrupted
double-linked list" abort). So every `KtExperts` stays alive until the interpreter exits (`close` only
refuses later calls); the weight copies of all of them are held until then.

kt-kernel's C++ code prints banners to the C stdout when its objects are made and destroyed; they are
sent to stderr here, so the benchmark's stdout still ends with its JSON line.

Shape legend: T tokens, H hidden, I intermediate, G global expert keys, M (token, key, weight) triples,
K the most triples of one token.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import sys

import numpy as np
import torch

from moecache.errors import MoecacheError
from moecache.runtime.cpu_experts import checked_call, cpu_flags


def _import_kt():
    """The kt_kernel module, or the one-line reason it does not import here."""
    try:
        import kt_kernel
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason to skip the backend
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"kt_kernel does not import ({type(exc).__name__}: {first})"
    return kt_kernel


def kt_moe_class(kt_kernel) -> tuple[str, type] | str:
    """(name, class) of the BF16 MoE kernel to use on this CPU, or why there is none."""
    moe = kt_kernel.kt_kernel_ext.moe
    if "amx_bf16" in cpu_flags() and getattr(moe, "AMXBF16_MOE", None) is not None:
        return "AMXBF16_MOE", moe.AMXBF16_MOE
    if getattr(moe, "AVX2BF16_MOE", None) is not None:
        return "AVX2BF16_MOE", moe.AVX2BF16_MOE
    return f"kt_kernel {kt_kernel.__version__} has no BF16 MoE kernel for this CPU"


def kt_unavailable_reason(dtype: torch.dtype) -> str | None:
    """Why the kt backend cannot run `dtype` weights here, or None where it can."""
    if dtype != torch.bfloat16:
        return f"kt-kernel's BF16 MoE takes bfloat16 weights, not {dtype}"
    kt = _import_kt()
    if isinstance(kt, str):
        return kt
    chosen = kt_moe_class(kt)
    return chosen if isinstance(chosen, str) else None


def kt_info() -> dict:
    """Version, loaded CPU variant and kernel class of kt_kernel (for the benchmark's JSON line)."""
    kt = _import_kt()
    if isinstance(kt, str):
        return {"unavailable": kt}
    chosen = kt_moe_class(kt)
    return {
        "version": kt.__version__,
        "variant": kt.__cpu_variant__,
        "class": chosen if isinstance(chosen, str) else chosen[0],
    }


@contextlib.contextmanager
def c_stdout_to_stderr():
    """Route file descriptor 1 (C printf) to stderr for the duration; Python's stdout is flushed first."""
    sys.stdout.flush()
    libc = ctypes.CDLL(None)
    libc.fflush(None)
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        libc.fflush(None)
        os.dup2(saved, 1)
        os.close(saved)


_ALIVE: list[KtExperts] = []  # see the module docstring: kt objects are freed only at exit


def _free_all() -> None:
    with c_stdout_to_stderr():
        while _ALIVE:
            executor = _ALIVE.pop()
            executor._moe = None  # the MoE object before the worker pool it runs on
            executor._cpu = None


class KtExperts:
    """`CpuExperts`' run contract on kt-kernel's BF16 MoE (see the module docstring).

    `w13_GIH` [G, 2I, H] and `w2_GHI` [G, H, I]: CPU bfloat16, each expert's rows contiguous. One call
    takes at most `max_tokens` tokens and `max_per_token` triples per token (kt sizes its buffers by them).
    """

    backend = "kt"

    def __init__(
        self,
        w13_GIH: torch.Tensor,
        w2_GHI: torch.Tensor,
        *,
        threads: int,
        max_tokens: int,
        max_per_token: int,
    ) -> None:
        reason = kt_unavailable_reason(w13_GIH.dtype)
        if reason is not None:
            raise MoecacheError(f"cpu experts backend 'kt' cannot run here: {reason}")
        g, two_i, h = w13_GIH.shape
        i = two_i // 2
        if (
            two_i % 2
            or tuple(w2_GHI.shape) != (g, h, i)
            or w2_GHI.dtype != w13_GIH.dtype
            or w13_GIH.stride()[1:] != (h, 1)
            or w2_GHI.stride()[1:] != (i, 1)
        ):
            raise MoecacheError(
                f"kt experts: want w13 [G, 2I, H] and w2 [G, H, I] of one dtype, rows contiguous; got"
                f" {tuple(w13_GIH.shape)} {w13_GIH.dtype} and {tuple(w2_GHI.shape)} {w2_GHI.dtype}"
            )
        self.num_keys, self.hidden, self.inter, self.dtype = g, h, i, w13_GIH.dtype
        self.threads, self.max_tokens, self.max_per_token = threads, max_tokens, max_per_token
        ext = _import_kt().kt_kernel_ext
        self.kernel_name, kernel = kt_moe_class(_import_kt())
        self._mask_G = torch.zeros(g, dtype=torch.bool)  # kt's "expert is on the GPU" mask: none are
        self._ids = np.full(max_tokens * max_per_token, -1, dtype=np.int64)
        self._weights = np.zeros(max_tokens * max_per_token, dtype=np.float32)
        self._qlen = np.zeros(1, dtype=np.int32)
        with c_stdout_to_stderr():
            pool = ext.WorkerPoolConfig()
            pool.subpool_count = 1
            pool.subpool_numa_map = [0]
            pool.subpool_thread_count = [threads]
            self._cpu = ext.CPUInfer(pool)
            cfg = ext.moe.MOEConfig(g, max_per_token, h, i, self._mask_G.data_ptr())
            cfg.layer_idx = 0
            cfg.pool = self._cpu.backend_
            cfg.max_len = max_tokens
            up_offset = i * h * w13_GIH.element_size()
            cfg.gate_projs = [[w13_GIH[k].data_ptr() for k in range(g)]]
            cfg.up_projs = [[w13_GIH[k].data_ptr() + up_offset for k in range(g)]]
            cfg.down_projs = [[w2_GHI[k].data_ptr() for k in range(g)]]
            cfg.gate_scales = cfg.up_scales = cfg.down_scales = [[0] * g]
            self._moe = kernel(cfg)
            identity_G = torch.arange(g, dtype=torch.int64)
            self._cpu.submit(self._moe.load_weights_task(identity_G.data_ptr()))
            self._cpu.sync()
        if not _ALIVE:
            atexit.register(_free_all)
        _ALIVE.append(self)
        self.closed = False

    def run(
        self,
        x_TH: torch.Tensor,
        keys_M: torch.Tensor,
        token_M: torch.Tensor,
        weight_M: torch.Tensor,
        out_TH: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`y[t] = sum over triples m with token_M[m] == t of weight_M[m] * expert_{keys_M[m]}(x[t])`,
        every row written (zeros for tokens without a triple), into `out_TH` when given."""
        if self.closed:
            raise MoecacheError("kt experts: run after close")
        x_TH, keys_M, token_M, weight_M, out_TH = checked_call(
            self.hidden, self.dtype, x_TH, keys_M, token_M, weight_M, out_TH, who="kt experts"
        )
        t = x_TH.shape[0]
        keys, toks, wts = keys_M.numpy(), token_M.numpy(), weight_M.numpy()
        m = keys.shape[0]
        if m and (keys.min() < 0 or keys.max() >= self.num_keys or toks.min() < 0 or toks.max() >= t):
            raise MoecacheError(
                f"kt experts: keys must lie in [0, {self.num_keys}) and tokens in [0, {t});"
                f" got keys {keys.min()}..{keys.max()}, tokens {toks.min()}..{toks.max()}"
            )
        count_T = np.bincount(toks, minlength=t)
        k = max(int(count_T.max()) if m else 1, 1)
        if t > self.max_tokens or k > self.max_per_token:
            raise MoecacheError(
                f"kt experts: {t} tokens with up to {k} triples each exceed the {self.max_tokens} x"
                f" {self.max_per_token} this executor was built for"
            )
        ids_TK = self._ids[: t * k].reshape(t, k)
        weights_TK = self._weights[: t * k].reshape(t, k)
        ids_TK.fill(-1)
        weights_TK.fill(0.0)
        if m:
            order = np.argsort(toks, kind="stable")
            tok_sorted = toks[order]
            slot = np.arange(m) - (np.cumsum(count_T) - count_T)[tok_sorted]
            ids_TK[tok_sorted, slot] = keys[order]
            weights_TK[tok_sorted, slot] = wts[order]
        self._qlen[0] = t
        self._cpu.submit(
            self._moe.forward_task(
                self._qlen.ctypes.data,
                k,
                ids_TK.ctypes.data,
                weights_TK.ctypes.data,
                x_TH.data_ptr(),
                out_TH.data_ptr(),
                False,
            )
        )
        self._cpu.sync()
        return out_TH

    def close(self) -> None:
        """Refuse later calls. kt's objects (weight copy, worker threads) are freed only at exit."""
        self.closed = True

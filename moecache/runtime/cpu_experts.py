"""CPU fallback executor: one layer visit's missed experts computed on the CPU from the canonical weights.

While the GPU computes the hits, the misses (token, expert) of the same visit run here, weighted by the
router exactly as the model combines experts: `y[t] += w * down(silu(gate(x[t])) * up(x[t]))` for every
missed (token, key, weight) triple, with the numerics of transformers' experts and of the slot-pool
kernel (moecache_kernels/expert_reference.py: float32 sums, gate, up, silu, the activation and the down
projection rounded to x's dtype, the weighted product too with `round_product`), the products summed in
fp32, returned in x's dtype or, given a float32 `out_TH`, in fp32: the experts module adds that to the
GPU half's fp32 sum and rounds once (docs/runtime.md, "One rounding").
The caller adds the shared expert itself, as the model does. All of a visit's misses go in ONE call:
triples are grouped by key, so each expert's weights are read once for all its tokens.

Backends:
- "cpp": `csrc/cpu_experts.cpp`, AVX-512 (gate/up: VDPBF16PS for bf16, FMA for fp32; down: the weights
  widened to fp32, FMA with the fp32 activations) in one OpenMP region, every
  thread streaming its share of each expert's rows: the decode GEMV is bound by memory bandwidth, which
  torch's small-M bf16 path leaves unused. Compiled with g++ on first use into a cache directory
  (`$MOECACHE_CPU_EXPERTS_CACHE`, else `~/.cache/moecache/cpu_experts`), loaded with ctypes (which
  releases the GIL for the call), no torch headers and no ninja needed.
- "torch": one `F.linear` pair per distinct expert (`moecache_kernels.expert_forward`: fp32, the same
  roundings), torch's intra-op threads.
- "auto": "cpp" where it builds and the CPU has the flags it needs, else "torch" with one warning line.
Asking for "cpp" where it cannot run is refused (MoecacheError naming the reason), not downgraded.

Concurrency: `run` releases the GIL for its heavy part (ctypes call / torch kernels), so `submit` runs it
on this executor's own worker thread while the caller's thread drives the GPU; one call at a time per
executor (a lock serialises them), since the workspaces are reused.

Shape legend: T tokens, H hidden, I intermediate, G global expert keys (layer * E + expert), M
(token, key, weight) triples, U distinct keys among them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from moecache_kernels import rounds_product, weighted_expert

from moecache.errors import MoecacheError

BACKENDS = ("auto", "cpp", "torch")
HOST_THREADS = ("work", "idle")  # the calling thread's part in the cpp backend's team (CpuExperts)
HOST_THREAD_ENV = "MOECACHE_CPU_HOST_THREAD"  # the default's override, for measuring "idle" in whole runs
DTYPES = (torch.bfloat16, torch.float32)
SOURCE = Path(__file__).with_name("csrc") / "cpu_experts.cpp"
CXX_FLAGS = (
    "-O3",
    "-std=c++17",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512bf16",
    "-mfma",
)
# /proc/cpuinfo flags the compiled code needs, per weight dtype.
CPU_FLAGS = {
    torch.float32: ("avx512f", "avx512bw", "avx512vl"),
    torch.bfloat16: ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
}
_DTYPE_CODE = {torch.bfloat16: 0, torch.float32: 1}
_warned: set[str] = set()


def cache_dir() -> Path:
    """Where the compiled library lives: $MOECACHE_CPU_EXPERTS_CACHE, else the user's cache directory."""
    env = os.environ.get("MOECACHE_CPU_EXPERTS_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "moecache" / "cpu_experts"


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags (first 'flags' line of /proc/cpuinfo); empty where unreadable."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _compile(cxx: str, directory: Path) -> Path:
    """The shared library for this source, compiler and flag set, compiled once (atomic rename)."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256("\0".join([SOURCE.read_text(), version, *CXX_FLAGS]).encode()).hexdigest()[:16]
    lib = directory / f"cpu_experts_{digest}.so"
    if lib.exists():
        return lib
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        done = subprocess.run([cxx, *CXX_FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        if done.returncode != 0:
            first = next((ln for ln in done.stderr.splitlines() if "error" in ln), done.stderr.strip()[:200])
            raise OSError(f"{cxx} failed on {SOURCE.name}: {first}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.cache
def _load_library() -> ctypes.CDLL | str:
    """The loaded cpp backend, or the reason it cannot be built or loaded here (cached per process)."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler '{cxx}' on PATH (set CXX)"
    try:
        lib = ctypes.CDLL(str(_compile(cxx, cache_dir())))
    except OSError as exc:
        return str(exc)
    fn = lib.moecache_cpu_experts_run
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(RunArgs)]
    return lib


class RunArgs(ctypes.Structure):
    """`RunArgs` of csrc/cpu_experts.cpp, field for field: filled once, updated per call (cheaper than
    converting twenty ctypes arguments on every call)."""

    _fields_ = [
        (name, ctypes.c_int64)
        for name in (
            "dtype",
            "T",
            "H",
            "I",
            "G",
            "M",
            "w13_stride",
            "w2_stride",
            "threads",
            "host_idle",
            "out_f32",
            "round_product",
        )  # fmt: skip
    ] + [
        (name, ctypes.c_void_p)
        for name in ("x_TH", "w13", "w2", "key_M", "token_M", "weight_M", "order_M", "key_U", "start_U")
        + ("act_MI", "acc_TH", "out_TH")
    ]


def cpp_unavailable_reason(dtype: torch.dtype) -> str | None:
    """Why the cpp backend cannot run `dtype` weights on this machine, or None where it can (builds it)."""
    missing = [f for f in CPU_FLAGS[dtype] if f not in cpu_flags()]
    if missing:
        return f"CPU lacks {', '.join(missing)} (from /proc/cpuinfo)"
    lib = _load_library()
    return lib if isinstance(lib, str) else None


def _resolve_backend(backend: str, dtype: torch.dtype) -> str:
    if backend not in BACKENDS:
        raise MoecacheError(f"cpu experts backend '{backend}' is not one of {', '.join(BACKENDS)}")
    if backend == "torch":
        return "torch"
    reason = cpp_unavailable_reason(dtype)
    if reason is None:
        return "cpp"
    if backend == "cpp":
        raise MoecacheError(f"cpu experts backend 'cpp' cannot run here: {reason}")
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"cpu experts: the cpp backend cannot run ({reason}); using torch", stacklevel=3)
    return "torch"


def _check_weights(w13_GIH: torch.Tensor, w2_GHI: torch.Tensor) -> tuple[int, int, int]:
    """(G, H, I) of the two weight views; each expert's rows must be contiguous (any expert stride)."""
    if w13_GIH.dim() != 3 or w2_GHI.dim() != 3:
        raise MoecacheError(
            f"cpu experts: want w13 [G, 2I, H] and w2 [G, H, I], got {tuple(w13_GIH.shape)}"
            f" and {tuple(w2_GHI.shape)}"
        )
    g, two_i, h = w13_GIH.shape
    if two_i % 2 or tuple(w2_GHI.shape) != (g, h, two_i // 2):
        raise MoecacheError(
            f"cpu experts: w13 {tuple(w13_GIH.shape)} and w2 {tuple(w2_GHI.shape)} disagree"
            " (want [G, 2I, H] and [G, H, I])"
        )
    for name, w in (("w13", w13_GIH), ("w2", w2_GHI)):
        if w.device.type != "cpu" or w.dtype not in DTYPES:
            raise MoecacheError(
                f"cpu experts: {name} must be a CPU bfloat16 or float32 tensor, got {w.dtype} on {w.device}"
            )
        if w.stride(2) != 1 or w.stride(1) != w.shape[2]:
            raise MoecacheError(f"cpu experts: {name} rows are not contiguous (strides {w.stride()})")
    if w13_GIH.dtype != w2_GHI.dtype:
        raise MoecacheError(f"cpu experts: w13 is {w13_GIH.dtype} but w2 is {w2_GHI.dtype}")
    return g, h, two_i // 2


class CpuExperts:
    """A layer visit's missed experts on the CPU, from the canonical (host) weights of every expert.

    `w13_GIH` [G, 2I, H] (gate rows, then up rows) and `w2_GHI` [G, H, I] are CPU tensors of one dtype
    (bfloat16 or float32), indexed by global key; they are only read. `threads`: the cpp backend's
    OpenMP threads (default: this process's CPUs less one, left to the thread that drives the GPU
    meanwhile: idle OpenMP threads spin a while before they sleep); the torch backend sets torch's
    intra-op threads to it when given (a process-wide setting). The chosen backend is `self.backend`.
    `host_thread` (cpp): "work", the calling thread is one of those threads; "idle", it joins them
    without a share (the team is threads + 1; the default threads then leave no CPU idle), so the
    weights streamed do not flush its core's caches of what it runs between calls (default "work", or
    $MOECACHE_CPU_HOST_THREAD; "idle" measured slower in decode on an H100 host; equal results either way).
    """

    def __init__(
        self,
        w13_GIH: torch.Tensor,
        w2_GHI: torch.Tensor,
        *,
        threads: int | None = None,
        backend: str = "auto",
        host_thread: str | None = None,
    ) -> None:
        self.num_keys, self.hidden, self.inter = _check_weights(w13_GIH, w2_GHI)
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise MoecacheError(f"cpu experts: threads must be a positive integer, got {threads!r}")
        self.w13_GIH, self.w2_GHI, self.dtype = w13_GIH, w2_GHI, w13_GIH.dtype
        self.backend = _resolve_backend(backend, self.dtype)
        where = "host_thread"
        if host_thread is None:
            where, host_thread = f"${HOST_THREAD_ENV}", os.environ.get(HOST_THREAD_ENV, "work")
        if host_thread not in HOST_THREADS:
            raise MoecacheError(f"cpu experts: {where}={host_thread!r}, expected one of {list(HOST_THREADS)}")
        self.host_thread = host_thread
        self.threads = threads or max(1, len(os.sched_getaffinity(0)) - 1)
        self._torch_threads = threads
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._work: dict[str, torch.Tensor] = {}
        self._args: RunArgs | None = None
        self._fn = _load_library().moecache_cpu_experts_run if self.backend == "cpp" else None

    def run(
        self,
        x_TH: torch.Tensor,
        keys_M: torch.Tensor,
        token_M: torch.Tensor,
        weight_M: torch.Tensor,
        out_TH: torch.Tensor | None = None,
        round_product: bool | None = None,
    ) -> torch.Tensor:
        """`y[t] = sum over triples m with token_M[m] == t of weight_M[m] * expert_{keys_M[m]}(x[t])`.

        Every row of the result is written (zeros for tokens without a triple). `out_TH`, when given,
        receives it (shape of x, contiguous; x's dtype, or float32: the fp32 sums unrounded) and is
        returned. x must have the weights' dtype. `round_product`: each weighted product rounded to x's
        dtype (default: `rounds_product` of x's and weight_M's dtypes; a caller holding widened router
        weights passes the router's).
        """
        if round_product is None:
            round_product = rounds_product(x_TH.dtype, weight_M.dtype)
        x_TH, keys_M, token_M, weight_M, out_TH = checked_call(
            self.hidden, self.dtype, x_TH, keys_M, token_M, weight_M, out_TH, float32_out=True
        )
        t = x_TH.shape[0]
        with self._lock:
            if self.backend == "cpp":
                self._run_cpp(x_TH, keys_M, token_M, weight_M, out_TH, round_product)
            else:
                self._run_torch(x_TH, keys_M, token_M, weight_M, out_TH, t, round_product)
        return out_TH

    def bind(self, x_TH: torch.Tensor, out_TH: torch.Tensor, max_entries: int) -> BoundCall:
        """A `run` on fixed buffers, for a caller that computes into the same memory every time (the
        fast loop's host points): x_TH and out_TH (contiguous, kept alive and at their addresses by
        the caller) are checked once; each call's triples are written into the returned call's arrays
        and `call(m, round_product)` computes the first m of them (BoundCall)."""
        return BoundCall(self, x_TH, out_TH, max_entries)

    def submit(
        self,
        x_TH: torch.Tensor,
        keys_M: torch.Tensor,
        token_M: torch.Tensor,
        weight_M: torch.Tensor,
        out_TH: torch.Tensor | None = None,
    ) -> Future:
        """`run` on this executor's worker thread; the Future's result is y. The caller keeps the inputs
        alive and unchanged until then."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moecache-cpu-experts")
        return self._pool.submit(self.run, x_TH, keys_M, token_M, weight_M, out_TH)

    def close(self) -> None:
        """Stop the worker thread (if `submit` started one)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _workspace(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A reused buffer of at least `numel` elements: allocated only when a call needs more."""
        buf = self._work.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = self._work[name] = torch.empty(max(numel, 1), dtype=dtype)
        return buf

    def _base_args(self) -> RunArgs:
        """A call struct with this executor's fixed fields (weights, shape, team); the rest is the caller's."""
        w13, w2 = self.w13_GIH, self.w2_GHI
        return RunArgs(
            dtype=_DTYPE_CODE[self.dtype], H=self.hidden, I=self.inter, G=self.num_keys,
            w13_stride=w13.stride(0), w2_stride=w2.stride(0), threads=self.threads,
            host_idle=int(self.host_thread == "idle"), w13=w13.data_ptr(), w2=w2.data_ptr(),
        )  # fmt: skip

    def _cpp_args(self, t: int, m: int) -> RunArgs:
        """The call struct, its workspaces grown (and their pointers refreshed) only when t or m exceed
        every earlier call's."""
        args = self._args
        if args is None:
            args = self._args = self._base_args()
            self._cap_t = self._cap_m = -1
        if m > self._cap_m:
            args.order_M = self._workspace("order", m, torch.int32).data_ptr()
            args.key_U = self._workspace("key_U", m, torch.int64).data_ptr()
            args.start_U = self._workspace("start_U", m + 1, torch.int32).data_ptr()
            args.act_MI = self._workspace("act", m * self.inter, torch.float32).data_ptr()
            self._cap_m = m
        if t > self._cap_t:
            args.acc_TH = self._workspace("acc", t * self.hidden, torch.float32).data_ptr()
            self._cap_t = t
        return args

    def _run_cpp(self, x_TH, keys_M, token_M, weight_M, out_TH, round_product: bool) -> None:
        t, m = x_TH.shape[0], keys_M.shape[0]
        args = self._cpp_args(t, m)
        args.T, args.M = t, m
        args.out_f32 = int(out_TH.dtype == torch.float32)
        args.round_product = int(round_product)
        args.x_TH, args.out_TH = x_TH.data_ptr(), out_TH.data_ptr()
        args.key_M, args.token_M, args.weight_M = keys_M.data_ptr(), token_M.data_ptr(), weight_M.data_ptr()
        rc = self._fn(args)
        if rc != 0:
            raise self._bad_triple(-rc - 1, keys_M, token_M, t)

    def _bad_triple(self, m: int, keys_M, token_M, t: int) -> MoecacheError:
        return MoecacheError(
            f"cpu experts: triple {m} has key {int(keys_M[m])} (want [0, {self.num_keys}))"
            f" and token {int(token_M[m])} (want [0, {t}))"
        )

    @torch.inference_mode()
    def _run_torch(self, x_TH, keys_M, token_M, weight_M, out_TH, t, round_product: bool) -> None:
        if self._torch_threads is not None and torch.get_num_threads() != self._torch_threads:
            torch.set_num_threads(self._torch_threads)
        bad_M = (keys_M.clamp(0, self.num_keys - 1) != keys_M) | (token_M.clamp(0, max(t - 1, 0)) != token_M)
        if bad_M.any():
            raise self._bad_triple(int(bad_M.nonzero()[0, 0]), keys_M, token_M, t)
        acc_TH = self._workspace("acc", t * self.hidden, torch.float32)[: t * self.hidden].view(
            t, self.hidden
        )
        acc_TH.zero_()
        order_M = torch.argsort(keys_M, stable=True)
        keys_U, count_U = torch.unique_consecutive(keys_M[order_M], return_counts=True)
        start = 0
        for key, count in zip(keys_U.tolist(), count_U.tolist(), strict=True):
            idx = order_M[start : start + count]
            start += count
            tok = token_M[idx]
            acc_TH.index_add_(
                0,
                tok,
                weighted_expert(x_TH[tok], self.w13_GIH[key], self.w2_GHI[key], weight_M[idx], round_product),
            )
        out_TH.copy_(acc_TH)


class BoundCall:
    """`CpuExperts.run(x_TH, keys_M[:m], token_M[:m], weight_M[:m], out_TH)` on buffers fixed at
    `CpuExperts.bind`: the caller writes a call's (key, token, weight) triples into `keys_M` (int64),
    `token_M` (int64) and `weight_M` (float32), numpy arrays of `max_entries`, then calls
    `call(m, round_product)` (`run`'s `round_product`: the router's weights are in x's dtype), which
    returns out_TH. With the cpp backend the call's arguments (every pointer, its own workspaces)
    are filled once, so a call sets two numbers and calls the library: the fewest Python steps between
    the routing's arrival and the experts' first weights, whose code and data the weights streamed by
    the previous call have pushed out of the caches. A bad key or token is refused as by `run`."""

    def __init__(self, executor: CpuExperts, x_TH: torch.Tensor, out_TH: torch.Tensor, max_entries: int):
        if max_entries < 1:
            raise MoecacheError(f"cpu experts: bind needs max_entries >= 1, got {max_entries}")
        if not (x_TH.is_contiguous() and out_TH.is_contiguous()):
            raise MoecacheError("cpu experts: bind needs contiguous x and out (they are used in place)")
        self.keys_M = np.zeros(max_entries, np.int64)
        self.token_M = np.zeros(max_entries, np.int64)
        self.weight_M = np.zeros(max_entries, np.float32)
        keys_t, token_t, weight_t = (torch.from_numpy(a) for a in (self.keys_M, self.token_M, self.weight_M))
        checked_call(
            executor.hidden, executor.dtype, x_TH, keys_t, token_t, weight_t, out_TH, float32_out=True
        )
        self.executor, self.x_TH, self.out_TH = executor, x_TH, out_TH
        self._tensors = (keys_t, token_t, weight_t)
        self._args = None
        self.last_ns = 0  # the host ns of the last call's computation alone (the library call, or `run`'s)
        if executor.backend == "cpp":
            t = x_TH.shape[0]
            work = {  # this call's own workspaces (`run`'s are the executor's)
                "order": torch.empty(max_entries, dtype=torch.int32),
                "key_U": torch.empty(max_entries, dtype=torch.int64),
                "start_U": torch.empty(max_entries + 1, dtype=torch.int32),
                "act": torch.empty(max_entries * executor.inter, dtype=torch.float32),
                "acc": torch.empty(t * executor.hidden, dtype=torch.float32),
            }
            args = self._args = executor._base_args()
            args.T, args.out_f32 = t, int(out_TH.dtype == torch.float32)
            args.x_TH, args.out_TH = x_TH.data_ptr(), out_TH.data_ptr()
            args.key_M, args.token_M = self.keys_M.ctypes.data, self.token_M.ctypes.data
            args.weight_M = self.weight_M.ctypes.data
            args.order_M, args.key_U = work["order"].data_ptr(), work["key_U"].data_ptr()
            args.start_U, args.act_MI = work["start_U"].data_ptr(), work["act"].data_ptr()
            args.acc_TH = work["acc"].data_ptr()
            self._work = work  # kept alive with the struct that points into them

    def __call__(self, m: int, round_product: bool) -> torch.Tensor:
        ex = self.executor
        with ex._lock:
            if self._args is not None:
                args = self._args
                args.M, args.round_product = m, round_product
                started = time.perf_counter_ns()
                rc = ex._fn(args)
                self.last_ns = time.perf_counter_ns() - started
                if rc != 0:
                    keys_t, token_t, _ = self._tensors
                    raise ex._bad_triple(-rc - 1, keys_t, token_t, self.x_TH.shape[0])
            else:
                keys_t, token_t, weight_t = self._tensors
                started = time.perf_counter_ns()
                ex._run_torch(
                    self.x_TH, keys_t[:m], token_t[:m], weight_t[:m], self.out_TH, self.x_TH.shape[0],
                    round_product,
                )  # fmt: skip
                self.last_ns = time.perf_counter_ns() - started
        return self.out_TH


def checked_call(
    hidden,
    dtype,
    x_TH,
    keys_M,
    token_M,
    weight_M,
    out_TH,
    who: str = "cpu experts",
    float32_out: bool = False,
):
    """The arguments of an executor's `run` (this module's, or a benchmark backend's with the same
    interface) checked, one MoecacheError line each, and made exact: x contiguous, keys and tokens int64,
    weights float32 (int32 -> int64, bf16/fp16 -> fp32: nothing copied when already so), `out_TH` a
    new tensor when None. `float32_out`: a float32 `out_TH` is accepted too (else x's dtype only).
    Returns (x_TH, keys_M, token_M, weight_M, out_TH)."""
    if x_TH.dim() != 2 or x_TH.shape[1] != hidden or x_TH.dtype != dtype:
        raise MoecacheError(f"{who}: x must be [T, {hidden}] {dtype}, got {x_TH.dtype} {tuple(x_TH.shape)}")
    m = keys_M.shape[0] if keys_M.dim() == 1 else -1
    if m < 0 or token_M.shape != (m,) or weight_M.shape != (m,):
        raise MoecacheError(
            f"{who}: keys, tokens and weights must be 1-D of one length, got"
            f" {tuple(keys_M.shape)}, {tuple(token_M.shape)}, {tuple(weight_M.shape)}"
        )
    if not (x_TH.is_cpu and keys_M.is_cpu and token_M.is_cpu and weight_M.is_cpu):
        raise MoecacheError(f"{who}: x, keys, tokens and weights must be CPU tensors")
    ints = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)
    if keys_M.dtype not in ints or token_M.dtype not in ints or not weight_M.is_floating_point():
        raise MoecacheError(
            f"{who}: keys and tokens must be integer tensors, weights floating point; got"
            f" {keys_M.dtype}, {token_M.dtype}, {weight_M.dtype}"
        )
    if keys_M.dtype != torch.int64 or not keys_M.is_contiguous():
        keys_M = keys_M.to(torch.int64).contiguous()
    if token_M.dtype != torch.int64 or not token_M.is_contiguous():
        token_M = token_M.to(torch.int64).contiguous()
    if weight_M.dtype != torch.float32 or not weight_M.is_contiguous():
        weight_M = weight_M.to(torch.float32).contiguous()
    x_TH = x_TH if x_TH.is_contiguous() else x_TH.contiguous()
    if out_TH is None:
        out_TH = torch.empty_like(x_TH)
    elif (
        out_TH.shape != x_TH.shape
        or out_TH.dtype not in ((x_TH.dtype, torch.float32) if float32_out else (x_TH.dtype,))
        or not out_TH.is_cpu
        or not out_TH.is_contiguous()
    ):
        dtypes = f"{x_TH.dtype} or torch.float32" if float32_out else str(x_TH.dtype)
        raise MoecacheError(
            f"{who}: out must be a contiguous CPU {dtypes} tensor of shape"
            f" {tuple(x_TH.shape)}, got {out_TH.dtype} {tuple(out_TH.shape)}"
        )
    return x_TH, keys_M, token_M, weight_M, out_TH

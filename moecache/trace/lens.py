"""The logit lens of `collect`: the token the model "would say" entering each MoE layer, on a sample.

For a sampled token t and MoE layer n, the trace's `lens_token` is
`argmax(lm_head(final_norm(h)))`, h being the hidden state (the residual stream) that enters the decoder
layer holding MoE layer n: the model's next-token guess after the decoder layers before it (for n = 0,
after the embeddings and any dense layers before the first MoE layer). The adapter names the modules
(`MoELayer.decoder_layer`, `final_norm()`, `lm_head()`, `lens_tokens`).

**Sampling.** Token (request_id, token_index) is sampled, at every MoE layer, when u < rate, u in [0, 1)
a splitmix64 hash of (seed, request_id, token_index) (`sampled_tokens`): deterministic for a seed, the
same whether the token comes in a prefill or a decode step, independent of the other tokens.

**Where it runs.** On the inference thread, in a forward pre-hook of each MoE layer's decoder layer,
under `torch.no_grad`, on the sampled rows of the step only. The result (an int tensor on the model's
device; no sync) travels with that layer's routing record, and the logger's writer thread copies it
to the host with the routing, so `RoutingLogger.log` stays a non-blocking append. Computing it in the
writer instead would mean keeping the hidden states alive and running the norm and the LM head on a
second thread while the model runs: on a GPU on the model's own stream (its cost would land inside
later forward steps, where it can be neither measured nor excluded), on a CPU competing for the same
cores. On the hook thread the cost is serial, bounded by the sample, and measurable.

**Timing.** `LogitLens.take_seconds()` returns the lens time since its last call, which `collect`
subtracts from each request's generation time. On the CPU it is the hooks' wall time; on CUDA, per
hook call, the larger of its host time and its kernels' device time (CUDA events, read once the
request has finished): the kernels run on the model's stream, so either the launches (host-bound
decode) or the kernels (device-bound prefill) add to the step's wall time. The per-step sampling
(hashing the step's token indices) is counted too.

Legend: T tokens of a forward step, N sampled rows, H hidden.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
import torch

from moecache.errors import MoecacheError

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
# Rows projected at once (bounds the [rows, vocab] logits of a long prefill).
CHUNK_ROWS = 1024


def _splitmix64(x_N: np.ndarray) -> np.ndarray:
    z = x_N + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def sampled_tokens(seed: int, request_id: str, token_index_N, rate: float) -> np.ndarray:
    """bool [N]: which of the request's tokens (by token_index) the lens samples at this rate."""
    token_N = np.asarray(token_index_N, np.int64).astype(np.uint64)
    if rate <= 0.0:
        return np.zeros(token_N.shape, bool)
    if rate >= 1.0:
        return np.ones(token_N.shape, bool)
    digest = hashlib.blake2b(f"{int(seed)}\0{request_id}".encode(), digest_size=8).digest()
    key = np.full(token_N.shape, int.from_bytes(digest, "little"), np.uint64)
    u_N = (_splitmix64(key + token_N * _GOLDEN) >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return u_N < rate


class LogitLens:
    """The sampled logit-lens projection for one model; `RoutingRecorder` drives it."""

    def __init__(self, adapter, rate: float, seed: int):
        rate = float(rate)
        if not 0.0 <= rate <= 1.0:
            raise MoecacheError(f"logging.logit_lens.rate={rate}: must be in [0, 1]")
        self.adapter = adapter
        self.rate = rate
        self.seed = int(seed)
        adapter.final_norm(), adapter.lm_head()  # a model without them fails here, before running
        self._request_id: str | None = None
        self._rows_N: np.ndarray | None = None  # the current step's sampled rows; None: none
        self._index_N: torch.Tensor | None = None  # the same on the device; None: every row
        self._num_tokens = 0
        self._host_seconds = 0.0  # host-timed work since the last take_seconds()
        self._events: list[tuple[float, torch.cuda.Event, torch.cuda.Event]] = []
        self.total_seconds = 0.0
        self.rows_projected = 0  # (token, MoE layer) rows given a lens token

    @property
    def active(self) -> bool:
        return self.rate > 0.0

    def start_request(self, request_id: str) -> None:
        self._request_id = request_id

    def start_step(self, first_token_index: int, num_tokens: int, device: torch.device) -> None:
        """Sample the step's tokens (first_token_index .. + num_tokens - 1 of the current request)."""
        start = time.perf_counter()
        self._num_tokens = num_tokens
        mask_T = sampled_tokens(
            self.seed,
            self._request_id,
            np.arange(first_token_index, first_token_index + num_tokens),
            self.rate,
        )
        rows_N = np.flatnonzero(mask_T)
        self._rows_N = rows_N if rows_N.size else None
        self._index_N = None
        if rows_N.size and rows_N.size < num_tokens:
            index_N = torch.from_numpy(rows_N)
            if device.type == "cuda":  # a pinned source: the copy does not wait for the stream
                self._index_N = index_N.pin_memory().to(device, non_blocking=True)
            else:
                self._index_N = index_N.to(device)
        self._host_seconds += time.perf_counter() - start

    def project(self, hidden: torch.Tensor) -> tuple[np.ndarray, torch.Tensor] | None:
        """(rows_N host int64, tokens_N int64 on the hidden state's device) for the step's sampled
        rows of `hidden` ([1, T, H] or [T, H], the residual stream entering a decoder layer); None
        when the step has no sampled token."""
        if self._rows_N is None:
            return None
        cuda = hidden.is_cuda
        start = time.perf_counter()
        if cuda:
            begin_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin_ev.record()
        hidden_TH = hidden.reshape(-1, hidden.shape[-1])
        if hidden_TH.shape[0] != self._num_tokens:
            raise MoecacheError(
                f"logit lens: a decoder layer got {hidden_TH.shape[0]} token rows, the step has {self._num_tokens}"
            )
        with torch.no_grad():
            hidden_NH = hidden_TH if self._index_N is None else hidden_TH.index_select(0, self._index_N)
            tokens_N = torch.cat([self.adapter.lens_tokens(chunk) for chunk in hidden_NH.split(CHUNK_ROWS)])
        self.rows_projected += int(self._rows_N.size)
        host = time.perf_counter() - start
        if cuda:
            end_ev.record()
            self._events.append((host, begin_ev, end_ev))
        else:
            self._host_seconds += host
        return self._rows_N, tokens_N

    def take_seconds(self) -> float:
        """Lens seconds since the last call (waits for the recorded CUDA events)."""
        seconds = self._host_seconds
        for host, begin_ev, end_ev in self._events:
            end_ev.synchronize()
            seconds += max(host, begin_ev.elapsed_time(end_ev) / 1e3)
        self._host_seconds, self._events = 0.0, []
        self.total_seconds += seconds
        return seconds

"""moecache's own greedy decode loop (batch 1): a StaticCache, static buffers, CUDA graphs between the
expert path's host points, over the Hugging Face model's own modules and forward.

    decoder = FastDecoder(model, max_cache_len=prompt_len + 64)   # a moecache.offload'ed model or not
    result = decoder.generate(input_ids, max_new_tokens=64)       # result.tokens [1, prompt + 64]
    fast_generate(model, input_ids, 64)     # the same, one shot: a DecodeResult (moecache/generation.py)

What runs (docs/runtime.md, "Fast decode loop"):
1. Prefill, eagerly, by transformers' own forward on the whole prompt into a `transformers.StaticCache`
   sized `max_cache_len` (its lazy buffers, the linear-attention conv/recurrent states of qwen3_5_moe
   included, are allocated there), the experts modules doing whole layer visits (the batched path).
2. Decode steps: the same forward on static input buffers (token id, position ids, and `cache_position`
   where the installed transformers still takes one), then the epilogue: greedy argmax into the static
   token buffer, which is the next step's input, and the positions advanced in place, on the device.
   The cache advances its own device-side length counter in place.
   - An offloaded model's experts modules are tapped (moecache/runtime/segments.py): "split" cuts the
     step at two host points per MoE layer (routing read-back + `manager.visit`; then commit + the CPU
     misses), "fused" (every expert resident, the mapping frozen) runs the slot-pool kernel inline with
     no host point; under a fixed placement split mode cuts only the layers that need it (segments.py,
     `layer_kinds`). An unmodified model runs its own experts, no host point.
   - On CUDA (graphs on by default) the first decode step of a mode runs eagerly (warm-up: kernel
     compilation, cuBLAS), then the step is captured once as CUDA graphs (one per segment, one private
     memory pool) and replayed for every later step, the host points between the replays. Capture
     happens once per decoder and mode; later `generate` calls replay at once. On the CPU the same
     segmented step runs eagerly.
3. Trace-forced routing (`forced=`, a ForcedRouting with the trace's router_weights; an offloaded model):
   the prefill is forced by the router hooks (attached for the call where the caller has not attached
   them); every decode step runs in split mode under `forced.supplied_by_caller()`: the hooks pass the
   router output through, and each MoE layer's host point writes the layer's next forced rows into the
   tap's static ids/weights buffers in place (segments.py) before the visit and the resident experts.

A decoder belongs to the `model.moecache` session it was built on: after `model.moecache.reconfigure`
it refuses to decode (one line); build a new FastDecoder (and drop the old one: it holds the old slot
pool and its graphs).

The transformers seams it relies on (present in 5.17 and 5.24): the CausalLM forward with `input_ids`,
`position_ids`, `use_cache`, `logits_to_keep` and the cache under `cache` (5.24) or `past_key_values`
(older), chosen by the forward's signature, `cache_position` passed only where the signature has it;
`StaticCache(config=, max_cache_len=)` and `Cache.reset()` (in place: the graphs' addresses stay).

Legend: T prompt tokens, N generated tokens (the token buffer holds max_cache_len), V vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
from dataclasses import dataclass

import torch
from torch import nn

from moecache.errors import MoecacheError
from moecache.runtime.layer_counters import LayerCounters
from moecache.runtime.segments import Segments

GRAPHS = ("auto", "on", "off")
HOST_POINTS = ("auto", "always")
MODES = ("dense", "split", "fused")  # an unmodified model; offloaded with host points; offloaded, frozen


@dataclass
class DecodeResult:
    """One `generate` call. Times in seconds; `decode_s` covers the `timed_steps` decode steps after the
    warm-up (eager steps before a capture, and the capture itself, are `warmup_s`)."""

    tokens: torch.Tensor  # int64 [1, T + N] on the CPU: the prompt, then the generated tokens
    logits: torch.Tensor | None  # float32 [N, V] on the CPU (keep_logits=True), else None
    prompt_tokens: int  # T
    mode: str  # dense | split | fused
    graphs_per_step: int  # CUDA graphs replayed per decode step (0: eager)
    prefill_s: float  # the prompt's forward, the first token included
    warmup_s: float
    decode_s: float
    timed_steps: int
    # The layer steps' counters over the timed steps (offloaded, split mode; else zeros): the host time
    # in the manager's calls, waiting for routing read-backs and on the CPU path, visits, CPU calls
    host: LayerCounters = dataclasses.field(default_factory=LayerCounters)

    @property
    def new_tokens(self) -> int:
        return int(self.tokens.shape[1]) - self.prompt_tokens

    @property
    def ms_per_token(self) -> float | None:
        return 1e3 * self.decode_s / self.timed_steps if self.timed_steps else None

    @property
    def manager_us_per_visit(self) -> float | None:
        return self.host.rates()["manager_us_per_visit"]

    @property
    def tokens_per_s(self) -> float | None:
        return self.timed_steps / self.decode_s if self.timed_steps and self.decode_s > 0 else None


class FastDecoder:
    """The decode loop of one model (module docstring). `graphs`: "auto" (on for CUDA), "on", "off";
    `host_points`: "auto" (none when the mapping is frozen) or "always" (split mode even then);
    `keep_logits`: keep every step's logits (float32, in the result); `warmup_steps`: eager decode
    steps of a mode before its capture (at least; with `compile`, warm-up goes on while a step still
    compiles something); `compile`: `torch.compile` the step (off by default; the expert taps stay
    outside the compiled regions); `forced`: a ForcedRouting (module docstring, 3.)."""

    def __init__(
        self,
        model: nn.Module,
        max_cache_len: int,
        *,
        graphs: str = "auto",
        host_points: str = "auto",
        keep_logits: bool = False,
        warmup_steps: int = 1,
        compile: bool = False,
        forced=None,
    ):
        from transformers import StaticCache

        if graphs not in GRAPHS:
            raise MoecacheError(f"fast decode: graphs={graphs!r}: expected one of {list(GRAPHS)}")
        if host_points not in HOST_POINTS:
            raise MoecacheError(
                f"fast decode: host_points={host_points!r}: expected one of {list(HOST_POINTS)}"
            )
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 2:
            raise MoecacheError(f"fast decode: max_cache_len={max_cache_len!r}: expected an integer >= 2")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise MoecacheError(f"fast decode: warmup_steps={warmup_steps!r}: expected an integer >= 1")
        self.model = model
        self.device = _model_device(model)
        on_cuda = self.device.type == "cuda"
        if graphs == "on" and not on_cuda:
            raise MoecacheError(f"fast decode: graphs=on needs a CUDA model; this one is on {self.device}")
        self.use_graphs = on_cuda and graphs != "off"
        self.host_points = host_points
        self.keep_logits = keep_logits
        self.warmup_steps = warmup_steps
        self.max_cache_len = max_cache_len
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._takes_cache_position = "cache_position" in params
        self._takes_logits_to_keep = "logits_to_keep" in params
        session = getattr(model, "moecache", None)
        self._session = session
        self._experts = _offloaded_experts(model) if session is not None else []
        self.forced = forced
        if forced is not None:
            _check_forced(forced, session, len(self._experts))
        self._taps = None
        if self._experts:
            from moecache.runtime.segments import ExpertsTaps

            self._taps = ExpertsTaps(session.runtime, Segments())
        self._segments = {mode: Segments() for mode in MODES}
        self._eager_steps = dict.fromkeys(MODES, 0)
        dev = self.device
        with torch.inference_mode():
            self.cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
            self.ids_11 = torch.zeros((1, 1), dtype=torch.long, device=dev)
            self.pos_11 = torch.zeros((1, 1), dtype=torch.long, device=dev)
            self.cache_pos_1 = torch.zeros(1, dtype=torch.long, device=dev)
            self.step_1 = torch.zeros(1, dtype=torch.long, device=dev)
            self.tokens_N = torch.zeros(max_cache_len, dtype=torch.long, device=dev)
        self.logits_NV: torch.Tensor | None = None  # allocated at the first prefill (vocabulary known)
        self._used = False
        # torch.compile of the step: the taps are left out of it (torch.compiler.disable), so each
        # compiled region is one segment; compiled at the first (warm-up) step of each mode.
        self._run_step = self._compiled_step() if compile else self._step

    def log_cpu_calls(self, log: list | None) -> None:
        """Log every CPU-path call of the offloaded model, the decode steps' host points' and the prefill's,
        into `log` as (tokens, entries, ns, uses) (ExpertsRuntime.cpu_log: calibrate's in-loop CPU-path
        rows); None: stop."""
        if self._taps is None:
            raise MoecacheError("fast decode: an unmodified model has no CPU path to log")
        self._taps.runtime.cpu_log = log

    def log_publish_lags(self, log: list | None) -> None:
        """Append every publish lag of the offloaded model's decode steps (ns from a deferred visit's last
        copy enqueue to the next layer's publication, segments.py `_route`) to `log` (calibrate's
        runtime.publish_lag); None: stop."""
        if self._taps is None:
            raise MoecacheError("fast decode: an unmodified model has no deferred visit to log")
        self._taps.publish_lag_log = log

    def _compiled_step(self):
        """`torch.compile` of the step, compiled (at the warm-up step) with a recompile limit above the
        number of decoder layers: each layer's forward is the same code with its own guards (its layer
        index, its kind), and dynamo's default limit (8) would leave every layer past the eighth eager.

        Each call returns whether dynamo compiled a frame in it: a step can compile frames the step
        before it did not (a model whose first layers are dense, DeepSeek-V2's, enters
        a decoder layer's frame resumed after an expert tap with another layer kind at its second
        step), and a compile while a CUDA graph is being captured fails the capture, so `_decode`
        warms up until a step compiles nothing."""
        import torch._dynamo.config as dynamo_config
        from torch._dynamo.utils import counters

        compiled = torch.compile(self._step, dynamic=False)
        name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
        layers = int(getattr(self.model.config.get_text_config(), "num_hidden_layers", 0) or 0)
        limit = max(getattr(dynamo_config, name), 2 * layers + 8)

        def run() -> bool:
            frames = counters["frames"]["total"]
            with dynamo_config.patch(**{name: limit}):
                compiled()
            return counters["frames"]["total"] != frames

        return run

    # ---- public ------------------------------------------------------------------------------------

    def generate(
        self, input_ids: torch.Tensor, max_new_tokens: int, *, eos_token_id=None, streamer=None
    ) -> DecodeResult:
        """Greedy continuation of `input_ids` ([1, T] or [T]): `max_new_tokens` tokens, fewer when
        `eos_token_id` (an id or a list) is generated (it is kept). `streamer`: transformers' streamer
        interface (`put` the prompt, then each token; `end`)."""
        if getattr(self.model, "moecache", None) is not self._session:
            raise MoecacheError(
                "fast decode: model.moecache is not the session this decoder was built on (reconfigure() "
                "or offload since): build a new FastDecoder"
            )
        prompt_T = self._check_prompt(input_ids, max_new_tokens)
        eos = _eos_set(eos_token_id)
        with torch.inference_mode(), _on_device(self.device), self._forcing(prompt_T, max_new_tokens):
            if streamer is not None:
                streamer.put(prompt_T.view(1, -1).cpu())
            t0 = time.perf_counter()
            first = self._prefill(prompt_T)
            self._sync()
            prefill_s = time.perf_counter() - t0
            if streamer is not None:
                streamer.put(torch.tensor([first]))
            # chosen after the prefill: its visits have uploaded every layer's mapping row
            mode = self._mode_for_this_call()
            budget = 0 if first in eos else max_new_tokens - 1
            self._install_taps(mode)
            try:
                with self._supplied():
                    steps, warmup_s, decode_s, timed, host = self._decode(mode, budget, eos, streamer)
            finally:
                self._install_taps(None)
            if streamer is not None:
                streamer.end()
            n = 1 + steps
            tokens = torch.cat([prompt_T.cpu(), self.tokens_N[:n].cpu()]).view(1, -1)
            # a copy: on the CPU .cpu() would alias the buffer the next call overwrites
            logits = self.logits_NV[:n].to("cpu", copy=True) if self.keep_logits else None
        return DecodeResult(
            tokens=tokens, logits=logits, prompt_tokens=int(prompt_T.numel()), mode=mode,
            graphs_per_step=len(self._segments[mode].graphs), prefill_s=prefill_s, warmup_s=warmup_s,
            decode_s=decode_s, timed_steps=timed, host=host,
        )  # fmt: skip

    def static_buffers(self) -> dict[str, torch.Tensor]:
        """The tensors a captured step reads and writes (their addresses never change)."""
        out = {
            "ids_11": self.ids_11, "pos_11": self.pos_11, "cache_pos_1": self.cache_pos_1,
            "step_1": self.step_1, "tokens_N": self.tokens_N,
        }  # fmt: skip
        if self.logits_NV is not None:
            out["logits_NV"] = self.logits_NV
        if self._taps is not None:
            t = self._taps
            out.update(tap_B=t.tap_B, y_TH=t.y_TH, cpu_TH=t.cpu_TH)
        return out

    # ---- the steps ---------------------------------------------------------------------------------

    def _mode_for_this_call(self) -> str:
        if self._taps is None:
            return "dense"
        if self.host_points == "always" or self.forced is not None:
            self._set_layer_kinds({})
            return "split"
        if self._taps.frozen():
            return "fused"
        self._set_layer_kinds(self._taps.layer_kinds())
        return "split"

    def _set_layer_kinds(self, kinds: dict[int, str]) -> None:
        """The split step's fused and CPU-only layers (ExpertsTaps.layer_kinds). A step captured with other
        kinds is dropped: the next split step warms up and is captured again."""
        taps = self._taps
        if kinds != taps.kind_L:
            taps.kind_L = kinds
            self._segments["split"] = Segments()
            self._eager_steps["split"] = 0

    def _decode(
        self, mode: str, budget: int, eos: set[int], streamer
    ) -> tuple[int, float, float, int, LayerCounters]:
        """Up to `budget` decode steps (stopping after an `eos` token): eager warm-up steps, the capture
        and its first replay (warm-up too: a streamer's gap for that step holds the capture), then
        replays (graphs on); eager steps otherwise. Returns (steps, warmup_s, decode_s, timed, the
        layer steps' counters over the timed steps)."""
        host = LayerCounters()
        segments = self._segments[mode]
        warmup_s = 0.0
        timed, t_start = 0, None
        compiled_last = False  # the last warm-up step compiled a frame (compile=True; `_compiled_step`)
        for step in range(budget):
            t0 = time.perf_counter()
            warming = (
                not segments.graphs
                and t_start is None
                and (self._eager_steps[mode] < self.warmup_steps or compiled_last)
            )
            if warming:
                compiled_last = bool(self._run_step())
                self._eager_steps[mode] += 1
                self._sync()
                warmup_s += time.perf_counter() - t0
            elif self.use_graphs and not segments.graphs:  # the capture, and its first replay: warm-up
                segments.capture(self._run_step)
                if self._taps is not None:
                    self._taps.capture_waits()  # on_miss="split": each layer's wait call, a graph too
                    self._taps.capture_streams()  # decode_stream_share: the streamed misses' call, too
                segments.replay()
                self._sync()
                warmup_s += time.perf_counter() - t0
            else:
                if t_start is None:  # the timed stretch: every step from here on
                    if self._taps is not None:
                        self._taps.flush()  # the last warm-up step's deferred visit, outside the timing
                    self._sync()
                    t_start = time.perf_counter()
                    if self._taps is not None:
                        host_start = self._taps.runtime.counters.copy()
                segments.replay() if segments.graphs else self._run_step()
                timed += 1
            if self._taps is not None:
                self._taps.count_fused_step()  # the layers that ran with no visit call
            if eos or streamer is not None:
                token = int(self.ids_11.item())
                if streamer is not None:
                    streamer.put(torch.tensor([token]))
                if token in eos:
                    budget = step + 1
                    break
        if self._taps is not None:
            self._taps.flush()  # the last step's deferred visit (segments.py), timed with the steps
        decode_s = 0.0
        if t_start is not None:
            self._sync()
            decode_s = time.perf_counter() - t_start
            if self._taps is not None:
                host = self._taps.runtime.counters.since(host_start)
        return budget, warmup_s, decode_s, timed, host

    def _forward(self, input_ids, position_ids=None, cache_position=None, last_only=False):
        kwargs = {self._cache_kw: self.cache, "use_cache": True}
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        if cache_position is not None and self._takes_cache_position:
            kwargs["cache_position"] = cache_position
        if last_only and self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        return self.model(input_ids=input_ids, **kwargs).logits[:, -1]

    def _prefill(self, prompt_T: torch.Tensor) -> int:
        """The prompt through transformers' own forward (eager, batched), into the reset cache; the
        static buffers set for the first decode step. Returns the first generated token."""
        if self._used:
            self.cache.reset()
        self._used = True
        T = prompt_T.numel()
        logits_1V = self._forward(prompt_T.view(1, -1), last_only=True)
        if self.keep_logits and self.logits_NV is None:
            self.logits_NV = torch.zeros(
                (self.max_cache_len, logits_1V.shape[-1]), dtype=torch.float32, device=self.device
            )
        next_1 = logits_1V.argmax(-1)
        self.tokens_N[0] = next_1[0]
        if self.logits_NV is not None:
            self.logits_NV[0] = logits_1V[0].float()
        self.ids_11.copy_(next_1.view(1, 1))
        self.pos_11.fill_(T)
        self.cache_pos_1.fill_(T)
        self.step_1.fill_(1)
        return int(next_1.item())

    def _step(self) -> None:
        """One decode step on the static buffers: the forward (cut by the taps), then the epilogue."""
        logits_1V = self._forward(self.ids_11, self.pos_11, self.cache_pos_1)
        next_1 = logits_1V.argmax(-1)
        self.ids_11.copy_(next_1.view(1, 1))
        self.tokens_N.index_copy_(0, self.step_1, next_1)
        if self.logits_NV is not None:
            self.logits_NV.index_copy_(0, self.step_1, logits_1V.float())
        self.step_1.add_(1)
        self.pos_11.add_(1)
        self.cache_pos_1.add_(1)

    def _install_taps(self, mode: str | None) -> None:
        """Tap the offloaded experts for `mode`'s decode steps; None: back to whole layer visits."""
        taps = self._taps
        if taps is not None and mode is not None:
            taps.mode = "fused" if mode == "fused" else "split"
            taps.segments = self._segments[mode]
        if taps is not None:  # on CUDA the split step's B(l) copies the layer's row (segments.py)
            split_cuda = mode == "split" and taps.is_cuda
            taps.manager.row_uploads = "executor" if split_cuda else "manager"
        if taps is not None:
            taps.forced = self.forced if mode is not None else None
            if mode is None:
                taps.abandon()  # a step cut short by an error leaves no half-done visit behind
        for module in self._experts:
            module.tap = taps if mode is not None else None

    @contextlib.contextmanager
    def _forcing(self, prompt_T: torch.Tensor, max_new_tokens: int):
        """Forced routing for one call: the trace rows it needs checked, the hooks attached for the
        call unless the caller attached them (to this model)."""
        forced = self.forced
        if forced is None:
            yield
            return
        needed = int(prompt_T.numel()) + max_new_tokens - 1
        left = forced.rows_left()
        if left < needed:
            raise MoecacheError(
                f"fast decode: forced routing has {left} rows left in the current request, this call needs "
                f"{needed} ({prompt_T.numel()} prompt tokens + max_new_tokens={max_new_tokens} - 1)"
            )
        attached = forced.attached_to
        if attached is not None and attached is not self.model:
            raise MoecacheError("fast decode: forced routing is attached to another model; detach() it first")
        if attached is None:
            with forced.attach(self.model):
                yield
        else:
            yield

    def _supplied(self):
        """The decode steps: the host points supply the forced rows, the hooks pass through."""
        return self.forced.supplied_by_caller() if self.forced is not None else contextlib.nullcontext()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _check_prompt(self, input_ids, max_new_tokens) -> torch.Tensor:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise MoecacheError(f"fast decode: max_new_tokens={max_new_tokens!r}: expected an integer >= 1")
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1 or ids.numel() == 0:
            raise MoecacheError(
                f"fast decode: input_ids of shape {tuple(torch.as_tensor(input_ids).shape)}: expected one "
                "non-empty prompt ([1, T] or [T]; the loop decodes batch 1)"
            )
        if ids.numel() + max_new_tokens > self.max_cache_len:
            raise MoecacheError(
                f"fast decode: {ids.numel()} prompt tokens + max_new_tokens={max_new_tokens} exceed the "
                f"decoder's max_cache_len={self.max_cache_len}"
            )
        return ids.to(self.device, torch.long)


# ---- helpers -------------------------------------------------------------------------------------


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    raise MoecacheError(f"fast decode: {type(model).__name__} has no parameters")


def _offloaded_experts(model: nn.Module) -> list:
    from moecache.runtime.experts_module import OffloadedExperts

    found = [m for m in model.modules() if isinstance(m, OffloadedExperts)]
    if not found:
        raise MoecacheError("fast decode: the model has model.moecache but no OffloadedExperts module")
    return found


def _check_forced(forced, session, num_moe_layers: int) -> None:
    from moecache.runtime.forced_routing import ForcedRouting

    if not isinstance(forced, ForcedRouting):
        raise MoecacheError(f"fast decode: forced={type(forced).__name__}: expected a ForcedRouting")
    if session is None:
        raise MoecacheError(
            "fast decode: forced= needs a moecache.offload'ed model (the forced rows are written at its "
            "experts' host points); force an unmodified model through model.generate"
        )
    if not forced.has_weights:
        raise MoecacheError(
            "fast decode: forced= needs a trace with router_weights (the host points write the trace's "
            "weights; the router's own probabilities are not read back); force through model.generate"
        )
    if forced.num_layers != num_moe_layers:
        raise MoecacheError(
            f"fast decode: the model has {num_moe_layers} MoE layers, the forced trace {forced.num_layers}"
        )


def _eos_set(eos_token_id) -> set[int]:
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int | torch.Tensor):
        return {int(t) for t in torch.as_tensor(eos_token_id).view(-1).tolist()}
    return {int(t) for t in eos_token_id}


class _on_device:
    """`torch.cuda.device(d)` for a CUDA device, nothing otherwise."""

    def __init__(self, device: torch.device):
        self._ctx = torch.cuda.device(device) if device.type == "cuda" else None

    def __enter__(self):
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc):
        if self._ctx is not None:
            self._ctx.__exit__(*exc)

"""How `moecache validate` generates one request: the execution path of a run (`validate.loop`).

- `transformers`: `model.generate` (greedy, no EOS stop, DynamicCache, eager). Each generated token is
  stamped in a logits processor (moecache/token_clock.py, a device synchronize first on CUDA).
- `fast`: moecache's decode loop (moecache/runtime/decode_loop.py `FastDecoder`), one decoder per run
  (a decoder belongs to the `model.moecache` session it was built on), sized for the run's longest
  request. A forced offloaded model is decoded with `forced=` (its host points write the trace's rows;
  CUDA graphs on CUDA); an unmodified model with graphs off (the router hooks force it eagerly: a
  forced router inside a replayed graph would replay its capture-time ids). Tokens are stamped by a
  streamer (each decode step's token is read back, i.e. synchronized, before its stamp). The first
  decode steps of a decoder are its warm-up (eager steps, the capture): their gaps are flagged, and
  left out of the inter-token latencies and decode rates.

Every loop returns a `Generated`: tokens, the time to first token, the gaps between later tokens, how
many of the first gaps were warm-up, and the loop's label (`transformers`, `fast-graphs`, `fast-eager`).

Legend: N generated tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from moecache.errors import MoecacheError
from moecache.generation import LOOPS, fast_generate, transformers_generate
from moecache.runtime.layer_counters import LayerCounters
from moecache.token_clock import TokenStamps


@dataclass
class Generated:
    tokens: list[int]
    ttft_s: float
    gaps_s: list[float]  # N - 1 gaps between consecutive generated tokens
    warmup_gaps: int  # the first gaps that were the decoder's warm-up (eager steps, graph capture)
    loop: str
    # the fast loop's layer steps over its timed decode steps (a LayerCounters); None for transformers
    host: LayerCounters | None = None


class TransformersLoop:
    label = "transformers"

    def __init__(self, model, device: str, pad_id: int):
        self.model, self.cuda, self.pad_id = model, device.startswith("cuda"), pad_id
        self.device = device

    def generate(self, prompt_ids: tuple[int, ...], max_new_tokens: int) -> Generated:
        stamp = TokenStamps(self.cuda)
        input_ids = torch.tensor([list(prompt_ids)], device=self.device)
        start = time.perf_counter()
        out = transformers_generate(self.model, input_ids, max_new_tokens, stamp, pad_token_id=self.pad_id)
        tokens = out[0, input_ids.shape[1] :].tolist()
        times = stamp.times
        if len(times) != len(tokens):
            raise MoecacheError(f"validate: {len(times)} token times for {len(tokens)} tokens")
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        return Generated(tokens, times[0] - start, gaps, 0, self.label)

    def close(self) -> None:
        pass


class FastLoop:
    """One FastDecoder for the run (module docstring); `forced`: the run's ForcedRouting or None."""

    def __init__(self, model, max_cache_len: int, forced=None):
        from moecache.runtime.decode_loop import FastDecoder

        offloaded = getattr(model, "moecache", None) is not None
        if forced is not None and offloaded:
            self.decoder = FastDecoder(model, max_cache_len=max_cache_len, forced=forced)
        else:  # unmodified: its routers are forced by hooks the caller attached, so no graph may replay
            graphs = "off" if forced is not None else "auto"
            self.decoder = FastDecoder(model, max_cache_len=max_cache_len, graphs=graphs)

    def generate(self, prompt_ids: tuple[int, ...], max_new_tokens: int) -> Generated:
        stamps = TokenStamps(False)  # the decoder reads each token back (a synchronize) before its stamp
        start = time.perf_counter()
        result = fast_generate(self.decoder, torch.tensor([list(prompt_ids)]), max_new_tokens, stamps)
        tokens = result.tokens[0, result.prompt_tokens :].tolist()
        times = stamps.times
        if len(times) != len(tokens) or len(tokens) != max_new_tokens:
            raise MoecacheError(
                f"validate: the fast loop gave {len(tokens)} tokens ({len(times)} stamps), asked {max_new_tokens}"
            )
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        warmup = len(gaps) - int(result.timed_steps)
        loop = "fast-graphs" if result.graphs_per_step else "fast-eager"
        return Generated(tokens, times[0] - start, gaps, warmup, loop, result.host)

    def close(self) -> None:
        self.decoder = None  # it holds the session's slot pool and graphs: dropped before a reconfigure


def make_loop(name: str, model, *, device: str, pad_id: int, max_cache_len: int, forced=None):
    if name == "transformers":
        return TransformersLoop(model, device, pad_id)
    if name == "fast":
        return FastLoop(model, max_cache_len, forced)
    raise MoecacheError(f"validate.loop={name!r}: expected one of {', '.join(LOOPS)}")

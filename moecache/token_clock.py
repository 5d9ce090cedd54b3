"""When each generated token's logits are ready: the one token clock of `moecache validate` and calibrate.

`TokenStamps` is a transformers logits processor; `model.generate(..., logits_processor=[stamps])` calls
it once per generated token, right after that token's logits exist. On CUDA it first synchronizes the
device, so a stamp is the time the token's work really finished, not when it was enqueued. Stamp 0 is the
end of the prefill (time to first token); the differences of later stamps are the inter-token latencies.
"""

from __future__ import annotations

import time

import torch


class TokenStamps:  # a LogitsProcessor by protocol (no transformers import for it)
    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return scores

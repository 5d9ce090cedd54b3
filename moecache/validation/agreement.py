"""Output agreement of a run with the unmodified model on the same prompts (greedy decoding).

Per request: the token match count is the number of generated positions whose token equals the
reference's at the same position; the logit error is max |logits - reference logits| over the positions
up to and including the first mismatch (after it the two runs continue different prefixes, so their
logits are not comparable). Over a run: match rate = matches / positions, max logit error = the largest.

Legend: N generated positions of one request, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Agreement:
    matches: int = 0
    positions: int = 0
    max_logit_error: float = 0.0

    def add(self, ref_tokens: list[int], ref_logits_NV: torch.Tensor, tokens: list[int], logits_NV) -> None:
        n = min(len(ref_tokens), len(tokens))
        same = [a == b for a, b in zip(ref_tokens[:n], tokens[:n], strict=True)]
        self.matches += sum(same)
        self.positions += max(len(ref_tokens), len(tokens))
        upto = same.index(False) + 1 if False in same else n
        if upto:
            diff = (logits_NV[:upto].float() - ref_logits_NV[:upto].float()).abs().max().item()
            self.max_logit_error = max(self.max_logit_error, float(diff))

    @property
    def match_rate(self) -> float | None:
        return self.matches / self.positions if self.positions else None

"""Runs `slot_moe` on saved CPU inputs under Triton's interpreter, in a process of its own.

Triton decides when it is first imported whether its library functions are interpreted, so the CPU
tests cannot switch TRITON_INTERPRET=1 on inside a pytest process that may have imported triton already.
`python interpret_slot_moe.py CASES OUTPUTS` loads a list of input dicts (torch.save), runs each into an
output buffer poisoned with NaN and once without `out=`, and saves the list of (out=, returned) pairs.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported, by moecache_kernels.slot_moe

import torch  # noqa: E402
from moecache_kernels import slot_moe  # noqa: E402

ARGS = ("x_TH", "topk_ids_TK", "topk_weights_TK", "slot_of_E", "w13_SIH", "w2_SHI")


def main(cases_path: str, outputs_path: str) -> None:
    results = []
    for case in torch.load(cases_path):
        args = [case[name] for name in ARGS]
        out = torch.full_like(case["x_TH"], float("nan"))
        returned = slot_moe(*args, out=out)
        assert returned is out, "slot_moe(out=buf) must return buf"
        results.append((out, slot_moe(*args)))
    torch.save(results, outputs_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

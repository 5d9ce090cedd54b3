"""Runs `slot_moe` on saved CPU inputs under Triton's interpreter, in a process of its own.

Triton decides when it is first imported whether its library functions are interpreted, so the CPU
tests cannot switch TRITON_INTERPRET=1 on inside a pytest process that may have imported triton already.
`python interpret_slot_moe.py CASES OUTPUTS` loads a list of input dicts (torch.save), runs each into an
output buffer poisoned with NaN and once without `out=`, and saves the list of (out=, returned) pairs.
A case with a "config" entry runs the public `slot_moe` with that launch config in place of the one
`get_config` would pick (how the CPU tests reach blocks and prefill layouts that are not the default);
one with an "out_dtype" entry (float32) gets a poisoned output buffer of that dtype.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported, by moecache_kernels.slot_moe

import importlib  # noqa: E402

import torch  # noqa: E402
from moecache_kernels import slot_moe  # noqa: E402

# the module (its name is shadowed by the function in the package namespace), whose get_config slot_moe calls
KERNEL = importlib.import_module("moecache_kernels.slot_moe")

ARGS = ("x_TH", "topk_ids_TK", "topk_weights_TK", "slot_of_E", "w13_SIH", "w2_SHI")


def main(cases_path: str, outputs_path: str) -> None:
    results = []
    picked = KERNEL.get_config
    for case in torch.load(cases_path):
        args = [case[name] for name in ARGS]
        config = case.get("config")
        KERNEL.get_config = picked if config is None else (lambda *_, config=config: config)
        out = torch.full_like(case["x_TH"], float("nan"), dtype=case.get("out_dtype", case["x_TH"].dtype))
        returned = slot_moe(*args, out=out)
        assert returned is out, "slot_moe(out=buf) must return buf"
        results.append((out, slot_moe(*args)))
    torch.save(results, outputs_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

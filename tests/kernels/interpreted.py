"""Run a few lines of Python under Triton's interpreter in a process of their own, on saved inputs.

Triton decides when it is first imported whether its library functions are interpreted, so a test
process that may have imported triton already cannot switch TRITON_INTERPRET=1 on; the kernels' CPU
tests hand their inputs to a subprocess instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch


def run_interpreted(script: str, inputs, folder: Path, what: str, timeout: int = 300):
    """`script` (Python reading `torch.load(sys.argv[1])` and writing `torch.save(..., sys.argv[2])`) run
    with TRITON_INTERPRET=1 on `inputs`; returns what it saved. Fails the test, naming `what`, with the
    end of its stderr where it exits non-zero."""
    torch.save(inputs, folder / "inputs.pt")
    run = subprocess.run(
        [sys.executable, "-c", script, str(folder / "inputs.pt"), str(folder / "outputs.pt")],
        capture_output=True, text=True, timeout=timeout, env=os.environ | {"TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert run.returncode == 0, f"interpreted {what} failed:\n{run.stderr[-4000:]}"
    return torch.load(folder / "outputs.pt")

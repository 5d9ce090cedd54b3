"""benchmarks/bench_split_misses.py: bad arguments refused (exit 2, one line naming the flag), no CUDA refused
before any work; on CUDA, a small run's table rows and JSON line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.benchmarks.script_module import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_split_misses.py"


@pytest.mark.parametrize(("arg", "message"), [
    (["--shapes", "qwen3.6,llama"], "--shapes: unknown shape 'llama'"),
    (["--misses", "0"], "--misses: must be >= 1, got 0"),
    (["--warmup", "-1"], "--warmup: must be >= 0, got -1"),
])  # fmt: skip
def test_bad_arguments_are_refused(monkeypatch, capsys, arg, message):
    with pytest.raises(SystemExit) as exc:
        run_script(monkeypatch, capsys, SCRIPT, arg)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without CUDA")
def test_without_cuda_it_refuses_in_one_line(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exc:
        run_script(monkeypatch, capsys, SCRIPT, ["--shapes", "qwen3.6"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and err == [
        "bench_split_misses: needs CUDA (the host link is what it measures)"
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_every_split_is_timed(monkeypatch, capsys):
    argv = ["--shapes", "qwen3.6", "--misses", "2", "--repeats", "2", "--warmup", "0", "--max-pool-mib", "64"]
    got = run_script(monkeypatch, capsys, SCRIPT, argv)["shapes"]["qwen3.6"]
    rows = got["rows"]
    assert [r["streamed"] for r in rows] == [0, 1, 2]
    assert rows[0]["copy_alone_us"] == 0 and rows[-1]["cpu_alone_us"] == 0
    assert all(r["wall_us"] > 0 for r in rows) and rows[1]["copy_both_us"] > 0
    assert got["best_wall_us"] == min(r["wall_us"] for r in rows)

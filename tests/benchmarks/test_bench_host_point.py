"""benchmarks/bench_host_point.py on the CPU stand-in: both parts of every CPU layer's host point timed
(the second half of the decode steps' calls), the hooks removed afterwards; bad arguments refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from moecache.runtime import cpu_experts, segments
from tests.benchmarks.script_module import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_host_point.py"


def test_every_cpu_layer_host_point_is_timed_and_the_hooks_are_removed(monkeypatch, capsys):
    before = (
        cpu_experts.BoundCall.__call__,
        segments.ExpertsTaps._wait_readback,
        segments.ExpertsTaps._combine,
    )
    got = run_script(monkeypatch, capsys, SCRIPT, ["--new-tokens", "6", "--sweep-mib", "1"])
    layers = got["model"]["num_layers"]
    for part in ("pre", "post"):  # 5 decode steps x every layer on the CPU, the second half kept
        assert got[part]["calls"] == 5 * layers // 2 and 0 < got[part]["p10_us"] <= got[part]["median_us"]
    after = (
        cpu_experts.BoundCall.__call__,
        segments.ExpertsTaps._wait_readback,
        segments.ExpertsTaps._combine,
    )
    assert after == before


@pytest.mark.parametrize(("arg", "message"), [
    (["--sweep-mib", "-1"], "--sweep-mib -1: must be >= 0"),
    (["--new-tokens", "1"], "--new-tokens 1: must be >= 2"),
])  # fmt: skip
def test_bad_arguments_are_refused(monkeypatch, capsys, arg, message):
    with pytest.raises(SystemExit) as exc:
        run_script(monkeypatch, capsys, SCRIPT, arg)
    assert exc.value.code == 2 and message in capsys.readouterr().err

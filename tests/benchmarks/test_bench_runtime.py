"""benchmarks/bench_runtime.py on the null device: the manager section (the fast loop's manager calls
timed, `--sweep-mib` MiB read through the caches before each visit) and the cpu_call section (both forms
of the CPU half, warm and swept); a negative sweep is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.script_module import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_runtime.py"
ARGS = ["--device", "null", "--layers", "4", "--experts", "16", "--top-k", "2",
        "--capacity", "8", "--warm-tokens", "2", "--tokens", "4"]  # fmt: skip


def run(monkeypatch, capsys, *extra: str) -> dict:
    return run_script(monkeypatch, capsys, SCRIPT, [*ARGS, *extra])


@pytest.mark.parametrize("sweep", [0, 1])
def test_the_manager_section_times_the_fast_loop_calls(monkeypatch, capsys, sweep):
    m = run(monkeypatch, capsys, "--sections", "manager", "--sweep-mib", str(sweep))["manager"]
    assert m["sweep_mib"] == sweep and m["visits_timed"] == 4 * 4
    assert m["fast_loop_median_us"] > 0 and m["host_routing_median_us"] > 0


def test_a_negative_sweep_is_refused(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exc:
        run(monkeypatch, capsys, "--sections", "manager", "--sweep-mib", "-1")
    assert exc.value.code == 2 and "--sweep-mib -1: must be >= 0" in capsys.readouterr().err


def test_the_cpu_call_section_times_both_forms_warm_and_swept(monkeypatch, capsys):
    c = run(monkeypatch, capsys, "--sections", "cpu_call", "--sweep-mib", "1")["cpu_call"]
    forms = {"eager_median_us", "eager_swept_median_us", "bound_median_us", "bound_swept_median_us"}
    assert set(c) == forms | {"sweep_mib"} and all(c[k] > 0 for k in forms)

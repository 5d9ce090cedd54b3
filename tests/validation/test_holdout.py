"""The held-out fidelity's verdicts (moecache/validation/holdout.py): a direction meets the time target
with at least 90% of its predicted runs within 15%, the hit-rate target only with every one within one
point; fitted runs and runs without a prediction are not judged."""

from __future__ import annotations

from moecache.validation.holdout import summary


def row(direction: str, fit_on, role: str, time_ok, hit_ok=True) -> dict:
    return {
        "direction": direction, "fit_on": fit_on, "workload": direction.split(" -> ")[1], "role": role,
        "time_within_target": time_ok, "hit_rate_within_target": hit_ok,
    }  # fmt: skip


def test_ninety_percent_within_meets_the_time_target_and_one_hit_rate_miss_fails_its_own():
    table = [
        *[row("a -> b", "a", "predicted", i < 9) for i in range(10)],  # 9 of 10
        *[row("a -> b", "a", "fitted", False) for _ in range(2)],  # not judged
        *[row("b -> a", "b", "predicted", i < 8, hit_ok=i != 0) for i in range(10)],  # 8 of 10, a hit miss
        row("calibrate -> a", None, "predicted", None),  # no time prediction
    ]
    out = summary(table)
    ab, ba, cal = out["directions"]
    assert (ab["direction"], ab["fitted_runs"], ab["predicted_runs"]) == ("a -> b", 2, 10)
    assert ab["time_within"] == 9 and ab["time_within_share"] == 0.9 and ab["time_target_met"] is True
    assert ab["hit_rate_target_met"] is True
    assert (
        ba["time_target_met"] is False and ba["hit_rate_within"] == 9 and ba["hit_rate_target_met"] is False
    )
    assert cal["time_judged"] == 0 and cal["time_target_met"] is None and cal["fitted_runs"] == 0
    held = out["held_out"]  # the cross-workload directions' predicted runs, calibrate's left out
    assert held["predicted_runs"] == 20 and held["time_within"] == 17 and held["time_target_met"] is False


def test_without_a_cross_workload_direction_nothing_is_held_out():
    out = summary([row("calibrate -> a", None, "predicted", True)])
    assert out["held_out"] is None and [d["direction"] for d in out["directions"]] == ["calibrate -> a"]

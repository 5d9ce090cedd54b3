"""The report renders every figure and section from synthetic artifacts, skips absent ones, and is
deterministic; its helpers compute what the hand arithmetic in the comments says."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from moecache.errors import MoecacheError
from moecache.report import decision_text, figures, render_report, sections
from moecache.report.roles import label_roles, label_specs
from moecache.report.tables import unique_slugs
from moecache.sim.policy_spec import PolicySpec
from tests.report.report_artifacts import CAPACITIES, TRACES, sweep_rows, write_all, write_sweep

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SUFFIXES = ("hit_rate", "ms_per_token", "per_layer", "frequency_cdf", "reuse_runs", "layer_transitions")
SUFFIXES += ("drift_convergence", "prefetch_lead")
SLUGS = ("tiny_multi_request_seed0", "tiny_long_single_seed0")


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    return write_all(tmp_path_factory.mktemp("artifacts"))


@pytest.fixture(scope="module")
def rendered(artifacts, tmp_path_factory) -> list[dict]:
    """The full report rendered twice into two folders from the same artifacts."""
    out = []
    for name in ("first", "second"):
        folder = tmp_path_factory.mktemp(name)
        out.append(render_report(artifacts["analysis"], artifacts["sweep"], artifacts["decision"], folder))
    return out


def links(report: Path) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report.read_text())


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert len(data) > 1000, path
    assert data[:8] == PNG_MAGIC, path


def test_full_report_has_every_figure_and_section(rendered):
    result = rendered[0]
    report = result["report"]
    out = report.parent
    expected = {f"{s}-{x}.png" for s in SLUGS for x in SUFFIXES}
    expected |= {"overview.png", "decision_verdicts.png", "extensions.png"}
    assert {p.name for p in result["figures"]} == expected
    for path in result["figures"]:
        assert path.parent == out / "figures"
        assert_png(path)
    linked = links(report)
    assert sorted(linked) == sorted(f"figures/{name}" for name in expected)  # each figure linked once
    assert all((out / link).is_file() for link in linked)
    text = report.read_text()
    # one screen first: the decision in a sentence, five rows, the three figures; then details, traces,
    # and the long tables in the appendix
    opening = text.split("## The decision in detail")[0]
    assert opening.startswith("# moecache expert-offloading report\n\n**Use `lfu`** (`lfu`, params `{}`)")
    assert "1 capacity- or workload-specific win(s) by other policies; the largest:" in opening
    assert sum(line.startswith("|") for line in opening.splitlines()) == 2 + 5  # header, separator, 5 rows
    assert "| largest specific win | `transition_prefetch(budget=2,min_probability=0.1,top=8)` |" in opening
    assert "C=2 (25.0%): -10.00% [-12.00%, -8.00%]" in opening  # 2 slots of 2 x 4 experts
    assert re.findall(r"!\[[^\]]*\]\(([^)]+)\)", opening) == [
        "figures/overview.png", "figures/decision_verdicts.png", "figures/extensions.png"
    ]  # fmt: skip
    assert text.index("## The decision in detail") < text.index("## Trace") < text.index("## Appendix")
    assert "- lfu is competitive in every cell of the useful range" in text
    assert "equivalence margin ±2.00%" in text and "90% confidence" in text
    appendix = text.split("## Appendix")[1]
    parquet = re.findall(r"From \[`([^`]+)`\]\(([^)]+)\)\.", appendix)  # relative links that resolve
    assert [name for name, _ in parquet] == [
        "decide-abc/verdicts.parquet", "decide-abc/extensions.parquet", "sweep-abc/sweep.parquet"
    ]  # fmt: skip
    assert all((out / rel).is_file() for _, rel in parquet)
    # The candidate rows in the useful range: static_hindsight hit rate 0.11 x C in [0.2, 0.95] for
    # C = 2, 4, 8 (0.22, 0.44, 0.88), not C = 0; lfu's hit rate is 0.10 x C. rel_diff -0.0123 -> -1.23%,
    # CI [-0.031, 0.0045] -> [-3.10%, +0.45%]; bytes/token 1024.0 prints with 4 significant digits -> 1024.
    rows = [line for line in appendix.splitlines() if line.startswith("| tiny/")]
    assert len(rows) == 2 * 3 * 2  # lfu (candidate) and lru (other) at C = 2, 4, 8
    for trace, workload in TRACES.items():
        head = f"| {trace} | {workload} "
        assert (
            head
            + "| 2 | `lfu` | candidate | non_inferior | -1.23% | [-3.10%, +0.45%] | 0.2 vs 0.22 | 1024 |  |"
            in rows
        )
        assert (
            head + "| 4 | `lfu` | candidate | equivalent | +0.40% | [-1.20%, +1.50%] | 0.4 vs 0.44 | 1024 "
            "| hit rate deficit 0.04 |" in rows
        )
        assert (
            head + "| 8 | `lfu` | candidate | better | -5.00% | [-8.00%, -2.00%] | 0.8 vs 0.88 | 1024 |  |"
            in rows
        )
    assert (
        head + "| 8 | `lru` | other | worse | +10.00% | [+5.00%, +15.00%] | 0.64 vs 0.88 | 1024 |  |" in rows
    )
    for trace in TRACES:
        assert f"## Trace `{trace}`" in text
    # headline numbers: 0.123456 -> 4 significant digits; 30 / 48 = 0.625; a null prints n/a
    assert "| concentration | `global_gini` | 0.1235 |" in text
    assert "| reuse | `reuse_share_distance_1` | 0.625 |" in text
    assert "| layer MI | `mean_mi_bits` | 0.9 |" in text
    assert "| predictors | `recall_previous_token` | 0.75 |" in text
    assert "| drift | `mean_js_vs_previous` | n/a |" in text
    # capacity to target: lfu 0.10 x C reaches 0.5 first at C = 8 (0.8), never 0.9; belady 0.125 x C reaches
    # 0.5 at C = 4 and 0.9 at C = 8 (1.0)
    assert "| label | hit rate ≥ 0.5 | hit rate ≥ 0.9 |" in text
    assert "| `lfu` | 8 | not reached |" in text
    assert "| `belady(bypass=True,warm=True)` | 4 | 8 |" in text


def test_render_is_deterministic(rendered):
    first, second = rendered
    assert first["report"].read_bytes() == second["report"].read_bytes()
    assert [p.name for p in first["figures"]] == [p.name for p in second["figures"]]
    for a, b in zip(first["figures"], second["figures"], strict=True):
        assert a.read_bytes() == b.read_bytes(), a.name


def test_without_analysis_and_decision(artifacts, tmp_path):
    result = render_report(None, artifacts["sweep"], None, tmp_path / "out")
    expected = {f"{s}-{x}.png" for s in SLUGS for x in ("hit_rate", "ms_per_token", "per_layer")}
    expected.add("overview.png")
    assert {p.name for p in result["figures"]} == expected
    for path in result["figures"]:
        assert_png(path)
    text = result["report"].read_text()
    assert "The decision artifact is absent; this section is skipped." in text
    assert "The analysis artifact is absent; no headline numbers." in text
    assert text.count("The analysis artifact is absent; figure skipped.") == 2 * 5  # 5 analysis figures
    assert "**Use" not in text and "The decision artifact is absent; no decision is shown." in text
    assert sorted(links(result["report"])) == sorted(f"figures/{name}" for name in expected)
    assert "| `lfu` | 8 | not reached |" in text  # the sweep's targets are still shown


def test_missing_sweep_files_are_skipped(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    result = render_report(None, sweep, None, tmp_path / "out")
    assert result["figures"] == []
    text = result["report"].read_text()
    assert "sweep.parquet is absent from the sweep artifact" in text
    assert "No trace appears in any artifact." in text


def test_degenerate_sweep_single_capacity_without_time_estimate(tmp_path):
    rows = [r for r in sweep_rows() if r["capacity"] == 4]
    for r in rows:
        r["est_ms_per_token"] = None
    sweep = write_sweep(tmp_path / "sweep", rows)
    result = render_report(None, sweep, None, tmp_path / "out")
    assert len(result["figures"]) == 2 * 3 + 1  # and the overview
    for path in result["figures"]:
        assert_png(path)


def test_missing_column_names_the_file(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    table = pa.Table.from_pylist(sweep_rows()).drop_columns(["hit_rate"])
    pq.write_table(table, sweep / "sweep.parquet")
    with pytest.raises(MoecacheError, match=r"sweep.parquet: missing column\(s\) \['hit_rate'\]"):
        render_report(None, sweep, None, tmp_path / "out")


def test_belady_bound_prefers_warm_label():
    def row(params: str, capacity: int, hit: float, policy: str = "belady") -> dict:
        return {"policy": policy, "params": params, "capacity": capacity, "hit_rate": hit,
                "label": PolicySpec.from_row({"policy": policy, "params": params}).label()}  # fmt: skip

    warm, cold = '{"warm": true}', '{"warm": false}'
    rows = pa.Table.from_pylist(
        [row(warm, 2, 0.3), row(warm, 4, 0.6), row(cold, 2, 0.5), row("{}", 2, 0.9, "lfu")]
    )
    specs = label_specs(rows)
    cap, hit, source = figures.belady_bound(rows, specs)
    assert cap.tolist() == [2, 4] and hit.tolist() == [0.3, 0.6]  # the warm label alone
    assert source == "belady(bypass=True,warm=True)"
    no_warm = rows.filter(pc.invert(pc.equal(rows["params"], warm)))
    cap, hit, _ = figures.belady_bound(no_warm, label_specs(no_warm))
    assert cap.tolist() == [2] and hit.tolist() == [0.5]  # no warm label: max over Belady labels, lfu ignored
    lfu = rows.filter(pc.equal(rows["policy"], "lfu"))
    assert figures.belady_bound(lfu, label_specs(lfu)) is None


def test_roles_follow_the_decision_by_policy_and_params():
    specs = label_specs(pa.Table.from_pylist(sweep_rows()))
    decision = {"selected": {"policy": "lfu", "params": {"reset_per_request": False}},
                "baseline": {"policy": "static_hindsight", "params": {}}}  # fmt: skip
    # lfu {reset_per_request: false} is the sweep's `lfu` label (params "{}"): matched by value, not by label
    assert label_roles(decision, specs) == {
        "lfu": "selected", "static_hindsight": "baseline", "lru": "lru", "belady(bypass=True,warm=True)": "bound"
    }  # fmt: skip


def test_helpers_match_hand_arithmetic():
    # counts [2, 5, 3]: sorted [5, 3, 2], cumulative [5, 8, 10]; 0.8 x 10 = 8 first reached at the 2nd key,
    # 0.9 x 10 = 9 at the 3rd, 0.5 x 10 = 5 at the 1st
    counts = np.array([2, 5, 3])
    assert [figures.cover(counts, f) for f in (0.5, 0.8, 0.9)] == [1, 2, 3]
    assert figures.cover(np.zeros(3), 0.8) is None
    # transitions 0->0 x1, 0->1 x3: row 0 = [1/4, 3/4]; expert 1 never a "from": NaN row
    p = figures.row_normalised(np.array([0, 0]), np.array([0, 1]), np.array([1, 3]), 2)
    assert p[0].tolist() == [0.25, 0.75] and np.isnan(p[1]).all()
    # values 1, 2, 3 with counts 2, 1, 1 in 2 log bins from 1 to 4: geomspace(1, 4, 3) = [1, 2, 4];
    # bin [1, 2) holds 2 of 4 -> 0.5, bin [2, 4] holds 1 + 1 of 4 -> 0.5
    edges, share = figures.log_histogram(np.array([1, 2, 3]), np.array([2, 1, 1]), bins=2)
    assert edges.tolist() == [1, 2, 4] and share.tolist() == [0.5, 0.5]
    # 10 layers, 6 evenly spaced: round(linspace(0, 9, 6)) = round([0, 1.8, 3.6, 5.4, 7.2, 9])
    # = 0, 2, 4, 5, 7, 9
    assert figures.spaced_layers(np.arange(10)).tolist() == [0, 2, 4, 5, 7, 9]
    assert unique_slugs(["a/b", "a_b", "a b"]) == {"a/b": "a_b", "a_b": "a_b-2", "a b": "a_b-3"}
    assert len(CAPACITIES) == 4


def test_decision_without_second_part_says_so():
    decision = {
        "selected": {"policy": "static_hindsight", "params": {}, "label": "static_hindsight"},
        "baseline": {"policy": "static_hindsight", "params": {}, "label": "static_hindsight"},
        "reasons": [],
        "rule": {"margin": 0.05, "confidence": 0.95},
    }
    assert decision_text.headline(decision).startswith(
        "**Use `static_hindsight`** (`static_hindsight`, params `{}`)"
    )
    text = decision_text.decision_details(decision)
    assert "- none recorded" in text
    # margin 0.05 -> 5.00%, confidence 0.95 -> 95%
    assert "equivalence margin ±5.00%; 95% confidence" in text
    assert decision_text.extensions_section(decision, None).endswith(
        "The decision judged no second-part policy.\n"
    )
    assert "| largest specific win | none |" in decision_text.five_rows(decision)


def test_extensions_section(rendered):
    text = rendered[0]["report"].read_text()
    section = text.split("## Every other policy (second part)")[1].split("\n## ")[0]
    assert (
        "| transition_prefetch | " in section
        and "| no | no | -4.00% | -4.00% | better 2, inconclusive 2 |" in section
    )
    # the win: one trace, held out, both capacities, r and interval each
    assert ("| `transition_prefetch(budget=2,min_probability=0.1,top=8)` | tiny/multi_request/seed0 | multi_request"
            " | held out | 2 of 2 | C=2 (25.0%): -10.00% [-12.00%, -8.00%]; C=4 (50.0%)") in section  # fmt: skip
    # every judged cell in the appendix: 2 traces x 2 capacities
    appendix = text.split("## Appendix")[1]
    assert (
        appendix.count(
            "| transition_prefetch | `transition_prefetch(budget=2,min_probability=0.1,top=8)` | held_out |"
        )
        == 4
    )


def test_prefetch_table_of_the_judged_cells():
    base = {"trace": "t", "mode": "timed", "bandwidth_scale": 1.0, "cpu_scale": 1.0, "gpu_scale": 1.0}
    sweep = pa.Table.from_pylist(
        [
            # 40 prefetches over 100 tokens; 30 used -> accuracy 0.75; 10 unused x 1000 B / 100 tokens = 100
            {**base, "label": "tp", "capacity": 8, "tokens": 100, "prefetches": 40, "prefetch_accuracy": 0.75,
             "prefetch_timely": 0.9, "prefetch_wasted_bytes": 10_000, "prefetch_lead_us_median": 250.0,
             "hit_rate": 0.5},
            {**base, "label": "tp", "capacity": 16, "tokens": 100, "prefetches": 1, "prefetch_accuracy": 1.0,
             "prefetch_timely": 1.0, "prefetch_wasted_bytes": 0, "prefetch_lead_us_median": 1.0, "hit_rate": 0.9},
        ]
    )  # fmt: skip
    judged = pa.Table.from_pylist([{"label": "tp", "trace": "t", "capacity": 8, "split": "held_out"}])
    text = sections.prefetch_table(sweep, judged)
    assert "| `tp` | t | 8 | 0.4 | 0.75 | 0.9 | 100 | 250 | 0.5 |" in text
    assert "| 16 |" not in text  # not a judged cell
    assert sections.prefetch_table(sweep.drop(["prefetches"]), judged) == "The sweep has no prefetch columns."

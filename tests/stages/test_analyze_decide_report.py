"""`moecache analyze -> sweep -> decide -> report` end to end on two small imported traces (one per
workload class), with lineage and reuse."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from moecache.cli import app
from moecache.config import compose
from moecache.errors import MoecacheError
from moecache.stages import analyze, decide, import_trace, report, sweep

LAYERS, EXPERTS, TOP_K = 3, 8, 2
SMALL = [  # `~key` then `+key=`: a dict override replaces the default policies (a plain `key=` merges)
    "~sweep.policies",
    "+sweep.policies={static_hindsight:[{}],lfu:[{reset_per_request:false},{reset_per_request:true}],lru:[{}],"
    "belady:[{warm:true,bypass:true}]}",
    "sweep.sensitivity.policies=[]",
    "analyze.history.candidates={lfu:[{reset_per_request:false}],lfu_window:[{window_tokens:16}]}",
    "decide.bootstrap.resamples=200",
    "analyze.window_tokens=8",
]


def _import(root: Path, npz: Path, name: str, workload: str) -> str:
    cfg = compose(
        [
            f"output_root={root}",
            f"trace_import.path={npz}",
            f"trace_import.name={name}",
            f"trace_import.workload={workload}",
            f"trace_import.num_layers={LAYERS}",
            f"trace_import.num_experts={EXPERTS}",
            f"trace_import.top_k={TOP_K}",
            "trace_import.expert_bytes=6291456",
            "trace_import.licence_file=null",
        ]
    )
    return import_trace.run(cfg).artifact.name


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, make_esft_npz):
    root = tmp_path_factory.mktemp("pipeline")
    npz = {
        name: make_esft_npz(root / f"{name}.npz", LAYERS, EXPERTS, TOP_K, lens, seed, random_weights=True)
        for name, lens, seed in (("multi", [20] * 10, 0), ("long", [200], 1))
    }
    multi = _import(root, npz["multi"], "multi", "multi_request")
    long = _import(root, npz["long"], "long", "long_single")
    base = [f"output_root={root}", f"traces=[{multi},{long}]", *SMALL]
    a = analyze.run(compose(base))
    s = sweep.run(compose(base))
    d = decide.run(compose(base))  # lineage: the newest sweep, the analysis over the same traces
    r = report.run(compose(base))  # lineage: the newest decision
    return root, base, a, s, d, r


def test_analysis_has_every_table_for_every_trace(pipeline):
    *_, a, _, _, _ = pipeline
    stems = (
        "frequency concentration request_drift window_drift convergence reuse runs token_transitions "
        "layer_transitions layer_mi predictors recurrence router_weight hit_rates history prefetch_lead"
    ).split()
    for stem in stems:
        table = pq.read_table(a.artifact / f"{stem}.parquet")
        assert set(table["trace"].to_pylist()) == {"multi", "long"}, stem
    # imported traces carry no logit-lens tokens: the token-signal table is written, empty
    assert pq.read_table(a.artifact / "token_signal.parquet").num_rows == 0
    lead = pq.read_table(a.artifact / "prefetch_lead.parquet").to_pylist()
    # 3 layers: leads 1 and 2 have predictions; lead 3 (the configured maximum) has none
    assert sorted({r["lead_layers"] for r in lead if r["tokens"]}) == [1, 2]
    assert {r["recall"] for r in lead if r["lead_layers"] == 3} == {None}
    assert all(r["lead_us"] > 0 for r in lead)  # the bundled profile's GPU time per layer
    summary = json.loads((a.artifact / "summary.json").read_text())
    assert summary["multi"]["requests"] == 10 and summary["long"]["tokens"] == 200
    # the adjacent-layer MI summary is the layer_mi table's mean (no other statistic overwrites it)
    mi = [
        r["mi_bits"]
        for r in pq.read_table(a.artifact / "layer_mi.parquet").to_pylist()
        if r["trace"] == "multi"
    ]
    assert summary["multi"]["mi_bits_mean"] == pytest.approx(sum(mi) / len(mi))
    assert summary["multi"]["token_gain"] is None  # no lens tokens in an imported trace
    freq = pq.read_table(a.artifact / "frequency.parquet").to_pylist()
    # every token makes LAYERS x TOP_K selections
    assert sum(r["count"] for r in freq if r["trace"] == "multi") == 200 * LAYERS * TOP_K


def test_decision_lineage_and_runtime_readable(pipeline):
    _, _, a, s, d, _ = pipeline
    decision = json.loads((d.artifact / "decision.json").read_text())
    assert decision["inputs"] == {"sweep": s.artifact.name, "analysis": a.artifact.name}
    assert decision["on_miss"] == "cpu"  # the sweep's sim.on_miss (its default here)
    assert decision["selected"]["policy"] in {"lfu", "static_hindsight", "lru"}
    # the second part judged every swept policy but the baseline's and belady, by (name, params)
    assert decision["extensions"]["judged"] == ["lfu", "lru"]
    assert decision["first_part"]["label"] in {
        "static_hindsight",
        "lfu(init_counts=None,reset_per_request=False)",
    }
    assert set(decision["best_generic"]) >= {"policy", "params", "label"}
    assert all({"policy", "params", "trace", "capacities", "cells"} <= set(w) for w in decision["wins"])
    cells = pq.read_table(d.artifact / "extensions.parquet")
    assert set(cells["policy"].to_pylist()) <= {"lfu", "lru"} and cells.num_rows > 0
    assert set(decision["workloads"]["required"]) == {"multi_request", "long_single"}
    verdicts = pq.read_table(d.artifact / "verdicts.parquet").to_pylist()
    units = {v["trace"]: v["unit"] for v in verdicts}
    assert units == {"multi": "request", "long": "block"}  # 10 requests >= 8; one request -> blocks
    manifest = json.loads((d.artifact / "manifest.json").read_text())
    assert manifest["inputs"] == [s.artifact.name, a.artifact.name]


def test_report_renders_and_stages_are_reused(pipeline):
    root, base, a, s, d, r = pipeline
    text = (r.artifact / "report.md").read_text()
    assert "figures/" in text
    for fig in (r.artifact / "figures").iterdir():
        assert fig.stat().st_size > 1000
    # re-running later stages reuses every earlier artifact
    assert analyze.run(compose(base)).reused and sweep.run(compose(base)).reused
    again = decide.run(compose(base))
    assert again.reused and again.artifact == d.artifact
    assert report.run(compose(base)).reused


def test_cli_decide_and_bad_lineage(pipeline, tmp_path):
    root, base, a, *_ = pipeline
    # the CLI takes only the keys decide reads (another stage's keys are refused)
    result = CliRunner().invoke(app, ["decide", f"output_root={root}", "decide.bootstrap.resamples=200"])
    assert result.exit_code == 0, result.output
    assert (
        result.output.strip()
        .splitlines()[-1]
        .endswith(
            json.loads(Path(result.output.strip().splitlines()[-1], "manifest.json").read_text())[
                "artifact_id"
            ]
        )
    )
    with pytest.raises(MoecacheError, match="no sweep artifact"):
        decide.run(compose([f"output_root={tmp_path}"]))
    with pytest.raises(MoecacheError, match="decide.sweep"):
        decide.run(compose([f"output_root={root}", f"decide.sweep={a.artifact.name}"]))

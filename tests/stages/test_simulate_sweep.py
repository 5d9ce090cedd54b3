"""`moecache simulate` and `moecache sweep` end to end on a small imported trace."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from moecache.cli import app
from moecache.config import compose
from moecache.errors import MoecacheError
from moecache.stages import import_trace, simulate, sweep

LAYERS, EXPERTS, TOP_K = 3, 8, 2


@pytest.fixture(scope="module")
def root(tmp_path_factory, make_esft_npz):
    root = tmp_path_factory.mktemp("sim")
    npz = make_esft_npz(root / "small.npz", LAYERS, EXPERTS, TOP_K, (40, 25, 35))
    cfg = compose(
        [
            f"output_root={root}",
            f"trace_import.path={npz}",
            "trace_import.name=small",
            f"trace_import.num_layers={LAYERS}",
            f"trace_import.num_experts={EXPERTS}",
            f"trace_import.top_k={TOP_K}",
            "trace_import.expert_bytes=6291456",
            "trace_import.licence_file=null",
        ]
    )
    import_trace.run(cfg)
    return root


def test_simulate_writes_metrics_per_layer_and_per_request(root):
    res = simulate.run(compose([f"output_root={root}", "capacity=[0,9,24]", "policy=lru"]))
    metrics = pq.read_table(res.artifact / "metrics.parquet").to_pylist()
    assert [m["capacity"] for m in metrics] == [0, 9, 24]
    assert metrics[0]["hit_rate"] == 0.0 and metrics[0]["transfers"] == 0
    assert metrics[2]["hit_rate"] > metrics[1]["hit_rate"] > 0
    assert all(m["h2d_bytes"] == m["transfers"] * 6291456 for m in metrics)
    assert metrics[0]["est_ms_per_token"] > metrics[2]["est_ms_per_token"] > 0
    layers = pq.read_table(res.artifact / "per_layer.parquet")
    assert layers.num_rows == 3 * LAYERS
    requests = pq.read_table(res.artifact / "per_request.parquet")
    assert requests.num_rows == 3 * 3
    again = simulate.run(compose([f"output_root={root}", "capacity=[0,9,24]", "policy=lru"]))
    assert again.reused and again.artifact == res.artifact


def test_simulate_on_miss_split_changes_only_where_misses_run(root):
    """sim.on_miss=split: the same hits and copies as cpu, a step never slower (w = 0 is cpu's step)."""
    runs = {
        mode: pq.read_table(
            simulate.run(
                compose([f"output_root={root}", "capacity=[9,24]", "policy=lru", f"sim.on_miss={mode}"])
            ).artifact
            / "metrics.parquet"
        ).to_pylist()
        for mode in ("cpu", "split")
    }
    for cpu, split in zip(runs["cpu"], runs["split"], strict=True):
        assert split["hit_rate"] == cpu["hit_rate"] and split["transfers"] == cpu["transfers"]
        assert split["est_ms_per_token"] <= cpu["est_ms_per_token"]


def test_sweep_grid_targets_and_sensitivity(root):
    res = sweep.run(compose([f"output_root={root}", "sweep.modes=[instant,timed]"]))
    table = pq.read_table(res.artifact / "sweep.parquet")
    for col in (
        "trace",
        "workload",
        "policy",
        "params",
        "capacity",
        "capacity_fraction",
        "hit_rate",
        "h2d_bytes",
        "transfers",
        "admissions",
        "evictions",
        "cpu_fallbacks",
        "ready_fraction",
        "est_ms_per_token",
        "est_tokens_per_s",
    ):
        assert col in table.column_names
    rows = table.to_pylist()
    grid = json.loads((res.artifact / "grid.json").read_text())["small"]
    assert grid[0] == 0 and grid[-1] == LAYERS * EXPERTS
    policies = {r["policy"] for r in rows}
    assert {"lru", "lfu", "static_hindsight", "belady"} <= policies
    # at full capacity the hindsight static placement hits everything; nothing hits at capacity 0
    full = [r for r in rows if r["capacity"] == LAYERS * EXPERTS and r["policy"] == "static_hindsight"]
    assert full and all(r["hit_rate"] == 1.0 for r in full)
    assert all(r["hit_rate"] == 0.0 for r in rows if r["capacity"] == 0)

    # sensitivity: halving the bandwidth never makes LRU faster
    def est(scale):
        return {
            r["capacity"]: r["est_ms_per_token"]
            for r in rows
            if r["policy"] == "lru"
            and r["mode"] == "timed"
            and r["bandwidth_scale"] == scale
            and r["cpu_scale"] == 1.0
            and r["gpu_scale"] == 1.0
        }

    slow, base = est(0.5), est(1.0)
    assert slow and all(slow[c] >= base[c] - 1e-9 for c in slow)  # sensitivity runs at the dense capacities
    targets = pq.read_table(res.artifact / "targets.parquet").to_pylist()
    hs = [
        t
        for t in targets
        if t["label"] == "static_hindsight" and t["mode"] == "instant" and t["bandwidth_scale"] == 1.0
    ]
    assert {t["target_hit_rate"] for t in hs} == {0.5, 0.8, 0.9} and all(
        t["capacity"] is not None for t in hs
    )

    # per block: summed per sweep row they give the row's totals; blocks stay inside one request
    # (requests of 40, 25 and 35 one-token steps, 16 steps per block -> 3 + 2 + 3 blocks)
    blocks = pq.read_table(res.artifact / "per_block.parquet").to_pylist()
    keys = ("trace", "label", "mode", "capacity", "bandwidth_scale", "cpu_scale", "gpu_scale")
    by_row: dict[tuple, list[dict]] = {}
    for b in blocks:
        by_row.setdefault(tuple(b[k] for k in keys), []).append(b)
    assert len(by_row) == len(rows)
    for r in rows:
        group = by_row[tuple(r[k] for k in keys)]
        assert [(b["request"], b["block"]) for b in group] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)] + [
            (2, 0),
            (2, 1),
            (2, 2),
        ]
        assert [b["tokens"] for b in group] == [16, 16, 8, 16, 9, 16, 16, 3]
        assert sum(b["hits"] for b in group) == round(r["hit_rate"] * r["accesses"])
        assert sum(b["transfers"] for b in group) == r["transfers"]
        assert sum(b["h2d_bytes"] for b in group) == r["h2d_bytes"]
        assert sum(b["est_us"] for b in group) == pytest.approx(r["est_total_ms"] * 1e3)
    layers = pq.read_table(res.artifact / "per_layer.parquet").to_pylist()
    base_rows = [r for r in rows if (r["bandwidth_scale"], r["cpu_scale"], r["gpu_scale"]) == (1.0, 1.0, 1.0)]
    assert len(layers) == LAYERS * len(base_rows)
    assert {(x["label"], x["capacity"]) for x in layers} == {(r["label"], r["capacity"]) for r in base_rows}


def _multirun_sweeps(root, launcher: list[str], policies: str) -> list[dict]:
    res = CliRunner().invoke(
        app,
        [
            "sweep",
            "-m",
            *launcher,
            f"policy={policies}",
            "capacity=6",
            f"output_root={root}",
            "sweep.modes=[instant]",
        ],
    )
    assert res.exit_code == 0, res.output
    return [
        json.loads((p / "manifest.json").read_text())
        for p in (root / "sweep").iterdir()
        if (p / "manifest.json").exists()
    ]


def test_multirun_with_joblib_two_jobs(root):
    made = _multirun_sweeps(root, ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"], "lru,static_cold")
    assert {tuple(m["config"]["policies"]) for m in made if m["config"]["capacity"] == 6} >= {
        ("lru",),
        ("static_cold",),
    }


def test_multirun_with_submitit_local_two_jobs(root):
    """The SLURM launcher's local twin: each job a separate process started by submitit."""
    made = _multirun_sweeps(
        root, ["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5"], "lfu,lru"
    )
    assert {tuple(m["config"]["policies"]) for m in made if m["config"]["capacity"] == 6} >= {
        ("lfu",),
        ("lru",),
    }


def test_capacity_as_percentage_and_memory_budget(root):
    """25% of 3 x 8 keys is 6 slots; 37.5 MiB of 6 MiB experts is 6 slots (6.25, rounded down)."""
    by_slots = simulate.run(compose([f"output_root={root}", "capacity=[0,6]", "policy=lru"]))
    mixed = simulate.run(compose([f"output_root={root}", "capacity=[0%,25%]", "policy=lru"]))
    budget = simulate.run(compose([f"output_root={root}", "capacity=[0B,37.5MiB]", "policy=lru"]))
    want = pq.read_table(by_slots.artifact / "metrics.parquet").to_pylist()
    for res in (mixed, budget):
        got = pq.read_table(res.artifact / "metrics.parquet").to_pylist()
        assert [r["capacity"] for r in got] == [0, 6]
        assert [r["hit_rate"] for r in got] == [r["hit_rate"] for r in want]
    one = sweep.run(compose([f"output_root={root}", "capacity=25%", "policy=lru", "sweep.modes=[instant]"]))
    assert json.loads((one.artifact / "grid.json").read_text()) == {"small": [6]}


def test_sweep_workers_do_not_change_the_artifact(root):
    args = [f"output_root={root}", "policy=lru", "capacity=6", "sweep.modes=[instant]"]
    one = sweep.run(compose([*args, "sweep.workers=1"]))
    two = sweep.run(compose([*args, "sweep.workers=2"]))
    assert two.reused and two.artifact == one.artifact
    other = sweep.run(compose([*args, "sweep.block_forward_steps=8"]))
    assert other.artifact != one.artifact


def test_bad_input_is_named(root, tmp_path):
    with pytest.raises(MoecacheError, match="capacity=-1"):
        simulate.run(compose([f"output_root={root}", "capacity=-1"]))
    with pytest.raises(MoecacheError, match="capacity=25"):
        simulate.run(compose([f"output_root={root}", "capacity=25"]))
    with pytest.raises(MoecacheError, match="unknown policy"):
        simulate.run(compose([f"output_root={root}", "capacity=3", "+policy.name=nope", "+policy.params={}"]))
    # a trace missing a required column
    trace = next((root / "import_trace").glob("*/trace.parquet"))
    table = pq.read_table(trace)
    bad = tmp_path / "bad.parquet"
    pq.write_table(table.drop_columns(["expert_ids"]).replace_schema_metadata(table.schema.metadata), bad)
    with pytest.raises(MoecacheError, match="expert_ids"):
        simulate.run(compose([f"output_root={root}", "capacity=3", f"traces=[{bad}]"]))
    # expert ids out of range for the metadata
    ids = pa.array([[e + 10 for e in row] for row in table["expert_ids"].to_pylist()], pa.list_(pa.int16()))
    out = tmp_path / "range.parquet"
    pq.write_table(
        table.set_column(table.column_names.index("expert_ids"), "expert_ids", ids).replace_schema_metadata(
            table.schema.metadata
        ),
        out,
    )
    with pytest.raises(MoecacheError, match="expert_ids range"):
        simulate.run(compose([f"output_root={root}", "capacity=3", f"traces=[{out}]"]))


def test_a_cost_profile_file_is_identified_by_its_content(root, tmp_path):
    bundled = next((Path(simulate.__file__).parents[1] / "data" / "cost_profiles").glob("*.json"))
    profile = tmp_path / "profile.json"
    profile.write_text(bundled.read_text())
    args = [f"output_root={root}", "capacity=6", "policy=lru", f"sim.cost_profile={profile}"]
    first = simulate.run(compose(args))
    assert simulate.run(compose(args)).reused
    profile.write_text(json.dumps(json.loads(bundled.read_text()), indent=1))  # same numbers, new bytes
    again = simulate.run(compose(args))
    assert not again.reused and again.artifact != first.artifact

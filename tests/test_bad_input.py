"""Every bad config value through the real CLI: exit code 2, one stderr line naming the culprit, no artifact.

Each row is one command line as a user would type it (a Hydra override list after the stage name). The
checks run before any trace is read, except a capacity above a trace's expert count, which needs that
trace's metadata and is refused before the first replay.
"""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from moecache.cli import app
from tests.conftest import write_trace

LAYERS, EXPERTS = 3, 8  # 24 expert keys


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    steps = [
        (r, s, layer, [[(r + s + layer) % EXPERTS, (3 * r + s + layer + 1) % EXPERTS]])
        for r in range(2)
        for s in range(6)
        for layer in range(LAYERS)
    ]
    return write_trace(tmp_path_factory.mktemp("trace") / "small.parquet", steps, LAYERS, EXPERTS)


T = "traces=[{trace}]"
CASES = [
    # unknown or mis-cased policy option: an error, never a silent fallback to lfu or the whole sweep
    (
        "policy-typo",
        ["simulate", T, "capacity=4", "policy=lruu"],
        "policy=lruu: no such option (did you mean lru?)",
    ),
    (
        "policy-case",
        ["simulate", T, "capacity=4", "policy=LRU"],
        "policy=LRU: no such option (did you mean lru?)",
    ),
    ("sweep-policy-typo", ["sweep", T, "policy=lruu"], "policy=lruu"),
    # the capacity syntax
    ("capacity-float", ["simulate", T, "capacity=3.7"], "capacity=3.7"),
    ("capacity-bool", ["simulate", T, "capacity=true"], "capacity=true"),
    ("capacity-empty", ["simulate", T, "capacity=[]"], "capacity=[]"),
    ("capacity-word", ["simulate", T, "capacity=abc"], "capacity='abc'"),
    ("capacity-negative", ["simulate", T, "capacity=-1"], "capacity=-1"),
    ("capacity-percent", ["simulate", T, "capacity=120%"], "capacity=120%"),
    ("capacity-unit", ["simulate", T, "capacity=3XB"], "unknown unit 'XB'"),
    ("capacity-list-item", ["simulate", T, "capacity=[4,2.5]"], "capacity[1]=2.5"),
    ("capacity-missing", ["simulate", T], "capacity is required"),
    ("capacity-above-experts", ["simulate", T, "capacity=25"], "capacity=25: more slots than experts (24"),
    ("sweep-capacity-float", ["sweep", T, "capacity=3.7"], "capacity=3.7"),
    # numeric sim and sweep keys
    ("bandwidth-word", ["simulate", T, "capacity=4", "sim.bandwidth_scale=abc"], "sim.bandwidth_scale='abc'"),
    ("cpu-scale-zero", ["simulate", T, "capacity=4", "sim.cpu_scale=0"], "sim.cpu_scale=0"),
    (
        "non-expert-negative",
        ["simulate", T, "capacity=4", "sim.non_expert_us_per_layer=-1"],
        "sim.non_expert",
    ),
    ("mode-unknown", ["simulate", T, "capacity=4", "sim.mode=fast"], "sim.mode='fast'"),
    ("on-miss-unknown", ["simulate", T, "capacity=4", "sim.on_miss=later"], "sim.on_miss='later'"),
    (
        "on-miss-instant",
        ["simulate", T, "capacity=4", "sim.mode=instant", "sim.on_miss=split"],
        "sim.on_miss=split: only a timed replay",
    ),
    ("targets-above-one", ["sweep", T, "sweep.targets=[1.5]"], "sweep.targets[0]=1.5"),
    ("dense-step-zero", ["sweep", T, "sweep.capacities.dense_step=0"], "sweep.capacities.dense_step=0"),
    ("fraction-above-one", ["sweep", T, "sweep.capacities.fractions=[2]"], "sweep.capacities.fractions[0]=2"),
    ("workers-zero", ["sweep", T, "sweep.workers=0"], "sweep.workers=0"),
    ("block-steps-zero", ["sweep", T, "sweep.block_forward_steps=0"], "sweep.block_forward_steps=0"),
    ("modes-empty", ["sweep", T, "sweep.modes=[]"], "sweep.modes=[]"),
    ("scale-key", ["sweep", T, "sweep.sensitivity.scales=[{bw:2}]"], "unknown key 'bw'"),
    # analyze's own keys, each named with its value before any trace is read
    (
        "analyze-coverage",
        ["analyze", T, "analyze.coverage=[1.5]"],
        "analyze.coverage[0]=1.5: expected a number in (0, 1]",
    ),
    (
        "analyze-coverage-column",
        ["analyze", T, "analyze.coverage=[0.5,0.501]"],
        "both name the column cover_50",
    ),
    ("analyze-window", ["analyze", T, "analyze.window_tokens=0"], "analyze.window_tokens=0"),
    (
        "analyze-convergence",
        ["analyze", T, "analyze.convergence_per_token_multiples=[0]"],
        "analyze.convergence_per_token_multiples[0]=0",
    ),
    ("analyze-lead", ["analyze", T, "analyze.max_lead_layers=0"], "analyze.max_lead_layers=0"),
    (
        "analyze-prefix",
        ["analyze", T, "analyze.history.prefix_fraction=1"],
        "analyze.history.prefix_fraction=1",
    ),
    (
        "analyze-history-multiple",
        ["analyze", T, "analyze.history.per_token_multiples=[-1]"],
        "analyze.history.per_token_multiples[0]=-1",
    ),
    # a cost profile's errors name the key and the value given
    (
        "profile-absent",
        ["simulate", T, "capacity=4", "sim.cost_profile=/nonexistent/profile.json"],
        "sim.cost_profile=/nonexistent/profile.json: no such file",
    ),
    (
        "profile-not-json",
        ["simulate", T, "capacity=4", "sim.cost_profile={trace}"],
        "sim.cost_profile={trace}: not valid JSON",
    ),
    (
        "profile-bundled",
        ["sweep", T, "sim.cost_profile=bundled:nope"],
        "sim.cost_profile=bundled:nope: no such bundled",
    ),
    (
        "profile-analyze",
        ["analyze", T, "sim.cost_profile=calibrate-000000000000"],
        "sim.cost_profile=calibrate-000000000000",
    ),
    # force must be a real boolean; seed an integer
    ("force-no", ["simulate", T, "capacity=4", "force=no"], "force='no'"),
    ("force-one", ["simulate", T, "capacity=4", "force=1"], "force=1"),
    ("seed-word", ["analyze", T, "seed=abc"], "seed='abc'"),
    (
        "traces-not-list",
        ["simulate", "traces=x.parquet", "capacity=4"],
        "traces='x.parquet': expected a list",
    ),
    # keys of another stage
    (
        "other-stage-key",
        ["simulate", T, "capacity=4", "decide.margin=9"],
        "`moecache simulate` does not read `decide`",
    ),
    (
        "other-stage-seed",
        ["simulate", T, "capacity=4", "seed=abc"],
        "`moecache simulate` does not read `seed`",
    ),
    (
        "other-stage-group",
        ["simulate", T, "capacity=4", "model=tiny"],
        "`moecache simulate` does not read `model`",
    ),
    ("report-reads-report", ["report", "sweep.workers=2"], "`moecache report` does not read `sweep`"),
    (
        "appended-other-stage-key",
        ["simulate", T, "capacity=4", "+decide.margin=9"],
        "+decide.margin=9: `moecache simulate` does not read `decide`",
    ),
    ("analyze-sweep-key", ["analyze", T, "sweep.targets=[0.5]"], "does not read `sweep.targets`"),
    # collect exists to log
    ("collect-logging-off", ["collect", "logging.enabled=false"], "logging.enabled=false"),
    # an unwritable output root fails before the computation
    (
        "output-root-under-file",
        ["simulate", T, "capacity=4", "output_root={trace}/sub"],
        "cannot write there",
    ),
    # Hydra's own failures are one line too
    ("override-syntax", ["simulate", T, "capacity=[4"], "bad config override"),
    (
        "unknown-key",
        ["simulate", T, "capacity=4", "sim.bandwith_scale=2"],
        "no such key `sim.bandwith_scale` (did you mean sim.bandwidth_scale?)",
    ),
    ("cfg-kind", ["simulate", "--cfg", "jobs"], "--cfg jobs: expected job, all or hydra"),
    # under -m: bad overrides, a bad value at any point, a job's own error
    ("multirun-policy-typo", ["simulate", "-m", T, "capacity=4", "policy=lru,lruu"], "policy=lruu"),
    ("multirun-capacity", ["simulate", "-m", T, "capacity=4,3.7"], "capacity=3.7"),
    ("multirun-syntax", ["simulate", "-m", T, "capacity=[4"], "bad config override"),
    ("multirun-other-stage", ["sweep", "-m", T, "capacity=4,6", "decide.margin=9"], "does not read `decide`"),
    (
        "multirun-job-error",
        ["simulate", "-m", T, "capacity=30,31", "policy=lru"],
        "capacity=30: more slots than",
    ),
]


@pytest.mark.parametrize("args,culprit", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(args, culprit, trace, tmp_path, monkeypatch):
    root = tmp_path / "out"
    monkeypatch.setenv("MOECACHE_OUTPUT_ROOT", str(root))
    argv = [a.replace("{trace}", str(trace)) for a in args]
    culprit = culprit.replace("{trace}", str(trace))
    res = CliRunner().invoke(app, argv)
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2, (argv, res.output, res.exception)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"moecache {argv[0]}: error: ") and culprit in lines[0], lines[0]
    published = list(root.rglob("manifest.json")) if root.exists() else []
    assert published == []

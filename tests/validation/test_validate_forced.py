"""`moecache validate` trace-forced, through the CLI, on the CPU: the real DeepSeek-V2-Lite ESFT law trace
(imported with an 8-token prefill step) forcing a random DeepSeek-V2-Lite-shaped model (26 MoE layers x
64 experts, top-6, 2 shared experts; model.random at a tiny width, no checkpoint), first 2 requests,
4 generated tokens each, one model offloaded once and reconfigured per run.

Both loops: every run's trace (the reference's and every strategy's) holds exactly the forcing trace's
expert ids and weights for the tokens it routed; every offloaded run's output agreement is forced by the
trace too; the artifact says which loop produced each run; with the fast loop every manager visit was
checked against the forcing trace. Bad forced input is one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from moecache.cli import app
from moecache.runtime.forced_routing import ForcedRouting
from moecache.trace.schema import read_trace
from tests.validation.test_validate_stage import decision

REPO = Path(__file__).resolve().parents[2]
# ../shared beside the checkout; on the device machine the trace travels in .device-data/ (carried)
ESFT = next(
    (p for p in (REPO / "../shared/data/traces/deepseek-v2-lite-esft/esft_law_routing.npz",
                 REPO / ".device-data/esft_law_routing.npz") if p.is_file()),
    REPO / "../shared/data/traces/deepseek-v2-lite-esft/esft_law_routing.npz",
)  # fmt: skip
pytestmark = pytest.mark.skipif(not ESFT.is_file(), reason="needs ../shared (the ESFT traces)")
PROMPT, NEW, REQUESTS = 8, 4, 2
L, E, K = 26, 64, 6
MODEL = [
    "model=deepseek_v2_lite", "model.path=null", "model.random.seed=0", "model.dtype=float32",
    "model.random.vocab_size=320", "model.experts_implementation=batched_mm",
    "model.random.overrides={hidden_size:64,intermediate_size:96,moe_intermediate_size:16,"
    "num_attention_heads:2,num_key_value_heads:2,kv_lora_rank:16,qk_nope_head_dim:8,qk_rope_head_dim:8,"
    "v_head_dim:8}",
]  # fmt: skip
STRATEGIES = "validate.strategies=[all_resident,all_cpu,lru_sync,selected]"


def run(root: Path, *overrides: str):
    return CliRunner().invoke(app, ["validate", f"output_root={root}", *MODEL, *overrides])


def imported(root: Path) -> Path:
    """`root` with the law trace imported (PROMPT-token prefill steps) and an lru decision."""
    res = CliRunner().invoke(app, [
        "import-trace", f"output_root={root}", f"trace_import.path={ESFT}", "trace_import.name=esft_law",
        f"trace_import.tokens_per_step={PROMPT}", "trace_import.licence_file=null",
    ])  # fmt: skip
    assert res.exit_code == 0, res.output
    decision(root, "lru")
    return root


def trace_id(root: Path) -> str:
    return next((root / "import_trace").iterdir()).name


@pytest.fixture(scope="module")
def trace_root(tmp_path_factory):
    root = imported(tmp_path_factory.mktemp("forced-out"))
    return root, trace_id(root)


def forced_validate(trace_root, loop: str):
    root, trace_id = trace_root
    res = run(
        root, f"validate.forced_trace={trace_id}", f"validate.forced_requests={REQUESTS}",
        f"validate.forced_max_tokens={NEW}", "validate.capacities=[25%]", STRATEGIES, f"validate.loop={loop}",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    folder = Path(res.stdout.strip().splitlines()[-1])
    runs = pq.read_table(folder / "runs.parquet").to_pylist()
    return folder, {(r["strategy"], r["capacity"]): r for r in runs}, root / "import_trace" / trace_id


@pytest.fixture(scope="module")
def transformers_run(trace_root):
    return forced_validate(trace_root, "transformers")


@pytest.fixture(scope="module")
def fast_run(trace_root):
    return forced_validate(trace_root, "fast")


def forcing_rows(trace_dir: Path) -> dict:
    forced = ForcedRouting.from_trace(trace_dir / "trace.parquet", num_layers=L, num_experts=E, top_k=K)
    table, _ = read_trace(trace_dir / "trace.parquet")
    return forced, table


def per_request(table, request_ids) -> dict:
    """request -> (ids [L, N, K], weights [L, N, K]) of a trace table (vectorised: the forcing trace is big)."""
    out = {}
    for rid in request_ids:
        rows = table.filter(pc.equal(table["request_id"].cast("string"), rid))
        order = np.lexsort((rows["token_index"].to_numpy(), rows["layer_id"].to_numpy()))
        ids = pc.list_flatten(rows["expert_ids"]).to_numpy().reshape(-1, K)[order].reshape(L, -1, K)
        w = pc.list_flatten(rows["router_weights"]).to_numpy().reshape(-1, K)[order].reshape(L, -1, K)
        out[rid] = (ids, w.astype(np.float32))
    return out


@pytest.mark.parametrize("which", ["transformers_run", "fast_run"])
def test_every_run_routes_exactly_the_forcing_trace(which, request):
    folder, runs, trace_dir = request.getfixturevalue(which)
    forced, table = forcing_rows(trace_dir)
    rids = forced.request_ids[:REQUESTS]
    want = per_request(table, rids)
    assert set(runs) == {("unmodified", None), ("all_resident", "all"), ("all_cpu", "0"),
                         ("lru_sync", "25%"), ("selected", "25%")}  # fmt: skip
    routed = PROMPT + NEW - 1
    for key, r in runs.items():
        assert r["requests"] == REQUESTS and r["prompt_tokens"] == REQUESTS * PROMPT, key
        assert r["generated_tokens"] == REQUESTS * NEW, key
        got_table = read_trace(folder / r["trace"])[0]
        assert sorted(set(got_table["request_id"].to_pylist())) == sorted(rids), key
        got = per_request(got_table, rids)
        for rid, (ids, w) in got.items():
            assert ids.shape == (L, routed, K), key
            assert np.array_equal(ids, want[rid][0][:, :routed]), key
            assert np.allclose(w, want[rid][1][:, :routed], atol=1e-6), key


def test_the_runs_agree_on_the_forcing_trace_and_the_artifact_names_the_loop(transformers_run, fast_run):
    for (folder, runs, _), loop in ((transformers_run, "transformers"), (fast_run, "fast")):
        result = json.loads((folder / "validation.json").read_text())
        assert result["workloads"] == ["esft_law"] and result["forced"][0]["has_router_weights"]
        assert result["reference"].startswith("unmodified") and result["model_build"].startswith("random")
        assert runs[("unmodified", None)]["reference"] is True
        agreement = result["agreement"]["esft_law"]
        assert agreement["routing"] == "forced by the trace esft_law" and agreement["runs"] == 4
        assert agreement["positions"] == PROMPT + NEW - 1  # the first request: what its runs route
        rows = pq.read_table(folder / "agreement.parquet").to_pylist()
        assert all(r["top1_agreement"] == 1.0 and r["max_abs_logit_error"] < 1e-3 for r in rows), loop
        assert runs[("all_cpu", "0")]["hit_rate"] == 0.0
        if loop == "transformers":
            assert {x["loop"] for x in runs.values()} == {"transformers"}
            assert {x["trace_source"] for x in runs.values()} == {"recorded"}
        else:  # the CPU: the fast loop steps eagerly
            assert {x["loop"] for x in runs.values()} == {"fast-eager"}
            assert {x["trace_source"] for x in runs.values()} == {"forcing trace"}
            for key, x in runs.items():  # every visit row of every offloaded run checked
                routed = REQUESTS * (PROMPT + NEW - 1) * L
                assert x["forced_rows_checked"] == (None if key[0] == "unmodified" else routed), key
        assert set(result["execution_per_run"].values()) == {x["loop"] for x in runs.values()}


def test_the_two_loops_agree(transformers_run, fast_run):
    _, slow, _ = transformers_run
    _, fast, _ = fast_run
    for key in slow:
        assert slow[key]["hit_rate"] == fast[key]["hit_rate"], key
        assert slow[key]["copies"] == fast[key]["copies"], key


def test_the_fast_loops_trace_carries_each_visits_cache_fields(transformers_run, fast_run):
    """The fast loop's trace is the forcing rows with each manager visit's cache columns: per row the
    same hits as the transformers loop's recorded trace, and over a run the admissions its counters
    report as copies; the unmodified run has no visit, its cache columns stay null."""
    slow_folder, slow, _ = transformers_run
    folder, runs, _ = fast_run
    key_cols = ["request_id", "token_index", "layer_id"]
    for key, r in runs.items():
        table = read_trace(folder / r["trace"])[0]
        hits = table["cache_hit"].to_pylist()
        if key[0] == "unmodified":
            assert all(h is None for h in hits), key
            continue
        assert all(h is not None for h in hits), key  # every row visited (no fused layer here)
        assert sum(len(a) for a in table["admitted"].to_pylist()) == r["copies"], key
        rows = sorted(zip(*(table[c].to_pylist() for c in key_cols), hits, strict=True))
        recorded = read_trace(slow_folder / slow[key]["trace"])[0]
        want = sorted(
            zip(*(recorded[c].to_pylist() for c in key_cols), recorded["cache_hit"].to_pylist(), strict=True)
        )
        assert rows == want, key


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["validate.loop=fast"], "validate.loop=fast: needs validate.forced_trace"),
        (["validate.forced_trace=import_trace-000000000000"], "import_trace-000000000000"),
        (["validate.forced_requests=0", "validate.forced_trace=x.parquet"], "validate.forced_requests=0"),
        (["validate.loop=quick"], "validate.loop='quick'"),
    ],
)
def test_bad_forced_input_is_one_line_exit_2(trace_root, overrides, message):
    root, _ = trace_root
    res = run(root, *overrides)
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_the_fast_loop_reports_its_host_points(transformers_run, fast_run):
    """The fast loop's runs say what their host points cost over the timed decode steps: the manager per
    visit, and the CPU path per call (and of it the executor's call) with its entries where a visit had
    misses; the transformers loop's runs, and the unmodified reference, say nothing."""
    _, slow, _ = transformers_run
    _, fast, _ = fast_run
    for key, row in fast.items():
        if key[0] == "unmodified":
            assert row["decode_manager_us_per_visit"] is None, key
            continue
        assert row["decode_manager_us_per_visit"] > 0, key
        assert row["decode_readback_wait_us_per_visit"] == 0.0, key  # the stand-in: nothing to read back
        if key[0] in ("all_cpu", "selected"):  # misses run on the CPU (lru_sync waits for its copies)
            assert row["decode_cpu_path_us_per_call"] > row["decode_cpu_exec_us_per_call"] > 0, key
            assert 1 <= row["decode_cpu_entries_per_call"] <= K, key  # one decode token: at most K entries
        if key[0] == "all_resident":
            assert row["decode_cpu_path_us_per_call"] is None, key  # no miss, no CPU call
            assert row["decode_cpu_exec_us_per_call"] is None, key
        # the publish lag: only where a deferred visit (on_miss="cpu") copied, never under a fixed placement
        if key[0] in ("all_resident", "all_cpu", "n_cpu_moe", "hindsight_static", "lru_sync"):
            assert row["decode_publish_lag_us"] is None, key
        elif row["copies"]:
            assert row["decode_publish_lag_us"] > 0, key
    # every run's decoder warm-up: its gaps' durations, one per warm-up gap (the fast loop: its first
    # decode step of a mode runs eagerly), none for the transformers loop
    for key, row in fast.items():
        assert len(row["warmup_gaps_ms"]) == row["warmup_gaps"] >= 1, key
        assert all(g > 0 for g in row["warmup_gaps_ms"]), key
    assert all(r["warmup_gaps_ms"] == [] for r in slow.values())
    assert all(r["decode_cpu_path_us_per_call"] is None for r in slow.values())
    assert all(r["decode_publish_lag_us"] is None for r in slow.values())
    assert all(r["decode_cpu_exec_us_per_call"] is None for r in slow.values())
    assert all(r["decode_readback_wait_us_per_visit"] is None for r in slow.values())


def test_a_fast_warm_up_decodes_in_a_decoder_as_long_as_its_runs(trace_root, monkeypatch):
    """validate.warmup=on with the fast loop: each warm-up generates WARMUP_TOKENS tokens in a decoder of
    the timed runs' length (their prompt and tokens), so the timed run's first step meets no new shape."""
    from moecache.validation import generation

    lengths = []  # the max_cache_len of every decoder validate builds, in order
    real = generation.make_loop

    def make_loop(name, model, **kw):
        lengths.append(kw["max_cache_len"])
        return real(name, model, **kw)

    monkeypatch.setattr(generation, "make_loop", make_loop)
    root, trace_id = trace_root
    res = run(
        root, f"validate.forced_trace={trace_id}", f"validate.forced_requests={REQUESTS}",
        f"validate.forced_max_tokens={NEW}", "validate.capacities=[25%]", "validate.loop=fast",
        "validate.strategies=[all_resident,lru_sync]", "validate.reference=all_resident", "validate.warmup=on",
        "validate.agreement_requests=0",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert len(lengths) == 4  # the reference's warm-up and run, lru_sync's warm-up and run
    assert set(lengths) == {PROMPT + NEW}


def test_a_warm_up_longer_than_its_runs_gets_a_decoder_it_fits(trace_root):
    """validate.forced_max_tokens=1 with the fast loop's warm-up: the warm-up's 2 tokens need a longer
    decoder than the timed runs' one token, and get it; a run without a decode step says so in the
    summary."""
    root, trace_id = trace_root
    res = run(
        root, f"validate.forced_trace={trace_id}", "validate.forced_requests=1", "validate.forced_max_tokens=1",
        "validate.capacities=[25%]", "validate.loop=fast", "validate.strategies=[all_resident]",
        "validate.reference=all_resident", "validate.warmup=on", "validate.agreement_requests=0",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    runs = pq.read_table(Path(res.stdout.strip().splitlines()[-1]) / "runs.parquet").to_pylist()
    assert [r["generated_tokens"] for r in runs] == [1]
    assert "no decode step, hit 1.000" in res.stderr


def test_repeated_runs_keep_the_median_repeat_in_alternating_rounds(trace_root):
    """validate.repeats=2: every offloaded run twice, the second round last to first; each row is the
    faster repeat's (the lower middle of two), lists both times, and names that repeat's trace; the
    reference runs once. validate.repeats=0 is one line, exit 2."""
    root, trace_id = trace_root
    common = [
        f"validate.forced_trace={trace_id}", "validate.forced_requests=1", f"validate.forced_max_tokens={NEW}",
        "validate.capacities=[25%]", "validate.strategies=[all_cpu,lru_sync]", "validate.agreement_requests=0",
    ]  # fmt: skip
    res = run(root, *common, "validate.repeats=2")
    assert res.exit_code == 0, res.output
    folder = Path(res.stdout.strip().splitlines()[-1])
    order = [line.split(":")[1].split()[1] for line in res.stderr.splitlines() if "(repeat " in line]
    assert order == ["all_cpu", "lru_sync", "lru_sync", "all_cpu"]
    runs = pq.read_table(folder / "runs.parquet").to_pylist()
    assert [r["strategy"] for r in runs] == ["unmodified", "all_cpu", "lru_sync"]
    assert len(runs[0]["time_per_token_ms_repeats"]) == 1 and runs[0]["hit_rate_repeats"] == [None]
    for r in runs[1:]:
        times = r["time_per_token_ms_repeats"]
        assert len(times) == 2 and r["time_per_token_ms"] == min(times)
        hits = r["hit_rate_repeats"]  # the stand-in lands every copy before the next visit: no race
        assert hits == [r["hit_rate"]] * 2
        first = times.index(min(times))
        assert r["trace"].endswith("-r1/trace.parquet") == (first == 1)
        assert (folder / r["trace"]).is_file()
    bad = run(root, *common, "validate.repeats=0")
    assert bad.exit_code == 2 and "validate.repeats" in bad.output


def test_an_all_resident_reference_runs_once_among_repeated_runs(trace_root):
    """validate.reference=all_resident with validate.repeats=2: the reference (the all_resident run)
    runs once, first; every other offloaded run twice."""
    root, trace_id = trace_root
    res = run(
        root, f"validate.forced_trace={trace_id}", "validate.forced_requests=1", f"validate.forced_max_tokens={NEW}",
        "validate.capacities=[25%]", "validate.strategies=[all_resident,lru_sync]", "validate.reference=all_resident",
        "validate.agreement_requests=0", "validate.repeats=2",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    runs = pq.read_table(Path(res.stdout.strip().splitlines()[-1]) / "runs.parquet").to_pylist()
    assert [(r["strategy"], r["reference"], len(r["time_per_token_ms_repeats"])) for r in runs] == [
        ("all_resident", True, 1),
        ("lru_sync", False, 2),
    ]

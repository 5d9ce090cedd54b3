"""Faults an operator meets: signals and killed processes while an artifact is written, damaged or
foreign artifacts, malformed traces (one verdict from every reader), and inputs checked before a model
is loaded. Each case is one line on stderr and exit code 2 (or, for a signal, the signal's status), with
no partial artifact and no temporary folder left behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from moecache import artifacts
from moecache.artifacts import TMP_PREFIX, ArtifactStore, owner_tag, remove_stale
from moecache.cli import app
from moecache.errors import MoecacheError
from tests.conftest import trace_table

REPO = Path(__file__).resolve().parents[1]
MOECACHE = str(Path(sys.executable).with_name("moecache"))
AID = "collect-0123456789ab"


def _wait_for_tmp(stage_dir: Path, proc: subprocess.Popen, timeout: float = 120.0) -> Path:
    """The temporary folder the process `proc` writes into, once it exists."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = list(stage_dir.glob(f"{TMP_PREFIX}*")) if stage_dir.is_dir() else []
        if found:
            return found[0]
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} first: {proc.stderr.read()}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("no temporary folder appeared")


WRITER = """
import sys, time
from moecache.artifacts import ArtifactStore
with ArtifactStore(sys.argv[1]).create("collect", schema_version=1, config={}, inputs=[], seed=0) as tmp:
    (tmp / "half.parquet").write_bytes(b"PAR1")
    time.sleep(60)
"""


def _default_signals() -> None:
    """In the child: the signals under test back to their defaults. A shell starts a background job with
    SIGINT ignored and `nohup` ignores SIGHUP; a process keeps an ignored signal ignored (Python raises no
    KeyboardInterrupt, the artifact store leaves an ignored SIGHUP alone), so the test would wait for
    nothing."""
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


@pytest.mark.parametrize(
    "signum,status",
    [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGHUP, 128 + signal.SIGHUP), (signal.SIGINT, None)],
    ids=["SIGTERM", "SIGHUP", "SIGINT"],
)
def test_a_signal_while_writing_leaves_no_artifact_and_no_temporary_folder(tmp_path, signum, status):
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)], stderr=subprocess.PIPE, text=True, cwd=REPO,
        preexec_fn=_default_signals,
    )  # fmt: skip
    _wait_for_tmp(tmp_path / "collect", proc)
    proc.send_signal(signum)
    code = proc.wait(timeout=30)
    if status is not None:
        assert code == status, proc.stderr.read()
    else:  # KeyboardInterrupt: Python ends by the signal
        assert code in (-signal.SIGINT, 128 + signal.SIGINT, 1), code
    assert list((tmp_path / "collect").iterdir()) == []


def test_sigterm_during_collect_exits_143_and_leaves_nothing(tmp_path):
    """The issue's case: `timeout -s TERM` during `moecache collect` (a scheduler, `docker stop`)."""
    env = {**os.environ, "MOECACHE_OUTPUT_ROOT": str(tmp_path)}
    proc = subprocess.Popen(
        [MOECACHE, "collect", "model=tiny", "generation.max_new_tokens=200"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
    )  # fmt: skip
    _wait_for_tmp(tmp_path / "collect", proc)
    time.sleep(0.5)  # inside the generation
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    assert list((tmp_path / "collect").iterdir()) == []
    assert proc.stdout.read() == ""  # no artifact path printed


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _tmp_folder(
    stage_dir: Path, pid: int, owner: str | None = None, stale: bool = False, aid: str = AID
) -> Path:
    name = f"{TMP_PREFIX}{'stale-' if stale else ''}{aid}-{owner or owner_tag()}-{pid}-0123abcd"
    path = stage_dir / name
    path.mkdir(parents=True)
    (path / "half.parquet").write_bytes(b"PAR1")
    return path


def test_the_next_run_removes_the_folder_of_a_killed_process_only(tmp_path):
    stage_dir = tmp_path / "collect"
    dead = _tmp_folder(stage_dir, _dead_pid())
    live = _tmp_folder(stage_dir, os.getppid())  # a live process: its run goes on
    other_host = _tmp_folder(
        stage_dir, _dead_pid(), owner="ffffffff" if owner_tag() != "ffffffff" else "00000000"
    )
    legacy = stage_dir / f"{TMP_PREFIX}{AID}-0123abcd"  # named by an older moecache: owner unknown
    legacy.mkdir()
    with ArtifactStore(tmp_path).create("collect", schema_version=1, config={}, inputs=[], seed=0):
        pass
    left = {p.name for p in stage_dir.iterdir()}
    assert dead.name not in left
    assert {live.name, other_host.name, legacy.name} <= left


def test_a_replaced_artifact_caught_between_its_renames_is_put_back(tmp_path):
    """SIGKILL between the two renames of a forced re-run leaves the old artifact as .tmp-stale-...:
    the next run restores it rather than deleting the only copy."""
    store = ArtifactStore(tmp_path)
    with store.create("collect", schema_version=1, config={"a": 1}, inputs=[], seed=0) as tmp:
        (tmp / "v.txt").write_text("old")
    (art,) = store.list()
    stale = tmp_path / "collect" / f"{TMP_PREFIX}stale-{art.id}-{owner_tag()}-{_dead_pid()}-0123abcd"
    os.rename(art.path, stale)
    remove_stale(tmp_path / "collect")
    assert (store.get(art.id).path / "v.txt").read_text() == "old"
    assert not stale.exists()


def test_sigkill_leaves_a_folder_that_the_next_run_removes(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)], stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    left = _wait_for_tmp(tmp_path / "collect", proc)
    proc.kill()
    proc.wait(timeout=30)
    assert left.is_dir()  # nothing can run on SIGKILL
    with ArtifactStore(tmp_path).create("collect", schema_version=1, config={"b": 1}, inputs=[], seed=0):
        pass
    assert not left.exists()


# --- damaged and foreign artifacts -------------------------------------------------------------------


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory) -> Path:
    steps = [(r, s, layer, [[(r + s + layer) % 8, (3 * r + s + layer + 1) % 8]]) for r in range(2)
             for s in range(6) for layer in range(3)]  # fmt: skip
    table, _ = trace_table(steps, 3, 8)
    path = tmp_path_factory.mktemp("trace") / "small.parquet"
    pq.write_table(table, path)
    return path


def _cli(*argv: str):
    res = CliRunner().invoke(app, list(argv))
    return res.exit_code, res.stderr.strip().splitlines(), res.stdout.strip().splitlines()


@pytest.fixture
def simulated(tmp_path, trace_file):
    argv = ["simulate", f"traces=[{trace_file}]", "capacity=4", f"output_root={tmp_path}"]
    code, err, out = _cli(*argv)
    assert code == 0, err
    return argv, Path(out[-1])


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-9] ^= 1  # inside the Parquet footer, same size
    path.write_bytes(bytes(data))


DAMAGE = [
    (
        "manifest-truncated",
        lambda a: _truncate(a / "manifest.json"),
        "manifest.json: not a readable manifest",
    ),
    ("manifest-not-object", lambda a: (a / "manifest.json").write_text("[]"), "a JSON object expected"),
    ("metrics-truncated", lambda a: _truncate(a / "metrics.parquet"), "metrics.parquet has"),
    ("metrics-changed", lambda a: _flip_last_byte(a / "metrics.parquet"), "metrics.parquet does not match"),
    ("file-missing", lambda a: (a / "per_layer.parquet").unlink(), "per_layer.parquet is missing"),
    (
        "manifest-of-another",
        lambda a: (a / "manifest.json").write_text(
            json.dumps(
                {**json.loads((a / "manifest.json").read_text()), "artifact_id": "simulate-000000000000"}
            )
        ),
        "is that of simulate-000000000000",
    ),
    (
        "manifest-without-files",
        lambda a: (a / "manifest.json").write_text(
            json.dumps(
                {k: v for k, v in json.loads((a / "manifest.json").read_text()).items() if k != "files"}
            )
        ),
        "no list of files",
    ),
]


@pytest.mark.parametrize("damage,culprit", [d[1:] for d in DAMAGE], ids=[d[0] for d in DAMAGE])
def test_a_damaged_artifact_is_one_line_and_recomputed_only_with_force(simulated, damage, culprit):
    argv, folder = simulated
    damage(folder)
    code, err, out = _cli(*argv)
    assert code == 2 and len(err) == 1, err
    assert str(folder) in err[0] and culprit in err[0] and "force=true" in err[0], err[0]
    assert out == []
    code, err, out = _cli(*argv, "force=true")
    assert code == 0, err
    assert Path(out[-1]) == folder
    code, err, out = _cli(*argv)  # the recomputed artifact is reused
    assert code == 0 and Path(out[-1]) == folder, err


def test_a_damaged_input_artifact_is_one_line(tmp_path, trace_file):
    code, err, out = _cli(
        "import-trace", f"output_root={tmp_path}", f"trace_import.path={trace_file}", "trace_import.format=parquet",
        "trace_import.name=small", "trace_import.run_id=small",
    )  # fmt: skip
    assert code == 0, err
    imported = Path(out[-1])
    _flip_last_byte(imported / "trace.parquet")
    code, err, _ = _cli("simulate", f"traces=[{imported.name}]", "capacity=4", f"output_root={tmp_path}")
    assert code == 2 and len(err) == 1 and "trace.parquet does not match" in err[0], err
    assert not (tmp_path / "simulate").exists() or not any((tmp_path / "simulate").iterdir())


def test_an_artifact_copied_anywhere_is_known_by_its_manifest(tmp_path):
    """An intact decide artifact outside the output root (under another folder name) is a decide
    artifact: the stage and id come from its manifest, not from the folders around it."""
    from moecache.stages.decide import _artifact

    store = ArtifactStore(tmp_path / "out")
    with store.create("decide", schema_version=2, config={"x": 1}, inputs=[], seed=0) as tmp:
        (tmp / "decision.json").write_text(json.dumps({"selected": {"policy": "lru", "params": {}}}))
    (art,) = store.list()
    copy = tmp_path / "elsewhere" / "my-decision"
    shutil.copytree(art.path, copy)
    found = _artifact(store, str(copy), "decide", "report.decision")
    assert found.stage == "decide" and found.id == art.id
    with pytest.raises(MoecacheError, match="a decide artifact, expected a sweep artifact"):
        _artifact(store, str(copy), "sweep", "decide.sweep")
    (copy / "decision.json").write_text("{}")
    with pytest.raises(MoecacheError, match="decision.json has 2 bytes"):
        _artifact(store, str(copy), "decide", "report.decision")


def test_each_artifact_is_hashed_once_per_process(tmp_path, monkeypatch):
    store = ArtifactStore(tmp_path)
    with store.create("collect", schema_version=1, config={}, inputs=[], seed=0) as tmp:
        (tmp / "a.bin").write_bytes(b"x" * 10)
    (art,) = store.list()
    artifacts._CHECKED.clear()
    calls = []
    real = artifacts.file_sha256
    monkeypatch.setattr(artifacts, "file_sha256", lambda p: calls.append(p) or real(p))
    store.get(art.id)
    store.resolve(str(art.path))
    assert len(calls) == 1


# --- one reader, one verdict --------------------------------------------------------------------------


def _set(table: pa.Table, name: str, array: pa.Array) -> pa.Table:
    return table.set_column(table.column_names.index(name), pa.field(name, array.type), array)


def _rows(table: pa.Table, change) -> pa.Table:
    rows = table.to_pylist()
    change(rows)
    return pa.Table.from_pylist(rows, schema=table.schema)


def _meta(table: pa.Table, **changes) -> pa.Table:
    from moecache.trace.schema import METADATA_KEY

    meta = json.loads(table.schema.metadata[METADATA_KEY]) | changes
    return table.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()})


def _row3(key, value):
    def change(rows):
        rows[3][key] = value

    return change


def _swap(rows):
    rows.insert(4, dict(rows[3]))


n = 36  # rows of the trace below
TRACES = [
    *(
        (f"no-{c}", lambda t, c=c: t.drop([c]), f"missing trace column(s) ['{c}']")
        for c in ("request_id", "step_index", "token_index", "phase", "layer_id", "expert_ids")
    ),  # fmt: skip
    ("phase-int", lambda t: _set(t, "phase", pa.array([1] * n, pa.int32())), "column 'phase' has type int32"),
    (
        "experts-float",
        lambda t: _set(t, "expert_ids", pa.array([[1.0, 2.0]] * n)),
        "column 'expert_ids' has type",
    ),
    (
        "experts-not-list",
        lambda t: _set(t, "expert_ids", pa.array([1] * n, pa.int16())),
        "column 'expert_ids'",
    ),
    ("weights-strings", lambda t: _set(t, "router_weights", pa.array([["a", "b"]] * n)), "a list of numbers"),
    ("weights-length", lambda t: _rows(t, _row3("router_weights", [1.0])), "one weight per expert"),
    ("lens-negative", lambda t: _rows(t, _row3("lens_token", -3)), "negative token id"),
    (
        "lens-string",
        lambda t: _set(t, "lens_token", pa.array(["a"] * n)),
        "column 'lens_token' has type string",
    ),
    ("phase-value", lambda t: _set(t, "phase", pa.array(["x"] * n)), "column 'phase' holds values"),
    ("layer-range", lambda t: _rows(t, _row3("layer_id", 7)), "column 'layer_id' is 7 at row 3"),
    ("expert-repeated", lambda t: _rows(t, _row3("expert_ids", [1, 1])), "repeats an expert at row 3"),
    ("row-duplicated", lambda t: _rows(t, _swap), "row 4 duplicates row 3"),
    ("no-rows", lambda t: t.slice(0, 0), "the trace has no rows"),
    ("meta-experts-zero", lambda t: _meta(t, num_experts=0), "'num_experts' must be a positive integer"),
    ("meta-run-string", lambda t: _meta(t, run="x"), "'run' must be an object"),
    ("meta-absent", lambda t: t.replace_schema_metadata({}), "not a moecache trace"),
]


def _verdicts(path: Path) -> dict[str, str]:
    """What every reader of a trace says of `path`: simulate and sweep (load_trace), analyze
    (load_token_trace), import-trace (its Parquet conversion) and validate's forced trace (read_trace)."""
    from moecache.analysis.tokens import load_token_trace
    from moecache.sim.trace_arrays import load_trace
    from moecache.stages.import_trace import _parquet
    from moecache.trace.schema import read_trace

    readers = {
        "simulate": lambda: load_trace(path),
        "analyze": lambda: load_token_trace(path),
        "import-trace": lambda: _parquet(path, {"run_id": "r"}, {}),
        "validate": lambda: read_trace(path),
    }
    out = {}
    for name, read in readers.items():
        try:
            read()
            out[name] = "accepted"
        except MoecacheError as exc:
            out[name] = str(exc)
    return out


@pytest.mark.parametrize("make,culprit", [c[1:] for c in TRACES], ids=[c[0] for c in TRACES])
def test_every_reader_gives_a_malformed_trace_the_same_one_line_verdict(tmp_path, make, culprit):
    steps = [(r, s, layer, [[(r + s + layer) % 8, (3 * r + s + layer + 1) % 8]]) for r in range(2)
             for s in range(6) for layer in range(3)]  # fmt: skip
    table, _ = trace_table(steps, 3, 8)
    assert table.num_rows == n
    path = tmp_path / "bad.parquet"
    pq.write_table(make(table), path)
    verdicts = _verdicts(path)
    assert len(set(verdicts.values())) == 1, verdicts
    (verdict,) = set(verdicts.values())
    assert verdict.startswith(f"{path}: ") and culprit in verdict and "\n" not in verdict, verdict


def test_simulate_refuses_a_trace_without_phase_in_one_line(tmp_path, trace_file):
    """The issue's case, through the CLI: a KeyError traceback before."""
    bad = tmp_path / "nophase.parquet"
    pq.write_table(pq.read_table(trace_file).drop(["phase"]), bad)
    for argv in (["simulate", f"traces=[{bad}]", "capacity=4"], ["sweep", f"traces=[{bad}]"]):
        code, err, _ = _cli(*argv, f"output_root={tmp_path / 'out'}")
        assert code == 2 and len(err) == 1 and "missing trace column(s) ['phase']" in err[0], err


# --- inputs checked before a model is loaded -----------------------------------------------------------


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: every check here must come before it."""
    import moecache.models

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the inputs were checked")

    monkeypatch.setattr(moecache.models, "load_model", refuse)


def _decision(root: Path, policy: str) -> Path:
    store = ArtifactStore(root)
    with store.create("decide", schema_version=2, config={"p": policy}, inputs=[], seed=0) as tmp:
        (tmp / "decision.json").write_text(json.dumps({"selected": {"policy": policy, "params": {}}}))
    return store.latest("decide").path


VALIDATE = ["validate", "validate.workloads=[multi_request]", "validate.capacities=[25%]"]


@pytest.mark.parametrize(
    "extra,culprit",
    [
        (["validate.cost_profile={bad_json}"], "validate.cost_profile="),
        (
            ["validate.cost_profile=/nonexistent/profile.json"],
            "validate.cost_profile=/nonexistent/profile.json: no such",
        ),
        (
            ["validate.forced_trace={bad_trace}", "validate.loop=transformers"],
            "missing trace column(s) ['phase']",
        ),
        (
            ["validate.forced_trace={trace}", "validate.forced_requests=9", "validate.loop=transformers"],
            "validate.forced_requests=9: the trace",
        ),
    ],
    ids=["profile-damaged", "profile-absent", "forced-trace-malformed", "forced-requests-above-trace"],
)
def test_validate_checks_its_inputs_before_loading_the_model(tmp_path, trace_file, no_model, extra, culprit):
    _decision(tmp_path, "lru")
    (tmp_path / "bad.json").write_text('{"schema_version": ')
    bad_trace = tmp_path / "nophase.parquet"
    pq.write_table(pq.read_table(trace_file).drop(["phase"]), bad_trace)
    values = {"bad_json": tmp_path / "bad.json", "bad_trace": bad_trace, "trace": trace_file}
    code, err, _ = _cli(*VALIDATE, f"output_root={tmp_path}", *(e.format(**values) for e in extra))
    assert code == 2 and len(err) == 1 and culprit in err[0], err


def test_validate_refuses_an_offline_selection_before_loading_the_model(tmp_path, no_model):
    _decision(tmp_path, "belady")
    code, err, _ = _cli(*VALIDATE, f"output_root={tmp_path}")
    assert code == 2 and len(err) == 1 and "offline policy" in err[0], err


def test_generate_refuses_an_offline_decision_before_loading_the_model(tmp_path, no_model):
    folder = _decision(tmp_path, "belady")
    code, err, _ = _cli(
        "generate", f"output_root={tmp_path}", "prompt=hi", "capacity=25%", "generation.max_new_tokens=2",
        f"runtime.decision={folder / 'decision.json'}",
    )  # fmt: skip
    assert code == 2 and len(err) == 1 and "runtime.decision=" in err[0] and "offline" in err[0], err


# --- damaged cost profiles ----------------------------------------------------------------------------


def _bundled() -> dict:
    from moecache.sim.inputs import BUNDLED_PROFILES

    return json.loads(next(iter(sorted(BUNDLED_PROFILES.glob("*.json")))).read_text())


PROFILES = [
    (
        "median-string",
        lambda d: d["cpu"][0].update(median_us="x"),
        "'cpu[0].median_us' must be a finite number",
    ),
    (
        "tokens-null",
        lambda d: d["cpu"][0].update(tokens_per_call=None),
        "'cpu[0].tokens_per_call' must be an integer",
    ),
    ("gbps-zero", lambda d: d["h2d"]["fit"].update(gbps=0), "'h2d.fit.gbps' must be a finite number > 0"),
    (
        "expert-bytes-string",
        lambda d: d["shape"].update(expert_bytes="x"),
        "'shape.expert_bytes' must be an integer",
    ),
    ("machine-list", lambda d: d.update(machine=[]), "'machine' must be an object"),
]


@pytest.mark.parametrize("damage,culprit", [p[1:] for p in PROFILES], ids=[p[0] for p in PROFILES])
def test_a_damaged_cost_profile_is_one_line_naming_the_key(tmp_path, damage, culprit):
    """Values of the wrong type were tracebacks inside the cost model's arithmetic."""
    from moecache.sim.inputs import load_profile

    data = _bundled()
    damage(data)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    with pytest.raises(MoecacheError) as err:
        load_profile(ArtifactStore(tmp_path), str(path), key="runtime.cost_profile")
    assert str(err.value).startswith(f"runtime.cost_profile={path}: ") and culprit in str(err.value), (
        err.value
    )


def test_validate_checks_the_model_s_shape_before_loading_it(tmp_path, no_model):
    """Capacities against the model's experts come from its config alone (moecache.models.loading's
    describe_model), before a weight is read."""
    _decision(tmp_path, "lru")
    argv = ["validate", "validate.workloads=[multi_request]", "validate.capacities=[1000]"]
    code, err, _ = _cli(*argv, f"output_root={tmp_path}")
    assert code == 2 and len(err) == 1 and "validate.capacities" in err[0] and "1000" in err[0], err

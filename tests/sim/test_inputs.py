"""Trace inputs (moecache/sim/inputs.py): names unique within a run, the same trace refused when listed
twice, and a file input identified by its content, so an overwritten file is never "reused"."""

from __future__ import annotations

import shutil

import pyarrow.parquet as pq
import pytest

from moecache.artifacts import ArtifactStore
from moecache.config import compose
from moecache.errors import MoecacheError
from moecache.sim.inputs import file_ref, is_trace_ref, resolve_traces, unique_names
from moecache.stages import import_trace, simulate
from tests.conftest import write_trace

LAYERS, EXPERTS = 2, 4


def steps(offset: int, tokens: int = 3):
    """Two requests of `tokens` decode tokens, one expert per layer; `offset` changes the routing."""
    return [
        (q, t, layer, [[(q + t + layer + offset) % EXPERTS]])
        for q in range(2)
        for t in range(tokens)
        for layer in range(LAYERS)
    ]


def test_unique_names_take_the_shortest_distinguishing_candidate():
    assert unique_names([["trace", "a/trace"], ["law", "x/law"]]) == ["trace", "law"]
    assert unique_names([["trace", "a/trace", "x/a/trace"], ["trace", "b/trace"]]) == ["a/trace", "b/trace"]
    assert unique_names([["t", "a/t", "x/a/t"], ["t", "a/t", "y/a/t"], ["u"]]) == ["x/a/t", "y/a/t", "u"]
    assert unique_names([["law", "law@import_trace-1"], ["law", "law@import_trace-2"]]) == [
        "law@import_trace-1",
        "law@import_trace-2",
    ]
    with pytest.raises(MoecacheError, match="both be named 'same'"):
        unique_names([["same"], ["same"]])


def test_same_named_files_both_appear_in_the_simulate_metrics(tmp_path):
    a = write_trace((tmp_path / "a").mkdir() or tmp_path / "a" / "trace.parquet", steps(0), LAYERS, EXPERTS)
    b = write_trace((tmp_path / "b").mkdir() or tmp_path / "b" / "trace.parquet", steps(1), LAYERS, EXPERTS)
    refs = resolve_traces(ArtifactStore(tmp_path / "out"), [str(a), str(b)])
    assert [r.name for r in refs] == ["a/trace", "b/trace"]
    res = simulate.run(compose([f"output_root={tmp_path / 'out'}", f"traces=[{a},{b}]", "capacity=2"]))
    metrics = pq.read_table(res.artifact / "metrics.parquet")
    assert sorted(set(metrics["trace"].to_pylist())) == ["a/trace", "b/trace"]
    assert metrics.num_rows == 2


def test_import_artifacts_with_one_name_get_their_ids_and_each_is_listed_once(tmp_path, make_esft_npz):
    ids = []
    for seed in (0, 1):
        npz = make_esft_npz(tmp_path / f"s{seed}.npz", LAYERS, EXPERTS, 2, [6, 4], seed)
        cfg = compose(
            [
                f"output_root={tmp_path / 'out'}", f"trace_import.path={npz}", "trace_import.name=law",
                f"trace_import.num_layers={LAYERS}", f"trace_import.num_experts={EXPERTS}", "trace_import.top_k=2",
                "trace_import.expert_bytes=1024", "trace_import.licence_file=null",
            ]
        )  # fmt: skip
        ids.append(import_trace.run(cfg).artifact.name)
    refs = resolve_traces(ArtifactStore(tmp_path / "out"), None)  # every trace artifact
    assert sorted(r.name for r in refs) == sorted(f"law@{i}" for i in ids)
    assert sorted(r.ref for r in refs) == sorted(ids)
    store = ArtifactStore(tmp_path / "out")
    folder = tmp_path / "out" / "import_trace" / ids[0]
    for twice in ([ids[0], str(folder)], [ids[0], str(folder / "trace.parquet")]):
        with pytest.raises(MoecacheError, match="names the same trace as"):
            resolve_traces(store, twice)


def test_the_same_trace_listed_twice_is_refused(tmp_path):
    a = write_trace(tmp_path / "t.parquet", steps(0), LAYERS, EXPERTS)
    store = ArtifactStore(tmp_path / "out")
    with pytest.raises(MoecacheError, match=r"names the same trace as") as err:
        resolve_traces(store, [str(a), str(tmp_path / "." / "t.parquet")])
    assert "\n" not in str(err.value) and "t.parquet" in str(err.value)


def test_a_file_is_identified_by_its_content(tmp_path):
    path = write_trace(tmp_path / "t.parquet", steps(0), LAYERS, EXPERTS)
    ref = file_ref(path)
    assert ref.startswith(f"{path}@sha256:") and len(ref.split("@sha256:")[1]) == 16 and is_trace_ref(ref)
    copy = tmp_path / "copy.parquet"
    shutil.copyfile(path, copy)
    assert file_ref(copy).split("@")[1] == ref.split("@")[1]  # same bytes, same digest


def test_overwriting_a_trace_file_changes_the_simulate_artifact(tmp_path):
    """The stale-input test: the old numbers must not come back as "reused"."""
    path = write_trace(tmp_path / "t.parquet", steps(0), LAYERS, EXPERTS)
    cfg = compose([f"output_root={tmp_path / 'out'}", f"traces=[{path}]", "capacity=2"])
    first = simulate.run(cfg)
    again = simulate.run(cfg)
    assert again.reused and again.artifact == first.artifact
    write_trace(path, steps(0, tokens=4), LAYERS, EXPERTS)  # same path, one more token per request
    changed = simulate.run(cfg)
    assert not changed.reused and changed.artifact != first.artifact
    old = pq.read_table(first.artifact / "metrics.parquet")["accesses"].to_pylist()
    new = pq.read_table(changed.artifact / "metrics.parquet")["accesses"].to_pylist()
    assert (old, new) == ([12], [16])

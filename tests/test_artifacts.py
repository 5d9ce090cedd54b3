"""Artifacts: ids from config + inputs, atomic publication, manifests, lineage."""

import json

import pytest

from moecache.artifacts import ArtifactStore, artifact_id
from moecache.errors import MoecacheError


def test_id_depends_on_config_and_inputs_only():
    a = artifact_id("sweep", 1, {"x": 1, "y": [1, 2]}, ["collect-abc"])
    assert a == artifact_id("sweep", 1, {"y": [1, 2], "x": 1}, ["collect-abc"])
    assert a.startswith("sweep-")
    assert a != artifact_id("sweep", 1, {"x": 2, "y": [1, 2]}, ["collect-abc"])
    assert a != artifact_id("sweep", 1, {"x": 1, "y": [1, 2]}, ["collect-abd"])
    assert a != artifact_id("sweep", 2, {"x": 1, "y": [1, 2]}, ["collect-abc"])


def test_create_publishes_with_manifest_and_lineage(tmp_path):
    store = ArtifactStore(tmp_path)
    with store.create("collect", schema_version=1, config={"a": 1}, inputs=[], seed=3) as tmp:
        (tmp / "data.txt").write_text("hello")
    parent = store.list("collect")[0]
    with store.create("analyze", schema_version=1, config={"b": 2}, inputs=[parent.id], seed=3) as tmp:
        (tmp / "out.txt").write_text("x")
    child = store.list("analyze")[0]
    m = child.manifest
    assert m["inputs"] == [parent.id] and m["stage"] == "analyze" and m["seed"] == 3
    assert m["config"] == {"b": 2} and len(m["config_hash"]) == 64
    for key in ("python", "torch", "transformers", "triton", "cuda", "onnxruntime"):
        assert key in m["versions"]
    assert m["machine"]["cpu_model"] and "gpu_model" in m["machine"]
    assert "git_commit" in m and m["created_at"].endswith("Z")
    assert m["files"] == ["out.txt"]
    assert store.get(child.id).path == tmp_path / "analyze" / child.id
    assert store.resolve(str(child.path)).id == child.id


def test_interrupted_run_leaves_no_artifact(tmp_path):
    store = ArtifactStore(tmp_path)
    with pytest.raises(RuntimeError):
        with store.create("collect", schema_version=1, config={"a": 1}, inputs=[], seed=0) as tmp:
            (tmp / "half.parquet").write_bytes(b"PAR1")
            raise RuntimeError("killed")
    assert store.list() == []
    assert list((tmp_path / "collect").iterdir()) == []  # no temporary folder left either


def test_rerun_replaces_atomically_and_keeps_id(tmp_path):
    store = ArtifactStore(tmp_path)
    for text in ("one", "two"):
        with store.create("collect", schema_version=1, config={"a": 1}, inputs=[], seed=0) as tmp:
            (tmp / "v.txt").write_text(text)
    (only,) = store.list()
    assert (only.path / "v.txt").read_text() == "two"
    assert sorted(p.name for p in (tmp_path / "collect").iterdir()) == [only.id]


def test_unknown_artifact_is_a_clear_error(tmp_path):
    with pytest.raises(MoecacheError, match="no artifact 'collect-000'"):
        ArtifactStore(tmp_path).get("collect-000")
    (tmp_path / "folder").mkdir()
    with pytest.raises(MoecacheError, match="no manifest.json"):
        ArtifactStore(tmp_path).resolve(str(tmp_path / "folder"))


def test_manifest_is_valid_json_on_disk(tmp_path):
    store = ArtifactStore(tmp_path)
    with store.create("collect", schema_version=1, config={"a": 1}, inputs=[], seed=0):
        pass
    (art,) = store.list()
    assert json.loads((art.path / "manifest.json").read_text())["artifact_id"] == art.id

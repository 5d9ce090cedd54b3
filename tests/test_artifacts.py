"""Artifacts: ids from config + inputs + code, atomic publication, manifests, lineage, damaged manifests."""

import json
import subprocess
import sys
import time

import pytest

from moecache import artifacts
from moecache.artifacts import ArtifactStore, artifact_id, code_fingerprint, source_files
from moecache.env_info import package_versions
from moecache.errors import MoecacheError


def test_id_depends_on_config_and_inputs():
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


@pytest.fixture
def fresh_fingerprint():
    code_fingerprint.cache_clear()
    yield
    code_fingerprint.cache_clear()


def test_id_depends_on_the_code(monkeypatch, fresh_fingerprint):
    files = source_files()
    assert any(path == "moecache/artifacts.py" for path, _ in files)
    assert any(path.startswith("moecache_kernels/") for path, _ in files)
    before = artifact_id("simulate", 1, {"x": 1}, ["collect-abc"])
    assert artifact_id("simulate", 1, {"x": 1}, ["collect-abc"]) == before  # same code, same id

    path, data = files[0]
    changed = [(path, data[:-1] + bytes([data[-1] ^ 1]))] + files[1:]  # one bit of one source byte
    monkeypatch.setattr(artifacts, "source_files", lambda: changed)
    code_fingerprint.cache_clear()
    assert artifact_id("simulate", 1, {"x": 1}, ["collect-abc"]) != before

    monkeypatch.setattr(artifacts, "source_files", lambda: files + [("moecache/new.py", b"")])
    code_fingerprint.cache_clear()
    assert artifact_id("simulate", 1, {"x": 1}, ["collect-abc"]) != before  # an added (empty) file counts

    monkeypatch.setattr(artifacts, "source_files", lambda: list(reversed(files)))
    code_fingerprint.cache_clear()
    assert artifact_id("simulate", 1, {"x": 1}, ["collect-abc"]) == before  # order of discovery does not


def test_code_fingerprint_is_cached_and_fast(fresh_fingerprint):
    start = time.perf_counter()
    first = code_fingerprint()
    cold = time.perf_counter() - start
    start = time.perf_counter()
    assert code_fingerprint() == first
    # measured: 4 ms cold for ~100 files (16-24 ms on a loaded machine); cached: about 1 us
    assert time.perf_counter() - start < 1e-3 and cold < 1.0
    assert len(first) == 64


def test_manifest_records_the_code_fingerprint(tmp_path):
    store = ArtifactStore(tmp_path)
    with store.create("collect", schema_version=1, config={"a": 1}, inputs=[], seed=0):
        pass
    (art,) = store.list()
    assert art.manifest["code_fingerprint"] == code_fingerprint()


def _publish(store, stage, config):
    with store.create(stage, schema_version=1, config=config, inputs=[], seed=None):
        pass
    return store.get(artifact_id(stage, 1, config, []))


def test_a_damaged_manifest_is_skipped_with_one_warning(tmp_path, capsys):
    store = ArtifactStore(tmp_path)
    good = _publish(store, "sweep", {"a": 1})
    bad = _publish(store, "sweep", {"a": 2})
    (bad.path / "manifest.json").write_text('{"artifact_id": ')
    assert [a.id for a in store.list()] == [good.id]
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and str(bad.path / "manifest.json") in warning[0]
    with pytest.raises(MoecacheError, match="not a readable manifest"):
        _ = bad.manifest
    (bad.path / "manifest.json").write_text("[1, 2]")
    with pytest.raises(MoecacheError, match="a JSON object expected"):
        _ = bad.manifest


def test_resolve_prefix(tmp_path):
    store = ArtifactStore(tmp_path)
    arts = [_publish(store, "sweep", {"a": i}) for i in range(40)]
    target = arts[0]
    unique = next(n for n in range(7, 19) if sum(a.id.startswith(target.id[:n]) for a in arts) == 1)
    assert store.resolve_prefix(target.id[:unique]).id == target.id
    assert store.resolve_prefix(target.id).id == target.id
    assert store.resolve_prefix(str(target.path)).id == target.id
    with pytest.raises(MoecacheError, match="'sweep-' is ambiguous: sweep-"):
        store.resolve_prefix("sweep-")
    with pytest.raises(MoecacheError, match="no artifact 'sweep-zzz'"):
        store.resolve_prefix("sweep-zzz")


def test_writing_a_manifest_imports_no_torch(tmp_path):
    """Versions come from distribution metadata (importing torch to read its version cost 2 s a stage)."""
    code = (
        "import sys\n"
        "from moecache.artifacts import ArtifactStore\n"
        f"store = ArtifactStore({str(tmp_path)!r})\n"
        "with store.create('simulate', schema_version=1, config={}, inputs=[], seed=None):\n"
        "    pass\n"
        "(art,) = store.list()\n"
        "v = art.manifest['versions']\n"
        "print('TORCH', 'torch' in sys.modules, v['torch'] is not None, 'cuda' in v)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "TORCH False True True" in out, out
    import importlib.metadata

    import torch

    assert json.loads(next(tmp_path.rglob("manifest.json")).read_text())["versions"]["torch"] == (
        importlib.metadata.version("torch")
    )
    assert package_versions()["cuda"] == torch.version.cuda

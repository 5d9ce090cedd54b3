"""`moecache import-trace`: ESFT .npz and canonical Parquet inputs, bad inputs, atomicity, reuse, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf
from typer.testing import CliRunner

from moecache.env_info import REPO_ROOT
from moecache.errors import MoecacheError
from moecache.stages import import_trace
from moecache.trace.schema import SCHEMA, read_trace

ESFT_DIR = (REPO_ROOT / "../shared/data/traces/deepseek-v2-lite-esft").resolve()
GROUP_YAML = REPO_ROOT / "conf/trace_import/deepseek_v2_lite_esft.yaml"
LAYERS, EXPERTS, TOP_K = 3, 8, 2
SEQ_LENS = (5, 1, 7)


def make_arrays(seq_lens=SEQ_LENS, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = sum(seq_lens)
    ids = np.stack(
        [np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(LAYERS)]) for _ in range(n)]
    ).astype(np.int8)
    weights = rng.random((n, LAYERS, TOP_K)).astype(np.float16)
    offsets = np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int64)
    return {"expert_ids": ids, "gate_weights": weights, "seq_offsets": offsets}


def write_npz(path: Path, **arrays) -> Path:
    np.savez_compressed(path, **arrays)
    return path


def make_cfg(tmp_path: Path, path: Path, **group) -> OmegaConf:
    base = OmegaConf.load(GROUP_YAML)
    base.merge_with(
        {
            "path": str(path),
            "name": "syn",
            "num_layers": LAYERS,
            "num_experts": EXPERTS,
            "top_k": TOP_K,
            **group,
        }
    )
    return OmegaConf.create({"output_root": str(tmp_path / "out"), "force": False, "trace_import": base})


def import_npz(tmp_path: Path, arrays: dict, **group):
    npz = write_npz(tmp_path / "syn.npz", **arrays)
    result = import_trace.run(make_cfg(tmp_path, npz, **group))
    table, meta = read_trace(result.artifact / "trace.parquet")
    return result, table, meta


def expected_keys(seq_lens, tokens_per_step: int) -> list[tuple]:
    """(request, step, layer, token) in the documented row order, built the slow, obvious way."""
    keys = []
    for s, length in enumerate(seq_lens):
        for t in range(length):
            step = t // tokens_per_step if tokens_per_step else 0
            keys.extend((f"syn/seq-{s:04d}", step, layer, t) for layer in range(LAYERS))
    return sorted(keys)


@pytest.mark.parametrize("tokens_per_step, phase", [(1, "decode"), (0, "prefill"), (4, "prefill")])
def test_round_trip(tmp_path, tokens_per_step, phase):
    arrays = make_arrays()
    result, table, meta = import_npz(tmp_path, arrays, tokens_per_step=tokens_per_step)
    rows = table.to_pydict()
    keys = list(
        zip(rows["request_id"], rows["step_index"], rows["layer_id"], rows["token_index"], strict=True)
    )
    assert keys == expected_keys(SEQ_LENS, tokens_per_step)
    assert set(rows["phase"]) == {phase}
    assert set(rows["run_id"]) == {"syn"}
    offsets = arrays["seq_offsets"]
    for req, layer, tok, ids, weights in zip(
        rows["request_id"],
        rows["layer_id"],
        rows["token_index"],
        rows["expert_ids"],
        rows["router_weights"],
        strict=True,
    ):
        token = offsets[int(req.rsplit("-", 1)[1])] + tok
        assert ids == arrays["expert_ids"][token, layer].tolist()
        assert weights == arrays["gate_weights"][token, layer].astype(np.float32).tolist()
    for name in ("resident_experts", "cache_hit", "copy_bytes", "cuda_duration_ns"):
        assert table[name].null_count == table.num_rows
    assert table.schema.names == SCHEMA.names
    assert (meta.num_layers, meta.num_experts, meta.top_k, meta.expert_bytes) == (
        LAYERS,
        EXPERTS,
        TOP_K,
        17301504,
    )
    assert meta.model == "deepseek-v2-lite"
    assert meta.run["source"]["sha256"] == import_trace.file_sha256(tmp_path / "syn.npz")
    assert meta.run["source"]["tokens_per_step"] == tokens_per_step
    n = sum(SEQ_LENS)
    assert result.summary == {
        "requests": 3, "tokens": n, "rows": n * LAYERS, "accesses": n * LAYERS * TOP_K,
        "layers": LAYERS, "experts": EXPERTS, "top_k": TOP_K,
    }  # fmt: skip
    assert json.loads((result.artifact / "run_metadata.json").read_text())["summary"] == result.summary


def _bad(arrays: dict, key: str, value) -> dict:
    return {**arrays, key: value}


def _drop(arrays: dict, key: str) -> dict:
    return {k: v for k, v in arrays.items() if k != key}


GOOD = make_arrays()
IDS = GOOD["expert_ids"]
REPEATED = IDS.copy()
REPEATED[4, 1, 1] = REPEATED[4, 1, 0]
BAD_NPZ = {
    "missing key": (_drop(GOOD, "gate_weights"), "'gate_weights'"),
    "ids 2-D": (_bad(GOOD, "expert_ids", IDS[:, 0]), "'expert_ids' has shape [13, 2]"),
    "wrong top_k": (_bad(GOOD, "expert_ids", IDS[:, :, :1]), "'expert_ids' has shape [13, 3, 1]"),
    "weights shape": (
        _bad(GOOD, "gate_weights", GOOD["gate_weights"][:-1]),
        "'gate_weights' has shape [12, 3, 2]",
    ),
    "float ids": (_bad(GOOD, "expert_ids", IDS.astype(np.float32)), "'expert_ids' has dtype float32"),
    "id too large": (_bad(GOOD, "expert_ids", np.where(IDS == 0, EXPERTS, IDS)), "'expert_ids' range 1..8"),
    "negative id": (_bad(GOOD, "expert_ids", np.where(IDS == 0, -1, IDS)), "'expert_ids' range -1..7"),
    "repeated id": (_bad(GOOD, "expert_ids", REPEATED), "token 4, layer 1"),
    "offsets 2-D": (_bad(GOOD, "seq_offsets", GOOD["seq_offsets"][None]), "'seq_offsets' has shape [1, 4]"),
    "offsets start": (_bad(GOOD, "seq_offsets", np.array([1, 5, 6, 13])), "must start at 0"),
    "offsets decrease": (_bad(GOOD, "seq_offsets", np.array([0, 6, 5, 13])), "must be non-decreasing"),
    "offsets end": (_bad(GOOD, "seq_offsets", np.array([0, 5, 6, 12])), "must end at N=13"),
}


@pytest.mark.parametrize("case", BAD_NPZ)
def test_bad_npz(tmp_path, case):
    arrays, needle = BAD_NPZ[case]
    npz = write_npz(tmp_path / "bad.npz", **arrays)
    with pytest.raises(MoecacheError) as err:
        import_trace.run(make_cfg(tmp_path, npz))
    message = str(err.value)
    assert str(npz) in message and needle in message and "\n" not in message
    assert not list((tmp_path / "out").rglob("manifest.json"))  # no artifact published


def test_missing_and_foreign_files(tmp_path):
    with pytest.raises(MoecacheError, match="nope.npz: no such file"):
        import_trace.run(make_cfg(tmp_path, tmp_path / "nope.npz"))
    fake = tmp_path / "trace.npz"
    fake.write_text(json.dumps({"expert_ids": [1, 2]}))
    with pytest.raises(MoecacheError, match=r"trace.npz: not a \.npz file"):
        import_trace.run(make_cfg(tmp_path, fake))
    with pytest.raises(MoecacheError, match="tokens_per_step must be >= 0"):
        import_npz(tmp_path, GOOD, tokens_per_step=-1)


def test_parquet_republish(tmp_path):
    first, table, meta = import_npz(tmp_path, GOOD, tokens_per_step=4)
    cfg = make_cfg(tmp_path, first.artifact / "trace.parquet", format="parquet", name="again")
    second = import_trace.run(cfg)
    assert second.artifact != first.artifact
    again, again_meta = read_trace(second.artifact / "trace.parquet")
    assert again.equals(table)
    assert again_meta.run["import"]["source"]["format"] == "parquet"
    assert second.summary == first.summary


def test_bad_parquet(tmp_path):
    _, table, _ = import_npz(tmp_path, GOOD)
    good = next((tmp_path / "out/import_trace").glob("*/trace.parquet"))
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    foreign = tmp_path / "foreign.parquet"
    pq.write_table(table.replace_schema_metadata(None), foreign)
    json_file = tmp_path / "trace.json"
    json_file.write_text("{}")
    cases = {
        truncated: "not a readable Parquet file",
        foreign: "not a moecache trace",
        json_file: "not a readable Parquet file",
        tmp_path / "absent.parquet": "no such file",
    }
    for path, needle in cases.items():
        with pytest.raises(MoecacheError) as err:
            import_trace.run(make_cfg(tmp_path, path, format="parquet"))
        assert str(path) in str(err.value) and needle in str(err.value) and "\n" not in str(err.value)


def test_failure_leaves_no_artifact(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(import_trace, "write_json_atomic", boom)  # after trace.parquet is written
    with pytest.raises(OSError, match="disk full"):
        import_npz(tmp_path, GOOD)
    assert list((tmp_path / "out" / "import_trace").iterdir()) == []


def test_reuse_and_changed_input(tmp_path):
    npz = write_npz(tmp_path / "syn.npz", **GOOD)
    cfg = make_cfg(tmp_path, npz)
    first = import_trace.run(cfg)
    again = import_trace.run(cfg)
    assert again.reused and again.artifact == first.artifact and again.summary == first.summary
    forced = import_trace.run(OmegaConf.merge(cfg, {"force": True}))
    assert not forced.reused and forced.artifact == first.artifact
    write_npz(npz, **make_arrays(seed=1))
    changed = import_trace.run(cfg)
    assert not changed.reused and changed.artifact != first.artifact


@pytest.mark.skipif(not ESFT_DIR.is_dir(), reason="../shared/data is not present")
def test_real_esft_law(tmp_path):
    stats = json.loads((ESFT_DIR / "summary_stats.json").read_text())["law"]
    cfg = make_cfg(
        tmp_path, ESFT_DIR / "esft_law_routing.npz", name="esft_law", num_layers=26, num_experts=64, top_k=6
    )
    result = import_trace.run(cfg)
    n, k, layers = stats["n_tokens"], stats["top_k"], stats["n_moe_layers"]
    assert result.summary == {
        "requests": stats["n_sequences"], "tokens": n, "rows": n * layers, "accesses": n * layers * k,
        "layers": layers, "experts": stats["n_experts"], "top_k": k,
    }  # fmt: skip
    assert (result.artifact / "LICENSE-source").read_text().startswith("MIT License")
    table, meta = read_trace(result.artifact / "trace.parquet")
    assert table["request_id"][-1].as_py() == f"esft_law/seq-{stats['n_sequences'] - 1:04d}"
    assert meta.run["source"]["file"] == "esft_law_routing.npz"


def test_cli(tmp_path):
    from moecache.cli import app

    npz = write_npz(tmp_path / "syn.npz", **GOOD)
    common = [f"output_root={tmp_path / 'out'}", "trace_import.num_layers=3", "trace_import.num_experts=8"]
    ok = CliRunner().invoke(
        app, ["import-trace", *common, "trace_import.top_k=2", f"trace_import.path={npz}"]
    )
    assert ok.exit_code == 0, ok.output
    path = Path(ok.stdout.strip().splitlines()[-1])
    assert path.parent == tmp_path / "out" / "import_trace" and (path / "trace.parquet").is_file()

    bad = CliRunner().invoke(app, ["import-trace", *common, f"trace_import.path={tmp_path / 'nope.npz'}"])
    assert bad.exit_code != 0
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "nope.npz: no such file" in lines[0]


def _published_parquet(tmp_path: Path, table, name: str) -> Path:
    path = tmp_path / f"{name}.parquet"
    pq.write_table(table, path)
    return path


def test_parquet_import_sorts_a_shuffled_trace_into_canonical_order(tmp_path):
    """A converter may reorder rows (every stage replays them in canonical order): the shuffled trace
    is refused by read_trace, published sorted by import-trace, and replays exactly as the original.
    The shuffle keeps the requests' first rows in their order (requests are sorted by first row) and
    scatters every other row."""
    from moecache.analysis.hit_rates import hit_rate_table
    from moecache.sim.trace_arrays import load_trace

    first, table, _ = import_npz(tmp_path, GOOD, tokens_per_step=4)
    ids = table["request_id"].to_pylist()
    heads = [ids.index(r) for r in dict.fromkeys(ids)]
    rest = np.setdiff1d(np.arange(table.num_rows), heads)
    order = np.concatenate([heads, np.random.default_rng(1).permutation(rest)])
    shuffled = _published_parquet(tmp_path, table.take(order), "shuffled")
    with pytest.raises(MoecacheError, match="out of canonical order|not contiguous"):
        read_trace(shuffled)
    result = import_trace.run(make_cfg(tmp_path, shuffled, format="parquet", name="sorted"))
    published, _ = read_trace(result.artifact / "trace.parquet")
    assert published.equals(table)
    assert result.summary == first.summary

    def replay(path):
        return hit_rate_table(load_trace(path), [2, 5]).drop_columns(["trace"])

    assert replay(result.artifact / "trace.parquet").equals(replay(first.artifact / "trace.parquet"))


@pytest.mark.parametrize(
    "case, make, needle",
    [
        ("duplicate", lambda t: t.take(np.concatenate([np.arange(t.num_rows), [4]])), "duplicates row 4"),
        ("null layer", lambda t: _null_at(t, "layer_id", 7), "column 'layer_id' is null at row 7"),
        ("null item", lambda t: _null_at(t, "expert_ids", 2, [1, None]), "null expert at row 2"),
    ],
)
def test_parquet_import_refuses_duplicates_and_nulls(tmp_path, case, make, needle):
    _, table, _ = import_npz(tmp_path, GOOD)
    bad = _published_parquet(tmp_path, make(table), case.replace(" ", "_"))
    before = set((tmp_path / "out" / "import_trace").iterdir())
    with pytest.raises(MoecacheError) as err:
        import_trace.run(make_cfg(tmp_path, bad, format="parquet", name="bad"))
    message = str(err.value)
    assert needle in message and str(bad) in message and "\n" not in message
    assert set((tmp_path / "out" / "import_trace").iterdir()) == before


def _null_at(table, name: str, row: int, value=None):
    values = table[name].to_pylist()
    values[row] = value
    field = table.schema.field(name).with_nullable(True)
    return table.set_column(table.schema.get_field_index(name), field, pa.array(values, field.type))


def test_import_validates_what_it_writes(tmp_path, monkeypatch):
    """The written file goes through read_trace before the artifact is published: a writer that put
    rows out of order (here: a Parquet writer reversing them) is refused, leaving no artifact."""
    real = pq.write_table

    def reversing_writer(table, where, **kwargs):
        real(table.take(np.arange(table.num_rows)[::-1]), where, **kwargs)

    monkeypatch.setattr(pq, "write_table", reversing_writer)
    with pytest.raises(MoecacheError, match="trace.parquet: row 1 is out of canonical order"):
        import_npz(tmp_path, GOOD)
    assert list((tmp_path / "out" / "import_trace").iterdir()) == []

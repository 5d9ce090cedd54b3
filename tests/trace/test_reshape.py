"""Reshaping a trace onto another routing shape (moecache/trace/reshape.py): hand-computed rows on a
small trace, refusals, the metadata label, the real ESFT law trace onto Qwen3.6's shape, and
`moecache import-trace ... trace_import.reshape=...` end to end into `simulate` and ForcedRouting."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf
from typer.testing import CliRunner

from moecache.config import CONF_DIR
from moecache.env_info import REPO_ROOT
from moecache.errors import MoecacheError
from moecache.stages import import_trace
from moecache.trace.reshape import RESHAPE_VERSION, TargetShape, layer_map, reshape_table, target_from_option
from moecache.trace.schema import SCHEMA, TraceMeta, empty_cache_columns, read_trace, schema_with_meta

LAW = (REPO_ROOT / "../shared/data/traces/deepseek-v2-lite-esft/esft_law_routing.npz").resolve()
GROUP_YAML = REPO_ROOT / "conf/trace_import/deepseek_v2_lite_esft.yaml"
QWEN = TargetShape(40, 256, 8, 6291456, "qwen3_6_35b_a3b")

# Source: L=3 layers x E=4 experts, top-2. Target: 4 layers x 8 experts (G=2; strides 1, then 2), top-3.
SOURCE = TraceMeta(3, 4, 2, 4096, model="toy", source="hand")
TARGET = TargetShape(4, 8, 3, 1024, "toy8")
# Routing of two token patterns, per source layer: (ids, weights); weights exact in float32.
TOKEN_X = {0: ([1, 3], [0.5, 0.25]), 1: ([0, 2], [0.5, 0.125]), 2: ([3, 1], [0.375, 0.375])}
TOKEN_Y = {0: ([2, 0], [0.25, 0.125]), 1: ([3, 1], [0.5, 0.25]), 2: ([0, 2], [0.0, 0.0625])}
# Worked by hand from the rule: target layer l' <- source layers (l', l'+1) mod 3 for l' < 3, layer 3
# (the second pass, stride 2) <- (0, 2); source layer s_1's
# expert e is target expert 4 + e; the 3 largest of the 4 candidates (ties: smaller id), / their sum.
EXPECTED_X = {
    0: ([1, 4, 3], [0.4, 0.4, 0.2]),  # 1 (0.5), 4 (0.5), 3 (0.25), 6 (0.125) left out
    1: ([0, 5, 7], [0.4, 0.3, 0.3]),  # 0 (0.5), 5 and 7 (0.375 each), 2 (0.125) left out
    2: ([5, 1, 3], [0.4, 0.3, 0.3]),  # 5 (0.5), 1 and 3 (0.375 each), 7 (0.25) left out
    3: ([1, 5, 7], [0.4, 0.3, 0.3]),  # from (0, 2): 1 (0.5), 5 and 7 (0.375 each), 3 (0.25) left out
}
EXPECTED_Y = {
    0: ([7, 2, 5], [0.5, 0.25, 0.25]),  # 7 (0.5), 2 and 5 (0.25 each), 0 (0.125) left out
    1: ([3, 1, 6], [8 / 13, 4 / 13, 1 / 13]),  # 3, 1, 6 (0.0625); 4 (weight 0) left out
    2: ([6, 4, 2], [4 / 7, 2 / 7, 1 / 7]),  # 6 (0.25), 4 (0.125), 2 (0.0625); 0 (weight 0) left out
    3: ([2, 0, 6], [4 / 7, 2 / 7, 1 / 7]),  # from (0, 2): 2, 0, 6 (0.0625); 4 (weight 0) left out
}


def canonical(rows: list[dict], meta: TraceMeta = SOURCE) -> pa.Table:
    """A canonical table from rows (request, step, token, phase, layer, ids, weights), in the order given."""
    cols = {
        "run_id": ["toy"] * len(rows),
        "request_id": [r["request"] for r in rows],
        "step_index": [r["step"] for r in rows],
        "token_index": [r["token"] for r in rows],
        "phase": [r["phase"] for r in rows],
        "layer_id": [r["layer"] for r in rows],
        "expert_ids": [r["ids"] for r in rows],
        "router_weights": [r["weights"] for r in rows],
    }
    columns = {
        **{k: pa.array(v, SCHEMA.field(k).type) for k, v in cols.items()},
        **empty_cache_columns(len(rows)),
    }
    schema = schema_with_meta(meta)
    return pa.Table.from_arrays([columns[f.name] for f in schema], schema=schema)


def source_rows(drop_b_layer: int | None = None) -> list[dict]:
    """Request r/a: a prefill step of tokens X, Y; request r/b: one decode token Y. Canonical order."""
    rows = []
    for layer in range(3):
        for token, pattern in enumerate((TOKEN_X, TOKEN_Y)):
            ids, w = pattern[layer]
            rows.append(
                dict(request="r/a", step=0, token=token, phase="prefill", layer=layer, ids=ids, weights=w)
            )
    for layer in range(3):
        if layer != drop_b_layer:
            ids, w = TOKEN_Y[layer]
            rows.append(dict(request="r/b", step=0, token=0, phase="decode", layer=layer, ids=ids, weights=w))
    return rows


def expected_rows() -> list[tuple]:
    rows = []
    for layer in range(4):
        for token, expected in enumerate((EXPECTED_X, EXPECTED_Y)):
            rows.append(("r/a", 0, token, "prefill", layer, *expected[layer]))
    rows += [("r/b", 0, 0, "decode", layer, *EXPECTED_Y[layer]) for layer in range(4)]
    return rows


def as_rows(table: pa.Table) -> list[tuple]:
    d = table.to_pydict()
    keys = ("request_id", "step_index", "token_index", "phase", "layer_id", "expert_ids", "router_weights")
    return list(zip(*(d[k] for k in keys), strict=True))


def assert_rows(got: list[tuple], want: list[tuple]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g[:6] == w[:6]
        assert g[6] == pytest.approx(w[6], rel=1e-6, abs=1e-7)


def test_layer_map():
    assert layer_map(3, 4, 2).tolist() == [[0, 1], [1, 2], [2, 0], [0, 2]]
    qwen = layer_map(26, 40, 4)
    assert qwen[0].tolist() == [0, 6, 12, 18] and qwen[25].tolist() == [25, 5, 11, 17]
    assert qwen[26].tolist() == [0, 7, 14, 21] and qwen[39].tolist() == [
        13,
        20,
        1,
        8,
    ]  # second pass, stride 7
    assert all(len(set(row)) == 4 for row in qwen.tolist())  # distinct source layers
    assert len({tuple(row) for row in qwen.tolist()}) == 40  # no target layer repeats another's sources
    assert all(len(set(row)) == 4 for row in layer_map(26, 200, 4).tolist())  # many passes


def test_hand_computed_rows(tmp_path):
    table, meta = reshape_table(canonical(source_rows()), SOURCE, TARGET, "toy")
    assert_rows(as_rows(table), expected_rows())
    assert table.schema.names == SCHEMA.names
    assert set(table["run_id"].to_pylist()) == {"toy"}
    for name in ("resident_experts", "cache_hit", "copy_bytes", "lens_token"):
        assert table[name].null_count == table.num_rows
    path = tmp_path / "reshaped.parquet"
    pq.write_table(table, path)
    read, read_meta = read_trace(path)  # valid: distinct experts, canonical order, ...
    assert read.num_rows == 12 and (read_meta.num_layers, read_meta.num_experts, read_meta.top_k) == (4, 8, 3)


def test_token_missing_a_source_layer_has_fewer_candidates():
    """r/b lacks source layer 2: target layers 1 (sources 1, 2), 2 (sources 2, 0) and 3 (sources 0, 2)
    get only the other source layer's two candidates, a row of two experts."""
    table, _ = reshape_table(canonical(source_rows(drop_b_layer=2)), SOURCE, TARGET, "toy")
    got = [r for r in as_rows(table) if r[0] == "r/b"]
    want = [
        ("r/b", 0, 0, "decode", 0, *EXPECTED_Y[0]),
        ("r/b", 0, 0, "decode", 1, [3, 1], [2 / 3, 1 / 3]),
        ("r/b", 0, 0, "decode", 2, [6, 4], [2 / 3, 1 / 3]),
        ("r/b", 0, 0, "decode", 3, [2, 0], [2 / 3, 1 / 3]),
    ]
    assert_rows(got, want)


def test_metadata_label(tmp_path):
    table, meta = reshape_table(canonical(source_rows()), SOURCE, TARGET, "toy")
    path = tmp_path / "reshaped.parquet"
    pq.write_table(table, path)
    _, read = read_trace(path)
    assert (read.num_layers, read.num_experts, read.top_k, read.expert_bytes) == (4, 8, 3, 1024)
    assert read.model == "toy8 (reshaped from toy)"
    assert read.source == f"reshaped-v{RESHAPE_VERSION}:hand"
    label = read.run["reshaped_from"]
    assert label["version"] == RESHAPE_VERSION == 2
    assert label["source_shape"] == {"num_layers": 3, "num_experts": 4, "top_k": 2, "expert_bytes": 4096}
    assert (label["source_model"], label["source"], label["groups"], label["strides"]) == (
        "toy",
        "hand",
        2,
        [1, 2],
    )
    assert label["source_layers"] == [[0, 1], [1, 2], [2, 0], [0, 2]]
    assert "q*E + e" in label["rule"] and "renormalised" in label["rule"]


REFUSALS = {
    "experts not a multiple": (TargetShape(4, 6, 3, 1), "num_experts a multiple of the source's 4"),
    "top_k above G*K": (TargetShape(4, 8, 5, 1), "top_k <= G*K = 2*2 = 4"),
    "no layers": (TargetShape(0, 8, 3, 1), "num_layers >= 1, got 0"),
    "more groups than source layers": (TargetShape(4, 16, 3, 1), "G = 4 distinct source layers"),
    "ids beyond int16": (TargetShape(4, 2**16, 3, 1), "holds layer and expert ids as int16"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals(case):
    target, needle = REFUSALS[case]
    with pytest.raises(MoecacheError) as err:
        reshape_table(canonical(source_rows()), SOURCE, target, "toy.parquet")
    assert (
        needle in str(err.value) and str(err.value).startswith("toy.parquet: ") and "\n" not in str(err.value)
    )


def _set(rows: list[dict], index: int, **change) -> list[dict]:
    return [dict(r, **change) if i == index else r for i, r in enumerate(rows)]


BAD_TABLES = {
    "no weights": (lambda: canonical(source_rows()).drop_columns(["router_weights"]), "needs the column 'router_weights'"),
    "negative weight": (lambda: canonical(_set(source_rows(), 3, weights=[0.5, -0.1])), "at row 3: reshape needs finite, non-negative"),
    "nan weight": (lambda: canonical(_set(source_rows(), 4, weights=[float("nan"), 0.1])), "at row 4: reshape needs finite"),
    "zero weights": (
        lambda: canonical([dict(r, weights=[0.0, 0.0]) if r["request"] == "r/b" else r for r in source_rows()]),
        "whose source weights sum to 0",
    ),
    "step differs within a token": (lambda: canonical(_set(source_rows(), 2, step=1)), "column 'step_index' is 1 at row 2"),
    "phase differs within a token": (lambda: canonical(_set(source_rows(), 7, phase="prefill")), "column 'phase' is 'prefill' at row 7"),
    "no rows": (lambda: canonical(source_rows()).slice(0, 0), "the trace has no rows"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_TABLES)
def test_bad_tables(case):
    make, needle = BAD_TABLES[case]
    with pytest.raises(MoecacheError) as err:
        reshape_table(make(), SOURCE, TARGET, "toy.parquet")
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_target_from_option():
    assert target_from_option("qwen3_6_35b_a3b", CONF_DIR) == QWEN
    given = {"num_layers": 4, "num_experts": 8, "top_k": 3, "expert_bytes": 1024, "model": "toy8"}
    assert target_from_option(given, CONF_DIR) == TARGET
    assert target_from_option({**given, "model": None}, CONF_DIR).model == "unknown"
    bad = {
        "qwen9": "trace_import.reshape='qwen9': no model group",
        7: "trace_import.reshape=7: expected null, a model group name",
        **{"unknown key": "unknown key(s) ['layers']"},
    }
    for option, needle in bad.items():
        value = {**given, "layers": 3} if option == "unknown key" else option
        with pytest.raises(MoecacheError, match=None) as err:
            target_from_option(value, CONF_DIR)
        assert needle in str(err.value)
    with pytest.raises(
        MoecacheError, match=r"trace_import.reshape.top_k must be a positive integer, got '8'"
    ):
        target_from_option({**given, "top_k": "8"}, CONF_DIR)


# ---- through import-trace ------------------------------------------------------------------------


def write_deepseek_shaped_npz(path: Path, seq_lens=(3, 2), seed: int = 0) -> Path:
    """A small random ESFT-format file of DeepSeek-V2-Lite's routing shape (26 x 64, top-6)."""
    rng = np.random.default_rng(seed)
    n = sum(seq_lens)
    ids = np.argsort(rng.random((n, 26, 64)), axis=2)[:, :, :6].astype(np.int8)
    weights = rng.random((n, 26, 6)).astype(np.float16)
    offsets = np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int64)
    np.savez_compressed(path, expert_ids=ids, gate_weights=weights, seq_offsets=offsets)
    return path


def import_cfg(tmp_path: Path, path: Path, **group) -> OmegaConf:
    base = OmegaConf.load(GROUP_YAML)
    base.merge_with({"path": str(path), "name": "syn", **group})
    return OmegaConf.create({"output_root": str(tmp_path / "out"), "force": False, "trace_import": base})


def test_import_trace_reshape_option(tmp_path):
    npz = write_deepseek_shaped_npz(tmp_path / "syn.npz")
    plain = import_trace.run(import_cfg(tmp_path, npz))
    by_name = import_trace.run(import_cfg(tmp_path, npz, reshape="qwen3_6_35b_a3b"))
    as_dict = dict(num_layers=40, num_experts=256, top_k=8, expert_bytes=6291456, model="qwen3_6_35b_a3b")
    by_dict = import_trace.run(import_cfg(tmp_path, npz, reshape=as_dict))
    assert len({plain.artifact, by_name.artifact}) == 2
    assert by_dict.artifact == by_name.artifact and by_dict.reused  # same resolved shape, same artifact
    assert plain.summary["layers"] == 26 and by_name.summary == {
        "requests": 2, "tokens": 5, "rows": 5 * 40, "accesses": 5 * 40 * 8, "layers": 40, "experts": 256, "top_k": 8,
    }  # fmt: skip
    table, meta = read_trace(by_name.artifact / "trace.parquet")
    source, _ = read_trace(plain.artifact / "trace.parquet")
    assert (
        meta.run["source"]["file"] == "syn.npz"
        and meta.run["reshaped_from"]["source_model"] == "deepseek-v2-lite"
    )
    assert import_trace.run(import_cfg(tmp_path, npz, reshape="qwen3_6_35b_a3b")).reused
    # The reshape of the imported canonical table, row for row.
    direct, _ = reshape_table(source, read_trace(plain.artifact / "trace.parquet")[1], QWEN, "x")
    assert table.select(["request_id", "token_index", "expert_ids", "router_weights"]).equals(
        direct.select(["request_id", "token_index", "expert_ids", "router_weights"])
    )
    with pytest.raises(MoecacheError, match=r"syn.npz: reshape needs top_k <= G\*K = 4\*6 = 24"):
        import_trace.run(import_cfg(tmp_path, npz, reshape={**as_dict, "top_k": 25}))


def test_cli_reshape_into_simulate_and_forced_routing(tmp_path):
    from moecache.cli import app
    from moecache.runtime.forced_routing import ForcedRouting

    npz = write_deepseek_shaped_npz(tmp_path / "syn.npz")
    root = f"output_root={tmp_path / 'out'}"
    runner = CliRunner()
    made = runner.invoke(
        app, ["import-trace", root, f"trace_import.path={npz}", "trace_import.name=syn", "trace_import.reshape=qwen3_6_35b_a3b"]
    )  # fmt: skip
    assert made.exit_code == 0, made.output
    trace = Path(made.stdout.strip().splitlines()[-1]) / "trace.parquet"
    sim = runner.invoke(
        app, ["simulate", root, f"traces=[{trace}]", "capacity=25%", "policy=lru", "sim.mode=instant"]
    )
    assert sim.exit_code == 0, sim.output
    metrics = pq.read_table(Path(sim.stdout.strip().splitlines()[-1]) / "metrics.parquet").to_pylist()
    assert [(m["capacity"], m["accesses"], m["tokens"]) for m in metrics] == [
        (2560, 5 * 40 * 8, 5)
    ]  # 25% of 40 x 256
    forced = ForcedRouting.from_trace(trace, num_layers=40, num_experts=256, top_k=8)
    assert forced.request_ids == ["syn/seq-0000", "syn/seq-0001"] and forced.num_tokens("syn/seq-0000") == 3
    bad = runner.invoke(
        app, ["import-trace", root, f"trace_import.path={npz}", "trace_import.reshape={num_layers:40,num_experts:100,top_k:8,expert_bytes:1}"]
    )  # fmt: skip
    assert bad.exit_code == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "reshape needs num_experts a multiple of the source's 64" in lines[0]


@pytest.mark.skipif(not LAW.is_file(), reason="../shared/data is not present")
def test_real_law_trace_onto_qwen_shape(tmp_path):
    from moecache.runtime.forced_routing import ForcedRouting

    plain = import_trace.run(import_cfg(tmp_path, LAW, name="esft_law"))
    result = import_trace.run(import_cfg(tmp_path, LAW, name="esft_law", reshape="qwen3_6_35b_a3b"))
    source, _ = read_trace(plain.artifact / "trace.parquet")
    table, meta = read_trace(result.artifact / "trace.parquet")
    tokens = plain.summary["tokens"]
    assert (meta.num_layers, meta.num_experts, meta.top_k, meta.expert_bytes) == (40, 256, 8, 6291456)
    assert result.summary["rows"] == tokens * 40 and result.summary["accesses"] == tokens * 40 * 8
    assert meta.model == "qwen3_6_35b_a3b (reshaped from deepseek-v2-lite)"
    # Every token keeps its request, step, position and phase (one row per target layer).
    keys = ["request_id", "step_index", "token_index", "phase"]
    assert (
        table.select(keys)
        .group_by(keys)
        .aggregate([])
        .sort_by([(k, "ascending") for k in keys])
        .equals(source.select(keys).group_by(keys).aggregate([]).sort_by([(k, "ascending") for k in keys]))
    )
    w_RK = pc.list_flatten(table["router_weights"]).to_numpy().reshape(-1, 8)
    assert np.allclose(w_RK.sum(axis=1), 1.0, atol=1e-5) and np.all(np.diff(w_RK, axis=1) <= 0)
    # A sample of rows against the rule, one row at a time in plain Python.
    src = {}
    for r, t, layer, ids, w in zip(*(source[c].to_pylist() for c in ("request_id", "token_index", "layer_id", "expert_ids", "router_weights")), strict=True):  # fmt: skip
        src[(r, t, layer)] = list(zip(ids, w, strict=True))
    rows = table.slice(0, 400).to_pylist() + table.slice(table.num_rows - 400).to_pylist()
    for row in rows:
        cands = [
            (q * 64 + e, w)
            for q in range(4)
            for e, w in src[
                (
                    row["request_id"],
                    row["token_index"],
                    (row["layer_id"] + (6 + row["layer_id"] // 26) * q) % 26,
                )
            ]
        ]
        best = sorted(cands, key=lambda c: (-c[1], c[0]))[:8]
        assert row["expert_ids"] == [e for e, _ in best]
        total = sum(w for _, w in best)
        assert row["router_weights"] == pytest.approx([w / total for _, w in best], rel=1e-5)
    forced = ForcedRouting.from_trace(table, num_layers=40, num_experts=256, top_k=8)
    assert len(forced.request_ids) == plain.summary["requests"]

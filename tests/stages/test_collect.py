"""`moecache collect` end to end on the tiny model: completeness, privacy, determinism, reuse, CLI."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from moecache.cli import app
from moecache.config import compose
from moecache.errors import MoecacheError
from moecache.models import load_model
from moecache.stages import collect
from moecache.trace.hooks import RoutingRecorder
from moecache.trace.logger import RoutingLogger
from moecache.trace.schema import TraceMeta, read_trace

SMALL = ["workload.num_requests=2", "generation.max_new_tokens=5", "workload.max_prompt_tokens=96"]


def _run(tmp_path, *overrides):
    return collect.run(compose([f"output_root={tmp_path}", *SMALL, *overrides]))


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    root = tmp_path_factory.mktemp("collect")
    return root, _run(root)


def test_trace_is_complete_and_both_formats_agree(first):
    _, result = first
    meta_run = json.loads((result.artifact / "run_metadata.json").read_text())
    table, meta = read_trace(result.artifact / "trace.parquet")
    requests = meta_run["requests"]
    assert len(requests) == 4  # 2 conversations x 2 turns
    tokens = sum(r["prompt_tokens"] + r["new_tokens"] - 1 for r in requests)
    assert table.num_rows == tokens * meta.num_layers
    assert all(r["new_tokens"] == 5 for r in requests)
    assert meta_run["logger"]["overflow_events"] == 0
    assert meta_run["logger"]["records_in"] == meta_run["logger"]["records_written"]
    jsonl = [json.loads(line) for line in (result.artifact / "trace.jsonl").read_text().splitlines()]
    assert jsonl == table.to_pylist()
    # one row per (request, token, layer); prefill is step 0, each decode step one token
    rows = table.select(["request_id", "token_index", "layer_id"]).to_pylist()
    assert len({tuple(r.values()) for r in rows}) == len(rows)
    decode = table.filter(table["phase"].to_numpy(zero_copy_only=False) == "decode")
    assert decode.num_rows == sum(r["new_tokens"] - 1 for r in requests) * meta.num_layers
    assert meta.num_experts == 32 and meta.top_k == 4 and meta.expert_bytes > 0
    assert meta.run["model_revision"] and meta.run["seed"] == 0 and meta.run["capacity"] is None


def test_logit_lens_is_off_by_default_and_timed_apart_when_on(first, tmp_path):
    _, off = first
    table, _ = read_trace(off.artifact / "trace.parquet")
    assert table["lens_token"].null_count == table.num_rows
    meta_off = json.loads((off.artifact / "run_metadata.json").read_text())
    assert meta_off["logit_lens_seconds"] == 0.0
    assert all(
        r["seconds"] == r["wall_seconds"] and r["logit_lens_seconds"] == 0 for r in meta_off["requests"]
    )
    assert "logit_lens" not in json.loads((off.artifact / "manifest.json").read_text())["config"]["logging"]

    on = _run(tmp_path, "workload.num_requests=1", "logging.logit_lens.rate=1.0")
    table, meta = read_trace(on.artifact / "trace.parquet")
    lens = table["lens_token"].to_numpy(zero_copy_only=False)
    assert table["lens_token"].null_count == 0 and ((lens >= 0) & (lens < 320)).all()  # tiny vocab: 320
    assert meta.run["logit_lens"] == {"rate": 1.0, "seed": 0}
    meta_on = json.loads((on.artifact / "run_metadata.json").read_text())
    assert meta_on["logit_lens_seconds"] > 0
    for r in meta_on["requests"]:
        assert r["seconds"] == pytest.approx(r["wall_seconds"] - r["logit_lens_seconds"])
    assert meta_on["logit_lens_seconds"] == pytest.approx(
        sum(r["logit_lens_seconds"] for r in meta_on["requests"])
    )
    assert on.summary["logit lens rows"] == table.num_rows
    with pytest.raises(MoecacheError, match="logit_lens.rate"):
        _run(tmp_path, "logging.logit_lens.rate=2")


def test_text_is_not_logged_by_default(first, tmp_path):
    _, result = first
    assert not (result.artifact / "texts.jsonl").exists()
    with_text = _run(tmp_path, "logging.log_text=true")
    lines = [json.loads(line) for line in (with_text.artifact / "texts.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all("completion" in line for line in lines)
    blob = b"".join(p.read_bytes() for p in result.artifact.iterdir())
    for line in lines:  # the same prompts ran in the default artifact, yet none of their text is there
        assert line["messages"][-1]["content"][:30].encode() not in blob


def test_same_config_and_seed_give_identical_rows_and_reuse(first, tmp_path):
    root, result = first
    again = _run(root)
    assert again.reused and again.artifact == result.artifact
    other = _run(tmp_path)  # a fresh output root: computed again from scratch
    assert not other.reused and other.artifact.name == result.artifact.name
    assert pq.read_table(other.artifact / "trace.parquet").equals(
        pq.read_table(result.artifact / "trace.parquet")
    )
    assert (other.artifact / "trace.jsonl").read_bytes() == (result.artifact / "trace.jsonl").read_bytes()


def test_logged_experts_equal_an_independent_router_recomputation(tmp_path):
    cfg = compose([f"output_root={tmp_path}"])
    loaded = load_model(cfg.model, cfg.output_root, "cpu")
    ad = loaded.adapter
    captured = {}
    handles = [
        layer.router.register_forward_pre_hook(
            lambda m, args, lid=layer.layer_id: captured.setdefault(lid, []).append(
                args[0].detach().reshape(-1, ad.hidden_size).clone()
            )
        )
        for layer in ad.moe_layers()
    ]
    meta = TraceMeta(ad.num_layers, ad.num_experts, ad.top_k, ad.expert_bytes)
    logger = RoutingLogger(tmp_path / "t", meta, "r")
    ids = torch.tensor([[5, 17, 99, 23, 42, 7, 61]])
    with RoutingRecorder(loaded.model, ad, logger) as rec, torch.inference_mode():
        rec.start_request("q")
        loaded.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=3,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    logger.close()
    for h in handles:
        h.remove()
    table, _ = read_trace(tmp_path / "t" / "trace.parquet")
    for layer in ad.moe_layers():
        x_TH = torch.cat(captured[layer.layer_id])
        probs_TE = torch.softmax(x_TH.float() @ layer.router.weight.float().T, dim=-1)
        want_TK = probs_TE.topk(ad.top_k, dim=-1).indices
        got = table.filter(table["layer_id"].to_numpy() == layer.layer_id)["expert_ids"].to_pylist()
        assert torch.equal(torch.tensor(got), want_TK)


def test_cli_prints_the_artifact_path_last(tmp_path):
    res = CliRunner().invoke(app, ["collect", f"output_root={tmp_path}", *SMALL, "workload.num_requests=1"])
    assert res.exit_code == 0, res.output
    last = Path(res.stdout.strip().splitlines()[-1])
    assert last.parent == tmp_path / "collect" and (last / "manifest.json").is_file()


def test_cli_bad_input_is_one_line_and_nonzero(tmp_path):
    res = CliRunner().invoke(app, ["collect", f"output_root={tmp_path}", "model.path=/nonexistent/ckpt"])
    assert res.exit_code != 0
    assert "model.path" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = CliRunner().invoke(app, ["collect", f"output_root={tmp_path}", "generation.nope=1"])
    assert res.exit_code != 0 and "nope" in res.stderr
    assert not (tmp_path / "collect").exists() or not any((tmp_path / "collect").iterdir())


def test_unknown_model_type_lists_supported(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(MoecacheError, match="qwen3_5_moe"):
        _run(tmp_path, f"model.path={ckpt}")


def test_logging_enabled_false_is_refused_before_the_model_loads(tmp_path):
    """collect's output is the routing log: `logging.enabled=false` contradicts the command (null, the
    default, lets the stage decide; the runtime's inference path reads it as off)."""
    with pytest.raises(MoecacheError, match="logging.enabled=false: `moecache collect` always logs routing"):
        _run(tmp_path, "logging.enabled=false")
    with pytest.raises(MoecacheError, match="logging.enabled='no': expected true or false"):
        _run(tmp_path, "logging.enabled=no")
    assert not (tmp_path / "models").exists() and not (tmp_path / "collect").exists()

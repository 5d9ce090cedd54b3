"""The logit lens of collect (moecache/trace/lens.py): deterministic sampling, the logger's
`lens_token` column, and on the tiny model the logged tokens against an independent recomputation
(output_hidden_states, then the final norm and the LM head by hand)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from moecache.config import compose
from moecache.errors import MoecacheError
from moecache.models import load_model
from moecache.trace.hooks import RoutingRecorder
from moecache.trace.lens import LogitLens, sampled_tokens
from moecache.trace.logger import RoutingLogger, StepContext
from moecache.trace.schema import TraceMeta, read_trace

PROMPT = [5, 17, 99, 23, 42, 7, 61, 88, 12, 3, 250, 31]
NEW_TOKENS = 4


def test_sampling_is_deterministic_and_per_token():
    tokens = np.arange(20_000)
    a = sampled_tokens(7, "conv/t0", tokens, 0.25)
    assert np.array_equal(a, sampled_tokens(7, "conv/t0", tokens, 0.25))
    assert abs(a.mean() - 0.25) < 0.02
    assert not np.array_equal(a, sampled_tokens(8, "conv/t0", tokens, 0.25))  # the seed matters
    assert not np.array_equal(a, sampled_tokens(7, "conv/t1", tokens, 0.25))  # and the request
    # a token's fate does not depend on the step it comes in
    assert np.array_equal(a[100:103], sampled_tokens(7, "conv/t0", [100, 101, 102], 0.25))
    # nested: a token sampled at a rate is sampled at every higher rate
    assert not (a & ~sampled_tokens(7, "conv/t0", tokens, 0.5)).any()
    assert not sampled_tokens(7, "q", tokens, 0.0).any() and sampled_tokens(7, "q", tokens, 1.0).all()


def test_logger_writes_lens_tokens_and_nulls(tmp_path):
    meta = TraceMeta(num_layers=2, num_experts=8, top_k=2, expert_bytes=1)
    logger = RoutingLogger(tmp_path, meta, "r")
    logger.set_step(StepContext("q", 0, "prefill", 0))
    ids, w = torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.ones(3, 2)
    logger.log(0, ids, w, np.array([0, 2]), torch.tensor([11, 13]))
    logger.log(1, ids, w)  # no lens for this record
    logger.set_step(StepContext("q", 1, "decode", 3))
    logger.log(0, ids[:1], w[:1], np.array([0]), torch.tensor([7]))
    logger.log(1, ids[:1], w[:1], np.array([0]), torch.tensor([9]))
    with pytest.raises(MoecacheError, match="together"):
        logger.log(1, ids[:1], w[:1], np.array([0]), None)
    logger.close()
    table, _ = read_trace(tmp_path / "trace.parquet")
    assert table["lens_token"].to_pylist() == [11, None, 13, None, None, None, 7, 9]
    lines = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert [line["lens_token"] for line in lines] == table["lens_token"].to_pylist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lens")
    cfg = compose([f"output_root={root}"])
    return root, load_model(cfg.model, cfg.output_root, "cpu")


def _record(loaded, out_dir, rate: float, seed: int = 0):
    """Greedy generation of PROMPT on the tiny model with the recorder and a lens at `rate`; returns
    the trace table and the full token sequence."""
    ad = loaded.adapter
    meta = TraceMeta(ad.num_layers, ad.num_experts, ad.top_k, ad.expert_bytes)
    logger = RoutingLogger(out_dir, meta, "r")
    lens = LogitLens(ad, rate, seed)
    ids = torch.tensor([PROMPT])
    with RoutingRecorder(loaded.model, ad, logger, lens) as rec, torch.inference_mode():
        rec.start_request("q")
        out = loaded.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    logger.close()
    assert lens.take_seconds() >= 0 and (rate == 0 or lens.total_seconds > 0)
    table, _ = read_trace(out_dir / "trace.parquet")
    return table, out[0]


def test_rate_one_logs_every_row_and_matches_a_recomputation(tiny, tmp_path):
    _, loaded = tiny
    ad, model = loaded.adapter, loaded.model
    table, sequence = _record(loaded, tmp_path, 1.0)
    vocab = model.config.get_text_config().vocab_size
    lens = table["lens_token"].to_numpy(zero_copy_only=False)
    assert table["lens_token"].null_count == 0
    assert ((lens >= 0) & (lens < vocab)).all()

    # Independently: one full forward over the sequence the generation fed (the last new token is
    # never fed), hidden_states[i] = the input of decoder layer i; the lens is argmax(head(norm(h))).
    fed = sequence[:-1].unsqueeze(0)
    with torch.no_grad():
        hidden = model(input_ids=fed, output_hidden_states=True).hidden_states
        norm, head = model.get_decoder().norm, model.get_output_embeddings()
        checked = 0
        for layer in ad.moe_layers():
            logits_TV = head(norm(hidden[layer.model_layer_index][0]))
            top2_TV = logits_TV.topk(2, dim=-1)
            want_T = top2_TV.indices[:, 0].numpy()
            clear_T = (top2_TV.values[:, 0] - top2_TV.values[:, 1]).numpy() > 1e-4  # no near-tie
            rows = table.filter(table["layer_id"].to_numpy() == layer.layer_id)
            got = dict(zip(rows["token_index"].to_pylist(), rows["lens_token"].to_pylist(), strict=True))
            assert sorted(got) == list(range(fed.shape[1]))
            for t in np.flatnonzero(clear_T):
                assert got[int(t)] == want_T[t], (layer.layer_id, int(t))
                checked += 1
    assert checked >= 0.9 * table.num_rows


def test_rate_zero_leaves_the_column_null(tiny, tmp_path):
    _, loaded = tiny
    table, _ = _record(loaded, tmp_path, 0.0)
    assert table["lens_token"].null_count == table.num_rows


def test_sampled_rows_are_deterministic_for_a_seed(tiny, tmp_path):
    _, loaded = tiny
    a, _ = _record(loaded, tmp_path / "a", 0.4, seed=3)
    b, _ = _record(loaded, tmp_path / "b", 0.4, seed=3)
    assert a.equals(b)
    positions = np.arange(len(PROMPT) + NEW_TOKENS - 1)
    want = set(positions[sampled_tokens(3, "q", positions, 0.4)].tolist())
    assert 0 < len(want) < len(positions)
    for layer in range(loaded.adapter.num_layers):
        rows = a.filter(a["layer_id"].to_numpy() == layer)
        got = {
            t
            for t, x in zip(rows["token_index"].to_pylist(), rows["lens_token"].to_pylist(), strict=True)
            if x is not None
        }
        assert got == want  # a sampled token has a lens token at every layer
    c, _ = _record(loaded, tmp_path / "c", 0.4, seed=4)
    assert not c["lens_token"].is_null().equals(a["lens_token"].is_null())


def test_a_trace_without_the_column_still_loads(tiny, tmp_path):
    _, loaded = tiny
    table, _ = _record(loaded, tmp_path, 0.0)
    old = pq.read_table(tmp_path / "trace.parquet").drop_columns(["lens_token"])
    pq.write_table(old, tmp_path / "old.parquet")
    back, meta = read_trace(tmp_path / "old.parquet")
    assert "lens_token" not in back.column_names and back.num_rows == table.num_rows


def test_rate_outside_zero_one_is_refused(tiny):
    _, loaded = tiny
    with pytest.raises(MoecacheError, match="logit_lens.rate"):
        LogitLens(loaded.adapter, 1.5, 0)

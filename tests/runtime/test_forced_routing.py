"""Trace-forced routing (moecache/runtime/forced_routing.py) on the CPU: the collected trace of a forced
run equals the forcing trace row by row (a collected trace of another random model; the real
DeepSeek-V2-Lite ESFT traces on a tiny-hidden model of their own routing shape), the weight rule without
trace weights is each model's own, an offloaded forced run computes what the unmodified forced model
computes and its manager sees exactly the forced ids, and bad input is one line.

Legend: L layers (MoE), E experts, K top-k, T tokens, N tokens of one request.
"""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

import moecache
from moecache.env_info import REPO_ROOT
from moecache.errors import MoecacheError
from moecache.models import adapter_for
from moecache.runtime.forced_routing import ForcedRouting
from moecache.trace.esft_import import EsftArrays, esft_to_table, load_esft_npz
from moecache.trace.hooks import RoutingRecorder
from moecache.trace.logger import LoggerConfig, RoutingLogger
from moecache.trace.schema import METADATA_KEY, TraceMeta, read_trace
from tests.runtime.helpers import spy_visits, tiny

MODEL_TYPES = ["qwen3_5_moe", "deepseek_v2", "mixtral", "qwen3_moe", "olmoe"]
PROMPTS = {"req-a": [5, 17, 99, 42, 7, 250, 3], "req-b": [11, 2, 64]}
NEW_TOKENS = 4
GREEDY = dict(do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0, eos_token_id=None)
ESFT = (REPO_ROOT / "../shared/data/traces/deepseek-v2-lite-esft/esft_intent_routing.npz").resolve()
ROW_COLUMNS = ("request_id", "step_index", "token_index", "phase", "layer_id", "expert_ids", "router_weights")


def vocab(model) -> int:
    return int(model.get_input_embeddings().num_embeddings)


def collect(model, adapter, out_dir, runs, forced: ForcedRouting | None = None, forced_first: bool = True):
    """Generate `runs` [(request_id, input_ids [1, P], max_new_tokens)] under the real recorder and logger,
    forced by `forced` (attached before the recorder, or after it); (the collected trace table, per run
    the generated sequences and the logits of every generated position)."""
    meta = TraceMeta(adapter.num_layers, adapter.num_experts, adapter.top_k, adapter.expert_bytes)
    logger = RoutingLogger(out_dir, meta, "run", LoggerConfig(formats=("parquet",)))
    outputs = []
    with contextlib.ExitStack() as stack:
        if forced is not None and forced_first:
            stack.enter_context(forced.attach(model, adapter))
        recorder = stack.enter_context(RoutingRecorder(model, adapter, logger))
        if forced is not None and not forced_first:
            stack.enter_context(forced.attach(model, adapter))
        stack.enter_context(torch.inference_mode())
        for request_id, input_ids, new_tokens in runs:
            recorder.start_request(request_id)
            if forced is not None:
                forced.start_request(request_id)
            out = model.generate(
                input_ids, max_new_tokens=new_tokens, output_logits=True, return_dict_in_generate=True,
                **GREEDY,
            )  # fmt: skip
            outputs.append((out.sequences, torch.cat(out.logits)))
    logger.close()
    return read_trace(out_dir / "trace.parquet")[0], outputs


def natural_trace(model_type, tmp_path):
    """A tiny model (seed 0), its adapter and the trace it routes naturally on both prompts."""
    model = tiny(model_type, seed=0)
    adapter = adapter_for(model)
    runs = [(rid, torch.tensor([p]), NEW_TOKENS) for rid, p in PROMPTS.items()]
    table, _ = collect(model, adapter, tmp_path / "natural", runs)
    return model, adapter, table


def forced_runs(forced: ForcedRouting, model):
    """Every request of the trace: its deterministic prompt and as many new tokens as the trace has."""
    return [
        (rid, forced.input_ids(rid, vocab(model)), forced.decode_steps(rid) + 1) for rid in forced.request_ids
    ]


def rows(table: pa.Table, columns=ROW_COLUMNS) -> dict[str, list]:
    return {name: table[name].to_pylist() for name in columns}


def shape_of(adapter) -> dict:
    return {"num_layers": adapter.num_layers, "num_experts": adapter.num_experts, "top_k": adapter.top_k}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_forced_run_collects_exactly_the_forcing_trace(model_type, tmp_path):
    _, adapter_a, want = natural_trace(model_type, tmp_path)
    path = tmp_path / "natural" / "trace.parquet"
    forced = ForcedRouting.from_trace(path, **shape_of(adapter_a))
    assert forced.request_ids == list(PROMPTS) and forced.has_weights
    assert [forced.prompt_len(r) for r in PROMPTS] == [len(p) for p in PROMPTS.values()]
    assert [forced.decode_steps(r) for r in PROMPTS] == [NEW_TOKENS - 1] * 2

    other = tiny(model_type, seed=1)  # another random model of the same shape
    adapter_b = adapter_for(other)
    runs = forced_runs(forced, other)
    natural_b, _ = collect(other, adapter_b, tmp_path / "other", runs)
    assert rows(natural_b)["expert_ids"] != rows(want)["expert_ids"]  # forcing has something to change

    # attached after the recorder: the prepended hook still runs first, so the recorder logs the forcing
    got, _ = collect(other, adapter_b, tmp_path / "forced", runs, forced, forced_first=False)
    assert rows(got) == rows(want)  # ids per row and router weights, float32 exactly
    assert forced.positions == [len(PROMPTS["req-b"]) + NEW_TOKENS - 1] * adapter_b.num_layers
    # detached: the model routes by itself again
    again, _ = collect(other, adapter_b, tmp_path / "after", runs)
    assert rows(again) == rows(natural_b)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_without_trace_weights_the_weights_follow_the_models_own_rule(model_type, tmp_path):
    model, adapter, want = natural_trace(model_type, tmp_path)
    no_weights = want.drop_columns(["router_weights"])
    forced = ForcedRouting.from_trace(no_weights, **shape_of(adapter))
    assert not forced.has_weights
    runs = [(rid, torch.tensor([p]), NEW_TOKENS) for rid, p in PROMPTS.items()]
    got, _ = collect(model, adapter, tmp_path / "forced", runs, forced)
    # the same model on the same prompts: the router's own probabilities at its own ids, its own rule
    assert rows(got, ROW_COLUMNS[:-1]) == rows(want, ROW_COLUMNS[:-1])
    np.testing.assert_allclose(
        np.array(rows(got)["router_weights"]), np.array(rows(want)["router_weights"]), rtol=1e-5, atol=1e-7
    )


def esft_model():
    """A random DeepSeek-V2 of DeepSeek-V2-Lite's routing shape (27 decoder layers, the first dense;
    26 MoE layers x 64 experts, top-6, 2 shared experts) with the tiny hidden sizes."""
    return tiny("deepseek_v2", seed=3, num_hidden_layers=27, n_routed_experts=64, num_experts_per_tok=6)


@pytest.mark.skipif(not ESFT.is_file(), reason=f"{ESFT} absent")
def test_the_real_esft_trace_drives_a_model_of_its_shape(tmp_path):
    model = esft_model()
    adapter = adapter_for(model)
    assert (adapter.num_layers, adapter.num_experts, adapter.top_k) == (26, 64, 6)
    assert adapter.shared_expert_intermediate_size == 2 * adapter.moe_intermediate_size
    arrays = load_esft_npz(ESFT, **shape_of(adapter))
    end = int(arrays.seq_offsets[2])  # the first two sequences (64 and 63 tokens)
    two = EsftArrays(arrays.expert_ids[:end], arrays.gate_weights[:end], arrays.seq_offsets[:3])
    meta = TraceMeta(**shape_of(adapter), expert_bytes=adapter.expert_bytes, model="deepseek-v2-lite")
    # chunks of 16 tokens: step 0 is a 16-token prefill, every later token is replayed as a decode step
    table = esft_to_table(two, name="esft_intent", run_id="esft", tokens_per_step=16, meta=meta)
    limit = 24
    forced = ForcedRouting.from_trace(table, **shape_of(adapter), max_tokens=limit)
    assert len(forced.request_ids) == 2
    assert [(forced.prompt_len(r), forced.decode_steps(r)) for r in forced.request_ids] == [(16, 8)] * 2
    got, _ = collect(model, adapter, tmp_path / "forced", forced_runs(forced, model), forced)
    want = table.filter(pc.less(table["token_index"], limit))
    key = [("request_id", "ascending"), ("layer_id", "ascending"), ("token_index", "ascending")]
    columns = ("request_id", "token_index", "layer_id", "expert_ids", "router_weights")
    assert got.num_rows == want.num_rows == 2 * limit * 26
    assert rows(got.sort_by(key), columns) == rows(want.sort_by(key), columns)
    decode = got.filter(pc.equal(got["phase"], "decode"))
    assert decode.num_rows == 2 * (limit - 16) * 26 and set(decode["step_index"].to_pylist()) == set(
        range(1, 9)
    )


@pytest.mark.parametrize("model_type", ["deepseek_v2", "qwen3_5_moe"])
def test_an_offloaded_forced_run_equals_the_unmodified_forced_model(model_type, tmp_path):
    _, adapter_a, _ = natural_trace(model_type, tmp_path)
    forced = ForcedRouting.from_trace(tmp_path / "natural" / "trace.parquet", **shape_of(adapter_a))
    plain = tiny(model_type, seed=1)
    adapter = adapter_for(plain)
    offloaded = copy.deepcopy(plain)
    runs = forced_runs(forced, plain)
    _, want = collect(plain, adapter, tmp_path / "plain", runs, forced)

    moecache.offload(offloaded, capacity="25%", policy="lru")  # the CPU stand-in device
    manager = offloaded.moecache.manager
    seen = spy_visits(manager)
    with torch.inference_mode(), forced.attach(offloaded):  # no adapter: the offloaded blocks' routers
        for request_id, input_ids, new_tokens in runs:
            forced.start_request(request_id)
            offloaded.moecache.begin_request()
            out = offloaded.generate(
                input_ids, max_new_tokens=new_tokens, output_logits=True, return_dict_in_generate=True,
                **GREEDY,
            )  # fmt: skip
            sequences, logits = want.pop(0)
            assert torch.equal(out.sequences, sequences)
            torch.testing.assert_close(torch.cat(out.logits), logits, rtol=1e-4, atol=1e-5)
    stats = offloaded.moecache.stats()
    assert stats["hits"] > 0 and stats["misses"] > 0  # both halves ran
    for layer in range(adapter.num_layers):
        want_NK = np.concatenate([forced.expert_ids(r)[layer] for r in forced.request_ids])
        assert np.array_equal(np.concatenate(seen[layer]), want_NK)


def test_bad_input_is_one_line(tmp_path):
    model, adapter, table = natural_trace("mixtral", tmp_path)
    path = tmp_path / "natural" / "trace.parquet"
    shape = shape_of(adapter)

    def refused(match, call, *args, **kwargs):
        with pytest.raises(MoecacheError, match=match) as info:
            call(*args, **kwargs)
        assert "\n" not in str(info.value)

    wrong = {**shape, "num_experts": shape["num_experts"] * 2}
    refused(
        f"{path}: trace metadata 'num_experts' is {shape['num_experts']}, the model has {wrong['num_experts']}",
        ForcedRouting.from_trace, path, **wrong,
    )  # fmt: skip
    refused("trace table: trace metadata 'top_k' is 2, the model has 3", ForcedRouting.from_trace, table,
            **{**shape, "top_k": 3})  # fmt: skip
    refused("max_tokens=0", ForcedRouting.from_trace, table, **shape, max_tokens=0)

    # a token lacking a layer: drop layer 1 of token 2 of req-a (step 0)
    keep = pc.invert(
        pc.and_(pc.equal(table["token_index"], 2), pc.equal(table["layer_id"], 1))
    )  # fmt: skip
    refused("request 'req-a': token 2 has no row for MoE layer 1", ForcedRouting.from_trace,
            table.filter(keep), **shape)  # fmt: skip
    # a row with fewer than top_k experts (valid in the format, impossible to force)
    short = table.to_pydict()
    short["expert_ids"][5], short["router_weights"][5] = (
        short["expert_ids"][5][:1],
        short["router_weights"][5][:1],
    )
    short_table = pa.table(short, schema=table.schema)
    pq.write_table(short_table, tmp_path / "short.parquet")
    read_trace(tmp_path / "short.parquet")  # the format accepts it
    refused(r"short.parquet: column 'expert_ids' holds \[\d+\] at row 5: 1 experts; forcing needs top_k=2",
            ForcedRouting.from_trace, tmp_path / "short.parquet", **shape)  # fmt: skip
    assert METADATA_KEY in short_table.schema.metadata

    forced = ForcedRouting.from_trace(path, **shape)
    refused("request_id 'nope' is not in the trace", forced.start_request, "nope")
    refused("vocab_size=0", forced.input_ids, "req-a", 0)
    prompt = forced.input_ids("req-a", vocab(model))
    assert torch.equal(prompt, forced.input_ids("req-a", vocab(model))) and prompt.shape == (1, 7)
    with forced.attach(model, adapter), torch.inference_mode():
        refused("already attached", forced.attach, model, adapter)
        refused(r"a router ran before start_request\(\)", model.generate, prompt, max_new_tokens=1, **GREEDY)
        forced.start_request("req-a")  # 7 + 3 tokens: a fifth new token needs row 10
        refused("request 'req-a' has 10 tokens in the trace; MoE layer 0 was asked for tokens 10..10",
                model.generate, prompt, max_new_tokens=NEW_TOKENS + 1, **GREEDY)  # fmt: skip
        forced.start_request("req-a")  # back to token 0: the whole request runs again
        model.generate(prompt, max_new_tokens=NEW_TOKENS, **GREEDY)
    other = tiny("mixtral", num_hidden_layers=3)
    refused("the model has 3 MoE layers, the trace 2", forced.attach, other)
    refused(
        "router has top_k 4 and 16 experts, the trace top_k 2 and 8 experts", forced.attach, tiny("qwen3_moe")
    )


def test_from_arrays_takes_routing_drawn_by_the_caller():
    """Arrays in (calibrate's random routing), the trace's accessors out; a bad shape, id or prompt
    length is one line."""
    rng = np.random.default_rng(0)
    ids_LNK = np.argsort(rng.random((2, 5, 8)), axis=-1)[..., :3]
    w_LNK = np.full((2, 5, 3), 1 / 3, np.float32)
    forced = ForcedRouting.from_arrays({"r": (ids_LNK, w_LNK, 2)}, num_experts=8)
    assert (forced.num_layers, forced.num_experts, forced.top_k, forced.has_weights) == (2, 8, 3, True)
    assert forced.prompt_len("r") == 2 and forced.decode_steps("r") == 3
    assert np.array_equal(forced.expert_ids("r"), ids_LNK)
    forced.start_request("r")
    ids, w = forced.take(1, 2)
    assert np.array_equal(ids, ids_LNK[1, :2]) and np.array_equal(w, w_LNK[1, :2])
    for bad, match in (
        ({"r": (ids_LNK, w_LNK[:, :4], 2)}, r"request 'r': ids \(2, 5, 3\), weights \(2, 4, 3\)"),
        ({"r": (ids_LNK, w_LNK, 6)}, "prompt_len 6"),
        ({"r": (ids_LNK + 8, w_LNK, 2)}, "ids outside 0..7"),
        (
            {"r": (ids_LNK, w_LNK, 2), "s": (ids_LNK[:1], w_LNK[:1], 2)},
            r"\(layers, top_k\) \[\(1, 3\), \(2, 3\)\]",
        ),
    ):
        with pytest.raises(MoecacheError, match=match) as info:
            ForcedRouting.from_arrays(bad, num_experts=8)
        assert "\n" not in str(info.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model_type", ["deepseek_v2", "qwen3_moe"])  # float32 / bf16 router weights
def test_forced_on_cuda_pinned_copies_and_an_offloaded_manager(model_type, tmp_path):
    _, adapter_a, want = natural_trace(model_type, tmp_path)
    forced = ForcedRouting.from_trace(tmp_path / "natural" / "trace.parquet", **shape_of(adapter_a))
    model = tiny(model_type, seed=1).to("cuda", torch.bfloat16)
    offloaded = copy.deepcopy(model)
    adapter = adapter_for(model)
    runs = [(rid, ids.cuda(), new) for rid, ids, new in forced_runs(forced, model)]
    got, _ = collect(model, adapter, tmp_path / "forced", runs, forced)
    assert rows(got, ROW_COLUMNS[:-1]) == rows(want, ROW_COLUMNS[:-1])
    weight_dtype = torch.float32 if model_type == "deepseek_v2" else torch.bfloat16  # the router's own
    want_w = torch.tensor(rows(want)["router_weights"]).to(weight_dtype).float()
    assert torch.equal(torch.tensor(rows(got)["router_weights"]), want_w)

    moecache.offload(offloaded, capacity="25%", policy="lru", device="cuda")
    manager = offloaded.moecache.manager
    seen = spy_visits(manager)
    with torch.inference_mode(), forced.attach(offloaded):
        for request_id, input_ids, new_tokens in runs:
            forced.start_request(request_id)
            offloaded.generate(input_ids, max_new_tokens=new_tokens, **GREEDY)
    for layer in range(adapter.num_layers):
        want_NK = np.concatenate([forced.expert_ids(r)[layer] for r in forced.request_ids])
        assert np.array_equal(np.concatenate(seen[layer]), want_NK)


def test_take_shares_the_hooks_cursors_and_supplied_by_caller_passes_the_router_through(
    tmp_path, monkeypatch
):
    model, adapter, table = natural_trace("olmoe", tmp_path)
    forced = ForcedRouting.from_trace(table, **shape_of(adapter))
    other = tiny("olmoe", seed=1)
    L, K = adapter.num_layers, adapter.top_k
    forced.start_request("req-a")
    ids_TK, w_TK = forced.take(1, 3)  # layer 1, tokens 0..2
    assert ids_TK.dtype == np.int64 and w_TK.dtype == np.float32 and ids_TK.shape == w_TK.shape == (3, K)
    assert not ids_TK.flags.writeable and not w_TK.flags.writeable
    assert np.array_equal(ids_TK, forced.expert_ids("req-a")[1, :3])
    assert forced.positions == [0, 3] + [0] * (L - 2) and forced.rows_left() == 10 - 3
    with pytest.raises(MoecacheError, match="was asked for tokens 3..10"):
        forced.take(1, 8)
    prompt = torch.tensor([PROMPTS["req-a"]])
    with torch.inference_mode(), forced.attach(other, adapter_for(other)):
        assert forced.attached_to is other
        forced.start_request("req-a")
        with forced.supplied_by_caller():  # the router's own choices, no cursor moves
            own, _ = collect(other, adapter_for(other), tmp_path / "own", [("req-a", prompt, 1)])
        assert forced.positions == [0] * L
        fresh = tiny("olmoe", seed=1)  # the same weights, never forced
        natural, _ = collect(fresh, adapter_for(fresh), tmp_path / "nat", [("req-a", prompt, 1)])
        assert rows(own)["expert_ids"] == rows(natural)["expert_ids"] != rows(table)["expert_ids"][: 7 * L]
        # a hook that would run inside a CUDA graph capture refuses (its copy would be baked in)...
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        with pytest.raises(MoecacheError, match="router hook ran inside a CUDA graph capture") as info:
            other(prompt)
        assert "\n" not in str(info.value) and forced.positions == [0] * L
        with forced.supplied_by_caller():  # ...unless the caller supplies the rows
            other(prompt)
    assert forced.attached_to is None

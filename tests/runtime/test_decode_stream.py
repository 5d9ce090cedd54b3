"""A share of a fast-loop decode visit's misses run on the device (moecache/runtime/decode_stream.py): the
share's rule and refusals; which entries leave the CPU call; on the CPU stand-in, the fast loop with a
share gives transformers' greedy tokens and logits (a streamed entry dropped, or run on both sides,
would not) and streams nothing where a layer has no resident half. GPU marker: the same with the
streamed call captured as a graph, against the eager loop and transformers.

Legend: T prompt tokens, N generated tokens, M missed entries.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import moecache
from moecache.cli import app
from moecache.errors import MoecacheError
from moecache.models import adapter_for
from moecache.models.expert_store import ExpertStore
from moecache.runtime.decode_loop import FastDecoder
from moecache.runtime.decode_stream import DecodeStream, check_share, streamed_count
from moecache.runtime.device import StandinDevice
from moecache.runtime.slot_pool import SlotPool
from tests.runtime.helpers import tiny

PROMPT_T = [5, 17, 99, 42, 7, 250, 3]
NEW = 8
GREEDY = dict(do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0)
SHARE = 0.34  # one of 3-5 misses, two of 6-8


def hf_greedy(model, new=NEW):
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([PROMPT_T], device=model.device), max_new_tokens=new, output_logits=True,
            return_dict_in_generate=True, **GREEDY,
        )  # fmt: skip
    return out.sequences.cpu(), torch.cat(out.logits).float().cpu()


@pytest.mark.parametrize("share", [0, 0.0, 0.34, 0.999])
def test_a_share_in_0_to_1_is_accepted(share):
    check_share(share)


@pytest.mark.parametrize("share", [-0.1, 1, 1.5, True, "0.3", None])
def test_a_share_outside_0_to_1_is_refused_in_one_line(share):
    with pytest.raises(MoecacheError, match=r"runtime\.decode_stream_share must be a number >= 0 and < 1"):
        check_share(share)


def test_the_streamed_count_rounds_down_and_leaves_one_entry_to_the_cpu():
    assert [streamed_count(m, 1 / 3) for m in range(9)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [streamed_count(m, 0.999) for m in (1, 2, 5)] == [0, 1, 4]


def _stream(share, experts=8, max_entries=8):
    device = StandinDevice()
    store = ExpertStore.allocate(2, experts, 4, 2, torch.float32, pages="base")
    return DecodeStream(device, store, device.compute_stream(), None, share=share, max_entries=max_entries)


def test_take_moves_the_most_used_experts_out_of_the_call_in_place():
    stream = _stream(0.5)
    base = 8  # layer 1
    keys_M = np.array([base + 3, base + 5, base + 3, base + 1, base + 5, base + 3, 0, 0], np.int64)
    token_M = np.array([0, 0, 1, 1, 2, 2, 0, 0], np.int64)
    weight_M = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0, 0], np.float32)
    left, experts_U, taken = stream.take(base, keys_M, token_M, weight_M, 6, tokens=3)
    # k = 3 entries: expert 3 (three entries) alone; expert 5 would exceed it
    assert (left, experts_U.tolist(), taken) == (3, [3], 3)
    assert keys_M[:3].tolist() == [base + 5, base + 1, base + 5]
    assert token_M[:3].tolist() == [0, 1, 2] and weight_M[:3].tolist() == pytest.approx([0.2, 0.4, 0.5])


def test_take_of_one_token_streams_its_first_entries():
    stream = _stream(0.34)
    keys_M = np.array([8 + 6, 8 + 2, 8 + 7, 8 + 0, 8 + 5, 8 + 1, 99], np.int64)  # layer 1, 6 misses
    token_M, weight_M = np.zeros(7, np.int64), np.arange(7, dtype=np.float32)
    left, experts_U, taken = stream.take(8, keys_M, token_M, weight_M, 6, tokens=1)
    assert (left, experts_U.tolist(), taken) == (4, [6, 2], 2)
    assert keys_M[:4].tolist() == [15, 8, 13, 9] and weight_M[:4].tolist() == [2, 3, 4, 5]


def test_take_streams_nothing_below_the_share_or_where_one_expert_holds_every_entry():
    stream = _stream(0.34)
    keys_M, token_M, weight_M = np.array([2, 4], np.int64), np.zeros(2, np.int64), np.ones(2, np.float32)
    left, experts_U, taken = stream.take(0, keys_M, token_M, weight_M, 2, tokens=1)
    assert (left, experts_U.size, taken) == (2, 0, 0) and keys_M.tolist() == [2, 4]
    keys_M = np.array([2, 2, 2], np.int64)
    left, experts_U, taken = stream.take(0, keys_M, np.arange(3), np.ones(3, np.float32), 3, tokens=3)
    assert (left, experts_U.size, taken) == (3, 0, 0)


def test_the_pool_has_a_slot_for_each_entry_the_share_may_stream():
    assert _stream(0.34, max_entries=8).pool.capacity == 2
    assert _stream(0.1, max_entries=6).pool.capacity == 1
    assert isinstance(_stream(0.5).pool, SlotPool)


@pytest.mark.parametrize(("model_type", "capacity"), [("qwen3_5_moe", "25%"), ("deepseek_v2", "50%"),
                                                      ("olmoe", "25%")])  # fmt: skip
def test_fast_loop_with_a_share_streamed_equals_transformers_generate(model_type, capacity):
    plain = tiny(model_type)
    want_tokens, want_logits = hf_greedy(plain)
    L = adapter_for(plain).num_layers
    got = {}
    for share in (0.0, SHARE):
        model = moecache.offload(copy.deepcopy(plain), capacity=capacity, policy="lru")
        model.moecache.runtime.stream_decode(share)
        result = FastDecoder(model, max_cache_len=len(PROMPT_T) + NEW, keep_logits=True).generate(
            torch.tensor([PROMPT_T]), NEW
        )
        assert torch.equal(result.tokens, want_tokens), f"{model_type} share {share}"
        torch.testing.assert_close(result.logits, want_logits, rtol=1e-4, atol=1e-5)
        got[share] = model.moecache.stats(), model.moecache.runtime.counters
    (s0, c0), (s1, c1) = got[0.0], got[SHARE]
    assert c0.streamed_experts == 0 and c1.streamed_experts > 0
    assert c1.streamed_entries == c1.streamed_experts  # one token a step: an entry per expert
    assert s1["visits"] == s0["visits"] == NEW * L  # the prefill, then a visit per layer and step
    # the streamed entries are misses to the manager, and left the CPU calls
    assert s1["misses"] == s0["misses"] and c1.cpu_entries == c0.cpu_entries - c1.streamed_entries


def test_a_layer_without_a_resident_half_streams_nothing():
    plain = tiny("qwen3_5_moe")
    want_tokens, want_logits = hf_greedy(plain)
    model = moecache.offload(copy.deepcopy(plain), capacity=0)
    model.moecache.runtime.stream_decode(SHARE)
    result = FastDecoder(model, max_cache_len=len(PROMPT_T) + NEW, keep_logits=True).generate(
        torch.tensor([PROMPT_T]), NEW
    )
    assert torch.equal(result.tokens, want_tokens)
    torch.testing.assert_close(result.logits, want_logits, rtol=1e-4, atol=1e-5)
    assert model.moecache.runtime.counters.streamed_experts == 0


def test_a_share_needs_the_cpu_on_miss():
    model = moecache.offload(tiny("qwen3_moe"), capacity="25%", policy="lru", on_miss="wait")
    with pytest.raises(MoecacheError, match=r'decode_stream_share=0\.34 needs on_miss="cpu"'):
        model.moecache.runtime.stream_decode(SHARE)
    model.moecache.runtime.stream_decode(0)  # off is always accepted


def test_offload_takes_the_share_and_reconfigure_keeps_it_where_on_miss_allows():
    model = moecache.offload(tiny("qwen3_moe"), capacity="25%", policy="lru", decode_stream_share=SHARE)
    assert model.moecache.runtime.decode_share == SHARE
    model.moecache.reconfigure(capacity="50%", policy="lfu")
    assert model.moecache.runtime.decode_share == SHARE
    model.moecache.reconfigure(capacity="50%", policy="lru", on_miss="wait")
    assert model.moecache.runtime.decode_share == 0


def test_offload_refuses_a_share_with_another_on_miss_before_the_model_changes():
    model = tiny("qwen3_moe")
    with pytest.raises(MoecacheError, match=r'needs on_miss="cpu"'):
        moecache.offload(model, capacity="25%", policy="lru", on_miss="wait", decode_stream_share=SHARE)
    assert getattr(model, "moecache", None) is None


BASE = ["model=tiny", "prompt=Hello there", "generation.max_new_tokens=6", "device=cpu", "capacity=25%"]


def generate(root, *overrides: str):
    return CliRunner().invoke(app, ["generate", *BASE, f"output_root={root}", *overrides])


def test_generate_with_a_share_gives_the_same_text(tmp_path):
    plain = generate(tmp_path)
    shared = generate(tmp_path, "runtime.decode_stream_share=0.34")
    assert plain.exit_code == 0 and shared.exit_code == 0, shared.output
    assert shared.stdout == plain.stdout and shared.stdout.strip()


@pytest.mark.parametrize(("overrides", "message"), [
    (["runtime.decode_stream_share=1"], "runtime.decode_stream_share=1: expected a number >= 0 and < 1"),
    (["runtime.decode_stream_share=half"], "runtime.decode_stream_share='half': expected a number"),
    (["runtime.decode_stream_share=0.3", "runtime.loop=transformers"], "it needs runtime.loop=fast"),
    (["runtime.decode_stream_share=0.3", "runtime.enabled=false"], "the unmodified model"),
    (["runtime.decode_stream_share=0.3", "runtime.on_miss=wait"], 'needs on_miss="cpu", got on_miss=\'wait\''),
])  # fmt: skip
def test_generate_refuses_a_bad_share_in_one_line_before_loading(tmp_path, overrides, message):
    res = generate(tmp_path, *overrides)
    assert res.exit_code == 2, res.output
    errors = [line for line in res.stderr.splitlines() if line.startswith("moecache generate: error:")]
    assert len(errors) == 1 and message in errors[0], res.stderr
    assert "load:" not in res.stderr  # refused before the checkpoint was read


@pytest.mark.parametrize(("model_type", "capacity"), [("qwen3_5_moe", "25%"), ("deepseek_v2", "50%")])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_streamed_call_replayed_equals_eager_and_transformers(model_type, capacity):
    """The copies on the stream's own copy stream, the compute stream's wait, the row upload and the
    captured call: the second call (every step replayed) against the eager loop and transformers."""
    new = 16
    plain = tiny(model_type)
    runs = {}
    for graphs in ("off", "on"):
        model = moecache.offload(copy.deepcopy(plain), capacity=capacity, policy="lru", device="cuda")
        model.moecache.runtime.stream_decode(SHARE)
        decoder = FastDecoder(model, max_cache_len=len(PROMPT_T) + new, graphs=graphs, keep_logits=True)
        decoder.generate(torch.tensor([PROMPT_T]), new)  # warm-up, capture
        before = model.moecache.runtime.counters.streamed_experts
        runs[graphs] = decoder.generate(torch.tensor([PROMPT_T]), new)
        assert model.moecache.runtime.counters.streamed_experts > before
    assert torch.equal(runs["on"].tokens, runs["off"].tokens)
    torch.testing.assert_close(runs["on"].logits, runs["off"].logits, rtol=1e-4, atol=1e-4)
    reference = copy.deepcopy(plain).cuda()
    reference.set_experts_implementation("batched_mm")
    want_tokens, want_logits = hf_greedy(reference, new=new)
    assert torch.equal(runs["on"].tokens, want_tokens)
    torch.testing.assert_close(runs["on"].logits, want_logits, rtol=1e-3, atol=1e-3)

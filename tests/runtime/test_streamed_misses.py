"""A prompt's misses on the device (moecache/runtime/streamed_misses.py): which experts a visit streams,
the float32 sum of the streamed, resident and CPU parts rounded once, the prompt's output unchanged
against every miss on the CPU, decode's one-token visits untouched, and bad settings refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from moecache_kernels import slot_moe_reference

import moecache
from moecache.errors import MoecacheError
from moecache.runtime.experts_module import OffloadedExperts
from tests.runtime.helpers import half_ulp_bf16, tiny


def _offloaded(dtype, **kw):
    model = tiny("qwen3_moe").to(dtype)
    moecache.offload(model, capacity="25%", policy="lru", **kw)
    return model


def test_select_takes_the_experts_that_enough_missed_entries_use():
    model = _offloaded(torch.float32, stream_min_tokens=2, stream_chunk=2)
    streamed = model.moecache.runtime.streamed
    ids_TK = np.array([[0, 1], [0, 2], [3, 2], [3, 0]])
    miss_TK = np.array([[True, True], [True, True], [True, False], [False, True]])
    # missed uses: expert 0 three times, 1 once, 2 once (its second use hit), 3 once
    assert streamed.select(ids_TK, miss_TK).tolist() == [0]
    assert streamed.select(ids_TK, np.zeros_like(miss_TK)).tolist() == []
    assert streamed.select(ids_TK[:1], miss_TK[:1]).tolist() == []  # one token: no expert used twice


def test_a_visit_with_streamed_resident_and_cpu_parts_rounds_their_float32_sum_once():
    """bf16, one visit whose entries run from the slot pool (hits), from the staging pools (experts used
    by at least 6 missed entries: more than two chunks, so each pool is refilled) and on the CPU (the
    other misses): the output is the float32 sum over all K entries rounded once."""
    model = _offloaded(torch.bfloat16, stream_min_tokens=6, stream_chunk=2)
    session = model.moecache
    experts = next(m for m in model.modules() if isinstance(m, OffloadedExperts))
    E, L0 = experts.num_experts, experts.layer_id
    gen = torch.Generator().manual_seed(0)
    T, H = 48, model.config.hidden_size
    K = model.config.num_experts_per_tok
    with torch.inference_mode():  # experts 0..K-1 admitted now, resident at the next visit
        warm_TK = torch.arange(K).repeat(T, 1)
        experts(torch.randn(T, H, generator=gen).to(torch.bfloat16), warm_TK, torch.ones(T, K))
        before = session.runtime.counters.copy()
        x_TH = (4 * torch.randn(T, H, generator=gen)).to(torch.bfloat16)
        skew_E = 1.0 / torch.arange(1, E + 1) ** 1.5  # some experts used by many tokens, most by few
        ids_TK = torch.stack([torch.multinomial(skew_E, K, generator=gen) for _ in range(T)])
        w_TK = torch.rand(T, K, generator=gen).to(torch.bfloat16)
        y_TH = experts(x_TH, ids_TK, w_TK)
    done = session.runtime.counters.since(before)
    assert done.gpu_entries > 0 and done.cpu_entries > 0, "the case must run every part"
    assert done.streamed_experts > 2 * 2 and done.streamed_entries >= 6 * done.streamed_experts
    assert done.gpu_entries + done.streamed_entries + done.cpu_entries == T * K
    store = session.manager.store
    w13, w2 = store.w13_GIH[L0 * E : (L0 + 1) * E], store.w2_GHI[L0 * E : (L0 + 1) * E]
    want_TH = slot_moe_reference(
        x_TH, ids_TK, w_TK.float(), torch.arange(E), w13, w2, out=torch.empty(T, H), round_product=True
    )
    bound_TH = half_ulp_bf16(want_TH) + 1e-5 * want_TH.abs()
    assert y_TH.dtype == torch.bfloat16 and ((y_TH.float() - want_TH).abs() <= bound_TH).all()


def test_a_prompt_streamed_gives_the_logits_of_every_miss_on_the_cpu_and_decode_streams_nothing():
    prompt_1T = torch.randint(0, 100, (1, 24), generator=torch.Generator().manual_seed(1))
    logits = {}
    for min_tokens in (0, 2):
        model = _offloaded(torch.float32, stream_min_tokens=min_tokens)
        with torch.inference_mode():
            logits[min_tokens] = model(prompt_1T).logits
            stats = model.moecache.stats()
            model(prompt_1T[:, :1])  # one token: no expert is used by two of its entries
        after = model.moecache.stats()
        if min_tokens:
            assert stats["streamed_entries"] > 0 and stats["streamed_experts"] > 0
            assert after["streamed_entries"] == stats["streamed_entries"]
            assert after["fallback_entries"] > stats["fallback_entries"]
        else:
            assert stats["streamed_entries"] == 0 and stats["fallback_entries"] > 0
    torch.testing.assert_close(logits[2], logits[0], rtol=1e-5, atol=1e-5)


def test_auto_streams_with_the_slots_on_cuda_only():
    """stream_min_tokens="auto" (offload's and generate's default): AUTO_MIN_TOKENS where the slot pool is
    on CUDA, nothing on the CPU stand-in; an integer is taken as given on either."""
    from moecache.runtime.streamed_misses import AUTO_MIN_TOKENS, resolve_min_tokens

    assert resolve_min_tokens("auto", True) == AUTO_MIN_TOKENS and resolve_min_tokens("auto", False) == 0
    assert resolve_min_tokens(5, False) == 5 and resolve_min_tokens(0, True) == 0
    model = tiny("qwen3_moe")
    moecache.offload(model, capacity="25%", policy="lru")  # the stand-in here
    assert model.moecache.runtime.streamed is None


def test_reconfigure_keeps_the_streaming_settings():
    model = _offloaded(torch.float32, stream_min_tokens=3, stream_chunk=5)
    session = model.moecache.reconfigure(capacity="50%", policy="lfu")
    assert session.runtime.stream_settings == (3, 5) and session.runtime.streamed.chunk == 5


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"stream_min_tokens": -1}, "runtime.stream_min_tokens must be auto or an integer >= 0, got -1"),
        ({"stream_min_tokens": True}, "runtime.stream_min_tokens must be auto or an integer >= 0, got True"),
        ({"stream_min_tokens": 2, "stream_chunk": 0}, "runtime.stream_chunk must be an integer >= 1, got 0"),
        ({"stream_min_tokens": 2.5}, "runtime.stream_min_tokens must be auto or an integer >= 0, got 2.5"),
        ({"stream_min_tokens": "32"}, "runtime.stream_min_tokens must be auto or an integer >= 0, got '32'"),
    ],
)
def test_bad_settings_are_refused_before_the_model_changes(kw, message):
    model = tiny("qwen3_moe")
    with pytest.raises(MoecacheError, match=message.replace(".", r"\.")):
        moecache.offload(model, capacity="25%", **kw)
    assert getattr(model, "moecache", None) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_streamed_prompt_gives_the_logits_of_every_miss_on_the_cpu():
    """CUDA: the copies on the staging stream, the compute stream's waits and the pools' reuse (chunk 2,
    so every prompt visit refills both pools) against the CPU path, bf16, then a one-token step."""
    prompt_1T = torch.randint(0, 100, (1, 64), generator=torch.Generator().manual_seed(2))
    logits, streamed = {}, {}
    for min_tokens in (0, 2):
        model = tiny("qwen3_moe").to(torch.bfloat16)
        moecache.offload(model, capacity="25%", policy="lru", device="cuda", stream_min_tokens=min_tokens,
                         stream_chunk=2)  # fmt: skip
        with torch.inference_mode():
            logits[min_tokens] = model(prompt_1T.cuda()).logits.float().cpu()
        streamed[min_tokens] = model.moecache.stats()["streamed_experts"]
    assert streamed[0] == 0 and streamed[2] > 4 * model.config.num_hidden_layers
    torch.testing.assert_close(logits[2], logits[0], rtol=2e-2, atol=2e-2)
    assert (logits[2].argmax(-1) == logits[0].argmax(-1)).float().mean() > 0.9

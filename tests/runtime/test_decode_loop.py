"""moecache's fast decode loop (moecache/runtime/decode_loop.py, segments.py) on the tiny model of every
adapter, float32 on the CPU: greedy tokens (and logits, to fp32 rounding) equal to transformers'
`model.generate` on the same weights, for the unmodified model and offloaded at capacity 0, a quarter
and all experts; the frozen mapping decoded with no host point; the static buffers and the cache
reused in place across steps and calls; EOS and the streamer; the `runtime.loop` switch of `moecache
generate`. GPU marker: CUDA graph replay equals eager decode while experts are published and evicted
between steps (a mapping baked into a graph would not).

Legend: T prompt tokens, N generated tokens, L MoE layers, K top-k, V vocabulary.
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import moecache
from moecache.cli import app
from moecache.errors import MoecacheError
from moecache.generation import fast_generate
from moecache.models import adapter_for
from moecache.runtime.decode_loop import FastDecoder
from moecache.runtime.forced_routing import ForcedRouting
from moecache.runtime.segments import ExpertsTaps
from moecache.trace.esft_import import EsftArrays, esft_to_table
from moecache.trace.schema import TraceMeta
from tests.runtime.helpers import split_profile, spy_visits, tiny

MODEL_TYPES = ["qwen3_5_moe", "deepseek_v2", "mixtral", "qwen3_moe", "olmoe"]
PROMPT_T = [5, 17, 99, 42, 7, 250, 3]
NEW = 6
GREEDY = dict(do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0)


def hf_greedy(model, prompt=PROMPT_T, new=NEW, eos=None):
    """transformers' greedy tokens [1, T + N] and the logits of each generated position [N, V]."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device=model.device), max_new_tokens=new, eos_token_id=eos,
            output_logits=True, return_dict_in_generate=True, **GREEDY,
        )  # fmt: skip
    return out.sequences.cpu(), torch.cat(out.logits).float().cpu()


@pytest.fixture(scope="module", params=MODEL_TYPES)
def reference(request):
    """(model_type, the unmodified model, its transformers greedy tokens and logits, L, K)."""
    model = tiny(request.param)
    adapter = adapter_for(model)
    return request.param, model, hf_greedy(model), adapter.num_layers, adapter.top_k


@pytest.mark.parametrize("capacity", [None, 0, "25%", "100%"], ids=["unmodified", "cap0", "quarter", "all"])
def test_fast_loop_equals_transformers_generate(reference, capacity):
    model_type, plain, (want_tokens, want_logits), L, K = reference
    model = (
        plain if capacity is None else moecache.offload(copy.deepcopy(plain), capacity=capacity, policy="lru")
    )
    decoder = FastDecoder(model, max_cache_len=len(PROMPT_T) + NEW, keep_logits=True)
    result = decoder.generate(torch.tensor([PROMPT_T]), NEW)
    assert torch.equal(result.tokens, want_tokens), f"{model_type} at capacity {capacity}"
    torch.testing.assert_close(result.logits, want_logits, rtol=1e-4, atol=1e-5)
    assert result.mode == ("dense" if capacity is None else "split")
    # the CPU: eager steps, the first decode step is the warm-up, the others are timed
    assert result.graphs_per_step == 0 and result.timed_steps == NEW - 2 and result.new_tokens == NEW
    if capacity is None:
        assert result.host.visits == 0 and result.manager_us_per_visit is None
        return
    # the host points' own times over the timed steps: a visit per MoE layer per step, in the manager
    assert result.host.visits == result.timed_steps * L and result.host.manager_ns > 0
    s = model.moecache.stats()
    assert s["visits"] == NEW * L  # the prefill, then one visit per MoE layer per decode step
    assert s["gpu_entries"] + s["fallback_entries"] == (len(PROMPT_T) + NEW - 1) * L * K
    assert s["hits"] + s["misses"] == s["accesses"]
    if capacity == 0:
        assert s["gpu_entries"] == 0 and s["hit_rate"] == 0.0
        # the last decode step's CPU half timed itself (the trace's cpu_duration_ns column)
        assert model.moecache.manager.last_visit.cpu_duration_ns > 0
    if capacity == "100%":  # copies admitted at the prefill land before the decode steps (stand-in)
        assert s["evictions"] == 0 and s["gpu_entries"] > 0


def test_compiled_step_is_compiled_with_a_recompile_limit_above_the_layer_count(monkeypatch):
    """Each decoder layer's forward is compiled with guards of its own (its index): the compiled step
    runs under a recompile limit of at least 2 x layers + 8, dynamo's own limit untouched outside it."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    before = getattr(dynamo_config, name)
    seen = []

    def fake_compile(step, **_):
        def run():
            seen.append(getattr(dynamo_config, name))
            step()

        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    plain = tiny("qwen3_5_moe")
    want, _ = hf_greedy(plain)
    model = moecache.offload(copy.deepcopy(plain), capacity="25%", policy="lru")
    result = FastDecoder(model, len(PROMPT_T) + NEW, compile=True).generate(torch.tensor([PROMPT_T]), NEW)
    assert torch.equal(result.tokens, want)
    layers = plain.config.get_text_config().num_hidden_layers
    assert seen and set(seen) == {max(before, 2 * layers + 8)}
    assert getattr(dynamo_config, name) == before


def test_compiled_warm_up_lasts_until_a_step_compiles_nothing(monkeypatch):
    """A compile while a CUDA graph is captured fails the capture: the compiled step warms up until a
    step compiles no frame, and no timed step compiles one. DeepSeek-V2 (a dense first layer, then
    MoE layers behind the expert taps' graph breaks) is the model whose second step still compiled.
    Real dynamo, its eager backend (no inductor: the frames are what matter)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend="eager", **kw))
    torch._dynamo.reset()
    try:
        plain = tiny("deepseek_v2")
        want, _ = hf_greedy(plain)
        model = moecache.offload(copy.deepcopy(plain), capacity="25%", policy="lru")
        decoder = FastDecoder(model, len(PROMPT_T) + NEW, compile=True)
        step, compiled = decoder._run_step, []

        def recording_step():
            frames = counters["frames"]["total"]
            said = step()  # whether it compiled a frame, as the decode loop reads it
            compiled.append(counters["frames"]["total"] != frames)
            assert said == compiled[-1]
            return said

        decoder._run_step = recording_step
        result = decoder.generate(torch.tensor([PROMPT_T]), NEW)
    finally:
        torch._dynamo.reset()
    assert torch.equal(result.tokens, want)
    warm = len(compiled) - result.timed_steps
    assert len(compiled) == NEW - 1 and result.timed_steps >= 1 and compiled[0]
    assert not compiled[warm - 1] and not any(compiled[warm:]), compiled


def test_a_frozen_mapping_decodes_with_no_host_point():
    """Every expert resident (static_cold at 100%): the experts call is the slot-pool kernel inline,
    no visit call during decode (each layer step counted as a visit whose experts all hit);
    host_points=always still splits, with the same tokens and counts."""
    plain = tiny("qwen3_5_moe")
    want, _ = hf_greedy(plain)
    L = adapter_for(plain).num_layers
    fused_model = moecache.offload(copy.deepcopy(plain), capacity="100%", policy="static_cold")
    fused = FastDecoder(fused_model, max_cache_len=len(PROMPT_T) + NEW).generate(
        torch.tensor([PROMPT_T]), NEW
    )
    assert fused.mode == "fused" and torch.equal(fused.tokens, want)
    assert fused_model.moecache.runtime.counters.visits == L  # visit calls: the prefill's only
    fused_stats = fused_model.moecache.stats()
    assert fused_stats["visits"] == NEW * L and fused_stats["hit_rate"] == 1.0
    split_model = moecache.offload(copy.deepcopy(plain), capacity="100%", policy="static_cold")
    split = FastDecoder(split_model, len(PROMPT_T) + NEW, host_points="always")
    result = split.generate(torch.tensor([PROMPT_T]), NEW)
    assert result.mode == "split" and torch.equal(result.tokens, want)
    stats = split_model.moecache.stats()
    assert stats["visits"] == NEW * L and stats["hit_rate"] == 1.0 and stats["copies"] == 0
    assert fused_stats["hits"] == stats["hits"] and fused_stats["gpu_entries"] == stats["gpu_entries"]


def layers_split(L: int) -> dict[int, str]:
    """static_layers at 50% of L MoE layers: the first half on the CPU, the last half resident."""
    return {layer: "cpu" if layer < L - L // 2 else "fused" for layer in range(L)}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_fixed_placement_runs_whole_layers_with_no_split(model_type):
    """static_layers at 50%: the resident layers run the slot-pool kernel inline (no visit call), the
    layers with no resident expert run the CPU half alone; the tokens, logits and counts are the split
    step's (host_points=always). lfu, whose placement changes, splits every layer."""
    plain = tiny(model_type)
    want, want_logits = hf_greedy(plain)
    L = adapter_for(plain).num_layers
    runs = {}
    for host_points in ("auto", "always"):
        model = moecache.offload(copy.deepcopy(plain), capacity="50%", policy="static_layers")
        decoder = FastDecoder(model, len(PROMPT_T) + NEW, host_points=host_points, keep_logits=True)
        result = decoder.generate(torch.tensor([PROMPT_T]), NEW)
        assert result.mode == "split" and torch.equal(result.tokens, want), host_points
        torch.testing.assert_close(result.logits, want_logits, rtol=1e-4, atol=1e-5)
        runs[host_points] = (decoder, result, model.moecache.stats(), model.moecache.runtime.counters.visits)
    (fixed, fixed_run, fixed_stats, fixed_calls), (split, split_run, split_stats, split_calls) = runs.values()
    assert fixed._taps.kind_L == layers_split(L) and split._taps.kind_L == {}
    torch.testing.assert_close(fixed_run.logits, split_run.logits, rtol=0, atol=0)
    cpu_layers = L - L // 2
    assert fixed_calls == L + (NEW - 1) * cpu_layers and split_calls == NEW * L  # the prefill's and decode's
    for key in ("visits", "hits", "misses", "gpu_entries", "fallback_entries", "copies"):
        assert fixed_stats[key] == split_stats[key], key
    assert fixed_stats["hit_rate"] == split_stats["hit_rate"] and 0 < fixed_stats["hit_rate"] < 1
    lfu = moecache.offload(copy.deepcopy(plain), capacity="50%", policy="lfu")
    decoder = FastDecoder(lfu, len(PROMPT_T) + NEW)
    assert torch.equal(decoder.generate(torch.tensor([PROMPT_T]), NEW).tokens, want)
    assert decoder._taps.kind_L == {}


def test_static_buffers_and_the_cache_keep_their_addresses(monkeypatch):
    """Every decode step reads the same input buffers and taps into the same buffers; a second call
    (another prompt) resets the cache in place and still equals transformers."""
    plain = tiny("qwen3_5_moe")
    model = moecache.offload(copy.deepcopy(plain), capacity="25%", policy="lru")
    decoder = FastDecoder(model, max_cache_len=32)
    forward_ids, tapped = [], []
    real_forward, real_route = decoder._forward, ExpertsTaps._route

    def forward(input_ids, *args, **kw):
        forward_ids.append((tuple(input_ids.shape), input_ids.data_ptr()))
        return real_forward(input_ids, *args, **kw)

    def route(self, layer):
        tapped.append(
            (self.tap_B.data_ptr(), self.ids_TK.data_ptr(), self.x_TH.data_ptr(), self.y_TH.data_ptr())
        )
        return real_route(self, layer)

    monkeypatch.setattr(decoder, "_forward", forward)
    monkeypatch.setattr(ExpertsTaps, "_route", route)
    first = decoder.generate(torch.tensor([PROMPT_T]), NEW)
    buffers = {name: t.data_ptr() for name, t in decoder.static_buffers().items()}
    cache_ptrs = cache_addresses(decoder.cache)
    other = [11, 12, 13]
    second = decoder.generate(torch.tensor([other]), 8)
    assert torch.equal(first.tokens, hf_greedy(plain)[0])
    assert torch.equal(second.tokens, hf_greedy(plain, other, 8)[0])
    assert {name: t.data_ptr() for name, t in decoder.static_buffers().items()} == buffers
    assert cache_addresses(decoder.cache) == cache_ptrs and len(cache_ptrs) == 2 + 3 * 2  # 1 full + 3 linear
    steps = [ptr for shape, ptr in forward_ids if shape == (1, 1)]
    assert len(steps) == (NEW - 1) + (8 - 1) and set(steps) == {decoder.ids_11.data_ptr()}
    assert len(tapped) == len(steps) * adapter_for(plain).num_layers and len(set(tapped)) == 1


def cache_addresses(cache) -> list[int]:
    """data_ptr of every tensor the StaticCache holds (KV of attention layers, conv/recurrent states)."""
    ptrs = []
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                ptrs.append(t.data_ptr())
        for name in ("conv_states", "recurrent_states"):
            for t in (getattr(layer, name, None) or {}).values():
                if isinstance(t, torch.Tensor):
                    ptrs.append(t.data_ptr())
    return ptrs


class Recorder:
    """A transformers-style streamer that keeps what it is given."""

    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.view(-1).tolist())

    def end(self):
        self.ended = True


def test_eos_stops_like_transformers_and_the_streamer_sees_every_token():
    plain = tiny("mixtral")
    full, _ = hf_greedy(plain, new=NEW)
    eos = int(full[0, len(PROMPT_T) + 2])  # the third generated token
    want, _ = hf_greedy(plain, new=NEW, eos=eos)
    assert want.shape[1] < full.shape[1]  # transformers stopped there
    model = moecache.offload(copy.deepcopy(plain), capacity="25%", policy="lru")
    streamer = Recorder()
    got = fast_generate(model, torch.tensor([PROMPT_T]), NEW, eos_token_id=[eos], streamer=streamer).tokens
    assert torch.equal(got, want)
    assert streamer.puts[0] == PROMPT_T and sum(streamer.puts[1:], []) == want[0, len(PROMPT_T) :].tolist()
    assert streamer.ended


def test_a_step_cut_short_by_an_error_leaves_the_session_usable():
    """An error inside a decode step after the layer's mapping was prepared (here: the resident experts'
    kernel) must not leave the manager waiting for that layer's visit: the next call decodes the same
    tokens as the unmodified model (fp32: whatever the cache holds)."""
    plain = tiny("qwen3_5_moe")
    want, _ = hf_greedy(plain, new=NEW)
    model = moecache.offload(copy.deepcopy(plain), capacity="25%", policy="lru")
    decoder = FastDecoder(model, max_cache_len=len(PROMPT_T) + NEW)
    runtime = decoder._taps.runtime
    kernel, calls = runtime.kernel, []

    def failing(x_TH, *args, **kwargs):
        calls.append(x_TH.shape[0] == 1)  # a decode step's call (the prefill's have the prompt's tokens)
        if sum(calls) == 3:
            raise RuntimeError("kernel failed")
        return kernel(x_TH, *args, **kwargs)

    runtime.kernel = failing
    with pytest.raises(RuntimeError, match="kernel failed"):
        decoder.generate(torch.tensor([PROMPT_T]), NEW)
    runtime.kernel = kernel
    got = decoder.generate(torch.tensor([PROMPT_T]), NEW)  # no reset: the cache goes on as it was
    assert torch.equal(got.tokens, want)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda m: FastDecoder(m, 16, graphs="on"), "graphs=on needs a CUDA model"),
        (lambda m: FastDecoder(m, 16, graphs="maybe"), "graphs='maybe'"),
        (lambda m: FastDecoder(m, 16, host_points="never"), "host_points='never'"),
        (lambda m: FastDecoder(m, 1), "max_cache_len=1"),
        (
            lambda m: FastDecoder(m, 8).generate(torch.tensor([PROMPT_T]), 2),
            "exceed the decoder's max_cache_len=8",
        ),
        (lambda m: FastDecoder(m, 32).generate(torch.tensor([PROMPT_T, PROMPT_T]), 2), "batch 1"),
        (lambda m: FastDecoder(m, 32).generate(torch.tensor([PROMPT_T]), 0), "max_new_tokens=0"),
    ],
)
def test_bad_arguments_are_one_line(make, message):
    with pytest.raises(MoecacheError, match=message):
        make(tiny("olmoe"))


# ---- the switch in `moecache generate` ----------------------------------------------------------------

BASE = ["model=tiny", "prompt=Hello there", "generation.max_new_tokens=6", "device=cpu"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("decode-loop-generate"))


def generate(root: str, *overrides: str):
    return CliRunner().invoke(app, ["generate", *BASE, f"output_root={root}", *overrides])


def test_generate_runs_either_loop_with_the_same_text(root):
    runs = {
        (loop, enabled): generate(root, f"runtime.loop={loop}", f"runtime.enabled={enabled}", "capacity=25%")
        for loop in ("fast", "transformers")
        for enabled in ("true", "false")
    }
    for key, res in runs.items():
        assert res.exit_code == 0, (key, res.output)
    texts = {res.stdout for res in runs.values()}
    assert len(texts) == 1 and texts.pop().strip()
    assert "generated 6 tokens" in runs[("fast", "true")].stderr
    fast, hf = (dict(line.split(": ", 1) for line in runs[(loop, "true")].stderr.splitlines() if ": " in line)
                for loop in ("fast", "transformers"))  # fmt: skip
    assert fast["visits"] == hf["visits"] and fast["accesses"] == hf["accesses"]
    assert fast["fallback_entries"] == hf["fallback_entries"]


def test_generate_compiles_the_fast_loop_when_asked(root, monkeypatch):
    """runtime.compile=true: the fast loop's step goes through torch.compile (a recording stand-in here),
    with the same text as without."""
    compiled = []

    def fake_compile(step, **kw):
        compiled.append(kw)
        return step

    plain = generate(root, "capacity=25%")
    monkeypatch.setattr(torch, "compile", fake_compile)
    res = generate(root, "capacity=25%", "runtime.compile=true")
    assert res.exit_code == 0 and plain.exit_code == 0, res.output
    assert compiled == [{"dynamic": False}] and res.stdout == plain.stdout


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["runtime.loop=turbo"], "runtime.loop='turbo': expected one of fast, transformers"),
        (["generation.do_sample=true"], "runtime.loop=fast decodes greedily"),
        (
            ["runtime.loop=transformers", "runtime.compile=true"],
            "runtime.compile=true compiles the fast loop",
        ),
        (["runtime.compile=maybe"], "runtime.compile"),
    ],
)
def test_generate_refuses_a_bad_loop_in_one_line(root, overrides, message):
    res = generate(root, "capacity=25%", *overrides)
    assert res.exit_code == 2, res.output
    errors = [line for line in res.stderr.splitlines() if line.startswith("moecache generate: error:")]
    assert len(errors) == 1 and message in errors[0], res.stderr


# ---- GPU: graph replay against eager decode ------------------------------------------------------------


STATS_KEYS = ("visits", "admissions", "evictions", "gpu_entries", "fallback_entries")


@pytest.mark.parametrize(("model_type", "capacity"), [("qwen3_5_moe", "25%"), ("deepseek_v2", "50%")])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_equals_eager_while_the_mapping_changes(model_type, capacity):
    """lru, a capacity where experts are both reused and evicted: between the replayed steps experts
    are published and evicted, and the graphs must read each step's mapping in place: the second call
    (every step replayed) gives the eager loop's tokens and logits, and transformers' (the unmodified
    model on the GPU). deepseek_v2's first decoder layer is dense: it rides in the first segment."""
    new = 16
    plain = tiny(model_type)
    L = adapter_for(plain).num_layers
    runs = {}
    for graphs in ("off", "on"):
        model = moecache.offload(copy.deepcopy(plain), capacity=capacity, policy="lru", device="cuda")
        decoder = FastDecoder(model, max_cache_len=len(PROMPT_T) + new, graphs=graphs, keep_logits=True)
        decoder.generate(torch.tensor([PROMPT_T]), new)  # warm-up, capture
        before = model.moecache.stats()
        result = decoder.generate(torch.tensor([PROMPT_T]), new)
        after = model.moecache.stats()
        runs[graphs] = result, {k: after[k] - before[k] for k in STATS_KEYS}
    (eager, eager_delta), (graph, graph_delta) = runs["off"], runs["on"]
    assert eager.graphs_per_step == 0 and graph.graphs_per_step == 2 * L + 1
    assert graph.timed_steps == new - 1  # the second call: every decode step replayed
    for delta in (eager_delta, graph_delta):
        assert delta["visits"] == new * L
        assert delta["evictions"] > 0 and delta["admissions"] > 0  # the mapping changed step to step
        assert delta["gpu_entries"] > 0 and delta["fallback_entries"] > 0
    assert torch.equal(graph.tokens, eager.tokens)
    torch.testing.assert_close(graph.logits, eager.logits, rtol=1e-4, atol=1e-4)
    reference = copy.deepcopy(plain).cuda()
    reference.set_experts_implementation("batched_mm")
    want_tokens, want_logits = hf_greedy(reference, new=new)
    assert torch.equal(graph.tokens, want_tokens)
    torch.testing.assert_close(graph.logits, want_logits, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_graph_per_step_for_an_unmodified_model_and_a_frozen_mapping():
    new = 12
    plain = tiny("qwen3_5_moe").cuda()
    plain.set_experts_implementation("batched_mm")
    want, _ = hf_greedy(plain, new=new)
    dense = FastDecoder(plain, len(PROMPT_T) + new, graphs="on").generate(torch.tensor([PROMPT_T]), new)
    assert dense.mode == "dense" and dense.graphs_per_step == 1 and torch.equal(dense.tokens, want)
    model = moecache.offload(copy.deepcopy(plain).cpu(), capacity="100%", policy="static_cold", device="cuda")
    decoder = FastDecoder(model, len(PROMPT_T) + new, graphs="on")
    fused = decoder.generate(torch.tensor([PROMPT_T]), new)
    again = decoder.generate(torch.tensor([PROMPT_T]), new)  # replayed from the first decode step on
    assert fused.mode == "fused" and fused.graphs_per_step == 1 and torch.equal(fused.tokens, want)
    assert torch.equal(again.tokens, want) and again.timed_steps == new - 1
    # the same mapping with host points: every layer has every entry resident, so every visit is
    # deferred to the next host point (segments.py, flush) and still happens, once per layer and step
    split = FastDecoder(model, len(PROMPT_T) + new, graphs="on", host_points="always")
    split.generate(torch.tensor([PROMPT_T]), new)  # warm-up, capture
    L = adapter_for(plain).num_layers
    before = model.moecache.stats()
    replayed = split.generate(torch.tensor([PROMPT_T]), new)
    after = model.moecache.stats()
    assert replayed.mode == "split" and torch.equal(replayed.tokens, want)
    assert after["visits"] - before["visits"] == new * L  # the prompt's visit and new - 1 decode steps
    assert after["fallback_entries"] == before["fallback_entries"] and split._taps._deferred is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_fixed_placement_replays_one_graph_per_cpu_layer(model_type):
    """static_layers at 50% on CUDA: a host point per layer with no resident expert and none at the
    resident layers (graphs: one per CPU layer, plus the step's last), replayed with the tokens and
    logits of the split step (host_points=always: two per layer), and its counts."""
    new = 12
    plain = tiny(model_type).cuda()
    L = adapter_for(plain).num_layers
    model = moecache.offload(
        copy.deepcopy(plain).cpu(), capacity="50%", policy="static_layers", device="cuda"
    )
    runs = {}
    for host_points in ("auto", "always"):
        decoder = FastDecoder(
            model, len(PROMPT_T) + new, graphs="on", host_points=host_points, keep_logits=True
        )
        decoder.generate(torch.tensor([PROMPT_T]), new)  # warm-up, capture
        before = model.moecache.stats()
        result = decoder.generate(torch.tensor([PROMPT_T]), new)
        after = model.moecache.stats()
        runs[host_points] = (result, {k: after[k] - before[k] for k in ("visits", "hits", "misses")})
    (fixed, fixed_counts), (split, split_counts) = runs.values()
    assert fixed.graphs_per_step == (L - L // 2) + 1 and split.graphs_per_step == 2 * L + 1
    assert torch.equal(fixed.tokens, split.tokens) and fixed_counts == split_counts
    torch.testing.assert_close(fixed.logits, split.logits, rtol=1e-5, atol=1e-5)
    K = adapter_for(plain).top_k
    assert fixed_counts["visits"] == new * L and 0 < fixed_counts["misses"] < fixed_counts["visits"] * K


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_graphs_equal_eager_while_the_mapping_changes():
    """torch.compile of the step (the taps outside the compiled regions), then graphs: the same tokens
    as the eager loop, lru at a quarter of the experts."""
    new = 12
    plain = tiny("qwen3_5_moe")
    tokens = {}
    for compiled in (False, True):
        model = moecache.offload(copy.deepcopy(plain), capacity="25%", policy="lru", device="cuda")
        graphs = "on" if compiled else "off"
        decoder = FastDecoder(model, len(PROMPT_T) + new, graphs=graphs, compile=compiled)
        result = decoder.generate(torch.tensor([PROMPT_T]), new)
        assert result.graphs_per_step == (2 * adapter_for(plain).num_layers + 1 if compiled else 0)
        assert model.moecache.stats()["evictions"] > 0
        tokens[compiled] = result.tokens
    assert torch.equal(tokens[True], tokens[False])


# ---- trace-forced routing in the fast loop ---------------------------------------------------------------

FORCED_PROMPT = 7  # the trace's prefill step; every later token of a request is one decode step
FORCED_NEW = {"forced/seq-0000": 6, "forced/seq-0001": 4}  # generated tokens per request


def random_forcing(adapter, seed: int = 7) -> ForcedRouting:
    """A trace of random routing (distinct experts per row, positive weights) for two requests, as the
    ESFT importer builds one: step 0 the 7-token prefill, every later token one decode step."""
    L, E, K = adapter.num_layers, adapter.num_experts, adapter.top_k
    lengths = [FORCED_PROMPT + n - 1 for n in FORCED_NEW.values()]
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    ids_NLK = np.argsort(rng.random((n, L, E)), axis=-1)[..., :K].astype(np.int64)
    w_NLK = rng.random((n, L, K)).astype(np.float32) + 0.1
    arrays = EsftArrays(ids_NLK, w_NLK / w_NLK.sum(-1, keepdims=True), np.cumsum([0, *lengths]))
    meta = TraceMeta(L, E, K, adapter.expert_bytes)
    table = esft_to_table(arrays, name="forced", run_id="r", tokens_per_step=FORCED_PROMPT, meta=meta)
    forced = ForcedRouting.from_trace(table, num_layers=L, num_experts=E, top_k=K)
    assert list(forced.request_ids) == list(FORCED_NEW)
    return forced


def forced_runs(model, forced, decode):
    """Every request of the trace through `decode(model, input_ids, new)`: (outputs, the manager's ids
    per layer [N, K] over all requests)."""
    seen = spy_visits(model.moecache.manager)
    outputs = []
    for rid, new in FORCED_NEW.items():
        forced.start_request(rid)
        model.moecache.begin_request()
        outputs.append(decode(model, forced.input_ids(rid, 320), new))
    return outputs, {layer: np.concatenate(rows) for layer, rows in seen.items()}


def hf_decode(model, input_ids, new):
    with torch.inference_mode():
        out = model.generate(
            input_ids.to(model.device), max_new_tokens=new, eos_token_id=None, output_logits=True,
            return_dict_in_generate=True, **GREEDY,
        )  # fmt: skip
    return out.sequences.cpu(), torch.cat(out.logits).float().cpu()


def trace_ids(forced, layer) -> np.ndarray:
    return np.concatenate([forced.expert_ids(r)[layer] for r in forced.request_ids])


def check_forced_fast_loop(model_type, capacity, policy, device="cpu", graphs="off", split_dir=None):
    """`split_dir`: both runs with on_miss="split", weighed by a profile written there whose copies are
    far cheaper than the CPU (so misses wait for their copies on the device)."""
    plain = tiny(model_type)
    adapter = adapter_for(plain)
    forced = random_forcing(adapter)
    offload = dict(capacity=capacity, policy=policy, device=device)
    if split_dir is not None:
        profile = split_dir / "profile.json"
        shape = SimpleNamespace(
            hidden_size=adapter.hidden_size,
            num_experts=adapter.num_experts,
            expert_bytes=adapter.expert_bytes,
        )
        profile.write_text(json.dumps(split_profile(shape, copy_us=1.0, cpu_us=1e6)))
        offload.update(on_miss="split", cost_profile=profile)
    hf_model = moecache.offload(copy.deepcopy(plain), **offload)
    with forced.attach(hf_model):  # transformers' generate, forced by the router hooks
        want, want_ids = forced_runs(hf_model, forced, hf_decode)
    fast_model = moecache.offload(copy.deepcopy(plain), **offload)
    max_len = FORCED_PROMPT + max(FORCED_NEW.values())
    decoder = FastDecoder(fast_model, max_len, graphs=graphs, keep_logits=True, forced=forced)
    results = []

    def fast(model, input_ids, new):
        result = decoder.generate(input_ids, new)  # attaches the hooks for the prefill itself
        results.append(result)
        return result.tokens, result.logits

    got, got_ids = forced_runs(fast_model, forced, fast)
    assert forced.attached_to is None  # detached after each call
    L = adapter.num_layers
    for (tokens, logits), (want_tokens, want_logits) in zip(got, want, strict=True):
        assert torch.equal(tokens, want_tokens), f"{model_type} at {capacity}"
        tol = 1e-4 if device == "cpu" else 1e-3
        torch.testing.assert_close(logits, want_logits, rtol=tol, atol=tol)
    for layer in range(L):  # the manager saw exactly the forced ids, in both loops
        assert np.array_equal(got_ids[layer], trace_ids(forced, layer))
        assert np.array_equal(want_ids[layer], trace_ids(forced, layer))
    assert all(r.mode == "split" for r in results)  # host points always, even with every expert resident
    if split_dir is None:  # the same visits in the same order, deferred to the next host point or not
        keys = ("visits", "hits", "misses", "admissions", "evictions", "gpu_entries", "fallback_entries")
        want_s, got_s = hf_model.moecache.stats(), fast_model.moecache.stats()
        assert {k: got_s[k] for k in keys} == {k: want_s[k] for k in keys}
    return plain, fast_model, results


@pytest.mark.parametrize("model_type", ["deepseek_v2", "qwen3_5_moe"])
@pytest.mark.parametrize(("capacity", "policy"), [("25%", "lru"), ("100%", "static_cold")])
def test_forced_fast_loop_equals_forced_transformers_generate(model_type, capacity, policy):
    plain, model, results = check_forced_fast_loop(model_type, capacity, policy)
    s = model.moecache.stats()
    if capacity == "25%":
        assert s["hits"] > 0 and s["misses"] > 0  # both halves ran on forced ids
    else:
        assert s["hit_rate"] == 1.0 and s["fallback_entries"] == 0
    # the forcing has something to change: unforced, the same model routes otherwise
    adapter = adapter_for(plain)
    natural = moecache.offload(copy.deepcopy(plain), capacity=capacity, policy=policy)
    seen = spy_visits(natural.moecache.manager)
    rid = next(iter(FORCED_NEW))
    forced = random_forcing(adapter)
    FastDecoder(natural, 16).generate(forced.input_ids(rid, 320), FORCED_NEW[rid])
    assert not np.array_equal(np.concatenate(seen[0]), forced.expert_ids(rid)[0])


@pytest.mark.parametrize("model_type", ["deepseek_v2", "qwen3_5_moe"])
def test_forced_fast_loop_splits_misses_as_transformers_generate_does(model_type, tmp_path):
    """on_miss="split" in both loops: the fast loop's wait call (after B(l), over the visit's wait row)
    gives transformers' tokens; misses did wait for their copies."""
    _, model, _ = check_forced_fast_loop(model_type, "25%", "lru", split_dir=tmp_path)
    s = model.moecache.stats()
    assert s["waited_copies"] > 0 and s["misses"] > 0


def test_forced_fast_loop_refuses_what_it_cannot_force():
    plain = tiny("deepseek_v2")
    adapter = adapter_for(plain)
    forced = random_forcing(adapter)
    model = moecache.offload(copy.deepcopy(plain), capacity="25%", policy="lru")

    def refused(match, call, *args, **kwargs):
        with pytest.raises(MoecacheError, match=match) as info:
            call(*args, **kwargs)
        assert "\n" not in str(info.value)

    refused("forced= needs a moecache.offload'ed model", FastDecoder, plain, 16, forced=forced)
    table_no_w = ForcedRouting.from_trace(
        forced_table(adapter).drop_columns(["router_weights"]),
        num_layers=adapter.num_layers, num_experts=adapter.num_experts, top_k=adapter.top_k,
    )  # fmt: skip
    refused("forced= needs a trace with router_weights", FastDecoder, model, 16, forced=table_no_w)
    refused("forced=str: expected a ForcedRouting", FastDecoder, model, 16, forced="trace.parquet")
    decoder = FastDecoder(model, 32, forced=forced)
    rid = forced.request_ids[1]  # 7 + 3 tokens
    refused(r"a router ran before start_request\(\)", decoder.generate, forced.input_ids(rid, 320), 4)
    forced.start_request(rid)
    refused("10 rows left in the current request, this call needs 11", decoder.generate,
            forced.input_ids(rid, 320), 5)  # fmt: skip
    other = copy.deepcopy(plain)
    with forced.attach(other):
        refused("attached to another model", decoder.generate, forced.input_ids(rid, 320), 4)
    assert decoder.generate(forced.input_ids(rid, 320), 4).new_tokens == 4
    model.moecache.reconfigure(capacity="100%", policy="static_cold")
    refused("not the session this decoder was built on", decoder.generate, forced.input_ids(rid, 320), 4)


def forced_table(adapter):
    """The canonical table behind random_forcing (with its router_weights)."""
    L, E, K = adapter.num_layers, adapter.num_experts, adapter.top_k
    forced = random_forcing(adapter)
    ids = np.concatenate([forced.expert_ids(r).transpose(1, 0, 2) for r in forced.request_ids])
    w = np.ones(ids.shape, np.float32) / K
    lengths = [forced.num_tokens(r) for r in forced.request_ids]
    arrays = EsftArrays(ids, w, np.cumsum([0, *lengths]))
    meta = TraceMeta(L, E, K, adapter.expert_bytes)
    return esft_to_table(arrays, name="forced", run_id="r", tokens_per_step=FORCED_PROMPT, meta=meta)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model_type", ["deepseek_v2", "qwen3_5_moe"])
@pytest.mark.parametrize(("capacity", "policy"), [("25%", "lru"), ("100%", "static_cold")])
def test_forced_graph_replay_equals_forced_transformers_generate(model_type, capacity, policy):
    """CUDA graphs on: each replayed step's host points write that step's forced rows into the tap
    buffers (a router hook inside a graph would replay its capture-time rows): tokens as transformers'
    forced generate, and the manager saw exactly the trace's ids."""
    plain, model, results = check_forced_fast_loop(model_type, capacity, policy, device="cuda", graphs="on")
    L = adapter_for(plain).num_layers
    assert all(r.graphs_per_step == 2 * L + 1 for r in results)
    assert results[1].timed_steps == FORCED_NEW["forced/seq-0001"] - 1  # every step of the 2nd replayed
    if capacity == "25%":
        s = model.moecache.stats()
        assert s["evictions"] > 0 and s["hits"] > 0 and s["misses"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model_type", ["deepseek_v2", "qwen3_5_moe"])
def test_forced_graph_replay_splits_misses_as_transformers_generate_does(model_type, tmp_path):
    """on_miss="split" with CUDA graphs: the wait call runs eagerly between B(l) and the CPU misses,
    behind the compute stream's wait on the copies; tokens as transformers' forced generate (split too)."""
    _, model, results = check_forced_fast_loop(
        model_type, "25%", "lru", device="cuda", graphs="on", split_dir=tmp_path
    )
    s = model.moecache.stats()
    assert s["waited_copies"] > 0 and s["misses"] > 0 and s["evictions"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_forcing_hook_inside_a_capture_is_refused_and_forced_decoding_still_works():
    """Forcing hooks attached but no forced= (graphs on): the capture reaches a router hook, which refuses
    in one line instead of baking its rows into the graph; the aborted capture leaves the device usable."""
    plain = tiny("deepseek_v2")
    adapter = adapter_for(plain)
    forced = random_forcing(adapter)
    model = moecache.offload(copy.deepcopy(plain), capacity="25%", policy="lru", device="cuda")
    rid = forced.request_ids[0]
    decoder = FastDecoder(model, 16, graphs="on")
    with forced.attach(model):
        forced.start_request(rid)
        with pytest.raises(MoecacheError, match="router hook ran inside a CUDA graph capture") as info:
            decoder.generate(forced.input_ids(rid, 320), FORCED_NEW[rid])
    assert "\n" not in str(info.value)
    del decoder
    forced.start_request(rid)
    result = FastDecoder(model, 16, forced=forced).generate(forced.input_ids(rid, 320), FORCED_NEW[rid])
    assert result.graphs_per_step == 2 * adapter.num_layers + 1 and result.new_tokens == FORCED_NEW[rid]


def test_a_layers_visit_follows_its_cpu_half_at_the_next_host_point():
    # on_miss="cpu": the visit cannot change what the layer computes, so the host runs the CPU misses
    # first and the visit (policy, bookkeeping) at the next host point (segments.py, _defer_visit)
    plain = tiny("qwen3_5_moe")
    L = adapter_for(plain).num_layers
    model = moecache.offload(plain, capacity=0, policy="lru")
    runtime, manager = model.moecache.runtime, model.moecache.manager
    order = []

    def spy(what, call):
        def logged(layer, *args, **kwargs):
            order.append((what, layer))
            return call(layer, *args, **kwargs)

        return logged

    # the prefill's whole visits run `cpu_half`, the host points its gathered form
    runtime.cpu_half, runtime.cpu_half_bound = (
        spy("cpu", runtime.cpu_half),
        spy("cpu", runtime.cpu_half_bound),
    )
    gathered = runtime.cpu_half_gathered

    def cpu_half_gathered(call, *args, **kwargs):  # its layer: the first miss's key // E
        order.append(("cpu", int(call.keys_M[0]) // manager.shape.num_experts))
        return gathered(call, *args, **kwargs)

    runtime.cpu_half_gathered = cpu_half_gathered
    manager.visit = spy("visit", manager.visit)
    decoder = FastDecoder(model, max_cache_len=len(PROMPT_T) + 4)
    decoder.generate(torch.tensor([PROMPT_T]), 4)  # the prefill's token, then 3 decode steps
    decode = order[2 * L :]  # after the prefill's whole layer visits (visit, then its CPU half)
    assert order[:2] == [("visit", 0), ("cpu", 0)]
    assert decode == [(what, layer) for _ in range(3) for layer in range(L) for what in ("cpu", "visit")]
    assert decoder._taps._deferred is None  # the last step's visit ran before generate returned


def test_every_cpu_half_is_counted_by_the_time_generate_returns():
    # a deferred visit's CPU half is counted at the next host point's flush (off the critical path), the
    # last step's before generate returns; an abandoned step's too
    plain = tiny("qwen3_5_moe")
    L = adapter_for(plain).num_layers
    model = moecache.offload(plain, capacity=0, policy="lru")
    runtime = model.moecache.runtime
    K, P = model.moecache.manager.shape.top_k, len(PROMPT_T)
    runtime.cpu_log = []
    decoder = FastDecoder(model, max_cache_len=P + 4)
    decoder.generate(torch.tensor([PROMPT_T]), 4)  # the prefill's whole visits, then 3 decode steps
    c = runtime.counters
    assert c.cpu_calls == 4 * L and c.cpu_entries == (P + 3) * L * K and c.cpu_exec_ns > 0
    assert [row[:2] for row in runtime.cpu_log] == [(P, P * K)] * L + [(1, K)] * 3 * L
    taps = decoder._taps
    taps._route_and_combine(0)  # a host point whose step then fails: its CPU half ran, its visit is dropped
    assert taps._deferred is not None and c.cpu_calls == 4 * L
    taps.abandon()
    assert taps._deferred is None and c.cpu_calls == 4 * L + 1

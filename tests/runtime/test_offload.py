"""`moecache.offload` on the tiny model of every adapter (CPU, float32, the CPU stand-in device): greedy
tokens identical to the unmodified model at capacity 0, a quarter and all experts; the dense expert
parameters gone; statistics that add up; a checkpoint folder loaded with its store filled from the
safetensors; bad arguments refused in one line.

Legend: T tokens, K top-k, L layers, E experts.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

import moecache
from moecache.errors import MoecacheError
from moecache.models import adapter_for, build_tiny
from moecache.models.loading import load_model
from moecache.offloading import offload_model
from moecache.runtime.experts_module import OffloadedExperts
from tests.runtime.helpers import split_profile, tiny

MODEL_TYPES = ["qwen3_5_moe", "deepseek_v2", "mixtral", "qwen3_moe", "olmoe"]
CAPACITIES = [0, "25%", "100%"]
PROMPT_T = [5, 17, 99, 42, 7, 250, 3]
NEW_TOKENS = 5
GREEDY = dict(
    max_new_tokens=NEW_TOKENS, do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0,
    eos_token_id=None,
)  # fmt: skip


def greedy(model) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(torch.tensor([PROMPT_T]), **GREEDY)


def greedy_logits(model) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy tokens and the logits of every generated position [NEW_TOKENS, vocab]."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([PROMPT_T]), output_logits=True, return_dict_in_generate=True, **GREEDY
        )
    return out.sequences, torch.cat(out.logits)


@pytest.fixture(scope="module", params=MODEL_TYPES)
def reference(request):
    """(model_type, the unmodified model, its greedy tokens and logits, its adapter's description)."""
    model = tiny(request.param)
    return request.param, model, greedy_logits(model), adapter_for(model).describe()


@pytest.mark.parametrize("capacity", CAPACITIES, ids=["cap0", "quarter", "all"])
def test_offloaded_greedy_tokens_equal_the_unmodified_model(reference, capacity):
    model_type, plain, want, arch = reference
    model = moecache.offload(copy.deepcopy(plain), capacity=capacity, policy="lru")
    tokens, logits = greedy_logits(model)
    assert torch.equal(tokens, want[0]), f"{model_type} at capacity {capacity}"
    # fp32, the same experts summed in another order: equal to rounding
    torch.testing.assert_close(logits, want[1], rtol=1e-4, atol=1e-5)
    s = model.moecache.stats()
    L, E, K = arch["num_layers"], arch["num_experts"], arch["top_k"]
    steps = NEW_TOKENS  # one prefill forward, then NEW_TOKENS - 1 decode forwards
    entries = (len(PROMPT_T) + NEW_TOKENS - 1) * L * K
    assert s["visits"] == steps * L
    assert s["hits"] + s["misses"] == s["accesses"] and s["gpu_entries"] + s["fallback_entries"] == entries
    assert s["copy_bytes"] == s["copies"] * arch["expert_bytes"]
    assert s["capacity"] == {0: 0, "25%": L * E // 4, "100%": L * E}[capacity]
    assert sum(s["residents_per_layer"]) <= s["capacity"]
    if capacity == 0:
        assert s["hit_rate"] == 0.0 and s["copies"] == 0 and s["fallback_entries"] == entries
        assert s["residents_per_layer"] == [0] * L
    if capacity == "100%":  # nothing is ever evicted; every expert used is copied once
        assert s["evictions"] == 0 and s["copies"] == s["admissions"] == s["misses"] and s["hits"] > 0


@pytest.mark.parametrize("model_type", ["deepseek_v2", "qwen3_5_moe"])
def test_split_misses_keep_the_unmodified_models_tokens(model_type, tmp_path):
    """on_miss="split" with copies far cheaper than the CPU (a hand-made profile): the misses whose copies
    are in flight run on the device from their slots once copied, the others on the CPU; the greedy
    tokens are the unmodified model's, the counters on_miss="cpu"'s."""
    plain = tiny(model_type)
    want = greedy_logits(plain)
    runs = {}
    for on_miss in ("cpu", "split"):
        model = moecache.offload(copy.deepcopy(plain), capacity="25%", policy="lru")
        if on_miss == "split":
            store = model.moecache.manager.store
            profile = tmp_path / "profile.json"
            profile.write_text(json.dumps(split_profile(store, copy_us=1.0, cpu_us=1e6)))
            model.moecache.reconfigure(capacity="25%", policy="lru", on_miss="split", cost_profile=profile)
        tokens, logits = greedy_logits(model)
        assert torch.equal(tokens, want[0]), on_miss
        torch.testing.assert_close(logits, want[1], rtol=1e-4, atol=1e-5)
        runs[on_miss] = model.moecache.stats()
    split, cpu = runs["split"], runs["cpu"]
    assert split["on_miss"] == "split" and split["waited_copies"] > 0 == cpu["waited_copies"]
    for key in ("hits", "misses", "admissions", "evictions", "copies"):
        assert split[key] == cpu[key], key
    assert split["fallback_entries"] < cpu["fallback_entries"]


def test_a_policy_that_weighs_costs_runs_with_a_profile(tmp_path):
    """impact reads the cost model: with cost_profile (any on_miss) it runs, and the greedy tokens are the
    unmodified model's."""
    plain = tiny("deepseek_v2")
    want = greedy_logits(plain)
    model = moecache.offload(copy.deepcopy(plain), capacity="25%", policy="lru")
    store = model.moecache.manager.store
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(split_profile(store, copy_us=1.0, cpu_us=10.0)))
    session = model.moecache.reconfigure(capacity="25%", policy="impact", cost_profile=profile)
    assert session.manager.policy.cost is session.manager.cost is not None
    tokens, logits = greedy_logits(model)
    assert torch.equal(tokens, want[0])
    torch.testing.assert_close(logits, want[1], rtol=1e-4, atol=1e-5)
    assert session.stats()["admissions"] > 0


def test_the_dense_experts_are_gone_and_the_rest_is_the_models():
    plain = tiny("qwen3_5_moe")
    arch = adapter_for(plain).describe()
    before = sum(p.numel() for p in plain.parameters())
    model = copy.deepcopy(plain)
    kept = [
        (layer.mlp.gate, layer.mlp.shared_expert, layer.mlp.shared_expert_gate)
        for layer in model.model.layers
    ]
    assert moecache.offload(model, capacity=4) is model
    assert not [n for n, _ in model.named_parameters() if ".experts." in n]
    assert not [k for k in model.state_dict() if ".experts." in k]
    expert_params = arch["expert_bytes"] // 4  # float32
    removed = before - sum(p.numel() for p in model.parameters())
    assert removed == arch["num_layers"] * arch["num_experts"] * expert_params
    for layer, modules in zip(model.model.layers, kept, strict=True):
        assert isinstance(layer.mlp.experts, OffloadedExperts)
        # the router and the shared expert stay the model's own modules
        assert (layer.mlp.gate, layer.mlp.shared_expert, layer.mlp.shared_expert_gate) == modules


def test_reset_starts_the_statistics_and_the_cache_again():
    model = moecache.offload(tiny("mixtral"), capacity="100%", policy="lru")
    first = greedy(model)
    stats = model.moecache.stats()
    model.moecache.reset()
    zero = model.moecache.stats()
    assert zero["visits"] == zero["copies"] == zero["fallback_entries"] == 0 and zero["hit_rate"] is None
    assert zero["residents_per_layer"] == [0, 0]
    assert torch.equal(greedy(model), first)
    again = model.moecache.stats()
    assert {k: again[k] for k in ("hits", "misses", "copies")} == {
        k: stats[k] for k in ("hits", "misses", "copies")
    }


def test_a_checkpoint_folder_fills_the_store_from_its_safetensors(tmp_path):
    cfg = {"name": "tiny", "model_type": "qwen3_5_moe", "path": None, "dtype": "float32",
           "build": {"seed": 0, "overrides": {}}}  # fmt: skip
    folder = build_tiny(cfg, tmp_path)
    plain = load_model({"path": str(folder), "dtype": "float32"}, tmp_path, "cpu").model
    model = moecache.offload(folder, capacity="25%", policy="lfu", output_root=tmp_path)
    assert torch.equal(greedy(model), greedy(plain))
    store = model.moecache.manager.store
    gate_up, down = adapter_for(plain).expert_weights(1)
    E = store.num_experts
    assert torch.equal(store.w13_GIH[E : 2 * E], gate_up) and torch.equal(store.w2_GHI[E : 2 * E], down)


def test_a_decision_selects_the_policy(tmp_path):
    path = tmp_path / "decision.json"
    path.write_text(json.dumps({"selected": {"policy": "lru", "params": {}}}))
    model = moecache.offload(tiny("olmoe"), capacity=8, decision=path)
    assert model.moecache.stats()["policy"] == "lru"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(capacity="abc"), "capacity='abc': expected an integer slot count"),
        (dict(capacity=[4, 8]), r"capacity=\[4, 8\]: expected an integer slot count"),
        (dict(capacity=10**6), "more slots than experts"),
        (dict(capacity=4, policy="belady"), "belady is offline"),
        (dict(capacity=4, policy="lru", decision="d.json"), "not both"),
        (dict(capacity=4, device="tpu"), "device='tpu'"),
    ],
)
def test_bad_arguments_are_one_line_and_leave_the_model_as_it_was(kwargs, message):
    model = tiny("mixtral")
    want = greedy(model)
    with pytest.raises(MoecacheError, match=message):
        offload_model(model, **kwargs)
    assert torch.equal(greedy(model), want) and not hasattr(model, "moecache")


def test_a_bad_capacity_is_refused_before_a_checkpoint_is_read(tmp_path):
    with pytest.raises(MoecacheError, match="capacity=12 apples: unknown unit"):
        moecache.offload(tmp_path / "absent", capacity="12 apples")


def test_an_offloaded_model_is_not_offloaded_twice():
    model = moecache.offload(tiny("mixtral"), capacity=2)
    with pytest.raises(MoecacheError, match="already offloaded"):
        moecache.offload(model, capacity=2)


def test_import_moecache_stays_light_and_offload_is_the_function():
    code = (
        "import sys, moecache\n"
        "assert 'torch' not in sys.modules, 'import moecache imported torch'\n"
        "import moecache.offloading\n"
        "assert moecache.offload is moecache.offloading.offload\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- reconfigure: a new cache on the same host store ---------------------------------------------------


@pytest.mark.parametrize("model_type", ["deepseek_v2", "qwen3_5_moe"])
def test_reconfigure_switches_the_cache_and_keeps_the_models_tokens(model_type):
    import gc
    import weakref

    plain = tiny(model_type)
    want = greedy_logits(plain)
    model = moecache.offload(copy.deepcopy(plain), capacity="25%", policy="lru")
    first = model.moecache
    assert torch.equal(greedy(model), want[0]) and first.stats()["visits"] > 0
    store, cpu = first.manager.store, first.runtime.cpu
    old_pool = weakref.ref(first.manager.pool.flat_SB)
    L, E = store.num_layers, store.num_experts
    full = first.reconfigure(capacity="100%", policy="static_cold")
    gc.collect()
    assert old_pool() is None  # the previous slot pool is gone (nothing else held it)
    assert model.moecache is full and full is not first
    assert full.manager.store is store and full.runtime.cpu is cpu  # nothing copied from the model again
    modules = [m for m in model.modules() if isinstance(m, OffloadedExperts)]
    assert len(modules) == L and all(m._runtime is full.runtime for m in modules)
    s = full.stats()  # from zero: the static residents were loaded before the counters start
    assert s["visits"] == s["copies"] == s["fallback_entries"] == 0 and s["hit_rate"] is None
    assert s["policy"] == "static_cold" and s["capacity"] == L * E and s["residents_per_layer"] == [E] * L
    tokens, logits = greedy_logits(model)
    assert torch.equal(tokens, want[0])
    torch.testing.assert_close(logits, want[1], rtol=1e-4, atol=1e-5)
    s = full.stats()
    assert s["hit_rate"] == 1.0 and s["fallback_entries"] == 0 and s["copies"] == 0
    with pytest.raises(MoecacheError, match=r"stats\(\) on a session replaced by reconfigure"):
        first.stats()

    none = full.reconfigure(capacity=0, policy="lru", on_miss="wait")
    assert model.moecache is none and none.manager.pool.capacity == 0 and none.manager.on_miss == "wait"
    assert none.stats()["visits"] == 0
    tokens, logits = greedy_logits(model)
    assert torch.equal(tokens, want[0])
    torch.testing.assert_close(logits, want[1], rtol=1e-4, atol=1e-5)
    s = none.stats()
    assert s["hit_rate"] == 0.0 and s["gpu_entries"] == 0 and s["fallback_entries"] > 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(capacity="abc"), "capacity='abc': expected an integer slot count"),
        (dict(capacity=10**6), "more slots than experts"),
        (dict(capacity=4, policy="belady"), "belady is offline"),
        (dict(capacity=4, policy="nope"), "unknown policy 'nope'"),
        (
            dict(capacity=4, policy="lru", decision="d.json"),
            "moecache reconfigure: give policy= or decision=",
        ),
        (dict(capacity=4, decision="absent.json"), "absent.json: cannot read the decision"),
        (dict(capacity=4, on_miss="later"), r"on_miss='later': expected one of \['cpu', 'wait', 'split'\]"),
        (
            dict(capacity=4, on_miss="split"),
            'on_miss="split" weighs copies against the CPU: give cost_profile=',
        ),
        (
            dict(capacity=4, cost_profile="p.json"),
            "cost_profile=p.json is read only with on_miss='split' or a policy that weighs costs",
        ),
        (dict(capacity=4, policy="impact"), "policy impact weighs measured costs .* give cost_profile="),
    ],
)
def test_reconfigure_refuses_bad_arguments_in_one_line_and_keeps_the_session(kwargs, message):
    model = moecache.offload(tiny("mixtral"), capacity=4, policy="lru")
    session = model.moecache
    want = greedy(model)
    with pytest.raises(MoecacheError, match=message) as info:
        session.reconfigure(**kwargs)
    assert "\n" not in str(info.value)
    assert model.moecache is session and torch.equal(greedy(model), want)  # still the working session
    assert session.stats()["capacity"] == 4

"""Random full-size models in memory (moecache/models/random_full.py), composed from the real conf/model
yamls: the full DeepSeek-V2-Lite and Qwen3.6-35B-A3B shapes (built on the meta device: shapes, no
memory) match their yaml's architecture; cut-down builds on the CPU are seeded and deterministic, go
through `load_model`, and run; bad input is one line."""

from __future__ import annotations

import pytest
import torch

from moecache.config import compose, to_container
from moecache.errors import MoecacheError
from moecache.models import adapter_for, load_model
from moecache.models.random_full import DEEPSEEK_V2_LITE_TEXT, build_random_model

# DeepSeek-V2-Lite's routing shape (26 MoE layers x 64 experts, top-6) at a tiny width: fast on a CPU.
SMALL_DEEPSEEK = (
    "model.random.overrides={hidden_size:64,intermediate_size:96,moe_intermediate_size:32,"
    "num_attention_heads:4,num_key_value_heads:4,kv_lora_rank:16,qk_nope_head_dim:8,qk_rope_head_dim:8,"
    "v_head_dim:8}"
)


def model_cfg(name: str, *overrides: str) -> dict:
    return to_container(compose([f"model={name}", "model.path=null", "model.random.seed=0", *overrides]))[
        "model"
    ]


@pytest.mark.parametrize("name", ["deepseek_v2_lite", "qwen3_6_35b_a3b"])
def test_the_full_shape_matches_the_yaml_architecture(name):
    cfg = model_cfg(name)
    model, _ = build_random_model(cfg, "meta")
    arch = adapter_for(model).describe()
    for key, value in cfg["architecture"].items():
        assert arch[key] == value, key
    params = sum(p.numel() for p in model.parameters())
    assert params == pytest.approx(15.7e9 if name == "deepseek_v2_lite" else 34.7e9, rel=0.01)
    assert next(model.parameters()).dtype == torch.bfloat16


def test_the_deepseek_fields_are_the_real_model_s():
    cfg = model_cfg("deepseek_v2_lite")
    model, _ = build_random_model(cfg, "meta")
    c = model.config
    assert (c.vocab_size, c.num_hidden_layers, c.first_k_dense_replace) == (102400, 27, 1)
    assert (c.kv_lora_rank, c.q_lora_rank, c.qk_rope_head_dim, c.n_shared_experts) == (512, None, 64, 2)
    assert c.rope_parameters["rope_theta"] == DEEPSEEK_V2_LITE_TEXT["rope_theta"]
    assert (c.topk_method, c.norm_topk_prob, c.max_position_embeddings) == ("greedy", False, 163840)


def test_a_cut_build_is_seeded_deterministic_and_loads_through_load_model(tmp_path):
    cut = ("model.dtype=float32", "model.random.num_layers=3", "model.random.vocab_size=320", SMALL_DEEPSEEK)
    a, _ = build_random_model(model_cfg("deepseek_v2_lite", *cut), "cpu")
    b, _ = build_random_model(model_cfg("deepseek_v2_lite", *cut), "cpu")
    c, _ = build_random_model(model_cfg("deepseek_v2_lite", *cut, "model.random.seed=1"), "cpu")
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    loaded = load_model(model_cfg("deepseek_v2_lite", *cut), tmp_path, "cpu")
    arch = loaded.adapter.describe()
    assert (arch["num_layers"], arch["num_experts"], arch["top_k"], arch["hidden_size"]) == (2, 64, 6, 64)
    assert loaded.revision.startswith("random:") and not list(tmp_path.iterdir())  # nothing written
    ids = torch.tensor([list(loaded.tokenizer.encode("hello"))])
    out = loaded.model.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=None)
    assert out.shape == (1, ids.shape[1] + 3)
    # offloaded: the same experts generated straight into the store, the rest of the model the same
    from moecache.models.loading import OffloadRequest

    offloaded = load_model(model_cfg("deepseek_v2_lite", *cut), tmp_path, "cpu", OffloadRequest(0, 0, "off"))
    store, E = offloaded.store, offloaded.adapter.num_experts
    for layer in loaded.adapter.moe_layers():
        gate_up_EIH, down_EHI = loaded.adapter.expert_weights(layer.layer_id)
        rows = slice(layer.layer_id * E, (layer.layer_id + 1) * E)
        assert torch.equal(store.w13_GIH[rows], gate_up_EIH) and torch.equal(store.w2_GHI[rows], down_EHI)
    dense = {
        k: v for k, v in loaded.model.state_dict().items() if not k.endswith(("gate_up_proj", "down_proj"))
    }
    rest = offloaded.model.state_dict()
    assert all(torch.equal(rest[k], v) for k, v in dense.items())


def test_a_cut_qwen_build_runs():
    cfg = model_cfg(
        "qwen3_6_35b_a3b", "model.dtype=float32", "model.random.num_layers=4", "model.random.vocab_size=320",
        "model.random.overrides={hidden_size:64,moe_intermediate_size:32,shared_expert_intermediate_size:32,"
        "num_experts:16,num_attention_heads:4,head_dim:16,linear_num_key_heads:2,linear_num_value_heads:4,"
        "linear_key_head_dim:16,linear_value_head_dim:16}",
    )  # fmt: skip
    model, _ = build_random_model(cfg, "cpu")
    arch = adapter_for(model).describe()
    assert (arch["num_layers"], arch["num_experts"], arch["top_k"]) == (4, 16, 8)
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 320)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.architecture.num_experts=32"], "num_experts: built 64, yaml 32"),
        (["model.random.seed=-1"], "model.random.seed=-1"),
        (
            ["model.random.num_layers=28"],
            "model.random.num_layers=28: deepseek_v2_lite has 27 decoder layers",
        ),
        (["model.random.vocab_size=abc"], "model.random.vocab_size='abc'"),
        (["+model.random.seedz=1"], "model.random.seedz: unknown key"),
        (["model.random.overrides={hidden_sise:64}"], "model.random.overrides.hidden_sise"),
        (["model.random.config_json=/nonexistent/config.json"], "model.random.config_json=/nonexistent"),
        (["model.path=/some/ckpt"], "give one of them"),
    ],
)
def test_bad_input_is_one_line(overrides, message):
    with pytest.raises(MoecacheError, match=None) as info:
        build_random_model(model_cfg("deepseek_v2_lite", *overrides), "meta")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_yaml_without_a_random_block_keeps_its_checkpoint_path():
    with pytest.raises(MoecacheError, match="model.path"):
        to_container(compose(["model=deepseek_v2_lite"]))

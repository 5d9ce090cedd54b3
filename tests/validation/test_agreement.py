"""Teacher-forced agreement (moecache/validation/agreement.py): the figures of LogitErrors and `within`,
`teacher_forced` against transformers' generate, a model forced onto its own captured routing
reproducing its logits bit for bit, and the float32 truth: a bf16 model widened for one pass and left bit
for bit as it was, every implementation measured against it, a run judged within their spread.

Legend: N positions, V vocabulary, L MoE layers, K top-k.
"""

from __future__ import annotations

import pytest
import torch

from moecache.runtime.forced_routing import ForcedRouting, moe_routers
from moecache.validation.agreement import (
    LogitErrors,
    RoutingCapture,
    agreement_row,
    float32_logits,
    implementation_tolerance,
    teacher_forced,
    within_spread,
)
from tests.runtime.helpers import tiny

PROMPT = [5, 17, 99, 42, 7, 250, 3]


def test_logit_errors_figures_and_within():
    base_NV = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    errors = LogitErrors()
    errors.add(base_NV + torch.tensor([[0.0, 0.0, 0.5], [0.0, 0.0, 4.0]]), base_NV)  # top-1 flips at row 1
    assert errors.figures() == {
        "positions": 2,
        "max_abs_logit_error": 4.0,
        "mean_abs_logit_error": pytest.approx(4.5 / 6),
        "top1_agreement": 0.5,
    }
    tight = LogitErrors()
    tight.add(base_NV + 0.25, base_NV)
    assert tight.within(errors) == dict.fromkeys(
        ("max_abs_logit_error", "mean_abs_logit_error", "top1_agreement"), True
    )
    assert errors.within(tight) == dict.fromkeys(tight.within(errors), False)
    with pytest.raises(ValueError, match="differ"):
        errors.add(base_NV[:1], base_NV)


def test_teacher_forced_greedy_equals_generate_and_feeding_its_tokens_gives_its_logits():
    model = tiny("qwen3_moe")
    greedy = teacher_forced(model, PROMPT, steps=4)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True, temperature=None, top_p=None, top_k=None,
        )  # fmt: skip
    assert greedy.tokens == out.sequences[0, :-1].tolist()  # the 4 fed, then generate's 5th
    assert greedy.logits_NV.shape == (len(PROMPT) + 4, model.config.vocab_size)
    torch.testing.assert_close(
        greedy.logits_NV[len(PROMPT) - 1 :], torch.cat(out.logits), rtol=1e-5, atol=1e-5
    )
    fed = teacher_forced(model, PROMPT, feed=greedy.tokens[len(PROMPT) :])
    assert torch.equal(fed.logits_NV, greedy.logits_NV)
    other = teacher_forced(model, PROMPT, feed=[1, 2, 3, 4])
    assert torch.equal(other.logits_NV[: len(PROMPT)], greedy.logits_NV[: len(PROMPT)])
    assert not torch.equal(other.logits_NV, greedy.logits_NV)
    with pytest.raises(ValueError, match="exactly one"):
        teacher_forced(model, PROMPT)


def test_forced_onto_its_own_captured_routing_a_bf16_model_reproduces_its_logits():
    """The captured ids and weights (float32 copies of the router's bf16 ones), forced back (ForcedRouting
    returns the weights in the router's own dtype): the forced run's logits are the unforced run's, bit
    for bit, with transformers' grouped_mm path (which weighs and sums in the weights' dtype)."""
    model = tiny("qwen3_moe").to(torch.bfloat16)
    model.set_experts_implementation("grouped_mm")
    routers = moe_routers(model)
    with RoutingCapture(routers) as capture:
        own = teacher_forced(model, PROMPT, steps=3)
    ids_LNK, w_LNK, prompt_len = capture.arrays(len(PROMPT))
    assert ids_LNK.shape == (len(routers), len(PROMPT) + 3, model.config.num_experts_per_tok)
    forced = ForcedRouting.from_arrays(
        {"r": (ids_LNK, w_LNK, prompt_len)}, num_experts=model.config.num_experts
    )
    feed = own.tokens[len(PROMPT) :]
    with forced.attach(model):
        forced.start_request("r")
        again = teacher_forced(model, PROMPT, feed=feed)
    assert torch.equal(again.logits_NV, own.logits_NV)
    ids_LNK[:, len(PROMPT) :] = (ids_LNK[:, len(PROMPT) :] + 1) % model.config.num_experts  # other experts
    moved = ForcedRouting.from_arrays(
        {"r": (ids_LNK, w_LNK, prompt_len)}, num_experts=model.config.num_experts
    )
    with moved.attach(model):
        moved.start_request("r")
        other = teacher_forced(model, PROMPT, feed=feed)
    assert torch.equal(other.logits_NV[: len(PROMPT)], own.logits_NV[: len(PROMPT)])
    assert not torch.equal(other.logits_NV, own.logits_NV)


def test_the_baseline_itself_is_within_the_implementations_tolerance():
    model = tiny("qwen3_moe").to(torch.bfloat16)
    prompts, feed = {"a": PROMPT}, {"a": [1, 2]}
    tolerance = implementation_tolerance(model, prompts, feed)
    assert set(tolerance.pairs) == {"eager"} and tolerance.pairs["eager"].positions == 9
    assert model.config._experts_implementation != "eager"  # restored
    model.set_experts_implementation("grouped_mm")  # the baseline, transformers' default path
    row = agreement_row(model, prompts, feed, tolerance)
    assert row == {
        "positions": 9, "max_abs_logit_error": 0.0, "mean_abs_logit_error": 0.0, "top1_agreement": 1.0,
        "max_abs_logit_error_within": True, "mean_abs_logit_error_within": True, "top1_agreement_within": True,
        "within_tolerance": True,
    }  # fmt: skip


def test_the_float32_truth_leaves_a_bf16_model_as_it_was_and_measures_every_implementation():
    model = tiny("qwen3_moe").to(torch.bfloat16)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    prompts, feed = {"a": PROMPT}, {"a": [1, 2, 3]}
    tolerance = implementation_tolerance(model, prompts, feed, float32=True)
    assert {n: t.dtype for n, t in model.state_dict().items()} == {n: t.dtype for n, t in before.items()}
    assert all(torch.equal(model.state_dict()[n], t) for n, t in before.items())  # bit for bit
    assert set(tolerance.from_truth) == {"eager", "grouped_mm"}
    base = tolerance.from_truth["grouped_mm"].figures()
    assert base["max_abs_logit_error"] > 0  # bf16 rounding, measured against float32
    model.set_experts_implementation("eager")
    again = float32_logits(model, prompts, feed)  # the same truth twice (the eager loop in float32)
    assert torch.equal(again["a"], tolerance.truth["a"])
    model.set_experts_implementation("grouped_mm")
    row = agreement_row(model, prompts, feed, tolerance)  # the baseline itself: inside the spread
    assert row["float32_max_abs_logit_error"] == base["max_abs_logit_error"] and row["within_float32_spread"]


def test_a_float32_model_is_its_own_truth():
    model = tiny("qwen3_moe")
    tolerance = implementation_tolerance(model, {"a": PROMPT}, {"a": [1]}, float32=True)
    assert tolerance.truth is tolerance.base
    assert tolerance.from_truth["grouped_mm"].figures()["max_abs_logit_error"] == 0.0


def test_within_the_spread_means_no_further_from_the_truth_than_the_others():
    def figs(max_e, mean_e, top1):
        return {"max_abs_logit_error": max_e, "mean_abs_logit_error": mean_e, "top1_agreement": top1}

    others = [figs(1.0, 0.10, 0.99), figs(2.0, 0.05, 0.98)]
    assert within_spread(figs(2.0, 0.10, 0.98), others)  # the worst of each figure: inside
    assert not within_spread(figs(2.1, 0.01, 1.0), others)
    assert not within_spread(figs(0.5, 0.11, 1.0), others)
    assert not within_spread(figs(0.5, 0.01, 0.97), others)

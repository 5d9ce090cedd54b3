"""moecache/runtime/router_topk.py on the CPU (where the operator computes topk_rows' reference): which
routers are switched, that a switched model computes what it did, hooks, remove, and the compiled step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moecache.models.adapter import adapter_for
from moecache.runtime.router_topk import KernelTopk, install_router_topk
from tests.runtime.helpers import tiny


class SoftmaxTopkRouter(nn.Module):
    """A router as transformers writes them: softmax, top-k, renormalised weights in the logits' dtype."""

    def __init__(self, hidden: int = 16, experts: int = 12, top_k: int = 3, largest: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, hidden, generator=torch.Generator().manual_seed(3)))
        self.top_k, self.largest = top_k, largest

    def forward(self, hidden_states):
        logits = F.linear(hidden_states, self.weight)
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        values, ids = torch.topk(probs, self.top_k, dim=-1, largest=self.largest)
        values /= values.sum(dim=-1, keepdim=True)
        return logits, values.to(logits.dtype), ids


def _routers(model) -> dict[int, nn.Module]:
    return {i: layer.router for i, layer in enumerate(adapter_for(model).moe_layers())}


def test_a_tiny_qwen3_5_moe_is_switched_and_compiled_computes_the_same_logits() -> None:
    model = tiny("qwen3_5_moe")
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    routers = _routers(model)
    switched = install_router_topk(routers, dtype=torch.float32)
    assert switched.layers == sorted(routers) and not switched.refused
    torch._dynamo.reset()
    with torch.no_grad():  # compiled: the switched routers call the operator
        got = torch.compile(model, backend="eager")(ids).logits
    assert torch.equal(got, want)
    with switched.suspended():
        assert all("forward" not in router.__dict__ for router in routers.values())
    assert all("forward" in router.__dict__ for router in routers.values())
    switched.remove()
    assert switched.layers == []
    assert all("forward" not in router.__dict__ for router in routers.values())


def _graph_targets(fn, *args) -> list:
    """The call targets of the FX graphs torch.compile makes of `fn(*args)` (backend recording them)."""
    targets = []

    def backend(gm, example_inputs):
        targets.extend(node.target for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    with torch.no_grad():
        torch.compile(fn, backend=backend)(*args)
    return targets


def test_a_compiled_switched_forward_calls_the_operator_and_an_eager_one_torch_topk() -> None:
    router = SoftmaxTopkRouter()
    x = torch.randn(4, 16)
    op = torch.ops.moecache.topk_rows
    assert op not in _graph_targets(router, x)
    install_router_topk({0: router}, dtype=torch.float32)
    torch._dynamo.reset()
    targets = _graph_targets(router, x)
    assert op in targets and torch.topk not in targets
    mode = KernelTopk()
    with torch.no_grad(), mode:
        router.forward.args[0](x)  # the router's own forward under a mode that is not always on
    assert mode.sent == 0


@pytest.mark.parametrize(
    ("router", "why"),
    [
        (SoftmaxTopkRouter(largest=False), "calls no torch.topk"),
        (nn.Identity(), "no 2-D weight"),
    ],
    ids=["smallest", "no_weight"],
)
def test_a_router_the_probe_cannot_vouch_for_is_left_alone(router: nn.Module, why: str) -> None:
    switched = install_router_topk({5: router}, dtype=torch.float32)
    assert switched.layers == [] and why in switched.refused[5]
    assert "forward" not in router.__dict__


def test_a_router_whose_outputs_would_change_is_left_alone(monkeypatch) -> None:
    """The operator giving another order (as a kernel and torch may on equal scores) fails the probe."""
    import moecache.runtime.router_topk as router_topk

    real = router_topk.topk_rows_reference

    def flipped(scores_TE, k, by_value):
        values, ids = real(scores_TE, k, by_value)
        return values.flip(-1).contiguous(), ids.flip(-1).contiguous()

    monkeypatch.setattr(router_topk, "topk_rows_reference", flipped)
    router = SoftmaxTopkRouter()
    switched = install_router_topk({2: router}, dtype=torch.float32)
    assert switched.layers == [] and "outputs differ from its own at 1 token(s)" == switched.refused[2]
    assert "forward" not in router.__dict__


def test_a_kernel_that_fails_leaves_the_router_alone(monkeypatch) -> None:
    """A kernel that cannot build or run on this machine refuses the router; the install goes on."""
    import moecache.runtime.router_topk as router_topk

    def broken(scores_TE, k, by_value):
        raise RuntimeError("no such instruction\nsecond line")

    monkeypatch.setattr(router_topk, "topk_rows_reference", broken)
    router = SoftmaxTopkRouter()
    switched = install_router_topk({0: router}, dtype=torch.float32)
    assert (
        switched.layers == []
        and switched.refused[0] == "the kernel failed (RuntimeError: no such instruction)"
    )
    assert "forward" not in router.__dict__


def test_describe_counts_the_switched_and_names_why_not() -> None:
    switched = install_router_topk(
        {0: SoftmaxTopkRouter(), 1: SoftmaxTopkRouter(largest=False), 2: SoftmaxTopkRouter()},
        dtype=torch.float32,
    )
    assert switched.describe() == (
        "routers' top-k in one launch: 2 of 3 MoE layers "
        "(torch.topk kept where its forward calls no torch.topk the kernel computes)"
    )


def test_hooks_still_run_once_per_call_and_not_for_the_probe() -> None:
    router = SoftmaxTopkRouter()
    calls = []
    router.register_forward_hook(lambda module, args, out: calls.append(out[2].shape))
    install_router_topk({0: router}, dtype=torch.float32)
    assert calls == []
    with torch.no_grad():
        router(torch.randn(2, 16))
    assert calls == [torch.Size([2, 3])]


def test_the_compiled_forward_has_no_graph_break_and_the_same_output() -> None:
    router = SoftmaxTopkRouter()
    x = torch.randn(1, 16)
    with torch.no_grad():
        want = router(x)
        install_router_topk({0: router}, dtype=torch.float32)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(router)(x)
        got = torch.compile(router, backend="eager")(x)
    assert explained.graph_break_count == 0
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_offload_on_the_cpu_leaves_the_routers_alone() -> None:
    import moecache

    model = tiny("qwen3_5_moe")
    routers = _routers(model)
    moecache.offload(model, capacity="50%", device="cpu")
    assert model.moecache.router_topk is None
    assert all("forward" not in router.__dict__ for router in routers.values())


class UnsortedFloat32Router(SoftmaxTopkRouter):
    """DeepSeek-V2's rule: float32 logits, softmax, topk(sorted=False), no renormalisation."""

    def forward(self, hidden_states):
        logits = F.linear(hidden_states.float(), self.weight.float())
        values, ids = torch.topk(
            logits.softmax(dim=-1, dtype=torch.float32), self.top_k, dim=-1, sorted=False
        )
        return logits, values, ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("router", "dtype"),
    [
        (SoftmaxTopkRouter(hidden=2048, experts=256, top_k=8), torch.bfloat16),  # Qwen3.6's: bf16 logits tie
        (UnsortedFloat32Router(hidden=2048, experts=64, top_k=6), torch.bfloat16),  # DeepSeek-V2-Lite's
    ],
    ids=["qwen3_6", "deepseek_v2_lite"],
)
def test_real_router_shapes_are_switched_on_cuda(router: nn.Module, dtype: torch.dtype) -> None:
    """The kernel gives CUDA torch.topk's outputs, ties and the unsorted order included, so the probe
    switches routers of the real shapes; their outputs under a compiled call are the router's own."""
    router = router.to("cuda", dtype)
    x = torch.randn(16, router.weight.shape[1], device="cuda", dtype=dtype)
    with torch.no_grad():
        want = router(x)
    switched = install_router_topk({0: router}, dtype=dtype)
    assert switched.layers == [0], switched.refused
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(router, backend="eager")(x)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

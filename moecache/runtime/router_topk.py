"""The routers' top-k through one Triton launch (kernels/moecache_kernels/topk_rows.py) in place of
`torch.topk`'s two kernels, without copying any router's code.

    switched = install_router_topk({layer: router, ...}, dtype=torch.bfloat16)   # a RouterTopk
    switched.layers, switched.refused     # the layers switched; {layer: why not} for the others
    with switched.suspended(): ...        # the routers' own forwards for a while (an A/B)
    switched.remove()                     # every router back to its own forward

Each switched router runs its own forward under a TorchFunctionMode (`KernelTopk`) that sends its
`torch.topk` calls (function or method) over the last dimension of a 2-D score tensor, largest first,
to `torch.ops.moecache.topk_rows` (the kernel on CUDA, `topk_rows_reference` elsewhere) where the call
is recorded: traced by `torch.compile` (a custom op, so the compiled step calls it) or captured into a
CUDA graph (the fast loop's decode steps, replayed as one launch). An eager call (a prefill, the
transformers loop) keeps torch's topk, which is cheaper to launch from Python. Every other op, and a
topk of any other form, runs unchanged.

A router is switched only where a probe says the outputs cannot change: its forward on random hidden states
(T = 1 and T = 7, a fixed seed) with the substitution and without returns equal tensors (`torch.equal`,
every output) and the substitution happened. The kernel returns the ids in the order CUDA's `torch.topk`
does, equal scores included (a bf16 router's logits tie often; the order is the order the experts' outputs
are summed in): topk_rows_reference spells it out. The CPU's topk orders differently, so there the probe
refuses a router whose scores tie or that asks for `sorted=False`. Hooks on a router (forced routing, the
routing recorder) run as before: the forward is replaced on the instance, `__call__` is the module's.

Legend: T tokens, H hidden, E experts, K top-k.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
from moecache_kernels.topk_rows_reference import MAX_E, SORT_LANES, topk_rows_reference
from torch import nn
from torch.overrides import TorchFunctionMode

PROBE_TOKENS = (1, 7)
PROBE_SEED = 0


@torch.library.custom_op("moecache::topk_rows", mutates_args=())
def topk_rows_op(scores_TE: torch.Tensor, k: int, by_value: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(values_TK, ids_TK int64) of each row: the Triton kernel on CUDA, the reference elsewhere."""
    if scores_TE.is_cuda:
        from moecache_kernels.topk_rows import topk_rows

        return topk_rows(scores_TE, k, by_value)
    return topk_rows_reference(scores_TE, k, by_value)


@topk_rows_op.register_fake
def _topk_rows_fake(scores_TE, k, by_value):
    num_tokens = scores_TE.shape[0]
    return scores_TE.new_empty((num_tokens, k)), scores_TE.new_empty((num_tokens, k), dtype=torch.int64)


class KernelTopk(TorchFunctionMode):
    """Sends `torch.topk(scores_TE, k, dim=-1 or 1, largest=True, sorted=...)` to the operator while
    `torch.compile` traces or a CUDA graph captures (where one launch replaces two for every later step;
    an eager call would pay the operator's Python launch each time), or `always`; counts the calls it
    sent (`sent`)."""

    def __init__(self, always: bool = False):
        super().__init__()
        self.always = always
        self.sent = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.topk or func is torch.Tensor.topk:
            call = _topk_call(*args, **kwargs)
            if call is not None and (self.always or _recorded(call[0])):
                self.sent += 1
                return torch.return_types.topk(torch.ops.moecache.topk_rows(*call))
        return func(*args, **kwargs)


def _recorded(scores: torch.Tensor) -> bool:
    """Whether this call is traced by torch.compile or captured into a CUDA graph."""
    return torch.compiler.is_compiling() or (scores.is_cuda and torch.cuda.is_current_stream_capturing())


def _topk_call(scores, k, dim=-1, largest=True, sorted=True, *, out=None):  # noqa: A002 (topk's own name)
    """(scores_TE, k, by_value) where the call is one the kernel computes, else None."""
    if (
        out is not None
        or not largest
        or not isinstance(scores, torch.Tensor)
        or scores.dim() != 2
        or dim not in (-1, 1)
        or not scores.is_floating_point()
        or not isinstance(k, int)
        or not 1 <= k <= min(scores.shape[1], SORT_LANES)
        or scores.shape[1] > MAX_E
    ):
        return None
    return scores, k, bool(sorted)


@dataclass
class RouterTopk:
    """What `install_router_topk` switched: per switched layer (router, its own instance `forward` or
    None, the switched forward), and the refused layers with the reason."""

    refused: dict[int, str] = field(default_factory=dict)
    _switched: dict[int, tuple[nn.Module, object, object]] = field(default_factory=dict, repr=False)

    @property
    def layers(self) -> list[int]:
        """The layers whose routers take the kernel, in install order."""
        return list(self._switched)

    def describe(self) -> str:
        """One line for the user: how many routers were switched, and why the others were not."""
        total = len(self.layers) + len(self.refused)
        line = f"routers' top-k in one launch: {len(self.layers)} of {total} MoE layers"
        reasons = sorted(set(self.refused.values()))
        return line + (f" (torch.topk kept where {'; '.join(reasons)})" if reasons else "")

    def remove(self) -> None:
        self._restore_own()
        self._switched.clear()

    @contextlib.contextmanager
    def suspended(self):
        """The routers' own forwards inside the block, the switched ones again after it."""
        self._restore_own()
        try:
            yield
        finally:
            for router, _, switched in self._switched.values():
                router.forward = switched

    def _restore_own(self) -> None:
        for router, own, _ in self._switched.values():
            if own is None:
                router.__dict__.pop("forward", None)
            else:
                router.forward = own


def install_router_topk(routers: dict[int, nn.Module], *, dtype: torch.dtype) -> RouterTopk:
    """Switch every router of `routers` (layer -> router module, on its device) whose probe passes
    (module docstring); `dtype` is the hidden states' the routers see (the model's)."""
    done = RouterTopk()
    for layer, router in routers.items():
        why = _probe(router, dtype)
        if why is not None:
            done.refused[layer] = why
            continue
        own = router.__dict__.get("forward")
        router.forward = functools.partial(_switched_forward, router.forward)
        done._switched[layer] = (router, own, router.forward)
    return done


def _switched_forward(forward, *args, **kwargs):
    with KernelTopk():
        return forward(*args, **kwargs)


@torch.no_grad()
def _probe(router: nn.Module, dtype: torch.dtype) -> str | None:
    """None where the router's outputs are the same with the kernel as without, on the probe's inputs;
    else why not (one phrase)."""
    weight = getattr(router, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return "no 2-D weight to size the probe"
    hidden = weight.shape[1]
    generator = torch.Generator(device="cpu").manual_seed(PROBE_SEED)
    for tokens in PROBE_TOKENS:
        x_TH = torch.randn((tokens, hidden), generator=generator).to(dtype=dtype, device=weight.device)
        own = router.forward(x_TH)  # the forward alone: hooks on the router do not see the probe
        mode = KernelTopk(always=True)
        try:  # a kernel that cannot build or run here leaves the router as it is, the offload goes on
            with mode:
                kernel = router.forward(x_TH)
        except Exception as exc:  # noqa: BLE001 (any failure of the substitution refuses it)
            return f"the kernel failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        if mode.sent == 0:
            return "its forward calls no torch.topk the kernel computes"
        if not _equal(own, kernel):
            return f"outputs differ from its own at {tokens} token(s)"
    return None


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, tuple | list):
        return (
            type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b

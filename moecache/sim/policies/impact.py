"""Impact: a score-based, cost-aware cache with an impact-driven prefetch of the next layer, in the spirit of
HybriMoE (Zhong et al., "HybriMoE: Hybrid CPU-GPU Scheduling and Cache Management for Efficient MoE
Inference", DAC 2025, arXiv 2504.05897; code github.com/PKU-SEC-Lab/HybriMoE).

Score (HybriMoE's "Minus Recent Score", MRS). Every key k has a score S_k, updated at every visit of its
layer (a layer step; each layer has its own clock, its visit count V_l):
    S_k <- alpha * u_k + (1 - alpha) * S_k,   u_k = the step's uses of k / the step's tokens
(the share of the step's tokens that selected k; 0 for the layer's keys the step did not select, which
only decay). Keys of other layers do not change. S_k starts at 0.
Call size: mu_k <- alpha * uses + (1 - alpha) * mu_k at every access of k (its first access sets mu_k =
uses), an EMA of the tokens one call of k carries; m_k = max(1, floor(mu_k + 1/2)) (at most the cost
tables' last entry).
Impact: I_k = S_k * saving(m_k), saving(m) = cpu_us(m) - gpu_us(m) from the bound CostModel: the expected
microseconds that holding k saves per visit of its layer. I_k <= 0 when the CPU is not slower.

At every layer step, after all the step's scores and call sizes are updated:
1. Demand. The step's misses in rank order (-I, key). A miss is admitted only if its copy pays for
   itself, I x horizon > copy_us (else the CPU serves it: no copy), and either a slot is free or I is
   strictly greater than the victim's impact. The victim is the resident with the lowest impact (ties:
   the larger key), keys of this step and keys admitted by this step excepted; an admission replaces it.
   A refused miss ends the step's admissions: every later miss ranks no better, so it would be refused too.
2. Prefetch (impact-driven), if `budget` > 0 and layer n + 1 < L exists: up to `budget` times, the
   non-held key of layer n + 1 with the greatest impact (> 0; ties: the smaller key), its impact as of
   that layer's last visit, is admitted under the same two tests (same victim rule and exclusions, the
   keys this step prefetched included); the first refusal ends the prefetch. A key this step evicted
   never qualifies (it was the lowest, so it cannot beat the new lowest).
Placements depend on the bound cost model (copy_us, tables), never on the replay mode: instant and timed
replays with the same cost make the same placements.

Parameters: `alpha` (0 < alpha <= 1, default 0.3): the EMA weight of a visit (1: only the last visit
counts); `horizon` (> 0, default 8): the visits over which a copy must pay for itself; `budget` (int >= 0,
default 1): prefetches per layer step (0: demand only).

What is kept from HybriMoE, what is simplified (read: the released code, ktransformers/operators/
experts.py: KScoreAwareCache, KExpertsCache.load_expert_weights, prefetch_expert and HSS, and
models/modeling_deepseek.py: MoEGate; the paper's own text was not available, only its abstract and the
README, which describe the prefetch as simulating the gain of preloading each next-layer expert):
- MRS is kept: the same layer-local EMA, S <- alpha * s + (1 - alpha) * S, with unselected experts of
  the layer decaying. In HybriMoE, s is the router's softmax probability of the top p = 2 x top_k experts
  of the step's first token (the rest of the layer's experts decay) and alpha = 0.5. The simulator's
  arrays carry no router weights, so s here is the share of the step's tokens that selected k (1 for
  each expert of a decode step), over all tokens of a prefill step, and only selected experts count.
- Eviction: HybriMoE gives each layer a fixed number of GPU slots and evicts that layer's lowest-score
  expert whenever its scheduler runs a non-resident expert on the GPU; the rank is the score alone.
  Here the slots are one pool over all layers and the rank is the impact (score x CPU-GPU saving).
- Admission: HybriMoE's decode scheduler (HSS) splits each layer step's experts between CPU and GPU with
  modelled times (CPU time per token, GPU time, a load time for non-resident experts put on the GPU):
  an expert is copied when that shortens this step; in prefill every miss goes through a temporary GPU
  buffer. Here a miss always runs on the CPU (the simulator's time model), and it is copied when the
  copy pays for itself over `horizon` visits and beats the victim: the same CPU/GPU/copy trade-off,
  judged over a longer horizon; hits are never moved to the CPU.
- Prefetch: the paper simulates the next layer's schedule with and without each candidate; the
  released code preloads the `prefetch_size` highest-score experts of layer n + 1 (default 0),
  evicting that layer's lowest-score expert unconditionally, and waits for them before the layer runs.
  Here the gain estimate is the candidate's impact, and a prefetch must beat the global victim and pay
  for its copy; in timed mode it is one copy on the FIFO engine like any other (no waiting).

Implementation (O(keys of the step x log E + L) per step, plus O(E) when a layer is rescaled, once per
~1000 visits at alpha 0.3):
- Lazy decay, as lfu_decay does it per layer: S_k is stored as X_k = S_k * (1 - alpha)^(-V_l), so a visit
  adds alpha * u_k * W_l to each of its keys (W_l = (1 - alpha)^(-V_l), computed as 2^frac(x) * 2^floor(x)
  with x = V_l * log2(1 / (1 - alpha))), and the layer's other keys decay untouched: S_k = X_k / W_l.
  Stored values carry a per-layer power-of-two scale, divided out exactly (all X of the layer and W_l)
  before W_l would pass 2^512; scores more than ~1000 halvings old may then fall to zero. With alpha = 1
  the keys of the layer's previous visit are reset to 0 instead.
- P_k = X_k * saving(m_k) and I_k = P_k / W_l. Between two visits of a layer the order of its keys' P
  does not change, so each layer keeps two indexed heaps (_heap): its residents by P (top: its lowest,
  ties the larger key) and its non-held keys with P > 0 (top: the greatest, ties the smaller key; the
  heap holds mirrored indexes K - 1 - k so that _heap's tie rule picks the smaller key). The victim is
  the lowest of the L residents' heap tops by I (ties: the larger key). The step's hits leave their heap
  for the step (so they cannot be victims) and return with their new P; admitted keys join at the end.
- u_k needs the step's tokens, which the step's own inputs give: every token selects top_k distinct
  experts of the layer, so tokens = sum of the step's uses / top_k (exact for a router's output; the
  same in the runtime, which sees nothing but the step).
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from moecache.sim.policies import _heap
from moecache.sim.policies._params import require_ints, require_number
from moecache.sim.policies.lfu import sort_ranked
from moecache.sim.policy import Policy, register

RENORM_EXPONENT = 512  # rescale a layer once the weight of a new use exceeds 2^512


@nb.njit(cache=True, inline="always")
def call_size(mu, top):
    """m = max(1, floor(mu + 1/2)), at most `top` (the cost tables' last index)."""
    m = np.int64(math.floor(mu + 0.5))
    return min(max(m, 1), top)


@nb.njit(cache=True, inline="always")
def find_victim(res_heap, res_n_L, p_G, w_L, num_experts):
    """(key, impact) of the resident with the lowest impact, ties the larger key, over the tops of the
    layers' resident heaps; (-1, 0.0) when no resident is eligible (the heaps hold only eligible keys)."""
    vk = -1
    vi = 0.0
    for layer in range(res_n_L.shape[0]):
        if res_n_L[layer] > 0:
            k = res_heap[layer * num_experts]
            imp = p_G[k] / w_L[layer]
            if vk < 0 or imp < vi or (imp == vi and k > vk):
                vk = k
                vi = imp
    return vk, vi


@nb.njit(cache=True, inline="always")
def evict_victim(res_heap, res_pos_G, res_n_L, non_heap, non_pos_J, non_n_L, p_G, q_J, num_experts, v):
    """Take victim v (the top of its layer's resident heap) out; it joins its layer's non-held heap if
    its P is positive."""
    layer = v // num_experts
    lo = layer * num_experts
    hi = lo + num_experts
    _, n = _heap.pop(res_heap[lo:hi], res_pos_G, p_G, res_n_L[layer])
    res_n_L[layer] = n
    if p_G[v] > 0:
        non_n_L[layer] = _heap.push(non_heap[lo:hi], non_pos_J, q_J, non_n_L[layer], p_G.shape[0] - 1 - v)


@nb.njit(_nrt=False)  # no reference counting: see lfu.py
def impact_step(state, key_U, uses_U, hit_U, a0, clock, request, resident_G, admit_out, evict_out):
    (x_G, p_G, q_J, mu_G, res_heap, res_pos_G, res_n_L, non_heap, non_pos_J, non_n_L,
     visits_L, scale_L, w_L, prev_G, prev_n_L, sav_M, miss, meta, fmeta) = state  # fmt: skip
    # meta: [E, L, capacity, held, top_k, budget, alpha is 1]; fmeta: [alpha, 1 - alpha,
    # log2(1 / (1 - alpha)), horizon, copy_us]
    n_keys = key_U.shape[0]
    if n_keys == 0:
        return 0, 0
    num_experts = meta[0]
    num_keys = x_G.shape[0]
    top = sav_M.shape[0] - 1
    for i in range(n_keys):  # the same check in the simulator and the runtime
        if uses_U[i] > top:
            raise ValueError("a call of more tokens than the cost model's tables hold (CostModel.for_trace)")
    layer = key_U[0] // num_experts  # every key of a layer step belongs to its layer
    lo = layer * num_experts
    hi = lo + num_experts
    rh = res_heap[lo:hi]
    nh = non_heap[lo:hi]
    selections = 0
    for i in range(n_keys):
        selections += uses_U[i]
    tokens = selections / meta[4]  # each token selects top_k experts of the layer

    # ---- the layer's clock: decay (lazily), or reset the last visit's scores when alpha = 1
    visit = visits_L[layer] + 1
    visits_L[layer] = visit
    if meta[6] != 0:
        for i in range(prev_n_L[layer]):
            k = prev_G[lo + i]
            x_G[k] = 0.0
            p_G[k] = 0.0
            q_J[num_keys - 1 - k] = 0.0
            if res_pos_G[k] >= 0:
                _heap.update(rh, res_pos_G, p_G, res_n_L[layer], k)
            elif non_pos_J[num_keys - 1 - k] >= 0:
                non_n_L[layer] = _heap.remove(nh, non_pos_J, q_J, non_n_L[layer], num_keys - 1 - k)
        w = 1.0
    else:
        xv = visit * fmeta[2]
        q = math.floor(xv)
        e = np.int64(q) - scale_L[layer]
        if e > RENORM_EXPONENT:  # divide the layer's stored values by 2^e: exact, order-keeping
            f = 2.0 ** (-e)
            n_non = 0
            for k in range(lo, hi):
                x_G[k] *= f
                p = x_G[k] * sav_M[call_size(mu_G[k], top)]
                p_G[k] = p
                j = num_keys - 1 - k
                q_J[j] = -p
                non_pos_J[j] = -1
                if res_pos_G[k] < 0 and p > 0:  # underflow may have emptied some scores
                    nh[n_non] = j
                    n_non += 1
            non_n_L[layer] = n_non
            _heap.heapify(nh, non_pos_J, q_J, n_non)
            _heap.heapify(rh, res_pos_G, p_G, res_n_L[layer])
            scale_L[layer] += e
            e = 0
        w = 2.0 ** (xv - q) * 2.0**e
    w_L[layer] = w

    # ---- the step's scores; hits leave the resident heap for the step (never victims of it)
    nm = 0
    alpha = fmeta[0]
    for i in range(n_keys):
        k = key_U[i]
        j = num_keys - 1 - k
        if resident_G[k]:
            res_n_L[layer] = _heap.remove(rh, res_pos_G, p_G, res_n_L[layer], k)
        else:
            if non_pos_J[j] >= 0:
                non_n_L[layer] = _heap.remove(nh, non_pos_J, q_J, non_n_L[layer], j)
            miss[nm] = k
            nm += 1
        u = uses_U[i]
        x_G[k] += (alpha * (u / tokens)) * w
        mu = mu_G[k]
        mu = u if mu == 0.0 else alpha * u + fmeta[1] * mu
        mu_G[k] = mu
        p = x_G[k] * sav_M[call_size(mu, top)]
        p_G[k] = p
        q_J[j] = -p
        prev_G[lo + i] = k
    prev_n_L[layer] = n_keys

    # ---- demand: misses best first; the first refusal ends it
    horizon = fmeta[3]
    copy_us = fmeta[4]
    cap = meta[2]
    held = meta[3]
    na = 0
    ne = 0
    sort_ranked(miss, nm, p_G)
    r = 0
    while r < nm:  # no `break` (see _heap)
        k = miss[r]
        imp = p_G[k] / w
        ok = imp * horizon > copy_us
        if ok and held >= cap:
            vk, vi = find_victim(res_heap, res_n_L, p_G, w_L, num_experts)
            ok = vk >= 0 and imp > vi
            if ok:
                evict_victim(
                    res_heap, res_pos_G, res_n_L, non_heap, non_pos_J, non_n_L, p_G, q_J, num_experts, vk
                )
                evict_out[ne] = vk
                ne += 1
                held -= 1
        if ok:
            held += 1
            admit_out[na] = k
            na += 1
            r += 1
        else:
            r = nm
    if na < nm:  # refused misses wait among the layer's non-held keys
        for i in range(na, nm):
            k = miss[i]
            if p_G[k] > 0:
                non_n_L[layer] = _heap.push(nh, non_pos_J, q_J, non_n_L[layer], num_keys - 1 - k)

    # ---- prefetch of layer n + 1: its best non-held keys; the first refusal ends it
    nxt = layer + 1
    if meta[5] > 0 and nxt < meta[1]:
        nlo = nxt * num_experts
        nnh = non_heap[nlo : nlo + num_experts]
        wn = w_L[nxt]
        b = 0
        while b < meta[5]:
            b += 1
            if non_n_L[nxt] == 0:
                b = meta[5]
                continue
            k = num_keys - 1 - nnh[0]
            imp = p_G[k] / wn
            ok = imp * horizon > copy_us
            vk = -1
            if ok and held >= cap:
                vk, vi = find_victim(res_heap, res_n_L, p_G, w_L, num_experts)
                ok = vk >= 0 and imp > vi
            if not ok:
                b = meta[5]
                continue
            _, n_nxt = _heap.pop(nnh, non_pos_J, q_J, non_n_L[nxt])
            non_n_L[nxt] = n_nxt
            if vk >= 0:
                evict_victim(
                    res_heap, res_pos_G, res_n_L, non_heap, non_pos_J, non_n_L, p_G, q_J, num_experts, vk
                )
                evict_out[ne] = vk
                ne += 1
            else:
                held += 1
            admit_out[na] = k
            na += 1

    # ---- the step's hits return with their new impact; admitted keys join their layers' heaps
    for i in range(n_keys):
        k = key_U[i]
        if resident_G[k]:
            res_n_L[layer] = _heap.push(rh, res_pos_G, p_G, res_n_L[layer], k)
    for i in range(na):
        k = admit_out[i]
        kl = k // num_experts
        klo = kl * num_experts
        res_n_L[kl] = _heap.push(res_heap[klo : klo + num_experts], res_pos_G, p_G, res_n_L[kl], k)
    meta[3] = held
    return na, ne


@register
class Impact(Policy):
    name = "impact"
    step = impact_step
    state_fields = (
        "x_G", "p_G", "q_J", "mu_G",  # scores, impacts (held and mirrored), call sizes
        "res_heap", "res_pos_G", "res_n_L",  # the residents' heaps, one per layer
        "non_heap", "non_pos_J", "non_n_L",  # the non-held keys' heaps, one per layer
        "visits_L", "scale_L", "w_L",  # the layers' clocks and lazy-decay weights
        "prev_G", "prev_n_L",  # the keys of every layer's last visit
        "sav_M", "miss", "meta", "fmeta",  # the saving table, the step's scratch, scalars
    )  # fmt: skip
    defaults = {"alpha": 0.3, "horizon": 8, "budget": 1}
    prefetches = True
    weighs_costs = True

    def __init__(self, **params):
        super().__init__(**params)
        require_number(self, "alpha", lambda a: 0 < a <= 1, "a number with 0 < alpha <= 1")
        require_number(self, "horizon", lambda h: h > 0, "a positive number of visits")
        require_ints(self, budget=0)

    def init_state(self, trace, capacity: int) -> tuple:
        cost = self.require_cost()
        sav_M = np.ascontiguousarray(cost.cpu_table() - cost.gpu_table(), np.float64)
        alpha = float(self.params["alpha"])
        n, layers, experts = trace.num_keys, trace.num_layers, trace.num_experts
        meta = np.array(
            [experts, layers, capacity, 0, trace.top_k, int(self.params["budget"]), int(alpha == 1.0)],
            np.int64,
        )
        fmeta = np.array(
            [
                alpha,
                1.0 - alpha,
                -math.log2(1.0 - alpha) if alpha < 1.0 else 0.0,
                float(self.params["horizon"]),
                float(cost.copy_us()),
            ],
            np.float64,
        )
        return (
            np.zeros(n, np.float64),  # x_G: scores, stored as S x W_l (lazy decay)
            np.zeros(n, np.float64),  # p_G: x_G x saving(m_k)
            np.zeros(n, np.float64),  # q_J: -p of key n - 1 - j (the non-held heaps' priorities)
            np.zeros(n, np.float64),  # mu_G: EMA of uses per access (0: never accessed)
            np.zeros(max(n, 1), np.int64),  # res_heap: layer l's residents in [l E, (l + 1) E)
            np.full(n, -1, np.int64),  # res_pos_G
            np.zeros(layers, np.int64),  # res_n_L
            np.zeros(max(n, 1), np.int64),  # non_heap: layer l's non-held keys (mirrored) with p > 0
            np.full(n, -1, np.int64),  # non_pos_J
            np.zeros(layers, np.int64),  # non_n_L
            np.zeros(layers, np.int64),  # visits_L
            np.zeros(layers, np.int64),  # scale_L: power-of-two exponent divided out of layer l's values
            np.ones(layers, np.float64),  # w_L: W_l at the layer's last visit
            np.zeros(max(n, 1), np.int64),  # prev_G: keys of layer l's last visit in [l E, ...)
            np.zeros(layers, np.int64),  # prev_n_L
            sav_M,
            np.zeros(max(experts, 1), np.int64),  # miss: the step's misses
            meta,
            fmeta,
        )

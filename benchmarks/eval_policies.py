"""The requested mechanisms judged on the real DeepSeek-V2-Lite ESFT traces before anyone builds them:
second-touch admission, decayed LFU with hysteresis and minimum residency, a profiled static placement
trained on another workload, prefill-aware admission, and warm starts.

Judged as `moecache decide`'s second part judges a policy (docs/decision.md): for each trace, the
family's parameter set with the lowest estimated time per token (timed replay, the sweep's default
cost profile) on the prefix (blocks before half of the tokens), averaged over the capacities, is
chosen; it is compared with the reference on the held-out rest (paired percentile bootstrap over
requests, or blocks of 16 forward steps when fewer than 8 requests are held out; margin 2%, 90%) and,
over whole traces, on every other workload. The reference is stricter than the rule's (the first-part
selection, lfu): the best *existing* online policy, chosen on the same prefix among lru, lfu, lfu_decay
and transition_prefetch. profile_static is only ever chosen among profiles of other workloads.
The issue's target is in instant hit rate (today's best online 0.49 at 25% on law, Belady 0.725): the
table gives both.

Prefill: the traces are teacher-forced with no generated token, so each request's first fraction of
tokens is replayed as ONE prefill step and the rest as decode steps (moecache/sim/prompt_split.py): an
approximation, labelled so. Metric: the decode miss rate (instant), over all decode steps and over the
first 32 decode tokens after each prompt, against the base policy without the filter (paired bootstrap
over requests of the ratio of misses to accesses).

Warm start: the hit rate of a trace's second half of requests from a cold cache, against the state the
policy ends the first half with (what manager_state saves and loads), and against a state warmed on
another workload's whole trace (`runtime.init=<trace>`).

Run: .venv/bin/python benchmarks/eval_policies.py [--quick] (a table, then one JSON line).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from moecache.cost_profile import CostProfile
from moecache.decision.bootstrap import paired_ratio_bootstrap
from moecache.decision.rule import classify
from moecache.sim.inputs import BUNDLED_PROFILES
from moecache.sim.metrics import per_block
from moecache.sim.policy import make_policy
from moecache.sim.prompt_split import prompt_as_prefill
from moecache.sim.replay import initial_resident_mask, replay_from, replay_instant
from moecache.sim.sweep import CostSettings, cost_model
from moecache.sim.timed import replay_timed
from moecache.sim.trace_arrays import DECODE, from_table
from moecache.trace.esft_import import esft_to_table, load_esft_npz
from moecache.trace.schema import TraceMeta

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "../shared/data/traces/deepseek-v2-lite-esft"
TASKS = ("intent", "law", "summary", "translation")
META = TraceMeta(num_layers=26, num_experts=64, top_k=6, expert_bytes=17301504)
PROFILE = BUNDLED_PROFILES / "h200_qwen3_6_35b_a3b_2026-11-30.json"  # the sweep's default (conf/sim)
FRACTIONS = (0.10, 0.15, 0.20, 0.25)
MARGIN, CONFIDENCE, RESAMPLES, MIN_REQUESTS, BLOCK = 0.02, 0.90, 2000, 8, 16  # conf/decide, conf/sweep
PREFIX = 0.5

EXISTING = [
    ("lru", {}),
    ("lfu", {}),
    ("lfu_decay", {"half_life_tokens": 64}),
    ("lfu_decay", {"half_life_tokens": 256}),
    ("transition_prefetch", {"budget": 2}),
]
FAMILIES = {
    "second_touch": [
        ("second_touch", {"base": "lru", "window_tokens": 32}),
        ("second_touch", {"base": "lru", "window_tokens": 256}),
        (
            "second_touch",
            {"base": "lfu_decay", "base_params": {"half_life_tokens": 256}, "window_tokens": 32},
        ),
    ],
    "lfu_hysteresis": [
        ("lfu_hysteresis", {"half_life_tokens": 256, "hysteresis": 0.25, "min_residency_tokens": 16}),
        ("lfu_hysteresis", {"half_life_tokens": 64, "hysteresis": 0.1, "min_residency_tokens": 4}),
        ("lfu_hysteresis", {"half_life_tokens": 1024, "hysteresis": 0.5, "min_residency_tokens": 64}),
    ],
    "profile_static": [],  # filled per profile trace in main()
}


def load(task: str, folder: Path):
    arrays = load_esft_npz(TRACES / f"esft_{task}_routing.npz", num_layers=26, num_experts=64, top_k=6)
    table = esft_to_table(arrays, name=f"esft_{task}", run_id=f"esft_{task}", tokens_per_step=1, meta=META)
    path = folder / f"esft_{task}.parquet"
    pq.write_table(table, path)
    return from_table(table, META, name=f"esft_{task}", workload=task), path


def label(name, params) -> str:
    return make_policy(name, **params).label()


def run_cell(trace, name, params, capacity, profile):
    """(instant hit rate, per-block dict of the timed replay)."""
    policy = make_policy(name, **params)
    cost = cost_model(trace, profile, CostSettings())
    policy.bind_cost(cost)
    hit = float(replay_instant(trace, policy, capacity).hit_A.mean())
    timed = replay_timed(trace, make_policy(name, **params).bind_cost(cost), capacity, cost)
    return hit, per_block(trace, timed, BLOCK, cost)


def prefix_mask(blocks) -> np.ndarray:
    tokens = blocks["tokens"]
    return (np.cumsum(tokens) - tokens) < PREFIX * tokens.sum()


def compare(ref_blocks, lab_blocks, keep, seed):
    """(r, lo, hi, verdict, unit) of lab vs ref on the kept blocks (decide's extensions._compare)."""
    req = ref_blocks["request"][keep]
    starts = np.flatnonzero(np.r_[True, req[1:] != req[:-1]])
    by_request = len(starts) >= MIN_REQUESTS
    agg = (lambda x: np.add.reduceat(x, starts)) if by_request else (lambda x: x)
    num = np.stack([agg(b["est_us"][keep]) for b in (ref_blocks, lab_blocks)])
    den = np.stack([agg(b["tokens"][keep]).astype(float) for b in (ref_blocks, lab_blocks)])
    rel, lo, hi = paired_ratio_bootstrap(num, den, 0, RESAMPLES, seed, CONFIDENCE)
    return (
        float(rel[1]),
        float(lo[1]),
        float(hi[1]),
        classify(lo[1], hi[1], MARGIN),
        "req" if by_request else "blk",
    )


def choose(results, trace, labels, caps):
    """The label of the lowest mean prefix time per token over the capacities."""

    def score(lab):
        per = []
        for c in caps:
            b = results[(trace, lab, c)][1]
            m = prefix_mask(b)
            per.append(b["est_us"][m].sum() / b["tokens"][m].sum())
        return float(np.mean(per))

    return min(labels, key=lambda lab: (score(lab), lab))


def decode_miss(trace, hit_A, first_decode_tokens=None):
    """Per request: (decode misses, decode accesses), over all decode steps or the first N decode tokens."""
    step_A = np.repeat(np.arange(trace.num_steps), np.diff(trace.start_V))
    decode_A = trace.phase_V[step_A] == DECODE
    if first_decode_tokens is not None:  # a request's decode steps are its steps 1, 2, ... after its prefill
        decode_A &= trace.step_V[step_A] <= first_decode_tokens
    req_A = trace.request_V[step_A]
    n = len(trace.request_ids)
    miss = np.bincount(req_A[decode_A], (~hit_A[decode_A]).astype(float), minlength=n)
    acc = np.bincount(req_A[decode_A], minlength=n).astype(float)
    return miss, acc


def fmt_r(r, lo, hi, verdict):
    return f"{100 * r:+.1f}% [{100 * lo:+.1f}, {100 * hi:+.1f}] {verdict}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="25%% only, fewer sets (a smoke run)")
    args = ap.parse_args()
    started = time.time()
    profile = CostProfile.load(PROFILE)
    fractions = (0.25,) if args.quick else FRACTIONS
    out: dict = {"capacities": list(fractions)}
    with tempfile.TemporaryDirectory() as tmp:
        loaded = {t: load(t, Path(tmp)) for t in TASKS}
        traces = {t: tr for t, (tr, _) in loaded.items()}
        caps = {t: [round(f * tr.num_keys) for f in fractions] for t, tr in traces.items()}
        profile_sets = {
            t: [
                ("profile_static", {"profile": str(loaded[a][1]), "split": s})
                for a in TASKS
                if a != t
                for s in ("global", "per_layer")
            ]  # fmt: skip
            for t in TASKS
        }
        # ---- replays --------------------------------------------------------------------------------
        results = {}
        for t, tr in traces.items():
            sets = EXISTING + [x for fam in ("second_touch", "lfu_hysteresis") for x in FAMILIES[fam]]
            sets += [("profile_static", {"profile": str(loaded[a][1]), "split": s}) for a in TASKS
                     for s in ("global", "per_layer")]  # fmt: skip
            for name, params in sets:
                for c in caps[t]:
                    results[(t, label(name, params), c)] = run_cell(tr, name, params, c, profile)
            for c in caps[t]:
                results[(t, "belady", c)] = (
                    float(replay_instant(tr, make_policy("belady"), c).hit_A.mean()),
                    None,
                )
        existing = [label(n, p) for n, p in EXISTING]
        fams = {
            "second_touch": {t: [label(n, p) for n, p in FAMILIES["second_touch"]] for t in TASKS},
            "lfu_hysteresis": {t: [label(n, p) for n, p in FAMILIES["lfu_hysteresis"]] for t in TASKS},
            "profile_static": {t: [label(n, p) for n, p in profile_sets[t]] for t in TASKS},
        }
        # ---- judged: held-out and other workloads ---------------------------------------------------
        rows = []
        ref_of = {t: choose(results, t, existing, caps[t]) for t in TASKS}
        print(f"# Judged on held-out tokens ({int(100 * (1 - PREFIX))}% of each trace) and other workloads")
        print(
            "| trace | cap | ref (best existing, on prefix) hit | mechanism | chosen on | set | hit | r time/token [90% CI] verdict |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for fam, labels in fams.items():
            chosen = {t: choose(results, t, labels[t], caps[t]) for t in TASKS}
            for t in TASKS:
                for i, c in enumerate(caps[t]):
                    ref_b = results[(t, ref_of[t], c)][1]
                    held = ~prefix_mask(ref_b)
                    cells = [(t, chosen[t], held, "held-out")]
                    if fam != "profile_static":
                        cells += [(a, chosen[a], np.ones_like(held), "other") for a in TASKS if a != t]
                    for on, lab, keep, split in cells:
                        if split == "other" and lab not in labels[t]:
                            continue
                        seed = np.random.SeedSequence([0, TASKS.index(t), c, TASKS.index(on), len(rows)])
                        r, lo, hi, verdict, unit = compare(ref_b, results[(t, lab, c)][1], keep, seed)
                        row = {
                            "trace": t, "capacity": c, "fraction": fractions[i], "mechanism": fam, "split": split,
                            "chosen_on": on, "label": lab, "hit": results[(t, lab, c)][0],
                            "ref": ref_of[t], "ref_hit": results[(t, ref_of[t], c)][0],
                            "belady_hit": results[(t, "belady", c)][0], "r": r, "lo": lo, "hi": hi,
                            "verdict": verdict, "unit": unit,
                        }  # fmt: skip
                        rows.append(row)
                        print(
                            f"| {t} | {fractions[i]:.0%} | {row['ref']} {row['ref_hit']:.3f} | {fam} | {split}:{on} "
                            f"| {lab} | {row['hit']:.3f} | {fmt_r(r, lo, hi, verdict)} |"
                        )
        out["judged"] = rows
        # ---- profile_static: every (profile, test) pair, instant hit rate at each capacity -----------
        print(
            "\n# profile_static trained on one workload, tested on another (instant hit rate; global / per_layer)"
        )
        print("| test \\ profile | " + " | ".join(TASKS) + " | best existing | belady |")
        print("| --- |" + " --- |" * (len(TASKS) + 2))
        matrix = []
        for t in TASKS:
            c = caps[t][-1]
            cells = []
            for a in TASKS:
                g = results[
                    (t, label("profile_static", {"profile": str(loaded[a][1]), "split": "global"}), c)
                ][0]
                p = results[
                    (t, label("profile_static", {"profile": str(loaded[a][1]), "split": "per_layer"}), c)
                ][0]
                cells.append(f"{g:.3f} / {p:.3f}" + (" (self)" if a == t else ""))
                matrix.append({"test": t, "profile": a, "capacity": c, "global": g, "per_layer": p})
            best = max(results[(t, lab, c)][0] for lab in existing)
            print(
                f"| {t} ({fractions[-1]:.0%}) | "
                + " | ".join(cells)
                + f" | {best:.3f} | {results[(t, 'belady', c)][0]:.3f} |"
            )
        out["profile_matrix"] = matrix
        # ---- the target: a third of the gap at 25% ----------------------------------------------------
        print(
            "\n# Target: the best new online policy closes a third of the gap (best existing -> Belady), instant hit rate"
        )
        print("| trace | cap | best existing | best new (label) | Belady | needed | met |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        new_labels = {
            t: fams["second_touch"][t] + fams["lfu_hysteresis"][t] + fams["profile_static"][t] for t in TASKS
        }
        target = []
        for t in TASKS:
            for i, c in enumerate(caps[t]):
                ex = max(existing, key=lambda lab: results[(t, lab, c)][0])
                nw = max(new_labels[t], key=lambda lab: results[(t, lab, c)][0])
                e, n, b = results[(t, ex, c)][0], results[(t, nw, c)][0], results[(t, "belady", c)][0]
                need = e + (b - e) / 3
                target.append({"trace": t, "fraction": fractions[i], "best_existing": e, "existing_label": ex,
                               "best_new": n, "new_label": nw, "belady": b, "needed": need, "met": n >= need})  # fmt: skip
                print(
                    f"| {t} | {fractions[i]:.0%} | {e:.3f} {ex} | {n:.3f} {nw} | {b:.3f} | {need:.3f} | {'yes' if n >= need else 'no'} |"
                )
        out["target"] = target
        # ---- prefill-aware admission on prompt-split traces (approximation) --------------------------
        print(
            "\n# Prefill-aware admission: each sequence's first fraction as ONE prefill step (approximation: teacher-forced traces)"
        )
        print(
            "| trace | prompt | cap | base | filter | decode miss base | filter | r [90% CI] | first 32 decode tokens: r [90% CI] |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        prefill_rows = []
        bases = [("lru", {}), ("lfu_decay", {"half_life_tokens": 256})]
        filters = [
            {"prefill_max_admits": 0},
            {"prefill_max_admits": 16},
            {"prefill_max_admits": -1, "prefill_weight": 0.1},
            {"prefill_max_admits": -1, "decode_admits": False},
        ]
        for t in TASKS:
            for frac in (0.25, 0.5):
                split_trace = prompt_as_prefill(traces[t], frac)
                c = round(0.25 * split_trace.num_keys)
                for bname, bparams in bases:
                    base_hit = replay_instant(split_trace, make_policy(bname, **bparams), c).hit_A
                    bm, ba = decode_miss(split_trace, base_hit)
                    bm32, ba32 = decode_miss(split_trace, base_hit, 32)
                    for f in filters:
                        pol = make_policy("prefill_admit", base=bname, base_params=bparams, **f)
                        hit = replay_instant(split_trace, pol, c).hit_A
                        fm, fa = decode_miss(split_trace, hit)
                        fm32, fa32 = decode_miss(split_trace, hit, 32)
                        seed = np.random.SeedSequence([1, TASKS.index(t), int(100 * frac), len(prefill_rows)])
                        r, lo, hi = (
                            x[1]
                            for x in paired_ratio_bootstrap(
                                np.stack([bm, fm]), np.stack([ba, fa]), 0, RESAMPLES, seed, CONFIDENCE
                            )
                        )
                        r32, lo32, hi32 = (
                            x[1]
                            for x in paired_ratio_bootstrap(
                                np.stack([bm32, fm32]), np.stack([ba32, fa32]), 0, RESAMPLES, seed, CONFIDENCE
                            )
                        )
                        fl = ",".join(f"{k}={v}" for k, v in f.items())
                        row = {"trace": t, "prompt_fraction": frac, "capacity": c, "base": make_policy(bname, **bparams).label(),
                               "filter": fl, "decode_miss_base": bm.sum() / ba.sum(), "decode_miss": fm.sum() / fa.sum(),
                               "r": r, "lo": lo, "hi": hi, "r32": r32, "lo32": lo32, "hi32": hi32}  # fmt: skip
                        prefill_rows.append(row)
                        print(f"| {t} | {frac:.0%} | 25% | {row['base']} | {fl} | {row['decode_miss_base']:.3f} | {row['decode_miss']:.3f} "
                              f"| {100 * r:+.1f}% [{100 * lo:+.1f}, {100 * hi:+.1f}] | {100 * r32:+.1f}% [{100 * lo32:+.1f}, {100 * hi32:+.1f}] |")  # fmt: skip
        out["prefill"] = prefill_rows
        # ---- warm start ---------------------------------------------------------------------------------
        print("\n# Warm start: hit rate of each trace's second half of requests (instant)")
        print("| trace | cap | policy | cold | warm: own first half | warm: another workload (trace) |")
        print("| --- | --- | --- | --- | --- | --- |")
        warm_rows = []
        for t in TASKS:
            tr = traces[t]
            n = len(tr.request_ids)
            first, second = tr.subset_requests(np.arange(n // 2)), tr.subset_requests(np.arange(n // 2, n))
            other = TASKS[(TASKS.index(t) + 1) % len(TASKS)]
            for frac in (0.10, 0.25):
                c = round(frac * tr.num_keys)
                for name, params in [
                    ("lru", {}),
                    ("lfu_decay", {"half_life_tokens": 256}),
                    ("lfu_hysteresis", {}),
                ]:
                    cold = float(replay_instant(second, make_policy(name, **params), c).hit_A.mean())
                    warm = {}
                    for src_name, src in (("own", first), ("other", traces[other])):
                        pol = make_policy(name, **params)
                        state = pol.init_state(second, c)
                        res = initial_resident_mask(pol, state, second, c)
                        replay_from(src, pol, state, res, c)
                        shifted = dataclasses.replace(
                            second, clock_V=second.clock_V + int(src.num_tokens),
                            request_V=second.request_V + len(src.request_ids),
                        )  # fmt: skip
                        warm[src_name] = float(replay_from(shifted, pol, state, res, c).hit_A.mean())
                    row = {"trace": t, "fraction": frac, "policy": make_policy(name, **params).label(), "cold": cold,
                           "warm_own": warm["own"], "warm_other": warm["other"], "other": other}  # fmt: skip
                    warm_rows.append(row)
                    print(f"| {t} | {frac:.0%} | {row['policy']} | {cold:.3f} | {warm['own']:.3f} ({warm['own'] - cold:+.3f}) "
                          f"| {warm['other']:.3f} ({warm['other'] - cold:+.3f}, {other}) |")  # fmt: skip
        out["warm"] = warm_rows
    out["seconds"] = round(time.time() - started, 1)
    print(json.dumps({"benchmark": "eval_policies", **out}, default=float))


if __name__ == "__main__":
    main()

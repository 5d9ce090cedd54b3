"""The Markdown of the decision: the one-screen opening, the decision in detail, and the appendix tables.

Every number is printed from decision.json, verdicts.parquet or extensions.parquet (docs/decision.md says
what they hold), never computed anew. Policies are named by their sweep label and, where the runtime
needs them, their (policy, params).
"""

from __future__ import annotations

import json

import pyarrow as pa

from moecache.report import markdown as md

DOCS = "docs/decision.md"


def _name(entry: dict | None) -> str:
    if not entry:
        return "n/a"
    return md.code(entry.get("label") or entry.get("policy"))


def _params(entry: dict | None) -> str:
    return md.code(json.dumps((entry or {}).get("params") or {}, sort_keys=True))


def _cell_text(c: dict) -> str:
    pct = "" if c.get("capacity_fraction") is None else f" ({md.pct(c['capacity_fraction'], 1, sign=False)})"
    return f"C={c['capacity']}{pct}: {md.pct(c['rel_diff'])} {md.interval(c['ci_lo'], c['ci_hi'])}"


def _specific(decision: dict) -> list[dict]:
    return [w for w in decision.get("wins") or [] if not w.get("consistent")]


def _largest_win(decision: dict) -> tuple[dict, dict] | None:
    """(win, cell) with the most negative relative difference among the specific wins."""
    cells = [(w, c) for w in _specific(decision) for c in w["cells"] if c.get("rel_diff") is not None]
    return min(cells, key=lambda wc: wc[1]["rel_diff"]) if cells else None


def headline(decision: dict | None) -> str:
    """The decision in one sentence."""
    if not decision or not decision.get("selected"):
        return "**No decision**: the decision artifact is absent or selected nothing."
    sel, first = decision["selected"], decision.get("first_part") or decision["selected"]
    base = decision.get("baseline") or {}
    if sel.get("label") != first.get("label"):
        why = (
            f"it is better than the first-part selection {_name(first)} in every judged cell"
            " (held-out tokens" + (", other workloads" if _workloads(decision) >= 2 else "") + ")"
        )
    elif first.get("label") != base.get("label"):
        why = f"it is competitive with the baseline {_name(base)} everywhere and no other policy beats it everywhere"
    else:
        why = "no candidate is competitive with it everywhere and no other policy beats it everywhere"
    text = f"**Use {_name(sel)}** ({md.code(sel.get('policy'))}, params {_params(sel)}): {why}."
    wins = _specific(decision)
    if wins:
        w, c = _largest_win(decision)
        text += (
            f" {len(wins)} capacity- or workload-specific win(s) by other policies; the largest:"
            f" {md.code(w['label'])} on {md.code(w['trace'])} ({w['split'].replace('_', ' ')}) at {_cell_text(c)}."
        )
    return text


def _workloads(decision: dict) -> int:
    return len(((decision.get("extensions") or {}).get("workloads") or {}).get("present") or [])


def five_rows(decision: dict | None) -> str:
    """Selected, first-part selection, baseline, best generic, largest specific win."""
    if not decision:
        return "The decision artifact is absent."
    ext = decision.get("extensions") or {}
    policies = ext.get("policies") or {}

    def judged(entry: dict | None) -> str:
        p = policies.get((entry or {}).get("policy") or "")
        if not p or p.get("label") != (entry or {}).get("label"):
            return "n/a"
        tally = ", ".join(f"{k} {v}" for k, v in (p.get("verdicts") or {}).items())
        return f"mean r {md.pct(p.get('mean_rel_diff'))} ({tally})"

    best = decision.get("best_generic")
    largest = _largest_win(decision)
    rows = [
        ["selected (the runtime's default)", _name(decision.get("selected")), _params(decision.get("selected")),
         judged(decision.get("selected")) if decision.get("selected") != decision.get("first_part") else "reference"],
        ["first-part selection (reference)", _name(decision.get("first_part")), _params(decision.get("first_part")),
         "r = 0 by definition"],
        ["baseline", _name(decision.get("baseline")), _params(decision.get("baseline")), "first part's yardstick"],
        ["best generic", _name(best), _params(best),
         "the reference" if not best or best.get("is_reference") else f"mean r {md.pct(best.get('mean_rel_diff'))}"
         + ("" if best.get("consistent") else ", not better in every cell")],
        ["largest specific win", md.code(largest[0]["label"]) if largest else "none",
         _params(largest[0]) if largest else "", (f"{largest[0]['trace']} ({largest[0]['split'].replace('_', ' ')}),"
                                                   f" {_cell_text(largest[1])}") if largest else ""],
    ]  # fmt: skip
    return md.table(["role", "policy", "params", "against the reference"], rows)


def _rule_text(decision: dict) -> str:
    rule = decision.get("rule") or {}
    parts = [
        f"metric {md.code(rule.get('metric', 'n/a'))} in {md.code(rule.get('mode', 'n/a'))} mode "
        "(lower is better)",
        f"equivalence margin ±{md.pct(rule.get('margin'), sign=False)}",
        f"{md.pct(rule.get('confidence'), digits=0, sign=False)} confidence",
    ]
    useful = (rule.get("useful_range") or {}).get("baseline_hit_rate")
    if useful:
        parts.append(f"useful range: baseline hit rate in {json.dumps(useful)}")
    deficit = (rule.get("hit_rate") or {}).get("max_deficit")
    if deficit is not None:
        parts.append(f"hit-rate deficit at most {md.num(deficit)}")
    ext = rule.get("extensions") or {}
    if ext:
        parts.append(
            f"second part: {json.dumps(ext.get('policies'))} but {json.dumps(ext.get('exclude') or [])},"
            f" parameters chosen on the first {md.pct(ext.get('prefix_fraction'), 0, sign=False)} of each trace"
        )
    return f"Rule ({DOCS}): " + "; ".join(parts) + "."


def decision_details(decision: dict | None) -> str:
    """Reasons, the rule, the workloads and the seed."""
    out = ["## The decision in detail", ""]
    if decision is None:
        return "\n".join(out + ["The decision artifact is absent; this section is skipped.", ""])
    out += [_rule_text(decision), ""]
    workloads = decision.get("workloads") or {}
    if workloads:
        present = ", ".join(map(str, workloads.get("present") or [])) or "none"
        required = ", ".join(map(str, workloads.get("required") or [])) or "none"
        out += [f"Workloads present: {present}; required: {required}.", ""]
    out += [
        f"First part: {md.num(decision.get('cells'))} useful (trace, capacity) cells; bootstrap seed"
        f" {md.num(decision.get('seed'))}.",
        "",
        "Reasons, as recorded in `decision.json`:",
        "",
    ]
    reasons = decision.get("reasons") or []
    out += [f"- {r}" for r in reasons] if reasons else ["- none recorded"]
    return "\n".join(out + [""])


def policies_table(decision: dict) -> str:
    """One row per policy judged in the second part."""
    ext = decision.get("extensions") or {}
    body = []
    for name, p in sorted((ext.get("policies") or {}).items()):
        chosen = ", ".join(f"{t}: {md.code(x)}" for t, x in sorted((p.get("chosen") or {}).items()))
        tally = ", ".join(f"{k} {v}" for k, v in (p.get("verdicts") or {}).items())
        body.append(
            [name, chosen or "n/a", "yes" if p.get("consistent") else "no",
             "yes" if p.get("competitive_everywhere") else "no", md.pct(p.get("mean_held_out_rel_diff")),
             md.pct(p.get("mean_rel_diff")), tally or "; ".join(p.get("reasons") or [])[:120]]
        )  # fmt: skip
    if not body:
        return "The decision judged no second-part policy."
    headers = ["policy", "parameters chosen on each prefix", "better everywhere", "never worse",
               "mean held-out r", "mean r", "verdicts"]  # fmt: skip
    return md.table(headers, body)


def wins_table(decision: dict) -> str:
    """Every specific win: policy, trace, split, capacities and r [interval] at each."""
    wins = _specific(decision)
    if not wins:
        return "No capacity- or workload-specific win: no other policy is better than the reference anywhere."
    body = [
        [md.code(w["label"]), w["trace"], w["workload"],
         w["split"].replace("_", " ") + (f" (chosen on {w['chosen_on']})" if w["split"] == "other_workload" else ""),
         f"{len(w['capacities'])} of {w['of_capacities']}", "; ".join(_cell_text(c) for c in w["cells"])]
        for w in wins
    ]  # fmt: skip
    return md.table(
        ["policy", "trace", "workload", "judged on", "capacities", "r [interval] per capacity"], body
    )


def extensions_section(decision: dict | None, figure: str | None) -> str:
    out = ["## Every other policy (second part)", ""]
    ext = (decision or {}).get("extensions")
    if not ext:
        return "\n".join(out + ["The decision judged no second-part policy.", ""])
    out += [
        f"Each policy's parameters are chosen on the first part of every trace and judged against the reference"
        f" {md.code(ext.get('reference'))} on the rest and on other workloads ({DOCS}).",
        "",
        policies_table(decision),
        "",
        "### Capacity- and workload-specific wins",
        "",
        wins_table(decision),
        "",
    ]
    if figure is not None:
        out += [f"![Every judged policy vs the reference]({figure})", ""]
    return "\n".join(out)


def verdict_table(verdicts: pa.Table, confidence) -> str:
    """Every first-part row in the useful range, sorted by trace, capacity and label."""
    rows = sorted(
        (r for r in verdicts.to_pylist() if r["in_useful_range"]),
        key=lambda r: (str(r["trace"]), r["capacity"], r["role"] != "candidate", str(r["label"])),
    )
    if not rows:
        return "No row lies in the useful range."
    ci = f"CI ({md.pct(confidence, digits=0, sign=False)})" if confidence is not None else "CI"
    headers = ["trace", "workload", "capacity", "label", "role", "verdict", "rel_diff", ci]
    headers += ["hit rate vs baseline", "bytes/token", "notes"]
    body = [
        [r["trace"], r["workload"], r["capacity"], md.code(r["label"]), r["role"], r["verdict"],
         md.pct(r["rel_diff"]), md.interval(r["ci_lo"], r["ci_hi"]),
         f"{md.num(r['hit_rate'])} vs {md.num(r['baseline_hit_rate'])}", md.num(r["bytes_per_token"]),
         r["reasons"] or ""]
        for r in rows
    ]  # fmt: skip
    return md.table(headers, body)


def cells_table(table: pa.Table) -> str:
    """Every second-part cell."""
    rows = sorted(table.to_pylist(), key=lambda r: (r["policy"], r["split"], r["trace"], r["capacity"]))
    return md.table(
        ["policy", "label", "split", "chosen on", "trace", "capacity", "unit (n)", "r", "CI", "verdict", "limits"],
        [
            [r["policy"], md.code(r["label"]), r["split"], r["chosen_on"], r["trace"], r["capacity"],
             f"{r['unit']} ({r['units']})", md.pct(r["rel_diff"]), md.interval(r["ci_lo"], r["ci_hi"]),
             r["verdict"], r.get("limits") or ""]
            for r in rows
        ],
    )  # fmt: skip

"""`moecache decide`: apply the pre-registered rule (conf/decide/) to a sweep; write the decision.

Inputs by lineage: `decide.sweep` (null: the newest sweep artifact) and `decide.analysis` (null: the
newest analysis artifact over the same traces, when there is one; the report shows it beside the
decision). Writes `decision.json` (the selected policy and parameters, the reasons, the rule; what the
runtime reads to configure itself), `verdicts.parquet` (one row per trace, capacity and policy) and
`extensions.parquet` (the second part: every other swept policy against the first-part selection on
held-out tokens and other workloads, decision/extensions.py). The rule: docs/decision.md.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
from omegaconf import DictConfig

from moecache.artifacts import Artifact, ArtifactStore, artifact_id
from moecache.decision import extensions
from moecache.decision.decide import decide
from moecache.decision.rule import Rule
from moecache.errors import MoecacheError
from moecache.sim.inputs import TRACE_STAGES, is_trace_ref
from moecache.stages.base import StageResult, prepare, reusable, store_for

STAGE = "decide"
SCHEMA_VERSION = 2  # 2: extensions.parquet (was predictive.parquet), best_generic, wins
LINEAGE_KEYS = ("sweep", "analysis")


def _artifact(store: ArtifactStore, ref: str | None, stage: str, what: str) -> Artifact:
    if ref:
        art = store.resolve(str(ref))
        if art.stage != stage:
            raise MoecacheError(f"{what}={ref}: a {art.stage} artifact, expected a {stage} artifact")
        return art
    art = store.latest(stage)
    if art is None:
        raise MoecacheError(f"{what}: no {stage} artifact under {store.root}/ (run `moecache {stage}` first)")
    return art


def trace_inputs(art: Artifact) -> list[str]:
    """The trace artifacts (or Parquet files) among an artifact's inputs."""
    return [i for i in art.manifest.get("inputs", []) if i.split("-")[0] in TRACE_STAGES or is_trace_ref(i)]


def _analysis_for(store: ArtifactStore, ref: str | None, sweep: Artifact) -> Artifact | None:
    if ref:
        return _artifact(store, ref, "analyze", "decide.analysis")
    same = [a for a in store.list("analyze") if sorted(trace_inputs(a)) == sorted(trace_inputs(sweep))]
    return same[-1].checked() if same else None


def rule_config(c: dict) -> dict:
    """The rule part of a resolved config's `decide` group (everything but the lineage keys)."""
    return {k: v for k, v in c["decide"].items() if k not in LINEAGE_KEYS}


def run(cfg: DictConfig) -> StageResult:
    c = prepare(cfg, STAGE)
    d = c["decide"]
    store = store_for(cfg)
    sweep = _artifact(store, d["sweep"], "sweep", "decide.sweep")
    analysis = _analysis_for(store, d["analysis"], sweep)
    rule_dict = rule_config(c)
    rule = Rule.from_dict(rule_dict)
    inputs = [sweep.id] + ([analysis.id] if analysis else [])
    config = {"rule": rule_dict, "sweep": sweep.id, "analysis": analysis.id if analysis else None}
    existing = reusable(cfg, STAGE, SCHEMA_VERSION, config, inputs)
    if existing is not None:
        return StageResult(
            existing, reused=True, summary=_summary(json.loads((existing / "decision.json").read_text()))
        )

    for name in ("sweep.parquet", "per_block.parquet", "costs.json"):
        if not (sweep.path / name).is_file():
            raise MoecacheError(
                f"{sweep.path}: no {name} (a sweep from before schema 2? re-run `moecache sweep force=true`)"
            )
    costs = json.loads((sweep.path / "costs.json").read_text())
    copy_us = {trace: float(cost["copy_us"]) for trace, cost in costs.items()}
    sweep_table = pq.read_table(sweep.path / "sweep.parquet")
    blocks = pq.read_table(sweep.path / "per_block.parquet")
    verdicts, decision = decide(sweep_table, blocks, rule, copy_us)
    comparison = extensions.apply(decision, sweep_table, blocks, rule, verdicts)
    decision["inputs"] = {"sweep": sweep.id, "analysis": analysis.id if analysis else None}
    # what the sweep's timed replays made of a miss (sim.on_miss): the runtime setting the selection holds for
    decision["on_miss"] = (sweep.manifest.get("config", {}).get("sim") or {}).get("on_miss", "cpu")
    with store.create(
        STAGE, schema_version=SCHEMA_VERSION, config=config, inputs=inputs, seed=rule.seed
    ) as tmp:
        pq.write_table(verdicts, tmp / "verdicts.parquet")
        pq.write_table(comparison, tmp / "extensions.parquet")
        (tmp / "decision.json").write_text(json.dumps(decision, indent=2) + "\n")
    return StageResult(
        store.get(artifact_id(STAGE, SCHEMA_VERSION, config, inputs)).path, summary=_summary(decision)
    )


def _summary(decision: dict) -> dict:
    out = {"selected": decision["selected"]["label"], "cells judged": decision.get("cells")}
    best = decision.get("best_generic")
    if best:
        out["best generic"] = best["label"]
    for label, ok in decision.get("competitive", {}).items():
        out[f"{label} competitive"] = ok
    out["specific wins"] = sum(1 for w in decision.get("wins", []) if not w["consistent"])
    for i, reason in enumerate(decision.get("reasons", [])[:8]):
        out[f"reason {i + 1}"] = reason
    return out

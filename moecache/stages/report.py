"""`moecache report`: one self-contained Markdown report with PNG figures for a pipeline run.

By lineage: `report.decision` (null: the newest decide artifact) names the decision; its manifest names
the sweep and the analysis it was made from; the newest validate artifact of that decision (else the
newest one) gives the validation section. Writes `report.md` and `figures/*.png`.
"""

from __future__ import annotations

from omegaconf import DictConfig

from moecache.artifacts import artifact_id
from moecache.report.render import render_report
from moecache.stages.base import StageResult, prepare, reusable, store_for
from moecache.stages.decide import _artifact

STAGE = "report"
SCHEMA_VERSION = 1


def run(cfg: DictConfig) -> StageResult:
    c = prepare(cfg, STAGE)
    store = store_for(cfg)
    decision = _artifact(store, c["report"]["decision"], "decide", "report.decision")
    lineage = decision.manifest["config"]
    sweep = store.get(lineage["sweep"])
    analysis = store.get(lineage["analysis"]) if lineage.get("analysis") else None
    validation = _validation_for(store, decision.id)
    inputs = (
        [decision.id, sweep.id]
        + ([analysis.id] if analysis else [])
        + ([validation.id] if validation else [])
    )
    config = {"decision": decision.id, **({"validation": validation.id} if validation else {})}
    existing = reusable(cfg, STAGE, SCHEMA_VERSION, config, inputs)
    if existing is not None:
        return StageResult(existing, reused=True, summary={"report": str(existing / "report.md")})
    with store.create(STAGE, schema_version=SCHEMA_VERSION, config=config, inputs=inputs, seed=None) as tmp:
        out = render_report(
            analysis.path if analysis else None, sweep.path, decision.path, tmp,
            validation.path if validation else None,
        )  # fmt: skip
        figures = len(out["figures"])
    path = store.get(artifact_id(STAGE, SCHEMA_VERSION, config, inputs)).path
    return StageResult(path, summary={"report": str(path / "report.md"), "figures": figures})


def _validation_for(store, decision_id: str):
    """The newest validate artifact of this decision; else the newest one (the section says it validates
    another decision); None when there is none."""
    found = store.list("validate")
    own = [a for a in found if decision_id in a.manifest.get("inputs", [])]
    newest = (own or found or [None])[-1]
    return newest.checked() if newest is not None else None

"""Find the inputs of a simulation: trace artifacts (or Parquet files) and a cost profile."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moecache.artifacts import Artifact, ArtifactStore
from moecache.cost_profile import CostProfile
from moecache.errors import MoecacheError
from moecache.sim.trace_arrays import TraceArrays, load_trace

TRACE_STAGES = ("collect", "import_trace")
BUNDLED_PROFILES = Path(__file__).resolve().parents[1] / "data" / "cost_profiles"


@dataclass(frozen=True)
class TraceInput:
    ref: str  # artifact id, or the Parquet file's path
    trace: TraceArrays


def _trace_name_and_workload(art: Artifact) -> tuple[str, str]:
    config = art.manifest.get("config", {})
    if art.stage == "collect":
        workload = config.get("workload", {}).get("name", "unknown")
        return f"{config.get('model', {}).get('name', 'model')}/{workload}/seed{config.get('seed')}", workload
    return str(config.get("name", art.id)), str(config.get("workload", "unknown"))


@dataclass(frozen=True)
class TraceRef:
    ref: str  # artifact id, or the Parquet file's path
    path: Path  # the trace.parquet file
    name: str
    workload: str


def resolve_traces(store: ArtifactStore, refs: list[str] | None) -> list[TraceRef]:
    """The trace files named by `refs` (artifact ids, artifact folders or Parquet files); with no refs,
    every trace artifact (collect and import_trace) under the store, oldest first."""
    if not refs:
        arts = [a for stage in TRACE_STAGES for a in store.list(stage)]
        if not arts:
            raise MoecacheError(
                f"no trace artifacts under {store.root}/ (run `moecache collect` or `moecache import-trace`, "
                "or name traces with traces=[...])"
            )
        refs = [a.id for a in sorted(arts, key=lambda a: a.manifest.get("created_at", ""))]
    found = []
    for ref in refs:
        path = Path(str(ref))
        if path.suffix == ".parquet":
            found.append(TraceRef(str(path), path, path.stem, "unknown"))
            continue
        art = store.resolve(str(ref))
        if art.stage not in TRACE_STAGES:
            raise MoecacheError(
                f"{ref}: a {art.stage} artifact is not a trace (expected one of {list(TRACE_STAGES)})"
            )
        name, workload = _trace_name_and_workload(art)
        found.append(TraceRef(art.id, art.path / "trace.parquet", name, workload))
    return found


def load_traces(store: ArtifactStore, refs: list[str] | None) -> list[TraceInput]:
    """The simulator's arrays of the traces named by `refs` (see resolve_traces)."""
    return [
        TraceInput(r.ref, load_trace(r.path, name=r.name, workload=r.workload))
        for r in resolve_traces(store, refs)
    ]


def load_profile(store: ArtifactStore, ref: str) -> tuple[str, CostProfile]:
    """A cost profile from `bundled:<stem>`, a calibrate artifact id/folder or a JSON file."""
    if ref.startswith("bundled:"):
        path = BUNDLED_PROFILES / f"{ref.split(':', 1)[1]}.json"
        if not path.is_file():
            have = sorted(p.stem for p in BUNDLED_PROFILES.glob("*.json"))
            raise MoecacheError(f"sim.cost_profile={ref}: no such bundled profile (have {have})")
        return ref, CostProfile.load(path)
    path = Path(ref)
    if path.is_file():
        return str(path), CostProfile.load(path)
    art = store.resolve(ref)
    if art.stage != "calibrate":
        raise MoecacheError(f"sim.cost_profile={ref}: a {art.stage} artifact is not a cost profile")
    return art.id, CostProfile.load(art.path)

"""Find the inputs of a simulation: trace artifacts (or Parquet files) and a cost profile.

Every stage that reads traces (simulate, sweep, analyze) resolves them here, so they agree on two
things: a trace's identity (`ref`, which goes into artifact ids: an artifact id, or a file's path and
content hash) and its name (the `trace` column of every result table, unique within one run).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from moecache.artifacts import Artifact, ArtifactStore
from moecache.cost_profile import CostProfile
from moecache.errors import MoecacheError
from moecache.sim.trace_arrays import TraceArrays, load_trace

TRACE_STAGES = ("collect", "import_trace")
BUNDLED_PROFILES = Path(__file__).resolve().parents[1] / "data" / "cost_profiles"


@dataclass(frozen=True)
class TraceInput:
    ref: str  # the trace's identity: see TraceRef.ref
    trace: TraceArrays


CONTENT_MARK = "@sha256:"  # a Parquet file input's ref: "<path>@sha256:<first 16 hex digits>"


def is_trace_ref(ref: str) -> bool:
    """Whether an artifact's input ref names a trace (a trace artifact or a Parquet file)."""
    return ref.split("-")[0] in TRACE_STAGES or CONTENT_MARK in ref or ref.endswith(".parquet")


def file_ref(path: Path) -> str:
    """A Parquet file's identity: its path and the sha256 of its bytes, so that an overwritten file
    gives new artifact ids rather than old results. Read in 1 MiB chunks: a few ms for a 100 MB trace."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return f"{path}{CONTENT_MARK}{digest.hexdigest()[:16]}"


def _trace_name_and_workload(art: Artifact) -> tuple[str, str]:
    config = art.manifest.get("config", {})
    if art.stage == "collect":
        workload = config.get("workload", {}).get("name", "unknown")
        return f"{config.get('model', {}).get('name', 'model')}/{workload}/seed{config.get('seed')}", workload
    return str(config.get("name", art.id)), str(config.get("workload", "unknown"))


@dataclass(frozen=True)
class TraceRef:
    ref: str  # artifact id, or "<path>@sha256:<digest>" for a Parquet file (file_ref)
    path: Path  # the trace.parquet file
    name: str  # unique among the traces of one run (unique_names)
    workload: str


def resolve_traces(store: ArtifactStore, refs: list[str] | None) -> list[TraceRef]:
    """The trace files named by `refs` (artifact ids, artifact folders or Parquet files); with no refs,
    every trace artifact (collect and import_trace) under the store, oldest first. The same trace
    named twice is refused; names are made unique (unique_names)."""
    if not refs:
        arts = [a for stage in TRACE_STAGES for a in store.list(stage)]
        if not arts:
            raise MoecacheError(
                f"no trace artifacts under {store.root}/ (run `moecache collect` or `moecache import-trace`, "
                "or name traces with traces=[...])"
            )
        refs = [a.id for a in sorted(arts, key=lambda a: a.manifest.get("created_at", ""))]
    found, seen = [], {}
    for ref in refs:
        entry, candidates = _resolve_one(store, str(ref))
        identity = str(entry.path.resolve())  # one file, however it is named
        if identity in seen:
            raise MoecacheError(
                f"traces: {ref!r} names the same trace as {seen[identity]!r}; list each trace once"
            )
        seen[identity] = ref
        found.append((entry, candidates))
    names = unique_names([candidates for _, candidates in found])
    return [replace(entry, name=name) for (entry, _), name in zip(found, names, strict=True)]


def _resolve_one(store: ArtifactStore, ref: str) -> tuple[TraceRef, list[str]]:
    """The TraceRef of one ref and its candidate names, shortest first (see unique_names)."""
    path = Path(ref)
    if path.suffix == ".parquet":
        if not path.is_file():
            raise MoecacheError(f"{path}: no such trace file")
        candidates = _path_names(path)
        return TraceRef(file_ref(path), path, candidates[0], "unknown"), candidates
    art = store.resolve(ref)
    if art.stage not in TRACE_STAGES:
        raise MoecacheError(
            f"{ref}: a {art.stage} artifact is not a trace (expected one of {list(TRACE_STAGES)})"
        )
    name, workload = _trace_name_and_workload(art)
    return TraceRef(art.id, art.path / "trace.parquet", name, workload), [name, f"{name}@{art.id}"]


def _path_names(path: Path) -> list[str]:
    """A file's candidate names, shortest first: its stem, then with ever more of its folders
    ("trace", "a/trace", "x/a/trace", ...), ending with the whole resolved path (less its root)."""
    resolved = path.resolve().with_suffix("")
    parts = resolved.parts[1:] if resolved.anchor else resolved.parts
    return ["/".join(parts[-n:]) for n in range(1, len(parts) + 1)]


def unique_names(candidates: list[list[str]]) -> list[str]:
    """One name per trace, from its candidates (shortest first): every trace takes its first candidate,
    and every trace whose name another one shares moves to its next, until no two are equal. So a name
    is as short as the traces of the run allow, and the same for the same inputs (a file: the shortest
    distinguishing path suffix; an artifact: its name, then name@artifact-id)."""
    level = [0] * len(candidates)
    while True:
        names = [c[i] for c, i in zip(candidates, level, strict=True)]
        counts = Counter(names)
        clashing = [n for n, name in enumerate(names) if counts[name] > 1]
        if not clashing:
            return names
        stuck = [n for n in clashing if level[n] + 1 >= len(candidates[n])]
        if stuck:
            raise MoecacheError(
                f"traces: two traces would both be named {names[stuck[0]]!r}; rename one of them"
            )
        for n in clashing:
            level[n] += 1


def load_traces(store: ArtifactStore, refs: list[str] | None) -> list[TraceInput]:
    """The simulator's arrays of the traces named by `refs` (see resolve_traces)."""
    return [
        TraceInput(r.ref, load_trace(r.path, name=r.name, workload=r.workload))
        for r in resolve_traces(store, refs)
    ]


def load_profile(store: ArtifactStore, ref: str, key: str = "sim.cost_profile") -> tuple[str, CostProfile]:
    """A cost profile from `bundled:<stem>`, a calibrate artifact id/folder or a JSON file; every error
    names `key` and the value given."""
    try:
        if ref.startswith("bundled:"):
            path = BUNDLED_PROFILES / f"{ref.split(':', 1)[1]}.json"
            if not path.is_file():
                have = sorted(p.stem for p in BUNDLED_PROFILES.glob("*.json"))
                raise MoecacheError(f"no such bundled profile (have {have})")
            return ref, CostProfile.load(path)
        path = Path(ref)
        if path.is_file():
            return str(path), CostProfile.load(path)
        if not path.exists() and (path.suffix == ".json" or len(path.parts) > 1):
            raise MoecacheError("no such file (expected a calibrate artifact id, its folder or a JSON file)")
        art = store.resolve(ref)
        if art.stage != "calibrate":
            raise MoecacheError(f"a {art.stage} artifact is not a cost profile")
        return art.id, CostProfile.load(art.path)
    except MoecacheError as exc:
        message = str(exc).removeprefix(f"{ref}: ").removeprefix(f"{Path(ref)}: ")
        raise MoecacheError(f"{key}={ref}: {message}") from exc

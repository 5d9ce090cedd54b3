"""Versioned, atomically written stage artifacts: `outputs/<stage>/<artifact-id>/manifest.json`.

An artifact id is derived from the stage, its schema version, the part of the resolved config that
determines the result, and the ids of its input artifacts, so an identical re-run finds (and by
default reuses) the same id. Files are written into a hidden temporary folder beside the final one
and renamed into place only once everything, the manifest last, is on disk: an interrupted run
leaves no artifact.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from moecache.env_info import git_commit, machine_info, package_versions
from moecache.errors import MoecacheError

MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"


def canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def config_hash(config: dict) -> str:
    return hashlib.sha256(canonical_json(config).encode()).hexdigest()


def artifact_id(stage: str, schema_version: int, config: dict, inputs: list[str]) -> str:
    key = canonical_json({"stage": stage, "schema": schema_version, "config": config, "inputs": inputs})
    return f"{stage}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON to `path` through a temporary file and a rename."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{uuid.uuid4().hex}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass(frozen=True)
class Artifact:
    """A finished artifact on disk."""

    path: Path

    @property
    def id(self) -> str:
        return self.path.name

    @property
    def manifest(self) -> dict:
        return json.loads((self.path / MANIFEST).read_text())

    @property
    def stage(self) -> str:
        return self.path.parent.name


class ArtifactStore:
    """The folder of all artifacts (`outputs/` by default)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def find(self, artifact_id: str) -> Artifact | None:
        stage = artifact_id.rsplit("-", 1)[0]
        path = self.root / stage / artifact_id
        if (path / MANIFEST).is_file():
            return Artifact(path)
        return None

    def get(self, artifact_id: str) -> Artifact:
        found = self.find(artifact_id)
        if found is None:
            raise MoecacheError(
                f"no artifact '{artifact_id}' under {self.root}/ (see `moecache artifacts list`)"
            )
        return found

    def resolve(self, ref: str) -> Artifact:
        """An artifact given by id or by path to its folder."""
        path = Path(ref)
        if (path / MANIFEST).is_file():
            return Artifact(path)
        if path.exists():
            raise MoecacheError(f"{path} is not an artifact folder: it has no {MANIFEST}")
        return self.get(ref)

    def list(self, stage: str | None = None) -> list[Artifact]:
        if not self.root.is_dir():
            return []
        stages = [self.root / stage] if stage else sorted(p for p in self.root.iterdir() if p.is_dir())
        found = []
        for stage_dir in stages:
            if not stage_dir.is_dir():
                continue
            for path in sorted(stage_dir.iterdir()):
                if not path.name.startswith(TMP_PREFIX) and (path / MANIFEST).is_file():
                    found.append(Artifact(path))
        return sorted(found, key=lambda a: a.manifest.get("created_at", ""))

    def latest(self, stage: str) -> Artifact | None:
        found = self.list(stage)
        return found[-1] if found else None

    @contextmanager
    def create(
        self,
        stage: str,
        *,
        schema_version: int,
        config: dict,
        inputs: list[str],
        seed: int | None,
        extra: dict | None = None,
    ) -> Iterator[Path]:
        """Yield a temporary folder to fill; on success it becomes `<root>/<stage>/<id>/`.

        On any exception the temporary folder is removed and nothing is published.
        """
        aid = artifact_id(stage, schema_version, config, inputs)
        final = self.root / stage / aid
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f"{TMP_PREFIX}{aid}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            yield tmp
            manifest = {
                "artifact_id": aid,
                "stage": stage,
                "schema_version": schema_version,
                "config": config,
                "config_hash": config_hash(config),
                "inputs": list(inputs),
                "seed": seed,
                "versions": package_versions(),
                "git_commit": git_commit(),
                "machine": machine_info(),
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "files": sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file()),
            }
            if extra:
                manifest.update(extra)
            write_json_atomic(tmp / MANIFEST, manifest)
            if final.exists():  # a forced re-run replaces the old artifact in one rename
                stale = final.parent / f"{TMP_PREFIX}stale-{aid}-{uuid.uuid4().hex[:8]}"
                os.rename(final, stale)
                os.rename(tmp, final)
                shutil.rmtree(stale, ignore_errors=True)
            else:
                os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

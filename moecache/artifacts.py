"""Versioned, atomically written stage artifacts: `outputs/<stage>/<artifact-id>/manifest.json`.

An artifact id is derived from the stage, its schema version, the part of the resolved config that
determines the result, the ids of its input artifacts and a fingerprint of the code that computes it
(`code_fingerprint`), so an identical re-run of the same code finds (and by default reuses) the same id,
and a code change never silently reuses a result of the old code (docs/artifacts.md). Files are written into a hidden temporary folder beside the final one
and renamed into place only once everything, the manifest last, is on disk: an interrupted run
leaves no artifact.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import sys
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


# The packages whose source computes artifacts: moecache and the expert kernels (kernels/ installs as
# moecache_kernels). conf/ is not hashed here: the part of the config that matters is in the id already.
FINGERPRINT_PACKAGES = ("moecache", "moecache_kernels")


def source_files(packages: tuple[str, ...] = FINGERPRINT_PACKAGES) -> list[tuple[str, bytes]]:
    """(package-relative path, bytes) of every file of `packages` (the .py source and the bundled data,
    such as moecache/data/cost_profiles/; compiled __pycache__ left out), sorted by path. The packages
    are located, not imported, so fingerprinting costs no import time."""
    files = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        for location in spec.submodule_search_locations:
            root = Path(location)
            for p in root.rglob("*"):
                if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc":
                    files.append((f"{name}/{p.relative_to(root).as_posix()}", p.read_bytes()))
    return sorted(files)


def fingerprint_of(files: list[tuple[str, bytes]]) -> str:
    """sha256 over the sorted (path, length, bytes) of `files`: a change of any byte, a renamed, added
    or removed file changes it."""
    digest = hashlib.sha256()
    for path, data in sorted(files):
        digest.update(path.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return digest.hexdigest()


@functools.cache
def code_fingerprint() -> str:
    """The fingerprint of the installed moecache code and data, computed once per process
    (docs/artifacts.md)."""
    return fingerprint_of(source_files())


def artifact_id(stage: str, schema_version: int, config: dict, inputs: list[str]) -> str:
    key = canonical_json(
        {
            "stage": stage,
            "schema": schema_version,
            "config": config,
            "inputs": inputs,
            "code": code_fingerprint(),
        }
    )
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


def read_manifest(path: Path) -> dict:
    """A manifest.json as a dict; a damaged one is one clear error naming the file."""
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MoecacheError(f"{path}: not a readable manifest ({' '.join(str(exc).split())})") from exc
    if not isinstance(manifest, dict):
        raise MoecacheError(f"{path}: not a readable manifest (a JSON object expected)")
    return manifest


@dataclass(frozen=True)
class Artifact:
    """A finished artifact on disk."""

    path: Path

    @property
    def id(self) -> str:
        return self.path.name

    @property
    def manifest(self) -> dict:
        return read_manifest(self.path / MANIFEST)

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

    def folders(self, stage: str | None = None) -> list[Path]:
        """Every published artifact folder (one holding a manifest.json), readable or not."""
        if not self.root.is_dir():
            return []
        stages = [self.root / stage] if stage else sorted(p for p in self.root.iterdir() if p.is_dir())
        found = []
        for stage_dir in stages:
            if not stage_dir.is_dir() or stage_dir.name.startswith("."):
                continue
            for path in sorted(stage_dir.iterdir()):
                if not path.name.startswith(TMP_PREFIX) and (path / MANIFEST).is_file():
                    found.append(path)
        return found

    def list(self, stage: str | None = None) -> list[Artifact]:
        """Every artifact, oldest first. One with a damaged manifest is skipped with a one-line warning
        on stderr naming it, so that one bad folder does not hide (or break) all the others."""
        found = []
        for path in self.folders(stage):
            try:
                found.append((read_manifest(path / MANIFEST).get("created_at", ""), Artifact(path)))
            except MoecacheError as exc:
                print(f"moecache: warning: skipping {exc}", file=sys.stderr)
        return [art for _, art in sorted(found, key=lambda pair: str(pair[0]))]

    def resolve_prefix(self, ref: str) -> Artifact:
        """An artifact given by path, whole id or a unique prefix of its id."""
        path = Path(ref)
        if (path / MANIFEST).is_file() or path.exists() or self.find(ref) is not None:
            return self.resolve(ref)
        matches = [p for p in self.folders() if p.name.startswith(ref)]
        if len(matches) == 1:
            return Artifact(matches[0])
        if not matches:
            raise MoecacheError(f"no artifact '{ref}' under {self.root}/ (see `moecache artifacts list`)")
        raise MoecacheError(f"'{ref}' is ambiguous: {', '.join(p.name for p in matches)}")

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
                "code_fingerprint": code_fingerprint(),
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

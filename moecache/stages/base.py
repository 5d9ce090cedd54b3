"""What every stage shares: its result, the artifact store, the device, reuse of finished work."""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from moecache.artifacts import ArtifactStore, artifact_id
from moecache.errors import MoecacheError


@dataclass
class StageResult:
    """A finished stage: its artifact folder, whether it was reused, and rows for the summary table."""

    artifact: Path
    reused: bool = False
    summary: dict = field(default_factory=dict)


def store_for(cfg: DictConfig) -> ArtifactStore:
    return ArtifactStore(cfg.output_root)


def check_writable(root: str | Path) -> None:
    """Create the output root if needed and write (then remove) a probe file in it, so that an output
    root the stage cannot write fails before the computation, not after it."""
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise MoecacheError(f"output_root={root}: cannot write there ({reason})") from exc


def prepare(cfg: DictConfig, stage: str) -> dict:
    """What every stage does first: the resolved config as a plain dict, every value the stage reads
    checked (moecache/config_values.py), and the output root proven writable. Nothing is read or
    computed before this passes."""
    from moecache.config import to_container
    from moecache.config_values import check_config

    c = to_container(cfg)
    check_config(stage.replace("_", "-"), c)
    check_writable(c["output_root"])
    return c


def profile_digest(profile_ref: str) -> str | None:
    """The sha256 of a cost profile given as a JSON file path, for the artifact id: overwriting the file
    must not bring back results of the old profile. None for a calibrate artifact (its id is an input
    already) and a bundled profile (part of the code fingerprint)."""
    path = Path(profile_ref)
    if profile_ref.startswith("bundled:") or not path.is_file():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()


def reusable(
    cfg: DictConfig, stage: str, schema_version: int, config: dict, inputs: list[str]
) -> Path | None:
    """The finished artifact with this exact id, unless `force=true` asks for a re-run. A damaged one
    (`check_artifact`: its manifest, a file missing, truncated or changed) is an error, never reused:
    `force=true` recomputes it."""
    force = cfg.get("force", False)
    if not isinstance(force, bool):
        raise MoecacheError(f"force={force!r}: expected true or false")
    if force:
        return None
    aid = artifact_id(stage, schema_version, config, inputs)
    return store_for(cfg).get(aid).path if store_for(cfg).find(aid) is not None else None


def torch_device(cfg: DictConfig) -> str:
    import torch

    want = str(cfg.get("device", "auto"))
    if want == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if want.startswith("cuda") and not torch.cuda.is_available():
        raise MoecacheError(
            f"device={want}: CUDA is not available on this machine (use device=cpu or device=auto)"
        )
    if want != "cpu" and not want.startswith("cuda"):
        raise MoecacheError(f"device={want}: expected auto, cpu or cuda[:N]")
    return want

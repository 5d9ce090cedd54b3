"""What every stage shares: its result, the artifact store, the device, reuse of finished work."""

from __future__ import annotations

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


def reusable(
    cfg: DictConfig, stage: str, schema_version: int, config: dict, inputs: list[str]
) -> Path | None:
    """The finished artifact with this exact id, unless `force=true` asks for a re-run."""
    if cfg.get("force", False):
        return None
    found = store_for(cfg).find(artifact_id(stage, schema_version, config, inputs))
    return found.path if found else None


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

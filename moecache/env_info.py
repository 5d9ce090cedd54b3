"""What machine and software produced an artifact: versions, CPU and GPU model, git commit."""

from __future__ import annotations

import functools
import importlib.metadata
import platform
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_versions() -> dict[str, str | None]:
    import torch

    return {
        "python": platform.python_version(),
        "moecache": _version("moecache"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": _version("transformers"),
        "triton": _version("triton"),
        "onnxruntime": _version("onnxruntime"),
        "pyarrow": _version("pyarrow"),
        "hydra-core": _version("hydra-core"),
    }


@functools.cache
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_model() -> str | None:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return None


@functools.cache
def git_commit() -> str | None:
    """The commit of the checkout, with '+dirty' when tracked files differ from it."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+dirty" if dirty else "")


def machine_info() -> dict:
    import os

    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpu_model": gpu_model(),
        "hostname": platform.node(),
    }

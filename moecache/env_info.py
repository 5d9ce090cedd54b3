"""What machine and software produced an artifact: versions, CPU and GPU model, git commit."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import platform
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_cuda_version() -> str | None:
    """The CUDA version torch was built with, read without importing torch (2 s on a cold start): from
    torch itself when it is already imported, else from the `cuda = ...` line of its version.py."""
    if "torch" in sys.modules:
        return sys.modules["torch"].version.cuda
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        tree = ast.parse((Path(spec.submodule_search_locations[0]) / "version.py").read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if isinstance(target, ast.Name) and target.id == "cuda" and isinstance(node.value, ast.Constant):
            return node.value.value
    return None


def package_versions() -> dict[str, str | None]:
    """Versions of the software an artifact depends on, from the installed distributions' metadata
    (never by importing a package, which for torch alone costs seconds)."""
    return dict(_package_versions())


@functools.cache
def _package_versions() -> dict[str, str | None]:
    return {
        "python": platform.python_version(),
        "moecache": _version("moecache"),
        "torch": _version("torch"),
        "cuda": torch_cuda_version(),
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


@functools.cache
def gpu_model() -> str | None:
    """The first GPU's name: from torch when it is already imported (the collect and calibrate stages),
    else from the NVIDIA driver's /proc entry, so a CPU-only stage does not import torch to ask."""
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        try:
            for line in info.read_text().splitlines():
                if line.startswith("Model:"):
                    return line.split(":", 1)[1].strip()
        except OSError:
            continue
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

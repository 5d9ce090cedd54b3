"""The project's folders never shadow another distribution's top-level package.

`python -m pytest`, `python -m moecache.cli` and any script run from the repository root put the root
first on sys.path. There, the top-level `kernels/` folder must not win over Hugging Face's `kernels`
distribution, which transformers imports whenever it is installed; the project's kernels are the
`moecache_kernels` package one level down. Each check runs in a fresh interpreter started from the root.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# transformers' modules behind every adapter moecache registers, and the integration that imports the
# `kernels` distribution
TRANSFORMERS_MODULES = [
    "transformers.integrations.hub_kernels",
    *(
        f"transformers.models.{name}.modeling_{name}"
        for name in ("qwen3_5_moe", "qwen3_moe", "deepseek_v2", "mixtral", "olmoe")
    ),
]


def run_from_root(code: str) -> subprocess.CompletedProcess:
    """`code` in a new interpreter, from the repository root, with the root first on sys.path."""
    prelude = f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
    return subprocess.run(
        [sys.executable, "-c", prelude + code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_kernels_folder_is_not_a_package():
    assert (ROOT / "kernels" / "moecache_kernels" / "__init__.py").is_file()
    assert not (ROOT / "kernels" / "__init__.py").exists(), (
        "kernels/__init__.py would shadow the `kernels` distribution"
    )


def test_transformers_modules_import_with_the_root_first_on_sys_path():
    code = "import importlib\n" + "\n".join(f"importlib.import_module({m!r})" for m in TRANSFORMERS_MODULES)
    code += "\nimport moecache.models, moecache_kernels\nprint(moecache_kernels.__file__)"
    result = run_from_root(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert Path(result.stdout.strip()) == ROOT / "kernels" / "moecache_kernels" / "__init__.py"


def test_the_kernels_distribution_wins_over_the_folder():
    from importlib import metadata

    try:
        metadata.distribution("kernels")
    except metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's `kernels` is not installed here")
    result = run_from_root("import kernels; print(kernels.__file__)")
    assert result.returncode == 0, result.stderr[-3000:]
    origin = Path(result.stdout.strip())
    assert ROOT / "kernels" not in origin.parents, (
        f"`import kernels` resolved to the project's folder: {origin}"
    )


def test_cli_module_runs_from_the_root():
    result = subprocess.run(
        [sys.executable, "-m", "moecache.cli", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "collect" in result.stdout

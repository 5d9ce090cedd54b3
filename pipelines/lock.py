"""The CPU development environment's lock: exact versions with hashes, written and checked.

    python pipelines/lock.py write LOCK TORCH_SPEC   # resolve pyproject's ranges afresh (`make lock`)
    python pipelines/lock.py check LOCK              # exit 1 unless this interpreter has every locked version

`write` asks pip to resolve `-e .[dev]`, the CPU torch wheel (TORCH_SPEC), setuptools (the build backend,
as `make setup` builds without isolation) and pip itself, with nothing installed (`--dry-run
--ignore-installed --report`), and writes one `name==version --hash=sha256:...` line per distribution
pip chose, sorted by name. The hash is that of the file pip picked for this interpreter and platform:
the lock is for the machine kind it was written on (CPython and platform in its header), and
`pip install --require-hashes` refuses any other file. moecache itself is not in the lock; it is
installed editable on top, without dependencies.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^([A-Za-z0-9._-]+)==(\S+)")


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def resolve(torch_spec: str) -> list[dict]:
    """pip's install report (its `install` entries) for the development environment, resolved afresh."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--dry-run",
            "--ignore-installed",  # fmt: skip
            "--report",
            str(report),
            "pip",
            "setuptools>=77",
            torch_spec,
            "-e",
            f"{ROOT}[dev]",
        ]
        subprocess.run(cmd, check=True, cwd=ROOT)
        return json.loads(report.read_text())["install"]


def lock_lines(install: list[dict]) -> list[str]:
    """One `name==version --hash=sha256:...` line per resolved distribution but moecache, by name."""
    lines = []
    for item in install:
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        if canonical(name) == "moecache":
            continue
        digest = item["download_info"].get("archive_info", {}).get("hashes", {}).get("sha256")
        if digest is None:
            raise SystemExit(
                f"lock: pip reported no sha256 for {name} {version} ({item['download_info']['url']})"
            )
        lines.append(f"{canonical(name)}=={version} --hash=sha256:{digest}")
    return sorted(lines)


def write(lock: Path, torch_spec: str) -> None:
    lines = lock_lines(resolve(torch_spec))
    header = [
        "# The CPU development environment of moecache, exact versions with hashes: `make setup` installs",
        "# it with `pip install --require-hashes`; `make lock` writes it afresh from pyproject.toml's ranges.",
        f"# Resolved for CPython {platform.python_version()} on {sys.platform}-{platform.machine()}"
        f" with pip {metadata.version('pip')}; torch as {torch_spec}.",
    ]
    tmp = lock.with_suffix(lock.suffix + ".tmp")
    tmp.write_text("\n".join(header + lines) + "\n")
    os.replace(tmp, lock)
    print(f"{lock}: {len(lines)} distributions")


def locked_versions(lock: Path) -> dict[str, str]:
    versions = {}
    for line in lock.read_text().splitlines():
        match = LINE.match(line)
        if match:
            versions[canonical(match[1])] = match[2]
    return versions


def check(lock: Path) -> int:
    """0 when every locked distribution is installed at its locked version, else 1 with the differences."""
    installed = {canonical(d.metadata["Name"]): d.version for d in metadata.distributions()}
    wrong = [
        f"{name} {installed.get(name, 'missing')} (locked {version})"
        for name, version in locked_versions(lock).items()
        if installed.get(name) != version
    ]
    if wrong:
        print(f"{lock}: the environment differs from the lock: {', '.join(wrong)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "write":
        write(Path(argv[1]), argv[2])
        return 0
    if len(argv) == 2 and argv[0] == "check":
        return check(Path(argv[1]))
    print("usage: python pipelines/lock.py write LOCK TORCH_SPEC | check LOCK", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A benchmark script imported as a module for its tests."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
from pathlib import Path


@contextlib.contextmanager
def script_module(name: str, path: Path):
    """The script at `path` as module `name`, registered in sys.modules while in use (a script's
    dataclasses look their module up by name), removed after."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def run_script(monkeypatch, capsys, path: Path, argv: list[str]) -> dict:
    """The script at `path` run in this process (its folder on sys.path, for its sibling imports) with
    `argv` after its name: its last stdout line, the benchmark's JSON line."""
    monkeypatch.syspath_prepend(str(path.parent))
    monkeypatch.setattr(sys, "argv", [path.name, *argv])
    with script_module(f"{path.stem}_script", path) as module:
        module.main()
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

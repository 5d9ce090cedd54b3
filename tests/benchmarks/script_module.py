"""A benchmark script imported as a module for its tests."""

from __future__ import annotations

import contextlib
import importlib.util
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

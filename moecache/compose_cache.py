"""A disk cache of composed configs: Hydra's compose is a pure function of the config tree and the overrides.

Composing `conf/` costs a cold process 0.15-0.2 s (Hydra builds the defaults list, loads and merges every
selected YAML file; importing Hydra and its override parser is more): a large part of a small stage
run, e.g. `moecache simulate` of one trace. The composed, *unresolved* DictConfig is cached under a key
that covers everything the result depends on:

- the bytes of every file under the config directory (and their paths), so an edited, added or removed
  YAML file gives a new key;
- the root config composed (a stage's conf/<stage>.yaml, or conf/config.yaml);
- the overrides, in order, exactly as given;
- the versions of hydra-core and omegaconf (from the installed distributions' metadata);
- this module's format version.

Interpolations (`${oc.env:MOECACHE_OUTPUT_ROOT,outputs}`, `${seed}`, ...) are stored unresolved, so
environment variables are read when the stage resolves the config, as without the cache. Only
successful compositions are cached; a failing override always goes through Hydra and gets its error.
The cache is a folder of pickles, `$MOECACHE_COMPOSE_CACHE`, else `$XDG_CACHE_HOME/moecache/compose`
(else `~/.cache/moecache/compose`); `MOECACHE_COMPOSE_CACHE=off` disables it. An unreadable entry is
ignored and replaced; an unwritable folder only means no caching.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

FORMAT = 1
OFF = "off"


def cache_dir() -> Path | None:
    env = os.environ.get("MOECACHE_COMPOSE_CACHE")
    if env == OFF:
        return None
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "moecache" / "compose"


def _dist_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "absent"


def key(conf_dir: Path, config_name: str, overrides: list[str]) -> str:
    """The cache key of composing `conf_dir`'s root `config_name` with `overrides` (module docstring)."""
    h = hashlib.sha256()
    parts = (
        f"format={FORMAT}",
        _dist_version("hydra-core"),
        _dist_version("omegaconf"),
        str(conf_dir),
        config_name,
    )
    for part in parts:
        h.update(part.encode() + b"\0")
    for path in sorted(p for p in conf_dir.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(conf_dir)).encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    h.update(b"overrides\0")
    for override in overrides:
        h.update(override.encode() + b"\0")
    return h.hexdigest()[:32]


def load(cache_key: str):
    """The cached composition, or None (absent, disabled or unreadable)."""
    directory = cache_dir()
    if directory is None:
        return None
    try:
        with open(directory / f"{cache_key}.pkl", "rb") as f:
            return pickle.load(f)
    except Exception:  # absent, truncated by a crash, written by another omegaconf: compose again
        return None


def store(cache_key: str, cfg) -> None:
    """Write `cfg` under `cache_key` atomically; any failure only means the next run composes again."""
    directory = cache_dir()
    if directory is None:
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=directory)
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(cfg, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, directory / f"{cache_key}.pkl")
    except Exception:
        Path(tmp).unlink(missing_ok=True)

"""What each command's root config composes, read from `conf/` without Hydra.

`moecache <stage>` composes conf/<stage>.yaml (`import-trace`: conf/import_trace.yaml), whose defaults
list names only what the stage reads: its config groups (`sim: default`), the keys it shares with other
stages (`common/seed`: a file of conf/common/ whose keys land at the top level) and parts of another
stage's group (`common/sweep_capacities@sweep.capacities`). Hydra's struct mode then refuses an override
of any other key; moecache/config.py turns that refusal into one line naming the key and the stage, with
what the stage does read, which this module lists from the same files. Reading a few small YAML files
costs no Hydra import, so `moecache <stage> --help` lists them cheaply.

conf/config.yaml is not a command's root: it composes every stage's keys at once for the Python API
(`moecache.config.compose` without a stage).
"""

from __future__ import annotations

import functools
from pathlib import Path

from moecache.errors import MoecacheError

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"  # moecache.config.CONF_DIR, without importing Hydra
ALL = "config"  # the root of every stage's keys
COMMON = "common"  # shared parts of the roots, not a config group


def root_name(stage: str) -> str:
    """The root config of a command: its name with `-` as `_` (import-trace: import_trace)."""
    return stage.replace("-", "_")


def stages(conf_dir: Path = CONF_DIR) -> list[str]:
    """The root configs of the commands under `conf_dir`, as command names."""
    return sorted(p.stem.replace("_", "-") for p in conf_dir.glob("*.yaml") if p.stem != ALL)


def _load(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text()) or {}


def _header_package(path: Path) -> str | None:
    """The `# @package NAME` header of a config file, if it has one."""
    first = path.read_text().split("\n", 1)[0].strip()
    if first.startswith("# @package "):
        return first.removeprefix("# @package ").strip()
    return None


def _own_keys(doc: dict) -> list[str]:
    return [str(k) for k in doc if k not in ("defaults", "hydra")]


@functools.cache
def stage_keys(stage: str, conf_dir: Path = CONF_DIR) -> tuple[str, ...]:
    """The config keys `stage` reads, in its root's order: a group (`sim`, `policy` even while none is
    selected), a top-level key (`seed`, `output_root`) or a dotted part of a group (`sweep.capacities`).
    Hydra's own `hydra` node is left out: every stage takes it."""
    root = conf_dir / f"{root_name(stage)}.yaml"
    if not root.is_file():
        raise MoecacheError(f"unknown stage {stage!r}; known: {', '.join(stages(conf_dir))}")
    doc = _load(root)
    keys: list[str] = []
    for entry in doc.get("defaults") or []:
        if isinstance(entry, dict):  # group: option, or group@package: option
            ((group, _option),) = entry.items()
            name, _, package = str(group).removeprefix("override ").partition("@")
            if not name.strip("/").startswith("hydra"):  # Hydra's own groups (hydra/launcher)
                keys.append(package or name.strip("/").replace("/", "."))
        elif entry == "_self_":
            keys.extend(_own_keys(doc))
        else:  # a config of its own: common/seed, common/sweep_capacities@sweep.capacities
            path, _, package = str(entry).partition("@")
            package = package or _header_package(conf_dir / f"{path.strip('/')}.yaml")
            if package == "_global_":
                keys.extend(_own_keys(_load(conf_dir / f"{path.strip('/')}.yaml")))
            else:
                keys.append(package or path.strip("/").rsplit("/", 1)[0].replace("/", "."))
    return tuple(dict.fromkeys(keys))


def stage_reads(stage: str, key: str, conf_dir: Path = CONF_DIR) -> bool:
    """True if `stage` reads the dotted config `key`: a key it reads, something below one, or a group
    part of which it reads (`sweep` for analyze, which reads sweep.capacities)."""
    key = key.replace("/", ".")
    return (
        key == "hydra"
        or key.startswith("hydra.")
        or any(
            key == k or key.startswith(k + ".") or k.startswith(key + ".")
            for k in stage_keys(stage, conf_dir)
        )
    )


def group_options(group: str, conf_dir: Path = CONF_DIR) -> list[str]:
    """The options of a config group: the YAML files of conf/<group>/."""
    return sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))


def groups(stage: str, conf_dir: Path = CONF_DIR) -> list[str]:
    """The config groups `stage` selects an option of (`policy=lru`, `model=tiny`)."""
    return [k for k in stage_keys(stage, conf_dir) if (conf_dir / k).is_dir()]

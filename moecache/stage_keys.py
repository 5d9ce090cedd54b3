"""Which config keys each stage reads, in one place, and the check of a command line against it.

Every stage composes the whole tree under `conf/`, so Hydra accepts `moecache simulate decide.margin=9`
without a word although simulate never reads `decide`: the user believes they changed something and
did not. `check_overrides` refuses such an override with one line before anything runs, and refuses a
config-group option that does not exist (`policy=lruu`, `policy=LRU`) with the known options.

An entry is a top-level key or group (`sim`) or a dotted key below one (`sweep.capacities`: analyze
reads only that part of `sweep`, through an interpolation in conf/analyze/default.yaml). A stage that
starts to read a new key must list it here; tests/test_config.py checks that every key the table
names exists and that every interpolation in a stage's groups points at a key the stage reads.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from moecache.errors import MoecacheError

# Read by every stage: where artifacts go, re-running, and Hydra's own settings (launcher, sweep dir).
COMMON_KEYS = ("output_root", "force", "hydra")

STAGE_KEYS: dict[str, tuple[str, ...]] = {
    "collect": ("model", "workload", "generation", "logging", "seed", "device"),
    "calibrate": ("cost", "model", "device"),
    "import-trace": ("trace_import",),
    "simulate": ("sim", "policy", "capacity", "traces"),
    "sweep": ("sweep", "sim", "policy", "capacity", "traces"),
    # sweep.capacities, sweep.policies: through the interpolations of conf/analyze/default.yaml
    "analyze": ("analyze", "sim", "traces", "seed", "sweep.capacities", "sweep.policies"),
    "decide": ("decide", "seed"),  # seed: conf/decide/default.yaml's `seed: ${seed}`
    "report": ("report",),
    # writes no artifact: streams text to stdout, the cache statistics to stderr
    "generate": ("model", "runtime", "capacity", "policy", "prompt", "generation", "seed", "device"),
    "validate": ("validate", "model", "seed", "device"),
}

# key=value, +key=value, ++key=value, ~key, ~key=value; a key may be a group path (hydra/launcher)
# or carry a package (group@pkg).
_OVERRIDE_RE = re.compile(r"^(?P<prefix>~|\+\+|\+)?(?P<key>[^=~+]+?)(?:=(?P<value>.*))?$", re.S)


def stage_reads(stage: str, key: str) -> bool:
    """True if `stage` reads the dotted config `key` (or something below or above it)."""
    key = key.replace("/", ".").split("@")[0]
    for allowed in COMMON_KEYS + STAGE_KEYS[stage]:
        if key == allowed or key.startswith(allowed + ".") or allowed.startswith(key + "."):
            return True
    return False


def group_options(conf_dir: Path, group: str) -> list[str]:
    """The options of a config group: the YAML files of conf/<group>/."""
    return sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))


def check_overrides(stage: str, overrides: list[str], conf_dir: Path) -> None:
    """Refuse, with one line, an override of a key `stage` does not read or an unknown group option."""
    if stage not in STAGE_KEYS:
        raise MoecacheError(f"unknown stage {stage!r}; known: {', '.join(STAGE_KEYS)}")
    for override in overrides:
        m = _OVERRIDE_RE.match(override.strip())
        if m is None or not m.group("key").strip():
            continue  # Hydra's parser names a malformed override itself
        key = m.group("key").strip()
        top = re.split(r"[./@]", key)[0]
        if not stage_reads(stage, key):
            reads = ", ".join(k for k in STAGE_KEYS[stage] + COMMON_KEYS if k != "hydra")
            raise MoecacheError(
                f"{override}: `moecache {stage}` does not read `{top if top != key else key}` "
                f"(it reads {reads})"
            )
        value = m.group("value")
        if (conf_dir / key).is_dir() and value is not None and m.group("prefix") != "~":
            _check_group_option(key, value, conf_dir)


def _check_group_option(group: str, value: str, conf_dir: Path) -> None:
    """`group=option` (or a multirun list `group=a,b`) names existing options, case included."""
    known = group_options(conf_dir, group)
    if not known or "(" in value or value.strip() in ("null", ""):
        return  # a sweep function such as choice(...) or a null selection: Hydra checks those
    for option in (v.strip() for v in value.split(",")):
        if option not in known:
            raise MoecacheError(
                f"{group}={option}: no such option{_suggest(option, known)}; known: {', '.join(known)}"
            )


def _suggest(option: str, known: list[str]) -> str:
    same_case = [k for k in known if k.lower() == option.lower()]
    close = same_case or difflib.get_close_matches(option, known, n=1)
    return f" (did you mean {close[0]}?)" if close else ""

"""Compose the Hydra config tree under `conf/` for one stage run, or launch a Hydra multirun.

A stage composes its own root, conf/<stage>.yaml, which holds only what the stage reads
(moecache/config_tree.py), so Hydra's struct mode refuses an override of any other key. Every Hydra or
OmegaConf failure (a bad override, a key the stage does not read, an unknown group option, a job of a
multirun that raised MoecacheError) comes out of here as one MoecacheError line naming the override,
never a traceback.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from moecache.config_tree import ALL, CONF_DIR, root_name, stage_keys, stage_reads
from moecache.errors import MoecacheError

# key=value, +key=value, ++key=value, ~key, ~key=value; a key may be a group path (hydra/launcher)
# or carry a package (group@pkg).
_OVERRIDE_RE = re.compile(r"^(?:~|\+\+|\+)?(?P<key>[^=~+]+?)(?:=.*)?$", re.S)
# Hydra's refusal of a group override the root's defaults list has no entry for (moecache simulate
# model=tiny): defaults_list.py, hydra-core 1.3.
_NO_DEFAULT_RE = re.compile(
    r"Could not (?:override|delete) '(?P<group>[^']+)'\. No match in the defaults list"
)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    cause = exc.__cause__
    if cause is not None and str(cause).strip():
        text = f"{text.splitlines()[0]}: {str(cause).strip().splitlines()[0]}"
    return " ".join(text.split("\n")[0].split())


def _override_key(override: str) -> str:
    m = _OVERRIDE_RE.match(override.strip())
    return m.group("key").strip().split("@")[0].replace("/", ".") if m else ""


def _override_for(key: str, overrides: list[str]) -> str:
    """The override (as given) that names `key`, something below it or the group above it."""
    for override in overrides:
        k = _override_key(override)
        if k and (k == key or k.startswith(key + ".") or key.startswith(k + ".")):
            return override
    return key


def _suggest(word: str, known: list[str]) -> str:
    same_case = [k for k in known if k.lower() == word.lower()]
    close = same_case or difflib.get_close_matches(word, known, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _not_read(stage: str, override: str, key: str, conf_dir: Path) -> MoecacheError:
    reads = ", ".join(stage_keys(stage, conf_dir))
    return MoecacheError(f"{override}: `moecache {stage}` does not read `{key}` (it reads {reads})")


def _no_such_key(override: str, key: str, conf_dir: Path, stage: str | None) -> MoecacheError:
    """An override of a key absent from a node the stage reads (sim.bandwith_scale), with the closest
    key of that node."""
    parent = key.rpartition(".")[0]
    known: list[str] = []
    try:
        base = _hydra_compose([], conf_dir, with_hydra=False, stage=stage)
        node = OmegaConf.select(base, parent) if parent else base
        if isinstance(node, DictConfig):
            known = [f"{parent}.{k}" if parent else str(k) for k in node]
    except (MoecacheError, OmegaConfBaseException):
        pass
    return MoecacheError(f"{override}: no such key `{key}`{_suggest(key, known)}")


def _composition_error(
    exc: BaseException, overrides: list[str], conf_dir: Path, stage: str | None
) -> MoecacheError:
    """Hydra's refusal of `overrides` as one line: a key or group the stage does not read (struct mode,
    or no entry in the root's defaults list), an unknown group option with the known ones, else Hydra's
    own message on one line."""
    from hydra.errors import MissingConfigException

    missing = getattr(exc, "missing_cfg_file", None)
    if isinstance(exc, MissingConfigException) and missing and "/" in missing and exc.options is not None:
        group, _, option = missing.rpartition("/")
        known = sorted(exc.options)
        return MoecacheError(
            f"{group}={option}: no such option{_suggest(option, known)}; known: {', '.join(known)}"
        )
    full_key = getattr(exc.__cause__, "full_key", None)
    if full_key:
        override = _override_for(full_key, overrides)
        if stage is not None and not stage_reads(stage, full_key, conf_dir):
            return _not_read(stage, override, full_key, conf_dir)
        return _no_such_key(override, full_key, conf_dir, stage)
    m = _NO_DEFAULT_RE.search(str(exc))
    if m and stage is not None:
        group = m.group("group").split("@")[0].replace("/", ".")
        return _not_read(stage, _override_for(group, overrides), group, conf_dir)
    return MoecacheError(f"bad config override: {_one_line(exc)}")


def _check_appended(cfg: DictConfig, overrides: list[str], conf_dir: Path, stage: str) -> None:
    """Hydra's struct mode lets `+key=value` append a key; refuse one the stage does not read
    (`moecache simulate +decide.margin=9`), as a plain override of it is refused."""
    partly = {k.split(".")[0] for k in stage_keys(stage, conf_dir) if "." in k}
    for key in cfg:
        key = str(key)
        found = [key] if key not in partly else [f"{key}.{sub}" for sub in cfg[key]]
        for dotted in found:
            if not stage_reads(stage, dotted, conf_dir):
                raise _not_read(stage, _override_for(dotted, overrides), dotted, conf_dir)


def compose(
    overrides: list[str] | None = None,
    conf_dir: Path = CONF_DIR,
    with_hydra: bool = False,
    stage: str | None = None,
) -> DictConfig:
    """The config of `stage` (its root conf/<stage>.yaml; None: conf/config.yaml, every stage's keys)
    with `overrides` (`key=value`, `group=option`), as Hydra composes it; `with_hydra`: with Hydra's
    own `hydra` node (for `--cfg hydra`). Without it the result comes from the compose cache when the
    config tree and the overrides are unchanged (moecache/compose_cache.py)."""
    overrides = list(overrides or [])
    if stage is not None:
        stage_keys(stage, conf_dir)  # an unknown stage is named before Hydra is imported
    if with_hydra:
        return _hydra_compose(overrides, conf_dir, with_hydra=True, stage=stage)
    from moecache import compose_cache

    cache_key = compose_cache.key(conf_dir, ALL if stage is None else root_name(stage), overrides)
    cfg = compose_cache.load(cache_key)
    if cfg is None:
        cfg = _hydra_compose(overrides, conf_dir, with_hydra=False, stage=stage)
        compose_cache.store(cache_key, cfg)
    return cfg


def _hydra_compose(
    overrides: list[str] | None, conf_dir: Path, with_hydra: bool, stage: str | None = None
) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    overrides = list(overrides or [])
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base=None):
            cfg = hydra_compose(
                config_name=ALL if stage is None else root_name(stage),
                overrides=overrides,
                return_hydra_config=with_hydra,
            )
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise _composition_error(exc, overrides, conf_dir, stage) from exc
    if stage is not None:
        _check_appended(cfg, overrides, conf_dir, stage)
    return cfg


def to_container(cfg: DictConfig) -> dict:
    """A plain, fully resolved dict; a missing mandatory value is a clear error naming its key."""
    from omegaconf.errors import MissingMandatoryValue

    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as exc:
        raise MoecacheError(f"config: {exc.full_key} is required (pass {exc.full_key}=...)") from exc
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        raise MoecacheError(f"config: {key + ': ' if key else ''}{_one_line(exc)}") from exc


class JobFailed:
    """What a multirun job returns instead of raising MoecacheError: Hydra would log the failure with
    a traceback; the message travels back (also from a joblib or submitit worker) and is raised once
    after the sweep as one line."""

    def __init__(self, message: str):
        self.message = message


def sweep_points(overrides: list[str]) -> list[list[str]]:
    """Every point of the Hydra sweep that `overrides` describe, as a list of plain overrides (Hydra's
    own `hydra.*` settings left out: they choose how to launch, not what a job computes)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    (points,) = BasicSweeper.split_arguments(
        [o for o in parsed if not o.key_or_group.startswith("hydra")], None
    )
    return points


def multirun(
    stage: str,
    fn: Callable[[DictConfig], object],
    overrides: list[str],
    conf_dir: Path = CONF_DIR,
    preflight: Callable[[DictConfig], object] | None = None,
):
    """Run `fn` once per point of the Hydra sweep that `overrides` describe, on the root config of
    `stage`, through the configured launcher (basic, joblib, submitit).

    `preflight(cfg)` is called on every point's composed config before any job starts, so that a bad
    value at any point is refused before work begins. Hydra's `@hydra.main` prints a traceback for any
    failure; the Hydra object it wraps is driven here instead, so that a bad override and a job's
    MoecacheError become one MoecacheError line."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    def task(cfg: DictConfig):
        try:
            return fn(cfg)
        except MoecacheError as exc:
            return JobFailed(str(exc))

    try:
        if preflight is not None:
            for point in sweep_points(overrides):
                preflight(compose(point, conf_dir, stage=stage))
        GlobalHydra.instance().clear()
        hydra = Hydra.create_main_hydra2(
            task_name=f"moecache-{stage}", config_search_path=create_config_search_path(str(conf_dir))
        )
        batches = hydra.multirun(
            config_name=root_name(stage), task_function=task, overrides=[*overrides, "hydra.mode=MULTIRUN"]
        )
    except MoecacheError:
        raise
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise _composition_error(exc, overrides, conf_dir, stage) from exc
    except OSError as exc:
        raise MoecacheError(f"multirun: {exc.filename or ''}: {exc.strerror or exc}") from exc
    finally:
        GlobalHydra.instance().clear()
    for batch in batches:
        for job in batch:
            if isinstance(job.return_value, JobFailed):
                raise MoecacheError(f"{job.return_value.message} (in the job {' '.join(job.overrides)})")
    return batches

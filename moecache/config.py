"""Compose the Hydra config tree under `conf/` for one stage run, or launch a Hydra multirun.

Every Hydra or OmegaConf failure (a bad override, an unknown key, a job of a multirun that raised
MoecacheError) comes out of here as one MoecacheError line, never a traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from moecache.env_info import REPO_ROOT
from moecache.errors import MoecacheError

CONF_DIR = REPO_ROOT / "conf"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    cause = exc.__cause__
    if cause is not None and str(cause).strip():
        text = f"{text.splitlines()[0]}: {str(cause).strip().splitlines()[0]}"
    return " ".join(text.split("\n")[0].split())


def compose(
    overrides: list[str] | None = None, conf_dir: Path = CONF_DIR, with_hydra: bool = False
) -> DictConfig:
    """The resolved config for `overrides` (`key=value`, `group=option`), as Hydra composes it;
    `with_hydra`: with Hydra's own `hydra` node (for `--cfg hydra`). Without it the result comes from
    the compose cache when the config tree and the overrides are unchanged (moecache/compose_cache.py)."""
    if with_hydra:
        return _hydra_compose(overrides, conf_dir, with_hydra=True)
    from moecache import compose_cache

    cache_key = compose_cache.key(conf_dir, list(overrides or []))
    cfg = compose_cache.load(cache_key)
    if cfg is None:
        cfg = _hydra_compose(overrides, conf_dir, with_hydra=False)
        compose_cache.store(cache_key, cfg)
    return cfg


def _hydra_compose(overrides: list[str] | None, conf_dir: Path, with_hydra: bool) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base=None):
            cfg = hydra_compose(
                config_name="config", overrides=list(overrides or []), return_hydra_config=with_hydra
            )
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise MoecacheError(f"bad config override: {_one_line(exc)}") from exc
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
    """Run `fn` once per point of the Hydra sweep that `overrides` describe, through the configured
    launcher (basic, joblib, submitit).

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
                preflight(compose(point, conf_dir))
        GlobalHydra.instance().clear()
        hydra = Hydra.create_main_hydra2(
            task_name=f"moecache-{stage}", config_search_path=create_config_search_path(str(conf_dir))
        )
        batches = hydra.multirun(
            config_name="config", task_function=task, overrides=[*overrides, "hydra.mode=MULTIRUN"]
        )
    except MoecacheError:
        raise
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise MoecacheError(f"bad config override: {_one_line(exc)}") from exc
    except OSError as exc:
        raise MoecacheError(f"multirun: {exc.filename or ''}: {exc.strerror or exc}") from exc
    finally:
        GlobalHydra.instance().clear()
    for batch in batches:
        for job in batch:
            if isinstance(job.return_value, JobFailed):
                raise MoecacheError(f"{job.return_value.message} (in the job {' '.join(job.overrides)})")
    return batches

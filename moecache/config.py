"""Compose the Hydra config tree under `conf/` for one stage run, or launch a Hydra multirun."""

from __future__ import annotations

import sys
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


def compose(overrides: list[str] | None = None, conf_dir: Path = CONF_DIR) -> DictConfig:
    """The resolved config for `overrides` (`key=value`, `group=option`), as Hydra composes it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base=None):
            cfg = hydra_compose(config_name="config", overrides=list(overrides or []))
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


def multirun(stage: str, fn: Callable[[DictConfig], object], overrides: list[str], conf_dir: Path = CONF_DIR):
    """Run `fn` once per point of the Hydra sweep that `overrides` describe (Hydra's own launcher)."""
    import hydra

    @hydra.main(config_path=str(conf_dir), config_name="config", version_base=None)
    def _task(cfg: DictConfig):
        return fn(cfg)

    saved = sys.argv
    sys.argv = [f"moecache-{stage}", "--multirun", *overrides]
    try:
        _task()
    finally:
        sys.argv = saved

"""The `moecache` command: a thin Typer layer over the stage functions in `moecache/stages/`.

Each stage subcommand takes Hydra overrides (`moecache collect model=tiny generation.max_new_tokens=64`)
and `-m/--multirun` for a Hydra sweep, on its own root config conf/<stage>.yaml, which holds only what the
stage reads. Progress and the summary table go to stderr; the last line on stdout is the output
artifact's path. Every bad input, also under `-m`, is one line on stderr
(`moecache <stage>: error: ...`) and exit code 2, before any computation: config values before anything
is read, a capacity against a trace's expert count right after that trace is read.

Imports stay lazy: `moecache --help` loads neither Hydra, numba nor torch (<= 0.3 s from a cold start).
"""

from __future__ import annotations

import importlib
import json
import sys

import typer
from typer.core import TyperCommand

from moecache.config_tree import group_options, groups, root_name, stage_keys
from moecache.errors import MoecacheError

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__.splitlines()[0])
artifacts_app = typer.Typer(no_args_is_help=True, help="List and inspect artifacts under output_root.")
app.add_typer(artifacts_app, name="artifacts")

LAUNCHERS = "basic (default), joblib, submitit_local, submitit_slurm"

# subcommand -> help; its module in moecache.stages, its root config and its artifact folder are root_name(it)
STAGES = {
    "collect": "Run a model on a workload with the routing logger on; write a trace artifact.",
    "calibrate": "Measure CPU/CUDA expert time and H2D bandwidth; write a cost-profile artifact.",
    "import-trace": "Convert an external routing trace into a canonical trace artifact.",
    "simulate": "Replay traces through one placement policy at one or more capacities.",
    "sweep": "Replay traces through every policy at every capacity of the grid; tabulate the metrics.",
    "analyze": "Offline sequence analysis of traces: frequency, drift, locality, transitions.",
    "decide": "Apply the pre-registered decision rule to a sweep; write decision.json.",
    "report": "Render a Markdown report with figures from a decision, its sweep and analysis.",
    "validate": "Run the decided policy and the baselines end to end on the workloads; write a validation artifact.",
}


def _fail(stage: str, exc: BaseException) -> None:
    print(f"moecache {stage}: error: {exc}", file=sys.stderr)
    raise typer.Exit(2)


def _print_summary(stage: str, result) -> None:
    from rich.console import Console
    from rich.table import Table

    err_console = Console(stderr=True)
    table = Table(title=f"moecache {stage}" + (" (reused existing artifact)" if result.reused else ""))
    table.add_column("what")
    table.add_column("value", justify="right")
    for key, value in result.summary.items():
        table.add_row(str(key), f"{value:,.4g}" if isinstance(value, float) else str(value))
    err_console.print(table)


def _stage_config_yaml(stage: str, overrides: list[str], what: str, resolve: bool) -> str:
    """The composed config as YAML: `job` the stage's (only the keys it reads), `hydra` Hydra's, `all`
    both."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from moecache.config import compose

    cfg = compose(overrides, with_hydra=what != "job", stage=stage)
    try:
        return OmegaConf.to_yaml(cfg.hydra if what == "hydra" else cfg, resolve=resolve)
    except OmegaConfBaseException as exc:
        raise MoecacheError(f"--cfg {what}: {' '.join(str(exc).split())}") from exc


def _printed(stage: str, overrides: list[str], show_cfg: str | None, resolve: bool) -> bool:
    """With `--cfg`, print the composed config instead of running. True: the command is done."""
    if show_cfg is None:
        return False
    if show_cfg not in ("job", "all", "hydra"):
        raise MoecacheError(f"--cfg {show_cfg}: expected job, all or hydra")
    print(_stage_config_yaml(stage, overrides, show_cfg, resolve), end="")
    return True


def _run_stage(stage: str, overrides: list[str], multirun: bool, show_cfg: str | None, resolve: bool) -> None:
    try:
        if _printed(stage, overrides, show_cfg, resolve):
            return
        from moecache.config import compose
        from moecache.config import multirun as hydra_multirun
        from moecache.stages.base import prepare

        module = importlib.import_module(f"moecache.stages.{root_name(stage)}")

        def once(cfg):
            prepare(cfg, stage)
            result = module.run(cfg)
            _print_summary(stage, result)
            print(result.artifact, flush=True)
            return str(result.artifact)

        if multirun:
            hydra_multirun(stage, once, overrides, preflight=lambda cfg: prepare(cfg, stage))
        else:
            once(compose(overrides, stage=stage))
    except MoecacheError as exc:
        _fail(stage, exc)


def _stage_epilog(stage: str) -> str:
    """The keys the stage reads and its groups' options (read from conf/), and how to see its config."""
    lines = [f"Config keys it reads (conf/{root_name(stage)}.yaml): {', '.join(stage_keys(stage))}."]
    for group in groups(stage):
        lines.append(f"Group {group}: {', '.join(group_options(group))} (select with {group}=OPTION).")
    lines.append(f"Launchers (with -m, hydra/launcher=NAME): {LAUNCHERS}.")
    lines.append(
        f"Print the composed config without running: moecache {stage} --cfg job [OVERRIDES] "
        "(--cfg hydra: Hydra's; --cfg all: both; --resolve: interpolations resolved)."
    )
    return "\n\n".join(lines)


class StageCommand(TyperCommand):
    """A stage's command, whose epilog (`_stage_epilog`: read from conf/) is built only when its help is
    shown, not at every start of the CLI."""

    @property
    def epilog(self) -> str:
        return _stage_epilog(self.name)

    @epilog.setter
    def epilog(self, value) -> None:
        pass  # always built from conf/


# The options every command that composes the config takes besides its overrides.
CFG_OPTION = typer.Option(
    None,
    "--cfg",
    "-c",
    help="Print the composed config and exit: job (the keys the command reads), hydra (Hydra's), or all.",
)
RESOLVE_OPTION = typer.Option(False, "--resolve", help="With --cfg: resolve interpolations.")


def _make_stage_command(stage: str, help_text: str) -> None:
    @app.command(
        stage,
        help=help_text + " Extra arguments are Hydra overrides (key=value, group=option).",
        cls=StageCommand,
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )
    def _command(
        ctx: typer.Context,
        multirun: bool = typer.Option(
            False, "-m", "--multirun", help="Hydra multirun over comma-separated values."
        ),
        cfg: str = CFG_OPTION,
        resolve: bool = RESOLVE_OPTION,
    ) -> None:
        _run_stage(stage, list(ctx.args), multirun, cfg, resolve)


for _stage, _help in STAGES.items():
    _make_stage_command(_stage, _help)


GENERATE_HELP = (
    'Continue prompt="..." with the offloaded model (capacity=..., policy=...): the text streams to '
    "stdout, the cache statistics go to stderr; runtime.enabled=false runs the unmodified model. "
    "Writes no artifact. Extra arguments are Hydra overrides (key=value, group=option)."
)


@app.command(
    "generate",
    help=GENERATE_HELP,
    cls=StageCommand,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def generate_command(ctx: typer.Context, cfg: str = CFG_OPTION, resolve: bool = RESOLVE_OPTION) -> None:
    """The stages' composition and one-line errors, without an artifact (nor a multirun: one prompt)."""
    stage, overrides = "generate", list(ctx.args)
    try:
        if _printed(stage, overrides, cfg, resolve):
            return
        from moecache.config import compose
        from moecache.stages.generate import run

        run(compose(overrides, stage=stage))
    except MoecacheError as exc:
        _fail(stage, exc)


def _stage_folder(stage: str) -> str:
    """The artifact folder name of a stage given by its command (import-trace) or folder name."""
    folders = {name: root_name(name) for name in STAGES}
    if stage in folders or stage in folders.values():
        return folders.get(stage, stage)
    raise MoecacheError(f"--stage {stage}: no such stage; known: {', '.join(STAGES)}")


def aligned(rows: list[tuple[str, ...]]) -> str:
    """Plain columns padded to their widest cell, the last one unpadded: ids are never cut short, in a
    narrow terminal or through a pipe (a rich Table truncates them with '…')."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(r, widths, strict=False)), r[-1]]) for r in rows)


@artifacts_app.command("list")
def artifacts_list(
    stage: str = typer.Option(None, help=f"Only this stage: {', '.join(STAGES)}."),
    output_root: str = typer.Option(
        None, help="The artifact folder (default: $MOECACHE_OUTPUT_ROOT or outputs)."
    ),
) -> None:
    """One line per artifact: id, stage, created time, inputs (oldest first)."""
    from moecache.artifacts import ArtifactStore, default_output_root

    output_root = output_root or default_output_root()
    try:
        found = ArtifactStore(output_root).list(_stage_folder(stage) if stage else None)
        rows = [("artifact id", "stage", "created", "inputs")]
        for art in found:
            m = art.manifest
            inputs = ", ".join(str(i) for i in m.get("inputs", [])) or "-"
            rows.append((art.id, art.stage, str(m.get("created_at", "?")), inputs))
    except MoecacheError as exc:
        _fail("artifacts list", exc)
    print(aligned(rows) if found else f"no artifacts under {output_root}/")


@artifacts_app.command("show")
def artifacts_show(
    artifact: str = typer.Argument(..., help="Artifact id, a unique prefix of one, or its folder."),
    output_root: str = typer.Option(
        None, help="The artifact folder (default: $MOECACHE_OUTPUT_ROOT or outputs)."
    ),
) -> None:
    """Print an artifact's manifest (JSON) and its folder."""
    from moecache.artifacts import ArtifactStore, default_output_root

    try:
        art = ArtifactStore(output_root or default_output_root()).resolve_prefix(artifact)
        manifest = art.manifest
    except MoecacheError as exc:
        _fail("artifacts show", exc)
    print(json.dumps(manifest, indent=2, sort_keys=True))
    print(art.path)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

"""The `moecache` command: a thin Typer layer over the stage functions in `moecache/stages/`.

Each stage subcommand takes Hydra overrides (`moecache collect model=tiny generation.max_new_tokens=64`)
and `-m/--multirun` for a Hydra sweep. Progress and the summary table go to stderr; the last line on
stdout is the output artifact's path.
"""

from __future__ import annotations

import importlib
import json
import sys

import typer
from rich.console import Console
from rich.table import Table

from moecache.errors import MoecacheError

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__.splitlines()[0])
artifacts_app = typer.Typer(no_args_is_help=True, help="List and inspect artifacts under output_root.")
app.add_typer(artifacts_app, name="artifacts")

err_console = Console(stderr=True)

# subcommand -> (module in moecache.stages, help)
STAGES = {
    "collect": ("collect", "Run a model on a workload with the routing logger on; write a trace artifact."),
    "calibrate": (
        "calibrate",
        "Measure CPU/CUDA expert time and H2D bandwidth; write a cost-profile artifact.",
    ),
    "import-trace": ("import_trace", "Convert an external routing trace into a canonical trace artifact."),
    "simulate": ("simulate", "Replay traces through one placement policy at one or more capacities."),
    "sweep": (
        "sweep",
        "Replay traces through every policy at every capacity of the grid; tabulate the metrics.",
    ),
    "analyze": ("analyze", "Offline sequence analysis of traces: frequency, drift, locality, transitions."),
    "decide": ("decide", "Apply the pre-registered decision rule to a sweep; write decision.json."),
    "report": ("report", "Render a Markdown report with figures from a decision, its sweep and analysis."),
}


def _fail(stage: str, exc: BaseException) -> None:
    print(f"moecache {stage}: error: {exc}", file=sys.stderr)
    raise typer.Exit(2)


def _print_summary(stage: str, result) -> None:
    table = Table(title=f"moecache {stage}" + (" (reused existing artifact)" if result.reused else ""))
    table.add_column("what")
    table.add_column("value", justify="right")
    for key, value in result.summary.items():
        table.add_row(str(key), f"{value:,.4g}" if isinstance(value, float) else str(value))
    err_console.print(table)


def _run_stage(stage: str, overrides: list[str], multirun: bool) -> None:
    from moecache.config import compose
    from moecache.config import multirun as hydra_multirun

    module = importlib.import_module(f"moecache.stages.{STAGES[stage][0]}")

    def once(cfg):
        result = module.run(cfg)
        _print_summary(stage, result)
        print(result.artifact, flush=True)
        return str(result.artifact)

    try:
        if multirun:
            hydra_multirun(stage, once, overrides)
        else:
            once(compose(overrides))
    except MoecacheError as exc:
        _fail(stage, exc)


def _make_stage_command(stage: str, help_text: str) -> None:
    @app.command(
        stage,
        help=help_text + " Extra arguments are Hydra overrides (key=value, group=option).",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )
    def _command(
        ctx: typer.Context,
        multirun: bool = typer.Option(
            False, "-m", "--multirun", help="Hydra multirun over comma-separated values."
        ),
    ) -> None:
        _run_stage(stage, list(ctx.args), multirun)


for _stage, (_module, _help) in STAGES.items():
    _make_stage_command(_stage, _help)


def _default_output_root() -> str:
    import os

    return os.environ.get("MOECACHE_OUTPUT_ROOT", "outputs")


@artifacts_app.command("list")
def artifacts_list(
    stage: str = typer.Option(None, help="Only this stage."),
    output_root: str = typer.Option(
        None, help="The artifact folder (default: $MOECACHE_OUTPUT_ROOT or outputs)."
    ),
) -> None:
    """One line per artifact: id, stage, created time, inputs."""
    from moecache.artifacts import ArtifactStore

    output_root = output_root or _default_output_root()
    table = Table()
    for col in ("artifact id", "stage", "created", "inputs"):
        table.add_column(col)
    found = ArtifactStore(output_root).list(stage)
    for art in found:
        m = art.manifest
        table.add_row(art.id, art.stage, m.get("created_at", "?"), ", ".join(m.get("inputs", [])) or "-")
    Console().print(table if found else f"no artifacts under {output_root}/")


@artifacts_app.command("show")
def artifacts_show(
    artifact: str = typer.Argument(..., help="Artifact id or folder."),
    output_root: str = typer.Option(
        None, help="The artifact folder (default: $MOECACHE_OUTPUT_ROOT or outputs)."
    ),
) -> None:
    """Print an artifact's manifest (JSON) and its files."""
    from moecache.artifacts import ArtifactStore

    try:
        art = ArtifactStore(output_root or _default_output_root()).resolve(artifact)
    except MoecacheError as exc:
        _fail("artifacts show", exc)
    print(json.dumps(art.manifest, indent=2, sort_keys=True))
    print(art.path)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

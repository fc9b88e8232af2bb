from __future__ import annotations

from pathlib import Path

import click

from pipeline.commands.options import OUTPUT_DIR, db_option


@click.command(short_help="End to end on CPU: tiny model, rollout, replay, compare.")
@click.option(
    "--out",
    "out_dir",
    default="runs/smoke",
    show_default=True,
    type=OUTPUT_DIR,
    help="A folder for the fixture, the replays, each comparison and lpx-run.json.",
)
@click.option(
    "--model",
    "model_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Model directory [default: the tiny model, built on first use under "
    "$LPX_CACHE or ~/.cache/lpx].",
)
@click.option(
    "--rollout", "rollout_engine", default="hf", show_default=True, help="Rollout engine."
)
@db_option("smoke")
@click.option(
    "--report-out",
    "report_dir",
    default="runs/report",
    show_default=True,
    type=OUTPUT_DIR,
    help="Where the history's HTML report is rendered after recording the run.",
)
@click.option("--no-history", is_flag=True, help="Do not record the run or render the report.")
def smoke(
    out_dir: Path,
    model_dir: Path | None,
    rollout_engine: str,
    db: str | None,
    report_dir: Path,
    no_history: bool,
) -> None:
    """End to end on CPU: tiny model, rollout, hf replay in fp32 and bf16, compare, verdict,
    then record the run into the history (SQLite runs/lpx.db by default) and render the report.

    Writes the fixture, both replays, one compare directory per replay and the run manifest
    (lpx-run.json) under --out, prints one line per comparison, and exits with the verdict
    (0 pass, 1 fail, 2 error). The last line is the report's path.

    \b
    Example:
      lpx smoke --out runs/smoke
    """
    from pipeline.flows.smoke import run_smoke

    code = run_smoke(out_dir, model_dir, rollout_engine, db, None if no_history else report_dir)
    click.get_current_context().exit(code)

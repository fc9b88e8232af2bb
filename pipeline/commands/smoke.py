from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.option(
    "--out",
    "out_dir",
    default="runs/smoke",
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
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
def smoke(out_dir: Path, model_dir: Path | None, rollout_engine: str) -> None:
    """End to end on CPU: tiny model, rollout, hf replay in fp32 and bf16, compare, verdict.

    Writes the fixture, both replays and one compare directory per replay under --out,
    prints one line per comparison, and exits with the verdict (0 pass, 1 fail).

    \b
    Example:
      lpx smoke --out runs/smoke
    """
    from pipeline.smoke import run_smoke

    click.get_current_context().exit(run_smoke(out_dir, model_dir, rollout_engine))

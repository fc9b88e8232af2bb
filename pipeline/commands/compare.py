from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from pipeline.errors import EXIT_PASS, EXIT_REGRESSION


@click.command()
@click.argument("fixture_path", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("replay_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory for report.json, tokens.parquet and summary.md.",
)
@click.option(
    "--policy",
    "policy_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Threshold policy YAML [default: the bundled one, docs/policy.md].",
)
@click.option(
    "--profile", help="Policy profile [default: the least precise dtype of the two sides]."
)
@click.option(
    "--channel",
    default="rollout",
    show_default=True,
    help="Fixture channel to compare: rollout, old, ref, current, rollout_raw, rollout_processed.",
)
@click.option(
    "--allow-weight-mismatch",
    is_flag=True,
    help="Compare even when the weight fingerprints differ (diagnoses stale weights).",
)
@click.option("--quiet", is_flag=True, help="Print only the verdict line.")
def compare(
    fixture_path, replay_path, out_dir, policy_path, profile, channel, allow_weight_mismatch, quiet
):
    """Compare a replay with its fixture token by token; write the report; exit with the verdict.

    Computes drift metrics (|d| tails, k1/k2/k3, IS ratio, ESS, clip fraction, per-sequence
    max/mean/sum), finds the worst tokens, tests semantic causes (off-by-one, mask/padding,
    position ids, temperature, dtype, stale weights) and applies the threshold policy.
    Exit 0 pass, 1 regression, 2 bad input.

    \b
    Example:
      lpx compare run/fixture.parquet run/replay-bf16.parquet --out run/compare-bf16
      lpx compare run/fixture.parquet run/replay.parquet --profile float32 --out run/strict
    """
    from pipeline.compare.outputs import render_summary, write_outputs
    from pipeline.compare.policy import load_policy
    from pipeline.compare.run import compare_files

    comparison = compare_files(
        fixture_path,
        replay_path,
        policy=load_policy(policy_path),
        profile=profile,
        channel=channel,
        allow_weight_mismatch=allow_weight_mismatch,
        command_line=shlex.join(["lpx", *sys.argv[1:]]),
    )
    paths = write_outputs(comparison, out_dir)
    report = comparison.report
    if not quiet:
        click.echo(render_summary(report))
    click.echo(f"verdict: {report['verdict'].upper()} -> {paths['report']}")
    click.get_current_context().exit(EXIT_PASS if report["verdict"] == "pass" else EXIT_REGRESSION)

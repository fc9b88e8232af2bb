from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from pipeline.commands.options import OUTPUT_DIR
from pipeline.errors import EXIT_PASS, EXIT_REGRESSION


@click.command()
@click.argument("fixture_path", type=click.Path(dir_okay=False, path_type=Path))
@click.argument(
    "replay_paths", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path)
)
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=OUTPUT_DIR,
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
@click.option(
    "--exact",
    is_flag=True,
    help="Fail on any completion token whose float32 logprobs are not bitwise equal (for "
    "batch-invariant or true-on-policy stacks); the policy's limits still apply.",
)
@click.option("--quiet", is_flag=True, help="Print only the verdict line.")
def compare(
    fixture_path,
    replay_paths,
    out_dir,
    policy_path,
    profile,
    channel,
    allow_weight_mismatch,
    exact,
    quiet,
):
    """Compare replays with their fixture token by token; write the report; exit with the verdict.

    Computes drift metrics (|d| tails, k1/k2/k3, IS ratio, ESS, clip fraction, NeMo-RL's
    token_mult_prob_error gates, per-sequence max/mean/sum, the bitwise-equal fraction, and
    forward/reverse KL over the rollout's top-k ids when both sides hold them), finds the
    worst tokens, tests semantic causes (off-by-one, mask/padding, position ids,
    temperature, dtype, stale weights) and applies the threshold policy; --exact also fails
    on any token that is not bitwise equal. Exit 0 pass, 1 regression, 2 bad input. With
    several replays, each pair gets its own directory under --out and report.json/summary.md
    hold the matrix, a row per pair.

    \b
    Example:
      lpx compare run/fixture.parquet run/replay-bf16.parquet --out run/compare-bf16
      lpx compare run/fixture.parquet run/replay.parquet --profile float32 --out run/strict
      lpx compare run/fixture.parquet run/replay-batch-invariant.parquet --exact --out run/exact
      lpx compare run/fixture.parquet run/hf.parquet run/fsdp.parquet run/megatron-tp2.parquet \\
          --out run/matrix
    """
    from pipeline.paths import check_output

    for name in ("report.json", "tokens.parquet", "summary.md"):
        check_output(out_dir / name, [fixture_path, *replay_paths])
    from pipeline.compare.matrix import render_matrix, write_matrix
    from pipeline.compare.outputs import render_summary, write_outputs
    from pipeline.compare.policy import load_policy
    from pipeline.compare.run import compare_tables
    from pipeline.fixture.io import read_table

    fixture = read_table(fixture_path, expect_kind="fixture")  # once, however many replays
    policy = load_policy(policy_path)
    comparisons = [
        compare_tables(
            fixture,
            read_table(replay_path, expect_kind="replay"),
            fixture_path,
            replay_path,
            policy=policy,
            profile=profile,
            channel=channel,
            allow_weight_mismatch=allow_weight_mismatch,
            command_line=shlex.join(["lpx", *sys.argv[1:]]),
            exact=exact,
        )
        for replay_path in replay_paths
    ]
    if len(comparisons) == 1:
        report = comparisons[0].report
        written = write_outputs(comparisons[0], out_dir)["report"]
        summary = render_summary(report)
    else:
        report = write_matrix(comparisons, out_dir)
        written = out_dir / "report.json"
        summary = render_matrix(report)
    if not quiet:
        click.echo(summary)
    click.echo(f"verdict: {report['verdict'].upper()} -> {written}")
    click.get_current_context().exit(EXIT_PASS if report["verdict"] == "pass" else EXIT_REGRESSION)

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from pipeline.commands.options import OUTPUT_DIR, device_option
from pipeline.contracts.files import COMPARE_OUTPUTS, REPORT
from pipeline.errors import EXIT_PASS, EXIT_REGRESSION

if TYPE_CHECKING:
    from pipeline.contracts.calibration import Calibration


def compare_options(function):
    """The options `lpx compare` and `lpx diagnose` share."""
    options = [
        click.argument("fixture_path", type=click.Path(dir_okay=False, path_type=Path)),
        click.argument(
            "replay_paths", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path)
        ),
        click.option(
            "--out",
            "out_dir",
            required=True,
            type=OUTPUT_DIR,
            help="Directory for report.json, tokens.parquet and summary.md.",
        ),
        click.option(
            "--policy",
            "policy_path",
            type=click.Path(dir_okay=False, path_type=Path),
            help="Threshold policy YAML [default: the bundled one, docs/policy.md].",
        ),
        click.option(
            "--profile", help="Policy profile [default: the least precise dtype of the two sides]."
        ),
        click.option(
            "--channel",
            default="rollout",
            show_default=True,
            help="Fixture channel to compare: rollout, old, ref, current, rollout_raw, "
            "rollout_processed.",
        ),
        click.option(
            "--allow-weight-mismatch",
            is_flag=True,
            help="Compare even when the weight fingerprints differ (diagnoses stale weights).",
        ),
        click.option(
            "--calibration",
            "calibration_path",
            type=click.Path(dir_okay=False, path_type=Path),
            help="The model's noise floor (lpx calibrate) [default: calibration.json beside "
            "the replay, else beside the fixture, when there is one].",
        ),
        click.option(
            "--no-calibration", is_flag=True, help="Judge by the profile's constants even so."
        ),
        click.option(
            "--allow-calibration-mismatch",
            is_flag=True,
            help="Judge with a calibration measured on other weights than the fixture's, on "
            "purpose; the report records it.",
        ),
        click.option(
            "--no-verify",
            is_flag=True,
            help="Do not verify the findings by re-scoring. By default they are verified with "
            "the fixture's model when it is on this machine and its weights are the "
            "fixture's (or --model's); unverified findings stay plausible.",
        ),
        click.option(
            "--verify-budget",
            type=click.FloatRange(min=0, min_open=True),
            metavar="SECONDS",
            help="Start no new hypothesis after this many seconds of verification per "
            "comparison; the report lists what was not tried, and the findings it would have "
            "tested stay as the signatures said [default: no limit].",
        ),
        click.option(
            "--allow-model-mismatch",
            is_flag=True,
            help="Verify with --model even though its weights are not the fixture's (a stale "
            "checkpoint on purpose); the report records it.",
        ),
        click.option(
            "--exact",
            is_flag=True,
            help="Fail on any completion token whose float32 logprobs are not bitwise equal "
            "(for batch-invariant or true-on-policy stacks); the policy's limits still apply.",
        ),
        click.option(
            "--weights-store",
            type=click.Path(file_okay=False, path_type=Path),
            help="With --model: verify stale weights and version changes by re-scoring under "
            "this store's published versions (lpx weights publish).",
        ),
        device_option,
        click.option("--quiet", is_flag=True, help="Print only the verdict line."),
    ]
    for option in reversed(options):
        function = option(function)
    return function


@click.command(short_help="Compare replays with their fixture token by token.")
@compare_options
@click.option(
    "--model",
    "model_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Verify the findings by re-scoring their sequences with each hypothesised bug "
    "committed (see `lpx diagnose`) [default: the fixture's model, when it is on this "
    "machine with the fixture's weights].",
)
def compare(model_dir, **options):
    """Compare replays with their fixture token by token; write the report; exit with the verdict.

    Computes drift metrics (|d| tails, k1/k2/k3, IS ratio, ESS, clip fraction, NeMo-RL's
    token_mult_prob_error gates, per-sequence max/mean/sum, the bitwise-equal fraction, and
    forward/reverse KL over the rollout's top-k ids when both sides hold them), finds the
    worst tokens, tests semantic causes (off-by-one, mask/padding, position ids,
    temperature, dtype, stale weights) and applies the threshold policy; --exact also fails
    on any token that is not bitwise equal. With a calibration (lpx calibrate) the precision
    gate judges the drift against the model's measured noise at this token count (a false
    alarm rate of 1e-3 per comparison). Each finding is verified by reproducing it with the
    model (the fixture's, when it is on this machine with the fixture's weights; --model;
    --no-verify to skip): precision included, by re-scoring in the declared precisions.
    Exit 0 pass, 1 regression, 2 bad input. With several replays, each pair gets its own
    directory under --out and report.json/summary.md hold the matrix, a row per pair.

    \b
    Example:
      lpx compare run/fixture.parquet run/replay-bf16.parquet --out run/compare-bf16
      lpx compare run/fixture.parquet run/replay.parquet --profile float32 --out run/strict
      lpx compare run/fixture.parquet run/replay.parquet --model models/tiny --out run/checked
      lpx compare run/fixture.parquet run/replay-batch-invariant.parquet --exact --out run/exact
      lpx compare run/fixture.parquet run/hf.parquet run/fsdp.parquet run/megatron-tp2.parquet \\
          --out run/matrix
    """
    run_compare(model_dir=model_dir, **options)


@click.command(short_help="Compare, then verify each finding by reproducing it.")
@compare_options
@click.option(
    "--model",
    "model_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Model directory [default: the one recorded in the fixture].",
)
def diagnose(model_dir, **options):
    """Compare, then verify every finding by reproducing it with the model.

    Each hypothesis the signatures propose (a temperature, a truncation, an extra or missing
    BOS, a position offset from an onset, padding attended, labels off by one) is committed
    in the reference model and the affected sequences are re-scored: a finding is verified
    when one side then matches down to the noise floor, ruled out when it does not (its
    runner-up is tried next), and what nothing reproduces is unexplained, listing what was
    ruled out. Give a calibration (lpx calibrate) for the model's own floor.

    \b
    Example:
      lpx calibrate run/fixture.parquet --dtype bf16
      lpx diagnose run/fixture.parquet run/replay-bf16.parquet --out run/diagnosis
    """
    from pipeline.errors import BadInput
    from pipeline.fixture.io import read_table

    if options["no_verify"]:
        raise BadInput(
            "lpx diagnose --no-verify: diagnose is compare with every finding verified; use "
            "lpx compare --no-verify to skip verification."
        )
    if model_dir is None:
        fixture = read_table(options["fixture_path"], expect_kind="fixture")
        model_dir = (fixture.metadata.get("model") or {}).get("path")
        if not model_dir:
            raise BadInput(f"{options['fixture_path']}: records no model path; pass --model DIR.")
    run_compare(model_dir=Path(model_dir), **options)


def run_compare(
    fixture_path,
    replay_paths,
    out_dir,
    policy_path,
    profile,
    channel,
    allow_weight_mismatch,
    calibration_path,
    no_calibration,
    allow_calibration_mismatch,
    no_verify,
    verify_budget,
    allow_model_mismatch,
    exact,
    weights_store,
    device,
    quiet,
    model_dir=None,
):
    from pipeline.errors import BadInput
    from pipeline.paths import check_output, check_replaceable_in

    if calibration_path is not None and no_calibration:
        raise BadInput(
            f"--calibration {calibration_path} and --no-calibration contradict each other; give "
            "one of them."
        )
    if verify_budget is not None and no_verify:
        raise BadInput(
            f"--verify-budget {verify_budget:g} and --no-verify contradict each other: the "
            "budget limits verification; give one of them."
        )
    outputs = COMPARE_OUTPUTS
    for name in outputs:
        check_output(out_dir / name, [fixture_path, *replay_paths])
    check_replaceable_in(out_dir, outputs)
    from pipeline.compare.matrix import render_matrix, write_matrix
    from pipeline.compare.outputs import render_summary, retract_verdicts, write_outputs
    from pipeline.compare.policy import load_policy
    from pipeline.compare.run import CompareOptions, compare_tables
    from pipeline.fixture.io import read_table
    from pipeline.verify import needs_verifying, verify_report

    retract_verdicts(out_dir)
    fixture = read_table(fixture_path, expect_kind="fixture")  # once, however many replays
    if model_dir is not None and no_verify and "trajectories" not in fixture.metadata:
        # (a fixture of trajectories also takes its tokenizer from --model)
        raise BadInput(
            f"--model {model_dir} and --no-verify contradict each other: --model names the model "
            "that verifies the findings; give one of them."
        )
    policy = load_policy(policy_path)
    verifying = VerificationModel(fixture, fixture_path, model_dir, no_verify, allow_model_mismatch)
    if weights_store is not None:
        from pipeline.weights.layout import check_store

        if model_dir is None:
            raise BadInput(
                f"--weights-store {weights_store}: verification re-scores the reference model "
                "and the store's versions; add --model DIR (or run lpx diagnose)."
            )
        check_store(Path(weights_store))
    comparisons = []
    for replay_path in replay_paths:
        replay = read_table(replay_path, expect_kind="replay")
        calibration, source = find_calibration(
            calibration_path, no_calibration, [Path(replay_path).parent, Path(fixture_path).parent]
        )
        calibration_mismatch = None
        if calibration is not None:
            from pipeline.belonging import check_calibration

            calibration_mismatch = check_calibration(
                fixture.metadata, fixture_path, calibration, source, allow_calibration_mismatch
            )
        options = CompareOptions(
            policy=policy,
            profile=profile,
            channel=channel,
            allow_weight_mismatch=allow_weight_mismatch,
            command_line=shlex.join(["lpx", *sys.argv[1:]]),
            calibration=calibration,
            calibration_source=source,
            exact=exact,
            model_dir=Path(model_dir) if model_dir is not None else None,
        )
        comparison = compare_tables(fixture, replay, fixture_path, replay_path, options)
        if calibration_mismatch:
            comparison.report.calibration["mismatch_allowed"] = calibration_mismatch
        if needs_verifying(comparison.report.diagnosis):
            verified_with = verifying.resolve()
            if verified_with is not None:
                added = verify_report(
                    comparison.report,
                    fixture,
                    replay,
                    verified_with,
                    policy,
                    channel=channel,
                    calibration=calibration,
                    device=device,
                    say=lambda line: click.echo(line, err=True),
                    weights_store=weights_store,
                    budget_s=verify_budget,
                )
                comparison.report.verification = {**verifying.note, **(added or {})}
            else:
                comparison.report.verification = verifying.note
        else:
            comparison.report.verification = {
                "ran": False,
                "reason": "no finding that a re-score could decide",
            }
        comparisons.append(comparison)
    if len(comparisons) == 1:
        report = comparisons[0].report
        written = write_outputs(comparisons[0], out_dir)["report"]
        summary, verdict = render_summary(report), report.verdict
    else:
        matrix = write_matrix(comparisons, out_dir)
        written = out_dir / REPORT
        summary, verdict = render_matrix(matrix), matrix["verdict"]
    if not quiet:
        click.echo(summary)
    click.echo(f"verdict: {verdict.upper()} -> {written}")
    click.get_current_context().exit(EXIT_PASS if verdict == "pass" else EXIT_REGRESSION)


class VerificationModel:
    """The model that verifies a comparison's findings, found once and only when needed: an
    explicit --model (its weights must be the fixture's unless --allow-model-mismatch), else
    the fixture's own model when it is on this machine and still holds the fixture's weights
    (reading every weight file for the fingerprint costs time, so only when a finding needs
    it). ``note`` says what was used, or why nothing was, for report.json."""

    def __init__(self, fixture, fixture_path, model_dir, no_verify: bool, allow_mismatch: bool):
        from pipeline.belonging import check_model
        from pipeline.engines.model_dir import check_model_dir

        self.fixture, self.fixture_path = fixture, fixture_path
        self.model_dir, self.resolved = model_dir, False
        self.note: dict = {"ran": False, "reason": "--no-verify"} if no_verify else {}
        if model_dir is not None:  # an explicit model: checked now, a mismatch is exit 2
            check_model_dir(model_dir)
            allowed = check_model(fixture.metadata, fixture_path, Path(model_dir), allow_mismatch)
            self.note = {"ran": True, "model": str(model_dir), "source": "--model"}
            if allowed:
                self.note["model_mismatch_allowed"] = allowed
            self.resolved = True
        self.disabled = no_verify

    def resolve(self) -> Path | None:
        if self.disabled:
            return None
        if not self.resolved:
            self.model_dir, self.note = self._fixture_model()
            self.resolved = True
        return None if self.model_dir is None else Path(self.model_dir)

    def _fixture_model(self) -> tuple[Path | None, dict]:
        from pipeline.belonging import check_model
        from pipeline.errors import BadInput

        recorded = (self.fixture.metadata.get("model") or {}).get("path")
        if not recorded:
            return None, {
                "ran": False,
                "reason": "the fixture records no model path; pass --model DIR",
            }
        if not Path(recorded).is_dir():
            return None, {
                "ran": False,
                "reason": f"the fixture's model {recorded} is not on this machine; pass --model DIR",
            }
        try:
            check_model(self.fixture.metadata, self.fixture_path, Path(recorded), False)
        except BadInput as error:
            return None, {"ran": False, "reason": str(error)}
        return Path(recorded), {"ran": True, "model": recorded, "source": "the fixture's model"}


def find_calibration(
    given: Path | None, off: bool, beside: list[Path]
) -> tuple[Calibration | None, str]:
    """(the calibration, its path): the one given, else calibration.json in the first of
    ``beside`` that holds one, else none."""
    from pipeline.compare.calibrated import CALIBRATION_FILE, load_calibration

    if off:
        return None, ""
    if given is not None:
        return load_calibration(given), str(given)
    for folder in beside:
        candidate = folder / CALIBRATION_FILE
        if candidate.is_file():
            return load_calibration(candidate), str(candidate)
    return None, ""

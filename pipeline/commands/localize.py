from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from pipeline.commands.options import COUNT, device_option

if TYPE_CHECKING:
    from pipeline.contracts.report import Report


@click.command(short_help="Name the first layer and op where two engines part.")
@click.argument("fixture_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--a", "spec_a", required=True, metavar="SPEC",
              help="Side A: ENGINE[:knob=value,...], e.g. hf or vllm:dtype=bf16.")  # fmt: skip
@click.option("--b", "spec_b", required=True, metavar="SPEC",
              help="Side B, e.g. megatron:tensor_parallel_size=2,dtype=bf16.")  # fmt: skip
@click.option("--sequence", "sequence_ids", multiple=True, metavar="ID",
              help="A sequence to capture, repeatable [default: the worst of --report, else "
              "--sequences spread over the fixture].")  # fmt: skip
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path),
              help="A comparison's report.json of this fixture: capture its worst sequences.")  # fmt: skip
@click.option("--allow-report-mismatch", is_flag=True,
              help="Take --report although it compared another fixture (its sequences are "
              "picked by id); localize.json records it.")  # fmt: skip
@click.option("--sequences", "count", type=COUNT, default=4, show_default=True,
              help="How many sequences when none is named.")  # fmt: skip
@click.option("--model", "model_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Model directory [default: the one recorded in the fixture]; it must hold "
              "the weights the fixture was rolled out with.")  # fmt: skip
@click.option("--allow-model-mismatch", is_flag=True,
              help="Run --model although its weights are not the fixture's (a stale checkpoint, "
              "on purpose); localize.json records it.")  # fmt: skip
@click.option("--model-b", "model_dir_b", type=click.Path(file_okay=False, path_type=Path),
              help="Side B's model directory, when it holds other weights [default: --model].")  # fmt: skip
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="A folder for localize.json and summary.md.")  # fmt: skip
@click.option("--keep-captures", is_flag=True,
              help="Keep the captured rows (DIR/captures, one .npy per side, sequence and "
              "boundary) instead of deleting them at the end.")  # fmt: skip
@click.option("--exact", is_flag=True,
              help="For stacks meant to be bitwise equal: name the first boundary whose "
              "captures differ in any bit (and the first element that does); no floors.")  # fmt: skip
@click.option("--no-floor-cache", "no_floor_cache", is_flag=True,
              help="Measure both sides' floors afresh instead of taking them from (and keeping "
              "them in) the floor cache ($LPX_LOCALIZE_FLOOR_CACHE, else "
              "$LPX_CACHE/localize-floors, else ~/.cache/lpx/localize-floors).")  # fmt: skip
@device_option
def localize(
    fixture_path, spec_a, spec_b, sequence_ids, report_path, allow_report_mismatch, count,
    model_dir, allow_model_mismatch, model_dir_b, out_dir, keep_captures, exact,
    no_floor_cache, device,
) -> None:  # fmt: skip
    """Name the first layer and op where two engines part, and verify it by swapping.

    Both sides run the chosen sequences with every boundary captured (embeddings; each
    layer's input norm, q/k/v after RoPE, attention output, MLP input and output, router
    logits and chosen experts; the final norm; the logits). Each side also runs in a higher
    precision, which measures its precision floor at every boundary (kept in the floor cache
    for the next run over the same weights and sequences). A boundary is beyond when its
    drift exceeds the two floors (the level rule), or when its op's own drift, with every
    input forced to the other side's, exceeds the two local floors (the step rule). The
    first boundary beyond is `localized`; running side A with side B's activation (or
    weights) there and seeing everything downstream fall back within the floor makes it
    `verified`. With --exact the first boundary not bitwise equal is named instead. Writes
    DIR/localize.json and DIR/localize.svg (drift by layer).
    Exit 0 when nothing is beyond the floor, 1 when a boundary is.

    \b
    Example:
      lpx localize run/fixture.parquet --a hf --b vllm --out run/localize
      lpx localize run/fixture.parquet --a hf:dtype=bf16 \\
          --b megatron:tensor_parallel_size=2,dtype=bf16 \\
          --report run/compare/report.json --out run/localize
      lpx localize run/fixture.parquet --a fsdp:nproc=2 --b hf --exact --out run/localize
    """
    from pipeline.belonging import check_model, check_report
    from pipeline.devices import resolve_device
    from pipeline.engines.model_dir import check_model_dir
    from pipeline.errors import BadInput
    from pipeline.fixture.io import read_table
    from pipeline.localize.adapters import parse_spec
    from pipeline.localize.run import OUTPUTS, choose_sequences, write
    from pipeline.localize.run import localize as run_localize
    from pipeline.paths import check_replaceable_in

    if out_dir.exists() and not out_dir.is_dir():
        raise BadInput(f"--out {out_dir}: is a file; give a directory for localize.json.")
    check_replaceable_in(out_dir, OUTPUTS, "--out")
    _refuse_contradictions(click.get_current_context(), sequence_ids, report_path)
    for spec in (spec_a, spec_b):  # a malformed spec is refused before any model loads
        parse_spec(spec)
    fixture = read_table(fixture_path, expect_kind="fixture")
    option = "--model" if model_dir else "the fixture's model"
    model_dir = model_dir or (fixture.metadata.get("model") or {}).get("path")
    if not model_dir:
        raise BadInput(f"{fixture_path}: records no model path; pass --model DIR.")
    check_model_dir(Path(model_dir))
    if model_dir_b is not None:
        check_model_dir(model_dir_b)
    # Side B's --model-b holds other weights by design; --model runs the fixture's tokens
    # as the fixture's own model must, unless a mismatch is asked for.
    allowed = {
        "model": check_model(
            fixture.metadata, fixture_path, Path(model_dir), allow_model_mismatch, option
        )
    }
    report = _read_report(report_path) if report_path else None
    if report is not None:
        allowed["report"] = check_report(
            fixture, fixture_path, report, report_path, allow_report_mismatch
        )
    rows = choose_sequences(fixture, list(sequence_ids), report, count)
    result = run_localize(
        fixture,
        Path(model_dir),
        spec_a,
        spec_b,
        rows,
        out_dir,
        device=resolve_device(device),
        model_dir_b=model_dir_b,
        keep_captures=keep_captures,
        exact=exact,
        floor_cache=not no_floor_cache,
    )
    allowed = {what: record for what, record in allowed.items() if record is not None}
    if allowed:
        result["allowed_mismatches"] = allowed
    path = write(result, out_dir)
    click.echo(summary_line(result) + f" -> {path}")
    if result["verdict"] != "clean":
        raise SystemExit(1)


def summary_line(result: dict) -> str:
    first = result.get("first")
    head = (
        f"localize: {len(result['sequences'])} sequences, {result['tokens']} tokens, "
        f"{len(result['boundaries'])} boundaries in {result['seconds']:.1f} s"
    )
    if result.get("mode") == "exact":
        return head + ": " + _exact_summary(result)
    if first is None:
        worst = max(result["boundaries"], key=lambda r: r["ratio"], default=None)
        tail = f"; worst {worst['boundary']} at {worst['ratio']:.2g} x floor" if worst else ""
        return f"{head}: clean, nothing beyond the precision floor{tail}"
    line = f"{head}: {result['verdict']} at {first['boundary']} ({first['ratio']:.3g} x floor"
    local = first.get("local")
    if local and "step" in first.get("beyond_by", []):
        line += f"; its own step {local['ratio']:.3g} x the local floor"
    line += ")"
    verification = result.get("verification") or {}
    if verification.get("verified"):
        line += f"; verified by swapping {verification['by']}"
    elif verification:
        line += "; not verified by any swap (see localize.json)"
    return line


def _exact_summary(result: dict) -> str:
    first = result.get("first")
    if first is None:
        return "clean, every boundary bitwise equal"
    where = first.get("first_difference") or {}
    line = (
        f"{result['verdict']} at {first['boundary']}, the first boundary not bitwise equal "
        f"({first['differing']} of {first['elements']} elements differ; the first at sequence "
        f"{where.get('sequence_id')} position {where.get('position')} feature "
        f"{where.get('feature')}: {where.get('a')} vs {where.get('b')})"
    )
    verification = result.get("verification") or {}
    if verification.get("verified"):
        line += f"; verified by swapping {verification['by']}"
    elif verification:
        line += "; no swap made everything after it bitwise equal (see localize.json)"
    return line


def _refuse_contradictions(ctx, sequence_ids, report_path) -> None:
    """Options that choose the sequences in two ways: one would be silently ignored."""
    from click.core import ParameterSource

    from pipeline.errors import BadInput

    if sequence_ids and report_path is not None:
        raise BadInput(
            f"--sequence {sequence_ids[0]!r} and --report {report_path} both choose the "
            "sequences; pass one (--sequence names them, --report takes its worst)."
        )
    if sequence_ids and ctx.get_parameter_source("count") is not ParameterSource.DEFAULT:
        raise BadInput(
            f"--sequence {sequence_ids[0]!r} and --sequences {ctx.params['count']} both choose "
            "the sequences; pass one (--sequences counts them when none is named)."
        )


def _read_report(path: Path) -> Report:
    """A pair's report.json, checked as `lpx record` checks it: localize picks sequences by
    its per-sequence drift, so a damaged one is refused rather than half read."""
    from pydantic import ValidationError

    from pipeline.contracts.base import held_as_written
    from pipeline.contracts.problems import describe
    from pipeline.contracts.report import Report
    from pipeline.contracts.sequences import SequencesUnreadable, with_sequences
    from pipeline.errors import BadInput

    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        reason = " ".join(str(getattr(error, "strerror", None) or error).split())[:120]
        raise BadInput(f"--report {path}: cannot read it as JSON ({reason}).") from None
    if isinstance(report, dict) and "pairs" in report:
        raise BadInput(
            f"--report {path}: a matrix's report; pass one pair's report.json from the "
            "directory beside it (compare/PAIR/report.json)."
        )
    if not isinstance(report, dict):
        raise BadInput(f"--report {path}: not a comparison report (expected an object).")
    try:
        Report.model_validate(report)
    except ValidationError as error:
        raise BadInput(
            f"--report {path}: not a comparison report lpx can read: "
            f"{describe(error, count=3)}; rerun `lpx compare`."
        ) from None
    try:  # its per-sequence rows, from sequences.parquet or inline (an older report)
        return with_sequences(held_as_written(Report, report), path)
    except SequencesUnreadable as error:
        raise BadInput(f"--report {path}: {error}") from None

from __future__ import annotations

import json
from pathlib import Path

import click

from pipeline.commands.options import COUNT, device_option


@click.command()
@click.argument("fixture_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--a", "spec_a", required=True, metavar="SPEC",
              help="Side A: ENGINE[:knob=value,...], e.g. hf or vllm:dtype=bf16.")  # fmt: skip
@click.option("--b", "spec_b", required=True, metavar="SPEC",
              help="Side B, e.g. megatron:tp=2,dtype=bf16.")  # fmt: skip
@click.option("--sequence", "sequence_ids", multiple=True, metavar="ID",
              help="A sequence to capture, repeatable [default: the worst of --report, else "
              "--sequences spread over the fixture].")  # fmt: skip
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path),
              help="A comparison's report.json: capture its worst sequences.")  # fmt: skip
@click.option("--sequences", "count", type=COUNT, default=4, show_default=True,
              help="How many sequences when none is named.")  # fmt: skip
@click.option("--model", "model_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Model directory [default: the one recorded in the fixture].")  # fmt: skip
@click.option("--model-b", "model_dir_b", type=click.Path(file_okay=False, path_type=Path),
              help="Side B's model directory, when it holds other weights [default: --model].")  # fmt: skip
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--keep-captures", is_flag=True,
              help="Keep the captured rows (DIR/captures, one .npy per side, sequence and "
              "boundary) instead of deleting them at the end.")  # fmt: skip
@device_option
def localize(
    fixture_path, spec_a, spec_b, sequence_ids, report_path, count, model_dir, model_dir_b,
    out_dir, keep_captures, device,
) -> None:  # fmt: skip
    """Name the first layer and op where two engines part, and verify it by swapping.

    Both sides run the chosen sequences with every boundary captured (embeddings; each
    layer's input norm, q/k/v after RoPE, attention output, MLP input and output, router
    logits and chosen experts; the final norm; the logits). Each side also runs in a higher
    precision, which measures its precision floor at every boundary. The first boundary whose
    drift exceeds the two floors is `localized`; running side A with side B's activation
    (or weights) there and seeing everything downstream fall back within the floor makes it
    `verified`. Writes DIR/localize.json and DIR/localize.svg (drift by layer).
    Exit 0 when nothing is beyond the floor, 1 when a boundary is.

    \b
    Example:
      lpx localize run/fixture.parquet --a hf --b vllm --out run/localize
      lpx localize run/fixture.parquet --a hf:dtype=bf16 --b megatron:tp=2,dtype=bf16 \\
          --report run/compare/report.json --out run/localize
    """
    from pipeline.devices import resolve_device
    from pipeline.engines.model_dir import check_model_dir
    from pipeline.errors import BadInput
    from pipeline.fixture.io import read_table
    from pipeline.localize.run import choose_sequences, write
    from pipeline.localize.run import localize as run_localize

    if out_dir.exists() and not out_dir.is_dir():
        raise BadInput(f"--out {out_dir}: is a file; give a directory for localize.json.")
    fixture = read_table(fixture_path, expect_kind="fixture")
    model_dir = model_dir or (fixture.metadata.get("model") or {}).get("path")
    if not model_dir:
        raise BadInput(f"{fixture_path}: records no model path; pass --model DIR.")
    check_model_dir(Path(model_dir))
    if model_dir_b is not None:
        check_model_dir(model_dir_b)
    report = _read_report(report_path) if report_path else None
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
    )
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
    if first is None:
        worst = max(result["boundaries"], key=lambda r: r["ratio"], default=None)
        tail = f"; worst {worst['boundary']} at {worst['ratio']:.2g} x floor" if worst else ""
        return f"{head}: clean, nothing beyond the precision floor{tail}"
    line = f"{head}: {result['verdict']} at {first['boundary']} ({first['ratio']:.3g} x floor)"
    verification = result.get("verification") or {}
    if verification.get("verified"):
        line += f"; verified by swapping {verification['by']}"
    elif verification:
        line += "; not verified by any swap (see localize.json)"
    return line


def _read_report(path: Path) -> dict:
    from pipeline.errors import BadInput

    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise BadInput(f"--report {path}: cannot read it as JSON ({error}).") from None
    if not isinstance(report, dict):
        raise BadInput(f"--report {path}: not a comparison report (expected an object).")
    return report

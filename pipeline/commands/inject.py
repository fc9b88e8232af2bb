from __future__ import annotations

from pathlib import Path

import click

from pipeline.commands.options import NON_NEGATIVE, OUTPUT_FILE
from pipeline.inject import FAULT_KINDS


@click.command()
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--kind", required=True, type=click.Choice(FAULT_KINDS))
@click.option("--sequence", "sequence_id", required=True, help="Sequence id to fault.")
@click.option(
    "--from-position",
    type=NON_NEGATIVE,
    default=0,
    show_default=True,
    help="First completion position the fault affects.",
)
@click.option("--out", "out_path", required=True, type=OUTPUT_FILE)
@click.option(
    "--model",
    "model_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="For position_ids, temperature, stale_weights [default: the recorded model].",
)
def inject(path, kind, sequence_id, from_position, out_path, model_dir) -> None:
    """Write a copy of a fixture (or replay) with one planted fault, to prove compare catches it.

    \b
    Kinds:
      token_shift    logprobs shifted by one token (off-by-one)
      mask           the pad fill value 0.0 where tokens are active (mask/padding bug)
      position_ids   re-scored with position ids offset by +16 (model re-run)
      temperature    processed logprobs at temperature 0.7 (model re-run)
      dtype          logprobs rounded to bfloat16
      stale_weights  re-scored with perturbed (older) weights, tokens tagged with the older
                     weight_version (model re-run)

    \b
    Example:
      lpx inject run/fixture.parquet --kind token_shift --sequence 3-0 --from-position 5 \\
          --out run/fixture-shifted.parquet
      lpx compare run/fixture-shifted.parquet run/replay.parquet --out run/shifted   # exits 1
    """
    from pipeline.paths import check_output

    check_output(out_path, [path])
    from pipeline.fixture.io import read_table, write_table
    from pipeline.inject import inject_fault

    table = read_table(path)
    faulted = inject_fault(table, kind, sequence_id, from_position, model_dir)
    write_table(faulted, out_path)
    click.echo(
        f"injected {kind} into sequence {sequence_id} from position {from_position} -> {out_path}"
    )

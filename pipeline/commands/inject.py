from __future__ import annotations

from pathlib import Path

import click

from pipeline.commands.options import NON_NEGATIVE, OUTPUT_FILE, device_option, dtype_option
from pipeline.faults.inject import FAULT_KINDS


@click.command(short_help="Copy a fixture with a planted fault for compare to catch.")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--kind",
    required=True,
    type=click.Choice(FAULT_KINDS),
    help="The fault to plant (docs/compare.md lists what each one does).",
)
@click.option(
    "--sequence",
    "sequence_ids",
    required=True,
    multiple=True,
    help="Sequence id to fault; repeat for several, or `all`.",
)
@click.option(
    "--from-position",
    type=NON_NEGATIVE,
    default=0,
    show_default=True,
    help="First completion position the fault affects (kinds with an onset).",
)
@click.option(
    "--out", "out_path", required=True, type=OUTPUT_FILE, help="The faulted fixture to write."
)
@click.option(
    "--model",
    "model_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="For the kinds that re-score with the model [default: the recorded model].",
)
@dtype_option(
    "Model kinds: the precision the bug is re-scored in (a bf16 engine's bug carries "
    "bf16 noise too)."
)
@device_option
def inject(path, kind, sequence_ids, from_position, out_path, model_dir, dtype, device) -> None:
    """Write a copy of a fixture (or replay) with a planted fault, to prove compare catches it.

    \b
    Data kinds (the logprobs edited):
      token_shift    logprobs shifted by one token (off-by-one)
      mask           the pad fill value 0.0 where tokens are active
      dtype          logprobs rounded to bfloat16
      noise          Gaussian noise of 1e-3 on every token alike (no precision does that)
    Model kinds (re-scored by the real model under the bug; docs/compare.md#the-fault-zoo):
      pad_attended, mask_dropped, pad_positions, packed_no_reset, positions_restart,
      position_ids, label_shift, bos_extra, bos_missing, prompt_truncated, temperature,
      top_k, top_p, top_k_top_p, stale_weights, version_change,
      version_change_unrecorded, lm_head_bf16, bf16, fp16

    \b
    Example:
      lpx inject run/fixture.parquet --kind token_shift --sequence 3-0 --from-position 5 \\
          --out run/fixture-shifted.parquet
      lpx inject run/fixture.parquet --kind pad_attended --sequence all --out run/padded.parquet
      lpx compare run/fixture-shifted.parquet run/replay.parquet --out run/shifted   # exits 1
    """
    from pipeline.paths import check_output

    check_output(out_path, [path])
    from pipeline.faults.inject import inject_fault
    from pipeline.fixture.io import read_table, write_table
    from pipeline.names import canonical_dtype

    table = read_table(path)
    chosen = "all" if "all" in sequence_ids else list(sequence_ids)
    dtype = canonical_dtype(dtype)  # --dtype is one of its spellings (a click.Choice)
    faulted = inject_fault(
        table, kind, chosen, from_position, model_dir, device=device, dtype=dtype
    )
    write_table(faulted, out_path)
    where = "every sequence" if chosen == "all" else f"sequence {', '.join(chosen)}"
    click.echo(f"injected {kind} into {where} from position {from_position} -> {out_path}")

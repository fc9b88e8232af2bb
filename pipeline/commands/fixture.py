from __future__ import annotations

import json
from pathlib import Path

import click
import numpy as np

from pipeline.commands.options import COUNT


@click.group()
def fixture() -> None:
    """Inspect fixtures and replays."""


@fixture.command("show", short_help="Summarise a fixture or replay: schema, metadata, sequences.")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--sequence", "sequence_id", help="Show this sequence token by token.")
@click.option("--limit", type=COUNT, default=10, show_default=True, help="Sequences to list.")
@click.option("--json", "as_json", is_flag=True, help="Print the metadata as JSON.")
def show(path: Path, sequence_id: str | None, limit: int, as_json: bool) -> None:
    """Summarise a fixture or replay: schema, metadata, channels, sequences.

    \b
    Example:
      lpx fixture show run/fixture.parquet
      lpx fixture show run/fixture.parquet --sequence 3-0
    """
    from pipeline.errors import BadInput
    from pipeline.fixture.io import read_table
    from pipeline.text import for_terminal

    table = read_table(path)
    if as_json:
        click.echo(json.dumps(table.metadata, indent=1))
        return
    meta = table.metadata
    engine = meta.get("engine") or {}
    model = meta.get("model") or {}
    click.echo(f"{path}: lpx {table.kind}, schema_version 1")
    click.echo(
        f"  engine     {for_terminal(engine.get('name') or '?')} "
        f"({for_terminal(engine.get('role') or '?')}), dtype {meta.get('dtype') or '?'}"
    )
    click.echo(
        f"  model      {for_terminal(model.get('path') or '?')}  "
        f"weights {for_terminal((model.get('weights_fingerprint') or '?')[:23])}"
    )
    click.echo(
        f"  sequences  {table.num_sequences}, completion tokens {table.num_completion_tokens} "
        f"({int(table.completion_mask.sum())} active), prompt tokens {len(table.prompt_ids)}"
    )
    click.echo(
        f"  channels   {', '.join(table.channels) or 'none'}"
        f"{', prompt_logprobs' if table.prompt_logprobs is not None else ''}"
        f"{', weight_version' if table.weight_versions is not None else ''}"
    )
    if meta.get("sampling"):
        click.echo(f"  sampling   {json.dumps(meta['sampling'])}")
    if meta.get("knobs"):
        click.echo(f"  knobs      {json.dumps(meta['knobs'])}")
    if sequence_id is None:
        click.echo(
            "  sequence_id  prompt  completion  " + "  ".join(f"mean {c}" for c in table.channels)
        )
        for i in range(min(limit, table.num_sequences)):
            span = table.completion_slice(i)
            means = "  ".join(
                f"{float(np.mean(v[span])) if span.stop > span.start else float('nan'):.4f}"
                for v in table.channels.values()
            )
            click.echo(
                f"  {for_terminal(table.sequence_ids[i]):<12} {len(table.prompt_of(i)):>6}  {span.stop - span.start:>10}  {means}"
            )
        return
    index = table.index_of().get(sequence_id)
    if index is None:
        raise BadInput(f"{path}: no sequence {sequence_id!r}.")
    span = table.completion_slice(index)
    click.echo(
        f"sequence {for_terminal(sequence_id)}: prompt ids {table.prompt_of(index).tolist()}"
    )
    click.echo("  position  token  mask  " + "  ".join(f"{c:>12}" for c in table.channels))
    for position, flat in enumerate(range(span.start, span.stop)):
        values = "  ".join(f"{float(v[flat]):>12.6f}" for v in table.channels.values())
        click.echo(
            f"  {position:>8}  {int(table.completion_ids[flat]):>5}  {int(table.completion_mask[flat]):>4}  {values}"
        )

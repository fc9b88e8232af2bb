from __future__ import annotations

from pathlib import Path

import click

from pipeline.commands.options import OUTPUT_DIR
from pipeline.families import families


@click.command("make-model", short_help="Build a tiny deterministic model + tokenizer, offline.")
@click.argument("out_dir", type=OUTPUT_DIR)
@click.option(
    "--arch",
    type=click.Choice(list(families())),
    default="llama",
    show_default=True,
    help="Model family: its config, layer layout and (MoE) routers.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Same seed, same bytes.")
def make_model(out_dir: Path, arch: str, seed: int) -> None:
    """Build a tiny deterministic causal LM + tokenizer in OUT_DIR, offline.

    It is trained for a few seconds on text shipped with lpx, so its next-token
    distributions are peaked like a real LM's. Same arch and seed give the same bytes.
    Hugging Face `AutoModelForCausalLM`/`AutoTokenizer` and vLLM load the directory.
    OUT_DIR must be new, empty, or a model lpx built before; it is written whole or not at all.
    A build is kept in $LPX_MODEL_CACHE [default: $LPX_CACHE/models/built] by its arch, seed,
    builder and libraries, and the same build again is a copy; LPX_MODEL_CACHE=off trains
    every time.

    \b
    Example:
      lpx make-model models/tiny-qwen2 --arch qwen2 --seed 1
    """
    from pipeline.tinymodel.build import install_tiny_model

    install_tiny_model(out_dir, arch=arch, seed=seed)
    click.echo(f"wrote tiny {arch} model (seed {seed}) to {out_dir}")

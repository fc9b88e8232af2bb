from __future__ import annotations

import click

from pipeline.commands.options import (
    COUNT,
    OUTPUT_DIR,
    TEMPERATURE,
    engine_option,
    model_and_prompts_options,
)
from pipeline.errors import EXIT_PASS, EXIT_REGRESSION
from pipeline.plugins import ROLLOUT


@click.command(short_help="Roll out under several knob settings, each vs the first.")
@engine_option(ROLLOUT, "vllm", "Rollout engine.")
@model_and_prompts_options
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=OUTPUT_DIR,
    help="A folder: one fixture and comparison per setting.",
)
@click.option(
    "--setting",
    "settings",
    multiple=True,
    required=True,
    metavar="NAME:KNOB=VALUE,...",
    help="A knob setting, repeatable; the first is the baseline.",
)
@click.option(
    "--max-tokens", type=COUNT, default=32, show_default=True, help="Completion tokens per sample."
)
@click.option("--temperature", type=TEMPERATURE, default=1.0, show_default=True, help="0 = greedy.")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed (per request).")
@click.option(
    "-n",
    "--samples-per-prompt",
    type=COUNT,
    default=1,
    show_default=True,
    help="Completions per prompt.",
)
def sweep(
    engine,
    model_dir,
    prompts_path,
    out_dir,
    settings,
    max_tokens,
    temperature,
    seed,
    samples_per_prompt,
):
    """Roll out the same prompts under several knob settings; compare each with the first.

    Loads the model as few times as the engine allows (vLLM: once per distinct
    engine-level setting; batch_size and top_logprobs reuse the loaded engine; SGLang: one
    server per distinct server-level setting). Every knob is read back from the engine:
    a setting whose knob the engine did not apply fails, naming it. Writes
    fixture-NAME.parquet and compare-NAME/ per setting and sweep.json; exits 1 when any
    setting breaks the policy against the baseline or was not applied.

    \b
    Example (batch size 1 vs all, prefix caching off, small prefill chunks):
      lpx sweep --engine vllm --model models/tiny --prompts prompts.txt -n 4 --out run/sweep \\
          --setting baseline: --setting batch1:batch_size=1 \\
          --setting no-prefix-cache:enable_prefix_caching=false \\
          --setting chunk16:enable_chunked_prefill=true,max_num_batched_tokens=16
      lpx sweep --engine sglang --model models/tiny --prompts prompts.txt --out run/sweep \\
          --setting baseline: --setting no-radix:radix_cache=false \\
          --setting chunk64:chunked_prefill_size=64
    """
    from pipeline.engines import rollout_engine
    from pipeline.engines.base import SamplingParams
    from pipeline.flows.sweep import parse_setting, run_sweep
    from pipeline.prompts import load_prompts

    parsed = [parse_setting(s) for s in settings]
    prompts = load_prompts(prompts_path, model_dir)
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        samples_per_prompt=samples_per_prompt,
    )
    rolling = rollout_engine(engine)
    if hasattr(rolling, "log_dir"):  # an engine with servers of its own keeps their logs
        rolling.log_dir = out_dir / "logs"
    rows = run_sweep(rolling, model_dir, prompts, sampling, parsed, out_dir)
    click.echo(
        f"{'setting':<20} {'verdict':<8} {'tokens':>7} {'max|d|':>10} {'mean|d|':>10} diverged"
    )
    for row in rows:
        if row["baseline"]:
            click.echo(f"{row['setting']:<20} baseline")
            continue
        click.echo(
            f"{row['setting']:<20} {row['verdict']:<8} {row['tokens_compared']:>7} "
            f"{row['max_abs_diff']:>10.3g} {row['mean_abs_diff']:>10.3g} {len(row['diverged_sequences'])}"
        )
    label = {"sglang": "SGLang", "vllm": "vLLM"}.get(engine, engine)
    for row in rows:
        for knob, values in row["knobs_not_applied"].items():
            click.echo(
                f"{row['setting']}: {label} did not apply {knob}={values['requested']} "
                f"(runs {values['applied']})"
            )
    failed = any(row.get("verdict") == "fail" or row["knobs_not_applied"] for row in rows)
    click.get_current_context().exit(EXIT_REGRESSION if failed else EXIT_PASS)

from __future__ import annotations

import click

from pipeline.commands.options import (
    COUNT,
    NON_NEGATIVE,
    OUTPUT_FILE,
    TEMPERATURE,
    TOP_P,
    device_knobs,
    device_option,
    dtype_option,
    engine_option,
    knob_options,
    model_and_prompts_options,
    parse_knobs,
)
from pipeline.plugins import ROLLOUT


@click.command(short_help="Sample completions from a rollout engine; write a fixture.")
@engine_option(ROLLOUT, "hf", "Rollout engine.")
@model_and_prompts_options
@click.option(
    "--out", "out_path", required=True, type=OUTPUT_FILE, help="The fixture to write (.parquet)."
)
@click.option(
    "--max-tokens", type=COUNT, default=32, show_default=True, help="Completion tokens per sample."
)
@click.option("--temperature", type=TEMPERATURE, default=1.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=NON_NEGATIVE, default=0, show_default=True, help="0 = off.")
@click.option(
    "--top-p", type=TOP_P, default=1.0, show_default=True, help="Nucleus sampling; 1 = off."
)
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed (per request).")
@click.option(
    "-n",
    "--samples-per-prompt",
    type=COUNT,
    default=1,
    show_default=True,
    help="Completions per prompt (a GRPO group).",
)
@click.option("--ignore-eos", is_flag=True, help="Always generate --max-tokens tokens.")
@click.option(
    "--logprobs-mode",
    type=click.Choice(["raw", "processed"]),
    default="raw",
    show_default=True,
    help="Which logprob the `rollout` channel holds: of the model's distribution, or of the "
    "one sampled from (after temperature/top-k/top-p). The other is kept too.",
)
@click.option(
    "--agent-turns",
    type=NON_NEGATIVE,
    default=0,
    show_default=True,
    help="Run a multi-turn agent loop of this many model turns per trajectory against lpx's "
    "offline tool environment (0 = one completion per prompt). --max-tokens is per turn.",
)
@click.option(
    "--agent-mode",
    type=click.Choice(["tito", "messages"]),
    default="tito",
    show_default=True,
    help="tito: each turn's context is the previous turns' ids; messages: the conversation "
    "re-rendered through the chat template and re-tokenized every turn.",
)
@click.option(
    "--agent-render",
    type=click.Choice(["engine", "lpx"]),
    default="engine",
    show_default=True,
    help="messages mode: engine renders each turn through the rollout engine's own chat path "
    "(vLLM's LLM.chat, SGLang's /v1/chat/completions) where it has one; lpx renders with "
    "transformers (HF and engines without a chat path always do).",
)
@click.option(
    "--agent-think/--agent-no-think",
    default=True,
    show_default=True,
    help="Each model turn a <think> block, opened after the generation prompt.",
)
@dtype_option()
@device_option
@knob_options
def rollout(
    engine,
    model_dir,
    prompts_path,
    out_path,
    max_tokens,
    temperature,
    top_k,
    top_p,
    seed,
    samples_per_prompt,
    ignore_eos,
    logprobs_mode,
    agent_turns,
    agent_mode,
    agent_render,
    agent_think,
    dtype,
    device,
    knob_pairs,
) -> None:
    """Sample completions for token-id prompts and write a fixture.

    The fixture records the sampled tokens, their logprobs, and every knob as the engine
    applied it (dtype, sampling, seed), with weight and tokenizer fingerprints.

    \b
    Example:
      lpx rollout --model models/tiny --prompts prompts.txt --temperature 0.7 \\
          --logprobs-mode processed -n 4 --out run/fixture.parquet
      lpx rollout --model models/tiny --prompts prompts.txt --device cuda:1 \\
          --set batch_size=64 --out run/fixture.parquet
      lpx rollout --model models/tiny --prompts prompts.txt --agent-turns 4 \\
          --max-tokens 16 --out run/agent.parquet
    """
    from pipeline.paths import check_output

    check_output(out_path, [prompts_path])
    from pipeline.engines import rollout_engine
    from pipeline.engines.base import SamplingParams, dropped_numerics
    from pipeline.engines.model_dir import check_model_dir
    from pipeline.errors import BadInput
    from pipeline.fixture.io import write_table
    from pipeline.prompts import load_prompts

    check_model_dir(model_dir)
    rollout_with = rollout_engine(engine)
    if hasattr(rollout_with, "log_dir"):  # an engine with a server of its own keeps its log
        rollout_with.log_dir = out_path.with_name(out_path.stem + ".logs")
    knobs = {
        "dtype": dtype,
        **device_knobs(rollout_with, engine, device),
        **parse_knobs(knob_pairs),
    }
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        samples_per_prompt=samples_per_prompt,
        ignore_eos=ignore_eos,
        logprobs_mode=logprobs_mode,
    )
    if agent_turns:
        from pipeline.prompts import load_prompt_texts
        from pipeline.trajectory.agent_loop import LoopSettings, agent_rollout

        settings = LoopSettings(
            turns=agent_turns,
            mode=agent_mode,
            think=agent_think,
            env_seed=seed,
            render=agent_render,
        )
        texts = load_prompt_texts(prompts_path)
        table = agent_rollout(rollout_with, model_dir, texts, sampling, knobs, settings)
    else:
        table = rollout_with.rollout(
            model_dir, load_prompts(prompts_path, model_dir), sampling, knobs
        )
    write_table(table, out_path)
    click.echo(
        f"{engine} rollout: {table.num_sequences} sequences, {table.num_completion_tokens} "
        f"completion tokens -> {out_path}"
    )
    dropped = dropped_numerics(table.metadata, engine)
    if dropped:  # written as it ran (its numerics read back), and refused as asked
        raise BadInput(
            f"{dropped}; {out_path} records the numerics it ran with. Set what this engine "
            "build runs (docs/reduced-precision.md), or drop the knob."
        )

from __future__ import annotations

import os
from pathlib import Path

import click

from pipeline.commands.options import (
    COUNT,
    OUTPUT_FILE,
    RANKS,
    REPLAY_TEMPERATURE,
    device_knobs,
    device_option,
    dtype_option,
    engine_option,
    knob_options,
    parse_knobs,
)
from pipeline.plugins import SCORING


@click.command(short_help="Teacher-force a fixture's tokens through a scoring engine.")
@click.argument("fixture_path", type=click.Path(dir_okay=False, path_type=Path))
@engine_option(SCORING, "hf", "Scoring engine.")
@click.option(
    "--model",
    "model_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Model directory [default: the one recorded in the fixture].",
)
@click.option(
    "--weights-store",
    "weights_store",
    type=click.Path(file_okay=False, path_type=Path),
    help="Score each completion token under the weight version the fixture records for it, "
    "loading every needed version from this store (lpx weights publish) once.",
)
@click.option(
    "--check-claims/--no-check-claims",
    default=True,
    show_default=True,
    help="With --weights-store: also score each sequence under the versions next to the ones "
    "it claims, so compare can name a fleet that served another version than it claims.",
)
@click.option(
    "--out", "out_path", required=True, type=OUTPUT_FILE, help="The replay to write (.parquet)."
)
@dtype_option()
@click.option(
    "--micro-batch-size",
    type=COUNT,
    default=8,
    show_default=True,
    help="Sequences per forward (a training step's micro-batch).",
)
@click.option(
    "--temperature",
    type=REPLAY_TEMPERATURE,
    default=1.0,
    show_default=True,
    help="Divide logits by this before log-softmax (to match processed rollout logprobs).",
)
@click.option("--prompt-logprobs", is_flag=True, help="Also score prompt tokens.")
@click.option(
    "--nproc",
    type=RANKS,
    default=1,
    show_default=True,
    help="Ranks for distributed engines (fsdp, deepspeed, megatron); lpx starts them "
    "(torchrun on CUDA, forked warm on the CPU). "
    "On CUDA one rank per GPU; auto = every visible GPU (1 on the CPU).",
)
@device_option
@click.option(
    "--rank-logs",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where each rank of a distributed engine writes its log [default: OUT's name with "
    "`.logs` beside it].",
)
@knob_options
def replay(
    fixture_path,
    engine,
    model_dir,
    weights_store,
    check_claims,
    out_path,
    dtype,
    micro_batch_size,
    temperature,
    prompt_logprobs,
    nproc,
    device,
    rank_logs,
    knob_pairs,
) -> None:
    """Teacher-force the fixture's exact tokens through a scoring engine; write a replay.

    Engines: hf, vllm, sglang, fsdp, deepspeed, megatron, logprob-server (an `lpx serve`
    endpoint), and any plug-in; `lpx engines` lists each one's knobs and their defaults,
    docs/engines.md says what they do. hf/fsdp/deepspeed knobs (--set): padding_side=right|left, packing=true|false, attn_implementation=sdpa|eager,
    lm_head_fp32=true|false (hf), top_k=N, top_p=P, allow_tf32=true|false (TF32 matmuls in
    fp32 on CUDA; off unless asked), router_replay=true|false (MoE: route every position
    to the fixture's recorded experts, R3; also megatron); fsdp: reduce_dtype; deepspeed:
    zero_stage=0..3; megatron: tensor_parallel_size=N, expert_model_parallel_size=N.
    Distributed engines run on --nproc ranks, one per GPU
    on CUDA (lpx starts them: torchrun on CUDA, forked from a warm interpreter on the CPU;
    under an existing torchrun launch it uses that one); each rank's log is kept under
    --rank-logs.

    \b
    Example:
      lpx replay run/fixture.parquet --dtype bf16 --set lm_head_fp32=true \\
          --set padding_side=left --out run/replay-bf16.parquet
      lpx replay run/fixture.parquet --engine megatron --nproc 2 \\
          --set tensor_parallel_size=2 --out run/replay-megatron-tp2.parquet
      lpx replay run/fixture.parquet --engine fsdp --nproc auto --device cuda \\
          --dtype bf16 --out run/replay-fsdp-bf16.parquet
      lpx replay run/fixture.parquet --weights-store /shared/weights \\
          --out run/replay-by-version.parquet
    """
    from pipeline.paths import check_output

    check_output(out_path, [fixture_path])
    from pipeline.engines import scoring_engine
    from pipeline.engines.base import dropped_numerics
    from pipeline.engines.distributed import (
        DistributedScoringEngine,
        leave_rank,
        run_worker,
        under_launcher,
    )
    from pipeline.engines.model_dir import check_model_dir
    from pipeline.errors import BadInput
    from pipeline.fixture.io import read_table, validate_table, write_table

    fixture = read_table(fixture_path, expect_kind="fixture")
    if weights_store is not None:
        if model_dir is not None:
            raise BadInput(
                "--model and --weights-store both name the weights; pass one: the store "
                "gives each token its own version."
            )
        model_dir = weights_store
    model_dir = model_dir or (fixture.metadata.get("model") or {}).get("path")
    if not model_dir:
        raise BadInput(f"{fixture_path}: records no model path; pass --model DIR.")
    if weights_store is None:
        check_model_dir(model_dir)
    validate_table(fixture, fixture_path, (fixture.metadata.get("model") or {}).get("vocab_size"))
    if weights_store is None:
        _check_routing_fits(fixture, fixture_path, Path(model_dir))
    scorer = scoring_engine(engine)
    knobs = {
        "dtype": dtype,
        "micro_batch_size": micro_batch_size,
        "temperature": temperature,
        "prompt_logprobs": prompt_logprobs,
        **device_knobs(scorer, engine, device),
        **parse_knobs(knob_pairs),
    }
    if isinstance(scorer, DistributedScoringEngine):
        if under_launcher():  # started by the user's torchrun/deepspeed: this is one rank
            if weights_store is not None:
                raise BadInput(
                    "--weights-store starts one launch per version itself; run it without "
                    "torchrun, with --nproc."
                )
            run_worker(engine, fixture_path, Path(model_dir), out_path, knobs)
            if os.environ.get("RANK") == "0":
                click.echo(f"{engine} replay -> {out_path}")
            # a finished rank of the user's launch ends as lpx's own ranks do: the
            # interpreter's teardown aborted one now and then (SIGABRT, "terminate called
            # without an active exception": the launch failed after the replay was written)
            leave_rank(0)
        knobs["nproc"] = nproc
        scorer.log_dir = rank_logs or out_path.with_name(out_path.stem + ".logs")
    elif nproc not in (1, "auto"):
        raise BadInput(
            f"engine {engine!r} is not distributed; --nproc applies to fsdp, deepspeed, megatron."
        )
    if hasattr(scorer, "log_dir") and scorer.log_dir is None:  # a server of its own: its log
        scorer.log_dir = rank_logs or out_path.with_name(out_path.stem + ".logs")
    if weights_store is not None:
        from pipeline.weights.multi_version import missing_summary, replay_by_version

        table = replay_by_version(
            fixture,
            weights_store,
            lambda sub, version_dir: scorer.score(sub, version_dir, knobs),
            check_claims=check_claims,
            say=lambda line: click.echo(f"{engine} replay, {line}", err=True),
        )
        warning = missing_summary(table)
        if warning:
            click.echo(f"warning: {warning}", err=True)
    else:
        table = scorer.score(fixture, Path(model_dir), knobs)
    write_table(table, out_path)
    click.echo(
        f"{engine} replay ({table.metadata.get('dtype')}): {table.num_sequences} sequences, "
        f"{table.num_completion_tokens} completion tokens -> {out_path}"
    )
    config_read = config_warning(fixture.metadata, table.metadata, fixture_path)
    if config_read:
        click.echo(f"warning: {config_read}", err=True)
    dropped = dropped_numerics(table.metadata, engine)
    if dropped:  # written as it ran (its numerics read back), and refused as asked
        raise BadInput(
            f"{dropped}; {out_path} records the numerics it ran with. Set what this engine "
            "build runs (docs/reduced-precision.md), or drop the knob."
        )


def _check_routing_fits(fixture, fixture_path: Path, model_dir: Path) -> None:
    """Refuse a fixture whose MoE routing the model cannot have made (exit 2): no engine's
    replay could use it, and a replay that dropped it silently would pass for a fair one."""
    import json

    from pipeline.errors import BadInput
    from pipeline.routing import routing_misfit

    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # check_model_dir has said what it needs; an engine reads it its own way
    misfit = routing_misfit(fixture, config, str(model_dir)) if isinstance(config, dict) else None
    if misfit:
        recorded = (fixture.metadata.get("model") or {}).get("path") or "DIR"
        raise BadInput(
            f"{fixture_path} {misfit}: it is not the model that rolled this fixture out; "
            f"replay it against the MoE model it came from (--model {recorded})."
        )


def config_warning(fixture_meta: dict, replay_meta: dict, fixture_path) -> str | None:
    """One line where the replay computed with another model config than the rollout
    recorded (a model directory with another config.json, an engine's overrides)."""
    from pipeline.compare.config_evidence import recorded_differences
    from pipeline.model_config import described

    differences = recorded_differences(fixture_meta, replay_meta)
    if not differences:
        return None
    return (
        f"this replay read the model config differently from the rollout in {fixture_path}: "
        f"{described(differences)}; both are recorded, and lpx compare names the difference "
        "(model_config). Replay with the rollout's config.json if it was not on purpose."
    )

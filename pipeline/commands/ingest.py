from __future__ import annotations

from pathlib import Path

import click

from pipeline.commands.options import OUTPUT_FILE, dtype_option
from pipeline.fixture.presets import PRESETS


def _message_logs():
    from pipeline.trajectory.message_log import read_message_logs

    return read_message_logs


def _train_data():
    from pipeline.trajectory.nemo_train import read_train_data

    return read_train_data


# presets whose dumps are not one JSON key per field: a reader of their own, imported on use
READERS = {"nemo-rl": _message_logs, "nemo-rl-train": _train_data}


@click.command(short_help="Convert another RL framework's JSONL rollouts to a fixture.")
@click.argument("jsonl_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--out", "out_path", required=True, type=OUTPUT_FILE, help="The fixture to write (.parquet)."
)
@click.option(
    "--preset",
    type=click.Choice(sorted([*PRESETS, *READERS])),
    default="generic",
    show_default=True,
    help="A framework's field names (docs/ingest.md): verl (DataProto rows, either stage), "
    "verl-agent (the agent loop's output), skyrl (TrajectoryOutput), skyrl-generator "
    "(GeneratorOutput, a sample per line), nemo-rl (message_log turns), nemo-rl-train "
    "(GRPO's train_data_step*.jsonl), "
    "slime (Sample.to_dict, rollout stage), slime-train (train-stage samples), generic. Fields "
    "a stage may not have yet (old/ref logprobs, masks, weight versions) are read where "
    "present.",
)
@click.option(
    "--field",
    "fields",
    multiple=True,
    metavar="NAME=JSON_KEY",
    help="Override one field name, repeatable; a field named here is required on every "
    "line, and NAME= (no key) leaves an optional one out. Names: sequence_id, prompt_ids, "
    "completion_ids, tokens, response_length, attention_mask (1 over real tokens, 0 over "
    "padding, across prompt + response), rollout, mask, old, ref, current, weight_version, "
    "routed_experts (MoE: per position, per layer, the top-k expert ids).",
)
@click.option(
    "--model",
    "model_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Model the rollout used: records its fingerprints and vocabulary.",
)
@click.option(
    "--engine-name", default="unknown", show_default=True, help="Engine that produced the dump."
)
@click.option(
    "--engine-version",
    default="unknown",
    show_default=True,
    help="The rollout engine's release, recorded in the fixture (history series key on it).",
)
@click.option(
    "--multi-turn",
    is_flag=True,
    help="The responses are agent trajectories: model turns (mask 1) with tool or user turns "
    "(mask 0) between them. Kept as turns and checked for token-exactness by compare (the "
    "verl-agent and skyrl presets imply it).",
)
@dtype_option("Dtype the rollout engine ran in.", default="bfloat16")
def ingest(
    jsonl_path, out_path, preset, fields, model_dir, engine_name, engine_version, multi_turn, dtype
) -> None:
    """Convert a JSONL rollout dump from another RL framework into a fixture.

    One trajectory per line with prompt and response token ids and the rollout logprob
    of every response token; optional mask, old/ref/current logprobs, weight versions.
    A dump taken before the trainer's recompute (no old/ref logprobs) gives a fixture
    without those channels; a dump whose lines differ in them is refused.

    \b
    Example (a verl rollout-stage dump: prompts, responses, response_mask,
    rollout_log_probs; a generic one with prompt_ids, response_ids, logits_lp):
      lpx ingest dump.jsonl --preset verl --model models/tiny --engine-name vllm \\
          --engine-version 0.11.0 --out run/fixture.parquet
      lpx ingest dump.jsonl --field rollout=logits_lp --out run/fixture.parquet
      lpx ingest agent.jsonl --preset verl-agent --model models/tiny --out run/agent.parquet
    """
    from pipeline.paths import check_output

    check_output(out_path, [jsonl_path])
    from pipeline.commands.options import parse_knobs
    from pipeline.fixture.ingest import ingest_jsonl
    from pipeline.fixture.io import validate_table, write_table
    from pipeline.names import canonical_dtype

    overrides = parse_knobs(fields, option="--field", example="mask=loss_mask")
    if preset in READERS and overrides:
        from pipeline.errors import BadInput

        raise BadInput(f"--preset {preset} reads its dump's own keys; --field does not apply")
    field_map = PRESETS.get(preset, PRESETS["generic"]).with_overrides(overrides)
    dtype = canonical_dtype(dtype)  # --dtype is one of its spellings (a click.Choice)
    metadata = {
        "engine": {
            "name": engine_name,
            "role": "rollout",
            "versions": {engine_name: engine_version},
        },
        "dtype": dtype,
    }
    if model_dir:
        from pipeline.engines.metadata import model_metadata

        metadata["model"] = model_metadata(model_dir)
    if preset in READERS:
        table = READERS[preset]()(jsonl_path, metadata)
    else:
        table = ingest_jsonl(jsonl_path, field_map, metadata)
    if table.routed_experts is not None and model_dir:
        _routing_from_model(table, model_dir, jsonl_path)
    validate_table(table, jsonl_path, (metadata.get("model") or {}).get("vocab_size"))
    if (multi_turn or field_map.multi_turn or preset == "nemo-rl-train") and preset != "nemo-rl":
        from pipeline.trajectory.fixture import turns_from_mask

        table.metadata["trajectories"] = turns_from_mask(table, jsonl_path)
        table.metadata["agent_loop"] = {"mode": "ingested", "preset": preset}
    write_table(table, out_path)
    click.echo(
        f"ingested {table.num_sequences} trajectories, {table.num_completion_tokens} "
        f"completion tokens -> {out_path}"
    )


def _routing_from_model(table, model_dir: Path, jsonl_path: Path) -> None:
    """The dump's routing layers and expert count read from the model it came from."""
    import json

    from pipeline.errors import BadInput
    from pipeline.families import routing

    spec = routing(json.loads((Path(model_dir) / "config.json").read_text()))
    layers, k = table.routed_experts.shape[1:]
    if spec is None or len(spec.layers) != layers or spec.top_k != k:
        have = (
            "no MoE layers" if spec is None else f"{len(spec.layers)} MoE layers, top-{spec.top_k}"
        )
        raise BadInput(
            f"{jsonl_path}: the routed experts hold {layers} layers x top-{k}, and {model_dir} "
            f"has {have}; ingest with the model the rollout used."
        )
    if int(table.routed_experts.max()) >= spec.num_experts:
        raise BadInput(
            f"{jsonl_path}: a routed expert id is {int(table.routed_experts.max())}, and the "
            f"model has {spec.num_experts} experts."
        )
    table.metadata["routing"].update(layers=sorted(spec.layers), num_experts=spec.num_experts)

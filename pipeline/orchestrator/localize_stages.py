"""The localize stages of a plan with `localize:`: one `lpx localize` per failing pair, after
the comparison, into the pair's localize/ directory.

Side A is the replay (the training engine), side B the rollout. A scoring engine captures
through the adapter of the same name (hf, fsdp, deepspeed, megatron, vllm, logprob-server),
with the pair's dtype and TP size; an engine with no capture adapter (the `http` rollout
engine, SGLang) skips the stage with its reason unless the plan names a spec for it.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.contracts.files import LOCALIZE as LOCALIZE_FILE
from pipeline.contracts.files import LOCALIZE_DIR, REPORT
from pipeline.names import canonical_dtype
from pipeline.orchestrator.outside import outside_paths
from pipeline.orchestrator.plan import Plan, Replay
from pipeline.orchestrator.stages import COMPARE, FIXTURE, MODEL, Stage, reads_of

SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
# Engines whose capture adapter takes the TP size (the others run the whole model).
TENSOR_PARALLEL = ("megatron", "vllm")


def capture_spec(engine: str, dtype: str, knobs: dict) -> str:
    """The capture spec for a side as the plan runs it, in the replay's knob names:
    `megatron:dtype=bf16,tensor_parallel_size=2`."""
    parts = [f"dtype={SHORT_DTYPES[canonical_dtype(dtype)]}"]
    tp = knobs.get("tensor_parallel_size") or knobs.get("tp")
    # megatron's capture defaults to tp=2: the replay's size is passed even when it is 1,
    # with its expert parallelism, so the capture runs the layout the replay ran
    if engine == "megatron" and tp is not None:
        parts.append(f"tensor_parallel_size={int(tp)}")
    elif engine in TENSOR_PARALLEL and tp is not None and int(tp) > 1:
        parts.append(f"tensor_parallel_size={int(tp)}")
    if engine == "megatron":
        for knob in ("expert_model_parallel_size", "expert_tensor_parallel_size"):
            if knobs.get(knob) is not None:
                parts.append(f"{knob}={int(knobs[knob])}")
    return f"{engine}:{','.join(parts)}"


def failing_pairs(run_dir: Path, replays: list[Replay]) -> list[tuple[Replay, str]]:
    """(replay, pair directory) for each pair whose comparison failed, from the compare
    stage's report.json: a matrix lists its pairs in the order of the replays compared."""
    try:
        report = json.loads((run_dir / COMPARE / REPORT).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []  # the compare stage's own status says what went wrong
    if "pairs" not in report:
        return [(replays[0], COMPARE)] if report.get("verdict") == "fail" else []
    return [
        (replay, f"{COMPARE}/{row['pair']}")
        for replay, row in zip(replays, report["pairs"], strict=False)
        if row.get("verdict") == "fail"
    ]


def localize_stage(plan: Plan, replay: Replay, pair_dir: str) -> Stage | str:
    """The `lpx localize` stage of one failing pair, or why it cannot run (one line)."""
    from pipeline.localize.adapters import REFUSED, engine_names

    options = plan.localize
    side_a = options.replays.get(replay.name) or capture_spec(
        replay.engine, replay.dtype, replay.knobs
    )
    side_b = options.rollout or capture_spec(
        plan.rollout.engine, plan.rollout.dtype, plan.rollout.knobs
    )
    known = engine_names()
    for role, spec in (("replay", side_a), ("rollout", side_b)):
        engine = spec.partition(":")[0]
        if engine in REFUSED:
            return f"skipped: the {role} engine {engine} has no capture adapter ({REFUSED[engine]})"
        if engine not in known:
            return (
                f"skipped: no capture adapter for the {role} engine {engine} (known: "
                f"{', '.join(known)}); name one in the plan's localize:"
            )
    model = MODEL if plan.model == "tiny" else plan.model
    out = f"{pair_dir}/{LOCALIZE_DIR}"
    argv = ["localize", FIXTURE, "--a", side_a, "--b", side_b]
    argv += ["--report", f"{pair_dir}/report.json", "--out", out, "--model", model]
    argv += ["--sequences", str(options.sequences)]
    argv += ["--device", options.device] if options.device != "auto" else []
    argv += ["--exact"] if options.exact else []
    return Stage(
        f"localize-{replay.name}",
        argv,
        [f"{out}/{LOCALIZE_FILE}"],
        ["compare"],
        options.image or replay.image,
        exit_1="fail",  # a boundary beyond the floor: what a failing pair is expected to show
        optional=True,
        pair=pair_dir,
        reads=reads_of(outside_paths(plan), "model"),
    )


def localize_images(plan: Plan) -> list[Stage]:
    """A stand-in stage per replay, so a container runner checks the images localize stages
    would use before any work (which pairs fail is known only after the comparison)."""
    if plan.localize is None:
        return []
    return [
        Stage(f"localize-{replay.name}", [], [], image=plan.localize.image or replay.image)
        for replay in plan.replays
    ]

"""A plan expanded into stage jobs: model -> rollout -> replays -> compare -> record -> report.

Each stage is one `lpx` command line over files in the run directory, so a runner only
starts processes (or containers) and never imports an engine. Paths are relative to the run
directory; the runner decides where that directory is mounted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.contracts.files import CALIBRATION
from pipeline.names import canonical_dtype
from pipeline.orchestrator.outside import OutsidePath, model_cache, outside_paths, sqlite_history
from pipeline.orchestrator.plan import Plan, Server

FIXTURE = "fixture.parquet"
LOGS = "logs"
PROMPTS = "prompts.txt"
MODEL = "model"
COMPARE = "compare"


@dataclass(frozen=True)
class Stage:
    name: str
    argv: list[str]  # `lpx` arguments
    outputs: list[str]  # relative to the run directory; all present = the stage is done
    needs: list[str] = field(default_factory=list)  # stages whose outputs it reads
    image: str | None = None
    nproc: int | str = 1  # or "auto": one rank per GPU the stage sees
    # What an exit code 1 means: "fail" (a comparison found drift) or "error".
    exit_1: str = "error"
    # A server the stage talks to; URL in argv is replaced by its address once it is up.
    server: Server | None = None
    memory: str | None = None  # container runners: the memory limit (Docker's --memory)
    # An optional stage's error is noted and leaves the run's verdict standing (localize).
    optional: bool = False
    pair: str | None = None  # the compare directory an optional stage reads and writes in
    # what it reads outside the run directory (the plan's checkpoint, prompts, ...): a
    # runner that moves the stage elsewhere brings these along
    reads: tuple[OutsidePath, ...] = ()


URL = "{server_url}"


def expand(plan: Plan) -> list[Stage]:
    stages = []
    outside = outside_paths(plan)
    model = plan.model
    if plan.model == "tiny":
        model = MODEL
        cache = model_cache(plan)
        stages.append(
            Stage(
                "model",
                ["make-model", MODEL],
                [f"{MODEL}/config.json"],
                image=plan.rollout.image,
                reads=(cache,) if cache else (),
            )
        )
    sampling = plan.sampling
    rollout_argv = [
        "rollout",
        "--engine",
        plan.rollout.engine,
        "--model",
        model,
        "--prompts",
        PROMPTS if plan.prompts == "bundled" else plan.prompts,
        "--out",
        FIXTURE,
        "--dtype",
        plan.rollout.dtype,
        "--max-tokens",
        str(sampling.max_tokens),
        "--temperature",
        repr(sampling.temperature),
        "--top-k",
        str(sampling.top_k),
        "--top-p",
        repr(sampling.top_p),
        "--seed",
        str(sampling.seed),
        "-n",
        str(sampling.samples_per_prompt),
        "--logprobs-mode",
        sampling.logprobs_mode,
        *(["--device", plan.rollout.device] if plan.rollout.device != "auto" else []),
        *_knobs(plan.rollout.knobs),
        *(["--set", f"url={URL}"] if plan.rollout.server else []),
        *_agent(plan.rollout.agent),
    ]
    needs_model = ["model"] if plan.model == "tiny" else []
    stages.append(
        Stage(
            "rollout",
            rollout_argv,
            [FIXTURE],
            needs_model,
            plan.rollout.image,
            server=plan.rollout.server,
            memory=plan.rollout.memory,
            reads=reads_of(outside, "model", "prompts"),
        )
    )
    if plan.calibrate is not None:
        stages.append(calibrate_stage(plan, model))
    for index, replay in enumerate(plan.replays):
        store = f"replays[{index}].weights_store"
        weights = ["--weights-store", replay.weights_store] if replay.weights_store else None
        argv = [
            "replay",
            FIXTURE,
            "--engine",
            replay.engine,
            "--dtype",
            replay.dtype,
            "--out",
            replay_file(replay.name),
            *(weights or ["--model", model]),
            *(["--nproc", str(replay.nproc)] if replay.nproc != 1 else []),
            *(["--device", replay.device] if replay.device != "auto" else []),
            # each rank of a distributed engine logs beside the stage's own log
            "--rank-logs",
            f"{LOGS}/replay-{replay.name}",
            *_knobs(replay.knobs),
        ]
        stages.append(
            Stage(
                f"replay-{replay.name}",
                argv,
                [replay_file(replay.name)],
                ["rollout"],
                replay.image,
                replay.nproc,
                memory=replay.memory,
                reads=reads_of(outside, store if weights else "model"),
            )
        )
    return stages


def calibrate_stage(plan: Plan, model: str) -> Stage:
    """The model's noise floor on the fixture's tokens, for every dtype the run meets."""
    dtypes = plan.calibrate.dtypes or sorted(
        {canonical_dtype(plan.rollout.dtype), *(canonical_dtype(r.dtype) for r in plan.replays)}
    )
    argv = ["calibrate", FIXTURE, "--model", model, "--out", CALIBRATION]
    argv += ["--sequences", str(plan.calibrate.sequences)]
    for dtype in dtypes:
        argv += ["--dtype", canonical_dtype(dtype)]
    # a SQLite history as `lpx record` finds it (from where `lpx run` started), not from the
    # run directory the stage runs in
    sqlite = sqlite_history(plan.history.db)
    argv += ["--db", str(sqlite) if sqlite else plan.history.db] if plan.history.db else []
    argv += [] if plan.calibrate.reuse else ["--no-reuse"]
    trainer = next((r.image for r in plan.replays if r.engine == "hf"), None)
    image = trainer or (plan.replays[0].image if plan.replays else plan.rollout.image)
    reads = reads_of(outside_paths(plan), "model", "history.db")
    return Stage("calibrate", argv, [CALIBRATION], ["rollout"], image, reads=reads)


def compare_stage(plan: Plan, replay_names: list[str]) -> Stage:
    """The comparison of the fixture with the replays that finished (a pair or a matrix);
    with `diagnose`, failing pairs' findings are verified by re-scoring with the model."""
    argv = ["compare", FIXTURE, *(replay_file(n) for n in replay_names), "--out", COMPARE]
    argv += ["--policy", plan.policy] if plan.policy else []
    argv += ["--calibration", plan.calibration] if plan.calibration else []
    # compare verifies by default; a plan that says diagnose: false opts out
    argv += (
        ["--model", MODEL if plan.model == "tiny" else plan.model]
        if plan.diagnose
        else ["--no-verify"]
    )
    if plan.diagnose and plan.verify_budget_s is not None:
        argv += ["--verify-budget", repr(plan.verify_budget_s)]
    return Stage(
        "compare",
        [*argv, "--quiet"],
        [f"{COMPARE}/report.json"],
        [f"replay-{n}" for n in replay_names],
        plan.rollout.image,
        exit_1="fail",
        reads=reads_of(
            outside_paths(plan), *(["model"] if plan.diagnose else []), "policy", "calibration"
        ),
    )


def reads_of(outside: dict[str, OutsidePath], *keys: str) -> tuple[OutsidePath, ...]:
    """The plan's outside paths under those keys, where the plan names them."""
    return tuple(outside[key] for key in keys if key in outside)


def replay_file(name: str) -> str:
    return f"replay-{name}.parquet"


def _knobs(knobs: dict) -> list[str]:
    pairs = []
    for key, value in knobs.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        pairs += ["--set", f"{key}={text}"]
    return pairs


def _agent(agent) -> list[str]:
    if agent is None:
        return []
    think = "--agent-think" if agent.think else "--agent-no-think"
    return ["--agent-turns", str(agent.turns), "--agent-mode", agent.mode, think,
            "--agent-render", agent.render]  # fmt: skip

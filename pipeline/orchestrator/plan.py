"""A run plan (PLAN.yaml): what `lpx run` rolls out, replays, compares and records.

Validated strictly, like a policy: an unknown key, engine or dtype is exit 2 naming the key
path, so a typo never silently drops a replay. Format and examples: docs/orchestrator.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from pipeline.errors import BadInput
from pipeline.names import DTYPE_ALIASES, DTYPES, canonical_dtype, engine_names
from pipeline.paths import safe_name
from pipeline.yaml_text import parse_yaml

Dtype = Literal[DTYPES + tuple(DTYPE_ALIASES)]
Device = Annotated[str, Field(pattern=r"^(auto|cpu|cuda(:\d+)?)$")]  # pipeline.devices
Knobs = dict[str, str | int | float | bool]
# A container memory limit as Docker takes it (--memory): bytes, or a number with b/k/m/g.
Memory = Annotated[str, Field(pattern=r"^[1-9][0-9]*[bkmgBKMG]?$")]
Count = Annotated[int, Field(ge=1, strict=True)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Sampling(_Strict):
    max_tokens: Count = 32
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(ge=0, strict=True)] = 0
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    seed: Annotated[int, Field(strict=True)] = 0
    samples_per_prompt: Count = 1
    logprobs_mode: Literal["raw", "processed"] = "raw"


class Server(_Strict):
    """An inference server the `http` rollout engine samples from (SGLang, `vllm serve`),
    started before the rollout stage and stopped after it. ``argv`` is its whole command
    line; ``{model}`` and ``{port}`` in it are filled in."""

    argv: list[str] = Field(min_length=1)
    image: str | None = None  # container runners; default: the rollout's image
    port: Annotated[int, Field(gt=0, lt=65536, strict=True)] = 30000
    health: str = "/health"
    env: dict[str, str] = {}
    start_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 600.0


class Agent(_Strict):
    """A multi-turn agent loop in the rollout stage (`lpx rollout --agent-turns`): model turns
    per trajectory against lpx's offline tool environment; max_tokens is per turn."""

    turns: Count = 4
    mode: Literal["tito", "messages"] = "tito"
    think: bool = True
    # messages mode: the engine's own chat path renders each turn where it has one (vLLM,
    # SGLang), else lpx renders with transformers
    render: Literal["engine", "lpx"] = "engine"


class Rollout(_Strict):
    engine: str
    image: str | None = None
    dtype: Dtype = "float32"
    device: Device = "auto"
    knobs: Knobs = {}
    memory: Memory | None = None  # container runners: the stage's memory limit (e.g. 8g)
    server: Server | None = None
    agent: Agent | None = None

    @field_validator("engine")
    @classmethod
    def _known_rollout(cls, name: str) -> str:
        return _known(name, "lpx.rollout_engines")

    @model_validator(mode="after")
    def _knobs_said_once(self) -> Rollout:
        _said_once(self, ("dtype", "device") + (("url",) if self.server else ()))
        return self


class Replay(_Strict):
    name: str
    engine: str
    image: str | None = None
    dtype: Dtype = "float32"
    device: Device = "auto"
    # ranks of a distributed engine: one per GPU on CUDA; auto = every GPU the stage sees
    nproc: Count | Literal["auto"] = 1
    knobs: Knobs = {}
    memory: Memory | None = None  # container runners: the stage's memory limit (e.g. 8g)
    # a weight store (lpx weights publish): each token scored under the version it claims,
    # instead of the plan's model
    weights_store: str | None = None

    @field_validator("engine")
    @classmethod
    def _known_scoring(cls, name: str) -> str:
        return _known(name, "lpx.scoring_engines")

    @field_validator("name")
    @classmethod
    def _file_name(cls, name: str) -> str:
        return _safe(name, "replay name")

    @model_validator(mode="after")
    def _knobs_said_once(self) -> Replay:
        _said_once(self, ("dtype", "device", "nproc"))
        return self


class Calibrate(_Strict):
    """`lpx calibrate` after the rollout: the model's own noise floor, which the compare stage
    judges drift against (calibration.json in the run directory)."""

    dtypes: list[Dtype] = []  # default: the rollout's and every replay's dtype
    sequences: Count = 32
    reuse: bool = True  # take a stored calibration from the history when one matches


class Localize(_Strict):
    """`lpx localize` on each pair whose comparison fails: the first layer and op where the
    replay (side A) and the rollout (side B) part, written to the pair's localize/. Each side's
    capture spec comes from its engine, dtype and TP size (orchestrator/stages.py) unless
    given here."""

    sequences: Count = 4  # the failing pair's worst sequences (its report.json)
    rollout: str | None = None  # side B's capture spec for every pair, e.g. vllm:dtype=bf16
    replays: dict[str, str] = {}  # side A's capture spec by replay name
    device: Device = "auto"
    image: str | None = None  # container runners; default: the replay's image
    exact: bool = False  # stacks meant to be bitwise equal: the first boundary that is not

    @field_validator("rollout")
    @classmethod
    def _rollout_spec(cls, spec: str | None) -> str | None:
        return None if spec is None else _spec(spec)

    @field_validator("replays")
    @classmethod
    def _replay_specs(cls, specs: dict[str, str]) -> dict[str, str]:
        return {name: _spec(spec) for name, spec in specs.items()}


class History(_Strict):
    db: str | None = None  # default: LPX_DB, else runs/lpx.db
    report: str | None = None  # where the HTML report is rendered; none: not rendered
    kind: Literal["nightly", "smoke", "manual"] = "manual"


class Plan(_Strict):
    version: Literal[1]
    name: str  # names the default run directory, runs/<name>-<UTC time>
    model: str  # "tiny": the tiny model lpx builds into the run dir; else a directory
    prompts: str = "bundled"  # "bundled": the smoke's prompt texts; else a text or JSONL file
    sampling: Sampling = Sampling()
    rollout: Rollout
    replays: list[Replay] = Field(min_length=1)
    policy: str | None = None
    calibrate: Calibrate | None = None
    # a calibration made before (lpx calibrate) that the compare stage judges with, in place
    # of a calibrate stage
    calibration: str | None = None
    # the compare stage verifies failing pairs' findings by re-scoring them with the model
    diagnose: bool = True
    # with diagnose: no new hypothesis after this many seconds per pair (--verify-budget)
    verify_budget_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    # failing pairs are localized to a layer and op (lpx localize): true, or a mapping
    localize: Localize | None = None
    history: History = History()
    stage_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 3600.0
    gpus: bool = False  # container runners give each stage every GPU of the host

    @field_validator("name")
    @classmethod
    def _dir_name(cls, name: str) -> str:
        return _safe(name, "plan name")

    @field_validator("localize", mode="before")
    @classmethod
    def _localize_switch(cls, value):
        """`localize: true` is every default; `false` is none."""
        if value is True:
            return {}
        return None if value is False else value

    @model_validator(mode="after")
    def _localized_replays_exist(self) -> Plan:
        names = {replay.name for replay in self.replays}
        unknown = sorted(set(self.localize.replays) - names) if self.localize else []
        if unknown:
            raise ValueError(
                f"localize.replays names {', '.join(unknown)}, which is not a replay of the "
                f"plan; replays: {', '.join(sorted(names))}"
            )
        return self

    @model_validator(mode="after")
    def _one_calibration(self) -> Plan:
        if self.calibrate is not None and self.calibration is not None:
            raise ValueError(
                "calibrate: and calibration: both give the compare stage its floor; keep "
                "calibrate: to measure it in the run, or calibration: to take one made before"
            )
        return self

    @field_validator("replays")
    @classmethod
    def _distinct(cls, replays: list[Replay]) -> list[Replay]:
        names = [r.name for r in replays]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"replay names must differ; {', '.join(twice)} appears twice")
        return replays


def _safe(name: str, what: str) -> str:
    """A name that becomes part of a path: one safe path component, never a way out of its
    root (a plan named ../../x must not write outside runs/)."""
    try:
        return safe_name(name, what)
    except BadInput as error:
        raise ValueError(error.format_message()) from None


def _said_once(stage, own: tuple[str, ...]) -> None:
    """A knob that contradicts one of the stage's own settings: the stage would pass both
    (`--dtype bf16 --set dtype=fp32`) and the knob would silently win. The same value in both
    places is only said twice (the http engine reads its declared dtype from its knobs)."""
    for key in own:
        if key not in stage.knobs:
            continue
        if key == "url":
            raise ValueError("knobs.url: lpx run fills in the server's address; leave it out")
        mine, theirs = getattr(stage, key), stage.knobs[key]
        if key == "dtype":
            try:
                same = canonical_dtype(str(theirs)) == canonical_dtype(mine)
            except ValueError:
                same = False
        else:
            same = str(theirs).lower() == str(mine).lower()
        if not same:
            raise ValueError(
                f"knobs.{key} {theirs!r} contradicts {key}: {mine!r}; give one {key}, as {key}:"
            )


def _spec(spec: str) -> str:
    """A capture spec, ENGINE[:knob=value,...]; the engine and knobs are checked when the
    stage opens it (a third-party adapter may be installed only in the stage's image)."""
    from pipeline.localize.adapters import parse_spec

    try:
        parse_spec(spec)
    except BadInput as error:
        raise ValueError(error.format_message()) from None
    return spec.strip()


def _known(name: str, group: str) -> str:
    names = engine_names(group)
    if name not in names:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(names)}")
    return name


def load_plan(path: Path) -> Plan:
    """Read and validate PLAN.yaml; relative paths in it are relative to the plan's folder."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise BadInput(f"{path}: not UTF-8 text; save the plan as UTF-8 YAML.") from None
    except OSError as error:
        raise BadInput(f"{path}: cannot read the plan ({error.strerror}).") from None
    data = parse_yaml(text, str(path), _UniqueKeys)
    try:
        plan = Plan.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the plan"
        reason = "unknown key" if first["type"] == "extra_forbidden" else first["msg"]
        if first["loc"] == ("model",) and first["type"] == "missing":
            reason = (
                "missing; name the model directory to compare (relative to the plan), or write "
                "`model: tiny` for lpx's tiny test model"
            )
        raise BadInput(f"{path}: {where}: {reason} (see docs/orchestrator.md).") from None
    return _resolved(plan, path.parent)


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (`dtype: bf16` and
    `dtype: fp32` among one replay's knobs): plain YAML keeps the last silently."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"{key!r} is given twice in one mapping ({seen[key]!r} and "
                    f"{_scalar(value_node)!r}); give it once",
                    key_node.start_mark,
                )
            seen[key] = _scalar(value_node)
        return super().construct_mapping(node, deep=deep)


def _scalar(node) -> str:
    return node.value if isinstance(node, yaml.ScalarNode) else f"a {node.id}"


def _resolved(plan: Plan, base: Path) -> Plan:
    def local(value: str | None, keep: tuple[str, ...] = ()) -> str | None:
        if value is None or value in keep or "://" in value:
            return value
        return str((base / value).resolve())

    plan.model = local(plan.model, ("tiny",))
    plan.prompts = local(plan.prompts, ("bundled",))
    plan.policy = local(plan.policy)
    plan.calibration = local(plan.calibration)
    for replay in plan.replays:
        replay.weights_store = local(replay.weights_store)
    return plan

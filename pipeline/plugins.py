"""Every plug-in group lpx reads, with its built-ins in one table.

A team ships an adapter without forking by registering it in one of these entry-point
groups; a registered name wins over a built-in one. The built-ins are also declared in
pyproject.toml's entry points (tests/engines/test_plugins.py holds the two equal), so an installed
lpx lists them either way. On the ground: naming a plug-in imports nothing; `load` imports
the one asked for.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

ROLLOUT = "lpx.rollout_engines"
SCORING = "lpx.scoring_engines"
CAPTURE = "lpx.capture_engines"

# group -> name -> "module:attribute"
BUILTIN: dict[str, dict[str, str]] = {
    ROLLOUT: {
        "hf": "pipeline.engines.hf.rollout:HFRolloutEngine",
        "vllm": "pipeline.engines.vllm.engine:VLLMRolloutEngine",
        "http": "pipeline.engines.http.rollout:HTTPRolloutEngine",
        "sglang": "pipeline.engines.sglang.engine:SGLangRolloutEngine",
    },
    SCORING: {
        "hf": "pipeline.engines.hf.replay:HFScoringEngine",
        "vllm": "pipeline.engines.vllm.engine:VLLMScoringEngine",
        "fsdp": "pipeline.engines.fsdp.replay:FSDPScoringEngine",
        "deepspeed": "pipeline.engines.deepspeed.replay:DeepSpeedScoringEngine",
        "megatron": "pipeline.engines.megatron.replay:MegatronScoringEngine",
        "logprob-server": "pipeline.engines.logprob_server.replay:LogprobServerEngine",
        "sglang": "pipeline.engines.sglang.engine:SGLangScoringEngine",
    },
    CAPTURE: {
        "hf": "pipeline.localize.adapters.hf:open_session",
        "fsdp": "pipeline.localize.adapters.fsdp:open_session",
        "deepspeed": "pipeline.localize.adapters.deepspeed:open_session",
        "megatron": "pipeline.localize.adapters.megatron:open_session",
        "vllm": "pipeline.localize.adapters.vllm:open_session",
        "logprob-server": "pipeline.localize.adapters.server:open_session",
        "sglang": "pipeline.localize.adapters.sglang:open_session",
    },
}


def _registered(group: str) -> dict[str, str]:
    """Names other distributions register in ``group``. lpx's own registrations are
    BUILTIN (held equal by a test): reading them from the installed metadata instead would let
    a stale editable install, made before a module moved, point at a module that is gone."""
    return {
        ep.name: ep.value
        for ep in entry_points(group=group)
        if ep.dist is None or ep.dist.metadata["Name"] != "lpx"
    }


def names(group: str) -> list[str]:
    """Every plug-in of ``group``: the built-ins and whatever is registered."""
    return sorted(set(BUILTIN[group]) | set(_registered(group)))


def target(group: str, name: str) -> str | None:
    """The "module:attribute" of ``name`` in ``group``: a registered one first, else built in."""
    return _registered(group).get(name) or BUILTIN[group].get(name)


def load(group: str, name: str):
    """The plug-in's object; None for a name the group does not have. ImportError is the
    caller's to turn into advice (which extra to install)."""
    where = target(group, name)
    if where is None:
        return None
    module_name, _, attribute = where.partition(":")
    return getattr(importlib.import_module(module_name), attribute)

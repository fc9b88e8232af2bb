"""Logits processing: what an engine does between the logits and the logprobs it returns
(penalties, a soft-cap, a logit bias, temperature, min-p, top-k, top-p), found by
re-scoring. One cause, `logits_processing`, whose parameters say which processing the
observed side carries, searched jointly (`verify/processing_fit.py`) from the best of its
seeds: no processing, the model's generation_config.json (what vLLM and SGLang apply where
a request sets nothing), the sampling the fixture records, and the defaults engines ship
for Qwen3 (its generation config, thinking and not).

The search re-processes one forward's head logits of a few compared tokens (this module
takes them); the judge then re-scores the finding's sequences under what it found."""

from __future__ import annotations

import numpy as np

from pipeline.contracts.causes import Cause
from pipeline.contracts.report import Finding
from pipeline.engines.metadata import generation_sampling
from pipeline.faults.forward import completion_logits, select_processed
from pipeline.faults.processing import (
    MODEL_CAP,
    OFF_BY_ONE,
    SCOPES,
    Processing,
    apply,
    model_cap,
    seen_before,
    split_scope,
    stacked,
)
from pipeline.faults.zoo import QWEN3_DEFAULTS
from pipeline.verify.hypothesis import Candidate, Family
from pipeline.verify.processing_fit import (
    SAMPLER,
    HeadLogits,
    continuous_of,
    find_processing,
    fit_continuous,
)
from pipeline.verify.search import SEARCH_LOGITS

KIND = "logits_processing"
ENGINE_DEFAULTS = (  # what engines apply to Qwen3 unasked: its generation config, both modes
    QWEN3_DEFAULTS,
    {"temperature": 0.7, "top_k": 20, "top_p": 0.8},
)
SEARCH_TOKENS = 256  # compared tokens the search re-processes, spread over the sequences
SEARCH_ROWS = 8  # sequences they are spread over (one forward each)
AGAIN = 0.01  # a processing found on other findings is taken where it leaves this of the gap


class LogitsProcessing(Family):
    name = KIND
    causes = (Cause.LOGITS_PROCESSING,)
    kinds = (KIND,)
    explains_fills = True  # a one-token kept set scores exactly 0
    # its search spreads over up to SEARCH_ROWS sequences: a top-k that binds in few of them
    # is seen only there, so it is never judged on a screen of two
    screened = False

    def hypotheses(self, ref, finding: Finding) -> list[Candidate]:
        return [Candidate(Cause.LOGITS_PROCESSING, KIND, ref.base, {})]

    def alternatives(self, ref, finding: Finding) -> list[Candidate]:
        return self.hypotheses(ref, finding)

    def search(self, ref, candidate, rows, observed, clean, side) -> Candidate:
        if candidate.params.get("searched"):
            return candidate
        logits = head_logits(ref, rows, observed, clean, _noise(ref, rows, clean, side))
        earlier = ref.found.setdefault(KIND, [])
        again = [p for p in earlier if logits.gap(p) <= AGAIN * logits.gap(Processing())]
        if again:  # the same processing, its numbers refitted on these tokens
            found = fit_continuous(logits, again[0], continuous_of(again[0]))
        else:
            found = find_processing(logits, seeds(ref))
        if found not in earlier:
            earlier.append(found)
        return Candidate(candidate.cause, KIND, candidate.settings, describe(ref, found, side))

    def merged(self, findings: list[Finding]) -> list[Finding]:
        """Findings this family verified on the same side with the same knobs, agreeing to
        MERGE_AGREE, are one processing: one finding over their sequences, with the numbers
        of the one that held the most sequences (the best determined). Knobs that differ
        more are different requests' sampling, kept apart."""
        out: list[Finding] = []
        for finding in findings:
            by = finding.details.get("verified_by") or {}
            same = next(
                (
                    i
                    for i, kept in enumerate(out)
                    if by.get("kind") == KIND and _agree(kept.details.get("verified_by") or {}, by)
                ),
                None,
            )
            if same is None:
                out.append(finding)
                continue
            kept = out[same]
            larger = kept if len(kept.sequences) >= len(finding.sequences) else finding
            out[same] = larger.but(sequences=sorted(set(kept.sequences) | set(finding.sequences)))
        return out

    def commit(self, ref, candidate, rows):
        processing = Processing.from_dict(candidate.params)
        cap = model_cap(ref.model)
        out = []
        for row in rows:
            prompt, completion = ref.fixture.prompt_of(row), ref.fixture.completion_of(row)
            logits = completion_logits(ref.model, prompt, completion, capped=False)
            scored = select_processed(
                apply(logits, prompt, completion, processing, cap), completion
            )
            out.append(scored[ref.mask(row)].astype(np.float64))
        return out


def head_logits(ref, rows: list[int], observed: list, clean: list, noise: float = 0.0):
    """The `HeadLogits` a search fits on: compared tokens spread evenly over the sequences
    (at most SEARCH_ROWS of them) and over each one's length, as many as SEARCH_LOGITS and
    SEARCH_TOKENS allow. Not the leading tokens: half are spread evenly, half are those the
    observed side moved furthest from the clean reference, where the processing acted most
    (a top-k under a top-p binds only where the distribution is flat, on a few tokens the
    first of one sequence may not hold). ``noise``: the side's noise on these sequences."""
    import torch

    vocab = ref.model.get_output_embeddings().weight.shape[0]
    budget = max(8, min(SEARCH_TOKENS, SEARCH_LOGITS // (2 * vocab)))
    chosen = [int(i) for i in np.unique(np.linspace(0, len(rows) - 1, SEARCH_ROWS).round())]
    per_row = max(4, budget // len(chosen))
    logits, targets, kept, histories = [], [], [], {scope: [] for scope in SCOPES}
    widths = []
    for index in chosen:
        row, seen = rows[index], observed[index]
        completion = np.asarray(ref.fixture.completion_of(row), dtype=np.int64)
        prompt = ref.fixture.prompt_of(row)
        compared = np.flatnonzero(np.asarray(ref.mask(row), dtype=bool))
        if not len(compared):
            continue
        picks = _informative(np.asarray(seen, dtype=np.float64), clean[index], per_row)
        at = compared[picks]
        head = completion_logits(ref.model, prompt, completion, capped=False, at=at)
        logits.append(head.double())
        targets.append(completion[at])
        kept.append(np.asarray(seen, dtype=np.float64)[picks])
        widths.append(len(at))
        for scope in SCOPES:
            own, counts = seen_before(prompt, completion, int(at[-1]) + 1, scope, head.device)
            index_at = torch.as_tensor(at, device=head.device)
            histories[scope].append((own, counts[index_at]))
    stacked_logits = torch.cat(logits)
    return HeadLogits(
        stacked_logits,
        np.concatenate(targets),
        np.concatenate(kept),
        {scope: stacked(histories[scope], widths, stacked_logits.device) for scope in SCOPES},
        model_cap(ref.model),
        vocab,
        noise,
    )


def _informative(observed: np.ndarray, clean: np.ndarray, count: int) -> np.ndarray:
    """Indices of ``count`` compared tokens: half evenly spread, half the furthest moved."""
    n = len(observed)
    if n <= count:
        return np.arange(n)
    even = np.linspace(0, n - 1, count - count // 2).round().astype(int)
    moved = np.nan_to_num(np.abs(observed - clean), nan=0.0, posinf=0.0)
    moved[even] = -1.0
    furthest = np.argsort(-moved, kind="stable")[: count // 2]
    return np.unique(np.concatenate([even, furthest]))


def _noise(ref, rows: list[int], clean: list, side: str) -> float:
    """The mean |d| the observed side's declared precision alone gives against fp32 on
    these tokens (the calibrated floor, else the precision's constant)."""
    from pipeline.compare.calibrated import side_precision

    meta = ref.fixture.metadata if side == "rollout" else ref.replay.metadata
    positions = ref.observed(rows)[2]
    floors = ref.token_floors((side_precision(meta), "float32"), clean, positions)
    return float(np.mean(np.concatenate(floors))) if floors else 0.0


def seeds(ref) -> list[Processing]:
    """Where the search starts: nothing, the model's generation defaults, the recorded
    sampling, and the defaults engines ship for Qwen3."""
    config = generation_sampling(ref.model_dir)
    sampling = ref.fixture.metadata.get("sampling") or {}
    recorded = {k: sampling[k] for k in ("temperature", "top_k", "top_p") if k in sampling}
    out = [Processing()]
    for values in (config, recorded, *ENGINE_DEFAULTS):
        kept = {k: v for k, v in values.items() if k in Processing.__dataclass_fields__}
        if kept.get("top_k", 0) < 0:
            kept["top_k"] = 0
        seed = Processing.from_dict(kept)
        if seed not in out:
            out.append(seed)
    return out


MERGE_AGREE = 0.05  # relative: two fits of one processing on different tokens agree this well


def _agree(a: dict, b: dict) -> bool:
    if a.get("kind") != KIND or a.get("side") != b.get("side"):
        return False
    ours, theirs = a.get("params") or {}, b.get("params") or {}
    knobs = [k for k in ours if k not in ("searched", "what")]
    if set(knobs) != {k for k in theirs if k not in ("searched", "what")}:
        return False
    for knob in knobs:
        x, y = ours[knob], theirs[knob]
        if knob == "logit_bias":
            x, y = dict((int(t), b) for t, b in x), dict((int(t), b) for t, b in y)
            if set(x) != set(y) or any(not _near(x[t], y[t]) for t in x):
                return False
        elif isinstance(x, int | float) and isinstance(y, int | float):
            if not _near(x, y):
                return False
        elif x != y:
            return False
    return True


def _near(x: float, y: float) -> bool:
    return abs(float(x) - float(y)) <= MERGE_AGREE * max(abs(float(x)), abs(float(y)), 1e-3)


def describe(ref, found: Processing, side: str) -> dict:
    """The parameters a reproduction reports: what it changed, and in words what that is."""
    params = {**found.changed(), "searched": True}
    words = []
    if found.logit_bias:
        words.append(f"a logit bias on {len(found.logit_bias)} tokens")
    if found.soft_cap == 0.0:
        words.append("the model's final-logit soft-cap skipped")
    elif found.soft_cap != MODEL_CAP:
        words.append(f"a final-logit soft-cap of {found.soft_cap:.4g}")
    if found.penalises:
        base, off = split_scope(found.penalty_scope)
        counted = f", {OFF_BY_ONE[off]}" if off else ""
        words.append(f"sampling penalties (counted over the {base}{counted})")
    sampler = {k: v for k, v in found.changed().items() if k in SAMPLER}
    if sampler:
        config = generation_sampling(ref.model_dir)
        declared = (ref.fixture.metadata.get("logprob_channels") or {}).get("rollout", "")
        if config and all(_close(config.get(k), v) for k, v in sampler.items()):
            words.append("the model's generation defaults (generation_config.json)")
        elif any(all(_close(d.get(k), v) for k, v in sampler.items()) for d in ENGINE_DEFAULTS):
            words.append("generation defaults engines apply to Qwen3, unrecorded")
        else:
            words.append("sampler processing")
        if side == "rollout" and not str(declared).startswith("processed"):
            words.append("in logprobs the fixture declares raw")
    raw = raw_where_processed_declared(ref, side)
    if raw:
        words.append(raw)
    params["what"] = ", ".join(words) or "none"
    return params


def raw_where_processed_declared(ref, side: str) -> str | None:
    """The reverse of processed logprobs declared raw: the fixture declares its channel
    processed, the replay applied that processing, and the rollout's logprobs are the raw
    ones (the reproduction moved the replay side, not the rollout)."""
    declared = str((ref.fixture.metadata.get("logprob_channels") or {}).get(ref.channel, ""))
    if side != "replay" or not declared.startswith("processed"):
        return None
    return (
        f"the fixture declares its {ref.channel} logprobs processed and the replay applied "
        "that processing, but they are raw: the engine returned raw logprobs where processed "
        "were declared (vLLM: logprobs_mode processed_logprobs; or declare them raw and "
        "replay raw)"
    )


def _close(a, b) -> bool:
    return a is not None and abs(float(a) - float(b)) <= 1e-3 * max(1.0, abs(float(b)))

"""Hypotheses read from the shape of the drift: batch-wide sampling processing (one-signed or
linear gaps), onsets after clean tokens (positions, an in-flight weight update), and drift
from the first token (precision, weights, each sequence's own context)."""

from __future__ import annotations

import numpy as np

from pipeline.compare.hypotheses.batch import (
    EXPLAINS,
    MIN_TOKENS,
    ONE_SIGNED,
    ONSET_WINDOW,
    SHARED_ONSET_CAP,
    SHARED_ONSET_MIN,
    SHARED_ONSET_QUIET,
    SHARED_ONSET_STEP,
    WEIGHT_STEP_RELATIVE,
    Batch,
    clean_at_floor,
    finding,
    flat_bad_diff,
    low_dtype,
    low_precision_side,
    numeric_ceiling,
    position_of,
    segment_sum,
    sharpening,
    temperature_fit,
    unexplained,
    weight_like,
    weighted_ceiling,
)
from pipeline.contracts.causes import Cause


def sampling_rule(batch: Batch, open_: np.ndarray):
    """Processed vs raw logprobs. Truncation renormalises the kept tokens, so the processed
    side is higher at every sampled token, by -log(kept mass): never more than -log(top_p)
    under top-p. Temperature makes the gap linear in the logprob. The rollout's recorded
    sampling names which processing was in use."""
    candidates = open_ & (batch.sig.bad >= MIN_TOKENS)
    if candidates.sum() == 0 or clean_at_floor(batch).any():
        return  # processing touches every sequence; some at the floor rule it out
    d = flat_bad_diff(batch, candidates)
    if len(d) < 3:
        return
    processed_higher_rollout = float(np.mean(d < 0))
    one_signed = max(processed_higher_rollout, 1 - processed_higher_rollout) >= ONE_SIGNED
    sampling = batch.context.sampling or {}
    temperature = float(sampling.get("temperature", 1.0) or 1.0)
    top_k = int(sampling.get("top_k", 0) or 0)
    top_p = float(sampling.get("top_p", 1.0) or 1.0)
    side = "rollout" if processed_higher_rollout >= 0.5 else "replay"
    gap = np.abs(d)
    max_gap = float(np.quantile(gap, 0.999))
    fit = temperature_fit(batch, candidates) or (
        sharpening(batch, candidates) if temperature != 1.0 else None
    )
    causes = []
    if one_signed and (top_k > 0 or top_p < 1.0):
        if top_k > 0:
            causes.append((Cause.TOP_K, f"top-k {top_k} in the rollout's sampling"))
        if top_p < 1.0:
            bound = -np.log(top_p)
            causes.append(
                ("top_p", f"top-p {top_p:g} in the rollout's sampling; gap <= {bound:.3g} nats")
            )
    elif fit and (temperature != 1.0 or batch.context.temperature_hint or not sampling):
        causes.append((Cause.TEMPERATURE, fit[0]))
    elif one_signed and not sampling:
        if max_gap <= -np.log(0.5):
            causes.append(
                ("top_p", f"every gap under {max_gap:.3g} nats: top-p ~{np.exp(-max_gap):.2f}")
            )
        else:
            causes.append((Cause.TOP_K, f"gaps up to {max_gap:.3g} nats, beyond a top-p bound"))
    elif batch.context.temperature_hint and one_signed:
        causes.append((Cause.TEMPERATURE, batch.context.temperature_hint))
    if not causes:
        return
    claimed = candidates.copy()
    for cause, why in causes:
        yield (
            finding(
                batch,
                cause,
                claimed,
                f"the {side} side is higher on {max(processed_higher_rollout, 1 - processed_higher_rollout):.0%} "
                f"of the drifting tokens (max gap {max_gap:.3g} nats); {why}: one side's logprobs "
                "are processed (after temperature/truncation) and the other's are raw; return "
                "raw logprobs from the rollout, or apply the same processing on both sides",
                details={
                    "processed_side": side,
                    "max_gap": max_gap,
                    **({"temperature_fit": fit[1]} if fit and cause == Cause.TEMPERATURE else {}),
                },
                runner_up=(
                    Cause.STALE_WEIGHTS,
                    "weights move sampled tokens both ways; here one side is higher throughout",
                )
                if one_signed
                else (
                    Cause.STALE_WEIGHTS,
                    "the gap is linear in the logprob, as a temperature makes it",
                ),
            ),
            claimed,
        )


def shared_onset_rule(batch: Batch, open_: np.ndarray):
    """A weight update in flight: from one completion index on, every sequence still
    generating drifts a little more, by a small fraction of its logprobs. Under another
    side's noise each sequence's tokens cross tau only now and then, but the batch's drift,
    measured in multiples of the noise floor and averaged by index, steps up at the update:
    a change point over the whole batch."""
    sig = batch.sig
    candidates = open_ & (sig.tokens >= 2 * SHARED_ONSET_MIN)
    if candidates.sum() < SHARED_ONSET_MIN:
        return
    in_play = candidates[batch.seq]
    local = np.arange(len(batch.diff)) - batch.offsets[batch.seq]
    excess = np.abs(batch.diff) / np.maximum(batch.noise_mean[batch.seq], 1e-12)
    index, z = local[in_play], np.minimum(excess[in_play], SHARED_ONSET_CAP)
    width = int(index.max()) + 1
    count = np.bincount(index, minlength=width).astype(np.float64)
    total = np.bincount(index, weights=z, minlength=width)
    before_n, before_sum = np.cumsum(count)[:-1], np.cumsum(total)[:-1]
    after_n, after_sum = count.sum() - before_n, total.sum() - before_sum
    ks = np.arange(1, width)
    # at least ONSET_WINDOW + 1 quiet tokens: drift from the first few tokens is a weight
    # difference from the start (stale weights), not an update during generation
    usable = (ks > ONSET_WINDOW) & (before_n >= SHARED_ONSET_MIN) & (after_n >= SHARED_ONSET_MIN)
    if not usable.any():
        return
    with np.errstate(divide="ignore", invalid="ignore"):
        before, after = before_sum / before_n, after_sum / after_n
    contrast = np.where(usable, after - before, -np.inf)
    best = int(np.argmax(contrast))
    k, level_before, level_after = int(ks[best]), float(before[best]), float(after[best])
    if level_before > SHARED_ONSET_QUIET or level_after < SHARED_ONSET_STEP * level_before:
        return
    mine_before = segment_sum(np.where(local < k, excess, 0.0), batch.offsets)
    mine_after = segment_sum(np.where(local >= k, excess, 0.0), batch.offsets)
    n_before = np.maximum(np.minimum(sig.tokens, k), 1)
    n_after = np.maximum(sig.tokens - k, 1)
    up = (
        candidates
        & (sig.tokens > k)
        & (mine_after / n_after > SHARED_ONSET_STEP * np.maximum(mine_before / n_before, 1.0))
    )
    if up.sum() < max(SHARED_ONSET_MIN, 0.5 * candidates.sum()):
        return
    relative = float(np.median(sig.relative[up]))
    # An update reaches every sequence still generating at k; a small one may move some
    # within the noise, but more sequences with no step at all than with one rule it out.
    flat = (sig.tokens > k + ONSET_WINDOW) & (
        mine_after / n_after <= 1.5 * np.maximum(mine_before / n_before, 1.0)
    )
    if relative > WEIGHT_STEP_RELATIVE or flat.sum() > up.sum():
        return
    # every sequence that drifts more after k than before it took the update too, each
    # token's excess capped as the batch's was: one admitted a little earlier, that met the
    # update two tokens before k, has its largest excess on those two (a lone sequence of a
    # continuous batch was left out, then named a position bug)
    capped = np.minimum(excess, SHARED_ONSET_CAP)
    capped_before = segment_sum(np.where(local < k, capped, 0.0), batch.offsets)
    capped_after = segment_sum(np.where(local >= k, capped, 0.0), batch.offsets)
    up |= (
        candidates
        & (sig.tokens > k)
        & (capped_after / n_after > capped_before / n_before)
        & (sig.bad > 0)
    )
    first = int(np.flatnonzero(up)[0])
    at = int(batch.positions[batch.offsets[first] + k])
    yield (
        finding(
            batch,
            Cause.VERSION_CHANGE,
            up,
            f"from completion index {at} on, {int(up.sum())} sequences drift more than before "
            f"it (the batch's mean |d| by index, in multiples of the noise floor, steps from "
            f"{level_before:.2f} to {level_after:.2f}), by a small fraction of the logprobs (median "
            f"{relative:.1%}), as a weight update does: the weights changed while they were "
            "being generated (an in-flight update); record per-token weight versions and score "
            "each token with its own",
            details={
                "at": at,
                "relative_drift": relative,
                "level_before": level_before,
                "level_after": level_after,
            },  # fmt: skip
            confidence=float(min(1.0, up.sum() / candidates.sum())),
            first=first,
            position=at,
            runner_up=(
                Cause.POSITION_IDS,
                f"a position bug scrambles attention, moving logprobs by tens of % "
                f"(here {relative:.1%})",
            ),
        ),
        up,
    )


def onset_rule(batch: Batch, open_: np.ndarray):
    """Drift that starts after clean tokens and stays: positions shifted from there, or a
    weight update in flight when many sequences share the onset index."""
    sig = batch.sig
    # Before an onset the two sides computed the same thing: agreement at the floor, not
    # merely under tau (context faults leave the first tokens a little off, under tau).
    floor = sig.prefix_floor >= 0.5
    after = (
        open_
        & (sig.first_bad >= 1)
        & floor
        & (sig.bad_after_onset >= 0.5)
        & (sig.bad >= MIN_TOKENS)
        & (sig.mean_abs > numeric_ceiling(batch))
    )
    if not after.any():
        return
    onsets = sig.first_bad[after]
    k0 = int(onsets.min())
    shared = after & (sig.first_bad <= k0 + ONSET_WINDOW)
    relative = float(np.median(sig.relative[after]))
    # An update reaches every sequence still generating at k0: one clean at the floor well
    # past k0 rules it out (a request admitted after it would drift from its first token).
    untouched = (clean_at_floor(batch) & (sig.tokens > k0 + ONSET_WINDOW)).any()
    if k0 >= 2 and shared.sum() >= 2 and relative <= WEIGHT_STEP_RELATIVE and not untouched:
        # Every sequence in flight switches weights at once: none drifts before k0, many
        # from k0 on, and the later onsets are tokens whose drift stayed under tau at first.
        late = open_ & floor & (sig.first_bad >= k0)
        onset_seq = int(np.flatnonzero(after & (sig.first_bad == k0))[0])
        yield (
            finding(
                batch,
                Cause.VERSION_CHANGE,
                late,
                f"{int(late.sum())} sequences are clean up to completion index {k0} and drift "
                f"from there on ({int(shared.sum())} of them within {ONSET_WINDOW} tokens of it), "
                f"by a small fraction of the logprobs (median {relative:.1%}), as a weight update "
                "does: the weights changed while they were being generated (an in-flight "
                "update); record per-token weight versions and score each token with its own",
                details={"at": position_of(batch, onset_seq), "relative_drift": relative},
                confidence=float(shared.sum() / late.sum()),
                first=onset_seq,
                runner_up=(
                    Cause.POSITION_IDS,
                    f"a position bug scrambles attention, moving logprobs by tens of % "
                    f"(here {relative:.1%})",
                ),
            ),
            late,
        )
        after = after & ~late
    restart = after & (sig.first_bad == 1)
    drifting = open_ & (sig.bad >= MIN_TOKENS)
    if restart.sum() >= 2 and restart.sum() >= EXPLAINS * drifting.sum():
        restart = open_ & floor & (sig.first_bad >= 1)  # every sequence restarts there
    else:
        restart[:] = False
    positions = (after & (sig.first_bad >= MIN_TOKENS)) | restart
    if positions.any():
        first = int(np.argmax(positions))
        yield (
            finding(
                batch,
                Cause.POSITION_IDS,
                positions,
                f"drift starts at position {position_of(batch, first)} of seq {batch.ids[first]} "
                f"(clean before) and stays on ({float(np.mean(sig.bad_after_onset[positions])):.0%} "
                "of the later tokens over tau) in "
                f"{int(positions.sum())} sequences: position ids are offset from there "
                "(restarted at the completion, KV-cache or packing position bug)",
                details={"onset": position_of(batch, first)},
                runner_up=(
                    Cause.VERSION_CHANGE,
                    "the onsets are not one shared index across the batch"
                    if positions.sum() > 1
                    else "only one sequence drifts; a weight update hits every sequence in flight",
                ),
            ),
            positions,
        )


def from_start_rule(batch: Batch, open_: np.ndarray):
    """Drift from the first tokens on: precision, the batch's weights, or one sequence's
    context (padding, a different prompt)."""
    sig = batch.sig
    if not open_.any():
        return
    ceiling = weighted_ceiling(batch, open_)
    mean_abs = float(np.average(sig.mean_abs[open_], weights=sig.tokens[open_]))
    # Clean at the floor, not merely under tau; substantial: most tokens from the onset on.
    clean = clean_at_floor(batch)
    substantial = open_ & (sig.bad >= MIN_TOKENS) & (sig.bad_after_onset >= 0.5)
    if clean.any() and substantial.any():
        # Precision and weights touch every sequence; some at the floor rule both out.
        yield from _context_findings(batch, substantial, clean)
        open_ = open_ & ~substantial
        if not open_.any():
            return
        mean_abs = float(np.average(sig.mean_abs[open_], weights=sig.tokens[open_]))
        ceiling = weighted_ceiling(batch, open_)
    if clean.any() and mean_abs > ceiling:
        # Weights, precision and prompts of the whole batch would reach the clean ones too.
        yield (unexplained(batch, open_), open_.copy())
        return
    weights, why_weights, bias = weight_like(sig, open_)
    # Without a measured floor, a low-precision side's noise may reach past the constant
    # ceiling on a large model: unbiased drift there is named precision, never a semantic
    # cause, and the finding says to calibrate.
    uncalibrated_low = not batch.calibrated and low_precision_side(batch)
    # The precision gate failed: at this token count the batch's drift is beyond what
    # precision gives, so precision is no explanation, however small each sequence's drift.
    beyond_gate = batch.context.beyond_precision
    beyond = (
        f"beyond what precision gives at {int(sig.tokens.sum())} tokens (the precision gate)"
        if beyond_gate
        else f"beyond the {ceiling:.3g} precision gives"
    )
    if not weights and not beyond_gate and (mean_abs <= ceiling or uncalibrated_low):
        floor = (
            f"the calibrated floor gives up to {ceiling:.3g} for these tokens"
            if batch.calibrated
            else f"{ceiling:g} is the constant for {low_dtype(batch)} sides"
            + (
                "; uncalibrated: lpx calibrate measures this model's own floor"
                if mean_abs > ceiling
                else ""
            )
        )
        yield (
            finding(
                batch,
                Cause.DTYPE,
                open_,
                f"numeric drift in {int(open_.sum())} sequences: mean |d| {mean_abs:.3g} "
                f"({floor}), from lower-precision kernels, TF32 or another reduction order, "
                f"not biased as a weight change biases sequences ({why_weights}); no semantic "
                "cause fits",
                severity="info",
                details={
                    "dtype": low_dtype(batch),
                    "mean_abs_diff": mean_abs,
                    "ceiling": ceiling,
                    "calibrated": batch.calibrated,
                    "bias": bias,
                },
                confidence=min(1.0, ceiling / max(mean_abs, 1e-12) / 2),
                # a claim like any other: verified only by re-scoring in the declared
                # precisions (verification), never by the signature
                status="plausible",
                residual_before=mean_abs,
                floor=float(np.average(batch.noise_mean[open_], weights=sig.tokens[open_])),
                runner_up=(
                    Cause.STALE_WEIGHTS,
                    f"weights bias whole sequences, the same way or strongly; {why_weights}",
                ),
            ),
            open_.copy(),
        )
        return
    if not weights:
        # Drift in every sequence, beyond precision, yet not a weight change's bias: the
        # whole batch saw other inputs (a BOS added or dropped, another chat template). One
        # optimiser step instead moves whole sequences, most of them the same way (a
        # likelihood step, an RL step with mostly positive advantages) or strongly.
        yield (
            finding(
                batch,
                Cause.PROMPT_MISMATCH,
                open_,
                f"drift in every sequence ({int(open_.sum())}) from the first tokens on, mean "
                f"|d| {mean_abs:.3g} ({beyond}), not biased as a "
                f"weight change biases sequences ({why_weights}): the two sides scored different "
                "prompt tokens for the whole batch (a BOS added or dropped, another chat "
                "template); compare the prompt ids each side used",
                details={"mean_abs_diff": mean_abs, "bias": bias},
                confidence=0.6,
                runner_up=(
                    Cause.STALE_WEIGHTS,
                    f"weights one step apart bias whole sequences, the same way or strongly; "
                    f"{why_weights}",
                ),
            ),
            open_.copy(),
        )
        return
    yield (
        finding(
            batch,
            Cause.STALE_WEIGHTS,
            open_,
            f"drift in every sequence ({int(open_.sum())}) from the first tokens on, mean |d| "
            f"{mean_abs:.3g} ({beyond}), biased per sequence as a weight change biases them "
            f"({why_weights}); {_fingerprints_said(batch)}, so if the weights differ they "
            "differ in the engines' memory (a weight sync that did not land, a wrong conversion "
            "or sharding); a change of the whole batch's sampling or prompts can look alike, "
            "and only re-scoring with the model tells them apart (lpx diagnose)",
            details={"mean_abs_diff": mean_abs, "bias": bias},
            confidence=0.9,
            runner_up=(
                Cause.PROMPT_MISMATCH,
                "a prompt mismatch moves each sequence its own way, and weakly on average",
            ),
        ),
        open_.copy(),
    )


def _fingerprints_said(batch: Batch) -> str:
    """What the weight fingerprints on file say, when the signature suspects the weights."""
    fixture, replay = batch.context.fixture_weights, batch.context.replay_weights
    if fixture and replay:
        return "the weight fingerprints on file are equal"
    return "no weight fingerprint on file " + ("for the replay" if fixture else "for the rollout")


def _context_findings(batch: Batch, open_, clean):
    """Some sequences drift from the start while others are clean at the noise floor:
    weights are shared by the batch, so it is each sequence's own input."""
    prompt_lengths = batch.context.prompt_lengths
    lengths = batch.context.sequence_lengths
    drift_ids = open_
    cause, why = Cause.MASK_PADDING, ""
    if prompt_lengths is not None and lengths is not None:
        longest_prompts = prompt_lengths[drift_ids].min() > prompt_lengths[clean].max()
        padded = lengths[drift_ids].max() < lengths[clean].max() or (
            np.median(lengths[drift_ids]) < np.median(lengths[clean])
        )
        if longest_prompts:
            cause = Cause.PROMPT_MISMATCH
            why = (
                f"every drifting sequence has a longer prompt ({int(prompt_lengths[drift_ids].min())}+ "
                f"tokens) than every clean one (<= {int(prompt_lengths[clean].max())}): the long "
                "prompts were cut (truncation to a max prompt length) on one side"
            )
        elif padded:
            why = (
                "the drifting sequences are shorter than the clean ones, as the sequences that "
                "get padding in a batch are: padding was attended (attention mask lost or "
                "dropped), or packed sequences attended across segments"
            )
        else:
            why = (
                "the drifting and clean sequences do not differ in length, as in packed "
                "micro-batches whose segments attend to each other (position ids not reset)"
            )
    runner = Cause.PROMPT_MISMATCH if cause == Cause.MASK_PADDING else Cause.MASK_PADDING
    yield (
        finding(
            batch,
            cause,
            open_,
            f"{int(open_.sum())} sequences drift from their first tokens while "
            f"{int(clean.sum())} are clean at the noise floor; {why}",
            confidence=0.8 if why else 0.5,
            runner_up=(
                Cause.STALE_WEIGHTS,
                f"weights are shared by the whole batch, yet {int(clean.sum())} sequences are "
                f"clean (second: {runner})",
            ),
        ),
        open_.copy(),
    )

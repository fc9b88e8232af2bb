"""Hypotheses read from the records: weight fingerprints and versions, and per-sequence data
signatures (a logprob shift by one token, a constant fill, labels off by one, rounding)."""

from __future__ import annotations

import numpy as np

from pipeline.compare.claims import misclaimed_versions
from pipeline.compare.hypotheses.batch import (
    EXPLAINS,
    LABEL_SHIFT_GAP,
    MIN_TOKENS,
    ONE_SIGNED,
    Batch,
    fills_zero,
    finding,
    rms,
    truncated_sampling,
    weights_evidence,
)
from pipeline.compare.signatures import segment_sum
from pipeline.contracts.causes import Cause


def fingerprint_rule(batch: Batch, open_: np.ndarray):
    evidence = weights_evidence(batch.context)
    if not evidence:
        return
    claimed = open_.copy()
    drift = (
        f"drift above tau in {int(claimed.sum())} sequences" if claimed.any() else "yet no drift"
    )
    yield (
        finding(
            batch,
            Cause.STALE_WEIGHTS,
            claimed,
            f"{evidence} ({drift})",
            severity="fault" if claimed.any() else "info",
        ),
        claimed,
    )


def data_shift_rule(batch: Batch, open_: np.ndarray):
    sig = batch.sig
    for shift in (1, -1):
        fits = open_ & (sig.bad >= MIN_TOKENS) & (sig.shift_fit[shift] >= EXPLAINS)
        if fits.any():
            share = float(np.mean(sig.shift_fit[shift][fits]))
            yield (
                finding(
                    batch,
                    Cause.TOKEN_SHIFT,
                    fits,
                    f"shifted by {shift:+d}, the replay logprob at t equals the rollout logprob at "
                    f"t{shift:+d} for {share:.0%} of the drifting tokens: logprobs and tokens are "
                    "off by one",
                    details={"shift": shift, "fit_fraction": share},
                    confidence=share,
                ),
                fits,
            )
            open_ = open_ & ~fits


def constant_fill_rule(batch: Batch, open_: np.ndarray):
    sig = batch.sig
    for side, other in (("rollout", "train"), ("train", "rollout")):
        filled = (
            open_
            & (sig.bad >= MIN_TOKENS)
            & (sig.constant_fill[side] >= EXPLAINS)
            & (sig.constant_fill[other] < 0.5)
        )
        if side == "rollout" and truncated_sampling(batch):
            # Under top-k/top-p a token alone in its kept set has processed logprob 0.0
            # exactly: a repeated 0.0 there is truncation, which the sampling rule names.
            filled &= ~fills_zero(batch, filled)
        if filled.any():
            values = batch.rollout if side == "rollout" else batch.train
            first = int(batch.offsets[np.argmax(filled)] + max(sig.first_bad[np.argmax(filled)], 0))
            name = "rollout" if side == "rollout" else "replay"
            yield (
                finding(
                    batch,
                    Cause.MASK_PADDING,
                    filled,
                    f"the {name} side repeats one value ({float(values[first]):g}) at "
                    f"{float(np.mean(sig.constant_fill[side][filled])):.0%} of the drifting tokens "
                    "while the other side varies: padding or masked tokens were treated as "
                    "active; check the completion mask and pad handling",
                    details={"side": name, "fill_value": float(values[first])},
                    runner_up=(Cause.TOKEN_SHIFT, "the values repeat rather than move by a token"),
                ),
                filled,
            )
            open_ = open_ & ~filled


def label_shift_rule(batch: Batch, open_: np.ndarray):
    """Labels scored off by one in the model: one side scores each token with the logits of
    the next position, so it is far lower on nearly every token from the first."""
    sig = batch.sig
    lower = np.where(sig.train_lower >= 0.5, sig.train_lower, 1 - sig.train_lower)
    fits = (
        open_
        & (sig.bad >= MIN_TOKENS)
        & (lower >= ONE_SIGNED)
        & (sig.low_side_gap >= LABEL_SHIFT_GAP)
        & (sig.first_bad <= 1)
    )
    drifting = open_ & (sig.bad >= MIN_TOKENS)
    # Label code is shared by the batch: it shifts every sequence, from the first token.
    if fits.sum() >= max(1, EXPLAINS * drifting.sum()):
        fits = drifting & (sig.first_bad <= 1)
        side = "replay" if np.mean(sig.train_lower[fits]) >= 0.5 else "rollout"
        gap = float(np.median(sig.low_side_gap[fits]))
        yield (
            finding(
                batch,
                Cause.TOKEN_SHIFT,
                fits,
                f"the {side} side is lower on {float(np.mean(lower[fits])):.0%} of the drifting "
                f"tokens by {gap:.2g} nats (median over sequences) from the first token: it scores "
                "each token with the logits of the wrong position (labels off by one)",
                details={"shift": "labels", "side": side, "median_gap": gap},
                runner_up=(
                    Cause.TOP_K,
                    f"a truncation gap stays near 0 on confident tokens; this one is {gap:.2g}",
                ),
            ),
            fits,
        )


def precision_rounding_rule(batch: Batch, open_: np.ndarray):
    sig = batch.sig
    for side, other, name in (("rollout", "train", "rollout"), ("train", "rollout", "replay")):
        for dtype, exact in (("bfloat16", sig.bf16_exact), ("float16", sig.fp16_exact)):
            rounded = open_ & (sig.bad >= MIN_TOKENS) & (exact[side] >= 1.0) & (exact[other] < 0.5)
            if rounded.any():
                yield (
                    finding(
                        batch,
                        Cause.DTYPE,
                        rounded,
                        f"the {name} logprobs are exactly representable in {dtype} at every "
                        "drifting token and the other side's are not: they were rounded to "
                        f"{dtype} (drift RMS {rms(batch, rounded):.3g})",
                        severity="info",
                        details={"side": name, "dtype": dtype},
                    ),
                    rounded,
                )
                open_ = open_ & ~rounded


def claimed_version_rule(batch: Batch, open_: np.ndarray):
    """A multi-version replay scored sequences under the store's versions next to the ones
    they claim: tokens far closer to another version than to their own were served by it."""
    channels = batch.context.version_channels
    if not channels or batch.versions is None:
        return
    misclaims = misclaimed_versions(
        batch.versions, batch.train, batch.rollout, batch.offsets, channels
    )
    for misclaim in misclaims:
        claimed = np.zeros(len(batch.ids), dtype=bool)
        claimed[misclaim.sequences] = True
        if not (claimed & open_).any():
            continue  # within tolerance: the claim is wrong, yet nothing drifts to explain
        yield (
            finding(
                batch,
                Cause.CLAIMED_VERSION,
                claimed,
                f"{misclaim.tokens} tokens in {int(claimed.sum())} sequences claim weight "
                f"version {misclaim.claimed} but match version {misclaim.served}: mean |d| "
                f"{misclaim.mean_abs_claimed:.3g} under the claimed version vs "
                f"{misclaim.mean_abs_served:.3g} under {misclaim.served}; the fleet served "
                f"{misclaim.served} while tagging {misclaim.claimed} (check its weight sync)",
                details={
                    "claimed": misclaim.claimed,
                    "served": misclaim.served,
                    "tokens": misclaim.tokens,
                    "mean_abs_diff_claimed": misclaim.mean_abs_claimed,
                    "mean_abs_diff_served": misclaim.mean_abs_served,
                },
                # the multi-version replay re-scored the tokens under both versions
                status="verified",
            ),
            claimed,
        )


def weight_version_rule(batch: Batch, open_: np.ndarray):
    """Recorded per-token weight versions: tokens sampled under another version than the
    batch's reference explain the drift on exactly those tokens."""
    reference = batch.context.reference_weight_version
    versions = batch.versions
    if versions is None or reference is None:
        return
    other = np.asarray(versions != reference, dtype=bool)
    seq = batch.seq
    n_other = segment_sum(other, batch.offsets)
    explained = segment_sum(batch.bad_tokens & other, batch.offsets)
    covered = open_ & (n_other > 0) & (explained >= EXPLAINS * np.maximum(batch.sig.bad, 1))
    if not covered.any():
        return
    whole = covered & (n_other == batch.sig.tokens)
    part = covered & ~whole
    other_versions = sorted({str(v) for v in versions[other]})
    drift_other = float(np.abs(batch.diff[other]).mean())
    drift_same = float(np.abs(batch.diff[~other]).mean()) if (~other).any() else 0.0
    if part.any():
        changes = np.flatnonzero(other & ~np.roll(other, 1) & (np.arange(len(other)) > 0))
        local = changes - batch.offsets[seq[changes]]
        index = int(np.bincount(local).argmax()) if len(local) else 0
        # point at a sequence that changes there; `at` is its completion position
        first = int(seq[changes[local == index][0]]) if len(local) else int(np.argmax(part))
        at = int(batch.positions[batch.offsets[first] + index]) if len(local) else 0
        yield (
            finding(
                batch,
                Cause.VERSION_CHANGE,
                part,
                f"the weight version changes within {int(part.sum())} sequences (to "
                f"{', '.join(other_versions)}, from completion index {at} in most) while the "
                f"batch is at {reference}; mean |d| {drift_other:.3g} on those tokens vs "
                f"{drift_same:.3g} on the others: score each token with its own version",
                details={"at": at, "versions": other_versions, "reference": str(reference)},
                first=first,
                position=at,
                runner_up=(
                    Cause.STALE_WEIGHTS,
                    "the tokens before the recorded change agree; only those after it drift",
                ),
            ),
            part,
        )
    if whole.any():
        yield (
            finding(
                batch,
                Cause.STALE_WEIGHTS,
                whole,
                f"{int(whole.sum())} sequences were sampled under weight_version "
                f"{', '.join(other_versions)} while the batch is at {reference}; mean |d| "
                f"{drift_other:.3g} on them vs {drift_same:.3g} on the others",
                details={"stale_versions": other_versions, "reference": str(reference)},
            ),
            whole,
        )

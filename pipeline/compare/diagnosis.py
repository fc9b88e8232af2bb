"""Explain drift: name the cause from the whole batch's evidence, never from one sequence.

Every rule reads the per-sequence signatures (``signatures.py``: arrays over all sequences
at once) and claims the drifting sequences its evidence explains, most specific evidence
first:

1. per-sequence data signatures: a logprob shift by one token, a constant fill, labels
   scored off by one, logprobs rounded to a low precision, recorded weight versions;
2. batch-wide sampling processing (temperature, top-k, top-p), from the one-signed or
   linear gap they leave, checked against the rollout's recorded sampling;
3. onsets: drift that starts after clean tokens (positions; a weight update at index k
   when many sequences share the onset);
4. drift from the first token: precision noise (unbiased, at a numeric level), weights
   (the whole batch, biased per sequence), padding or prompt context (only some sequences;
   the rest clean, which rules weights out, since weights are shared by the batch).

Each finding carries a confidence, the first bad position, the runner-up cause and why it
lost; `unexplained` says what was ruled out. Causes follow shared/notes/metrics.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from functools import cached_property

import numpy as np

from pipeline.compare.claims import misclaimed_versions
from pipeline.compare.signatures import Signatures, segment_sum, signatures

FAULT_CAUSES = (
    "token_shift",
    "mask_padding",
    "position_ids",
    "prompt_mismatch",
    "temperature",
    "top_k",
    "top_p",
    "stale_weights",
    "version_change",
    "claimed_version",
    "missing_version",
)
KNOWN_CAUSES = (*FAULT_CAUSES, "dtype", "unexplained")  # what a policy's fail_on_findings may name
EXPLAINS = 0.75  # fraction of a sequence's drifting tokens a signature must explain
MIN_TOKENS = 2
ONE_SIGNED = 0.95  # fraction of drifting tokens on which the same side is higher
LABEL_SHIFT_GAP = 2.0  # nats: a factor e^2 at the typical token, beyond any processing
# Mean |d| that precision alone gives, by the lowest precision declared by either side. fp32
# runs still meet TF32 matmuls, another reduction order or a head left in bf16 (~1e-3);
# bf16 engines of the same weights differ by a mean |d| of ~0.011-0.013 in public reports.
NUMERIC_CEILING = {"float32": 0.01, "float16": 0.01, "bfloat16": 0.03}
WEIGHT_SIGN_Z = 8.0  # a weight change: per-sequence direction this many s.e. above chance
ONSET_WINDOW = 3  # tokens: a shared onset may show up to this late (drift under tau at first)
PREFIX_FLOOR = 0.1  # before an onset, |d| stays under this fraction of tau
# A weight update moves logprobs by a small fraction of their size (one RL step: KL ~1e-3,
# mean |d| a few % of mean |logprob|); a position bug scrambles attention, tens of %.
WEIGHT_STEP_RELATIVE = 0.3
LIKELY_LOGPROB = float(np.log(0.3))


@dataclass
class Finding:
    cause: str
    sequences: list[str]
    first_position: dict
    evidence: str
    severity: str = "fault"
    details: dict = field(default_factory=dict)
    confidence: float = 1.0
    runner_up: dict | None = None  # {"cause", "why_not"}

    def as_dict(self) -> dict:
        # shallow: dataclasses.asdict deep-copies every sequence id (80 ms on 30k sequences)
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class Batch:
    """What the rules see: signatures per sequence plus the batch's own records."""

    sig: Signatures
    ids: list[str]
    positions: np.ndarray  # each token's position in its completion (masked tokens skipped)
    offsets: np.ndarray
    train: np.ndarray
    rollout: np.ndarray
    tau: float
    versions: np.ndarray | None
    context: dict

    @property
    def drifting(self) -> np.ndarray:
        return self.sig.bad > 0

    # Per-token arrays several rules read; computed once.
    @cached_property
    def seq(self) -> np.ndarray:
        """Each token's sequence index."""
        return np.repeat(np.arange(len(self.ids)), np.diff(self.offsets))

    @cached_property
    def diff(self) -> np.ndarray:
        """d = train - rollout per token, float64."""
        return self.train.astype(np.float64) - self.rollout.astype(np.float64)

    @cached_property
    def bad_tokens(self) -> np.ndarray:
        return np.abs(self.diff) > self.tau


def diagnose_region(
    train, rollout, offsets, positions, sequence_ids, weight_versions, tau, context
) -> list[Finding]:
    """Findings for one compared region (the completion), from flat arrays."""
    batch = Batch(
        signatures(train, rollout, offsets, tau),
        list(sequence_ids),
        positions,
        offsets,
        train,
        rollout,
        tau,
        weight_versions,
        context,
    )
    open_ = batch.drifting.copy()
    findings: list[Finding] = []
    for rule in RULES:
        if not open_.any() and rule is not fingerprint_rule:
            continue
        for finding, claimed in rule(batch, open_):
            findings.append(finding)
            open_ &= ~claimed
    if open_.any():
        findings.append(_unexplained(batch, open_))
    return findings


# --- rules: each yields (finding, the sequences it claims) --------------------------------


def fingerprint_rule(batch: Batch, open_: np.ndarray):
    evidence = weights_evidence(batch.context)
    if not evidence:
        return
    claimed = open_.copy()
    drift = (
        f"drift above tau in {int(claimed.sum())} sequences" if claimed.any() else "yet no drift"
    )
    yield (
        _finding(
            batch,
            "stale_weights",
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
                _finding(
                    batch,
                    "token_shift",
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
        if side == "rollout" and _truncated_sampling(batch):
            # Under top-k/top-p a token alone in its kept set has processed logprob 0.0
            # exactly: a repeated 0.0 there is truncation, which the sampling rule names.
            filled &= ~_fills_zero(batch, filled)
        if filled.any():
            values = batch.rollout if side == "rollout" else batch.train
            first = int(batch.offsets[np.argmax(filled)] + max(sig.first_bad[np.argmax(filled)], 0))
            name = "rollout" if side == "rollout" else "replay"
            yield (
                _finding(
                    batch,
                    "mask_padding",
                    filled,
                    f"the {name} side repeats one value ({float(values[first]):g}) at "
                    f"{float(np.mean(sig.constant_fill[side][filled])):.0%} of the drifting tokens "
                    "while the other side varies: padding or masked tokens were treated as "
                    "active; check the completion mask and pad handling",
                    details={"side": name, "fill_value": float(values[first])},
                    runner_up=("token_shift", "the values repeat rather than move by a token"),
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
            _finding(
                batch,
                "token_shift",
                fits,
                f"the {side} side is lower on {float(np.mean(lower[fits])):.0%} of the drifting "
                f"tokens by {gap:.2g} nats (median over sequences) from the first token: it scores "
                "each token with the logits of the wrong position (labels off by one)",
                details={"shift": "labels", "side": side, "median_gap": gap},
                runner_up=(
                    "top_k",
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
                    _finding(
                        batch,
                        "dtype",
                        rounded,
                        f"the {name} logprobs are exactly representable in {dtype} at every "
                        "drifting token and the other side's are not: they were rounded to "
                        f"{dtype} (drift RMS {_rms(batch, rounded):.3g})",
                        severity="info",
                        details={"side": name, "dtype": dtype},
                    ),
                    rounded,
                )
                open_ = open_ & ~rounded


def claimed_version_rule(batch: Batch, open_: np.ndarray):
    """A multi-version replay scored sequences under the store's versions next to the ones
    they claim: tokens far closer to another version than to their own were served by it."""
    channels = batch.context.get("version_channels")
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
            _finding(
                batch,
                "claimed_version",
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
            ),
            claimed,
        )


def weight_version_rule(batch: Batch, open_: np.ndarray):
    """Recorded per-token weight versions: tokens sampled under another version than the
    batch's reference explain the drift on exactly those tokens."""
    reference = batch.context.get("reference_weight_version")
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
            _finding(
                batch,
                "version_change",
                part,
                f"the weight version changes within {int(part.sum())} sequences (to "
                f"{', '.join(other_versions)}, from completion index {at} in most) while the "
                f"batch is at {reference}; mean |d| {drift_other:.3g} on those tokens vs "
                f"{drift_same:.3g} on the others: score each token with its own version",
                details={"at": at, "versions": other_versions, "reference": str(reference)},
                first=first,
            ),
            part,
        )
    if whole.any():
        yield (
            _finding(
                batch,
                "stale_weights",
                whole,
                f"{int(whole.sum())} sequences were sampled under weight_version "
                f"{', '.join(other_versions)} while the batch is at {reference}; mean |d| "
                f"{drift_other:.3g} on them vs {drift_same:.3g} on the others",
                details={"stale_versions": other_versions, "reference": str(reference)},
            ),
            whole,
        )


def sampling_rule(batch: Batch, open_: np.ndarray):
    """Processed vs raw logprobs. Truncation renormalises the kept tokens, so the processed
    side is higher at every sampled token, by -log(kept mass): never more than -log(top_p)
    under top-p. Temperature makes the gap linear in the logprob. The rollout's recorded
    sampling names which processing was in use."""
    candidates = open_ & (batch.sig.bad >= MIN_TOKENS)
    if candidates.sum() == 0 or _clean_at_floor(batch).any():
        return  # processing touches every sequence; some at the floor rule it out
    d = _flat_bad_diff(batch, candidates)
    if len(d) < 3:
        return
    processed_higher_rollout = float(np.mean(d < 0))
    one_signed = max(processed_higher_rollout, 1 - processed_higher_rollout) >= ONE_SIGNED
    sampling = batch.context.get("sampling") or {}
    temperature = float(sampling.get("temperature", 1.0) or 1.0)
    top_k = int(sampling.get("top_k", 0) or 0)
    top_p = float(sampling.get("top_p", 1.0) or 1.0)
    side = "rollout" if processed_higher_rollout >= 0.5 else "replay"
    gap = np.abs(d)
    max_gap = float(np.quantile(gap, 0.999))
    fit = _temperature_fit(batch, candidates) or (
        _sharpening(batch, candidates) if temperature != 1.0 else None
    )
    causes = []
    if one_signed and (top_k > 0 or top_p < 1.0):
        if top_k > 0:
            causes.append(("top_k", f"top-k {top_k} in the rollout's sampling"))
        if top_p < 1.0:
            bound = -np.log(top_p)
            causes.append(
                ("top_p", f"top-p {top_p:g} in the rollout's sampling; gap <= {bound:.3g} nats")
            )
    elif fit and (temperature != 1.0 or batch.context.get("temperature_hint") or not sampling):
        causes.append(("temperature", fit[0]))
    elif one_signed and not sampling:
        if max_gap <= -np.log(0.5):
            causes.append(
                ("top_p", f"every gap under {max_gap:.3g} nats: top-p ~{np.exp(-max_gap):.2f}")
            )
        else:
            causes.append(("top_k", f"gaps up to {max_gap:.3g} nats, beyond a top-p bound"))
    elif batch.context.get("temperature_hint") and one_signed:
        causes.append(("temperature", batch.context["temperature_hint"]))
    if not causes:
        return
    claimed = candidates.copy()
    for cause, why in causes:
        yield (
            _finding(
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
                    **({"temperature_fit": fit[1]} if fit and cause == "temperature" else {}),
                },
                runner_up=(
                    "stale_weights",
                    "weights move sampled tokens both ways; here one side is higher throughout",
                )
                if one_signed
                else (
                    "stale_weights",
                    "the gap is linear in the logprob, as a temperature makes it",
                ),
            ),
            claimed,
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
        & (sig.mean_abs > _ceiling(batch))
    )
    if not after.any():
        return
    onsets = sig.first_bad[after]
    k0 = int(onsets.min())
    shared = after & (sig.first_bad <= k0 + ONSET_WINDOW)
    relative = float(np.median(sig.relative[after]))
    # An update reaches every sequence still generating at k0: one clean at the floor well
    # past k0 rules it out (a request admitted after it would drift from its first token).
    untouched = (_clean_at_floor(batch) & (sig.tokens > k0 + ONSET_WINDOW)).any()
    if k0 >= 2 and shared.sum() >= 2 and relative <= WEIGHT_STEP_RELATIVE and not untouched:
        # Every sequence in flight switches weights at once: none drifts before k0, many
        # from k0 on, and the later onsets are tokens whose drift stayed under tau at first.
        late = open_ & floor & (sig.first_bad >= k0)
        onset_seq = int(np.flatnonzero(after & (sig.first_bad == k0))[0])
        yield (
            _finding(
                batch,
                "version_change",
                late,
                f"{int(late.sum())} sequences are clean up to completion index {k0} and drift "
                f"from there on ({int(shared.sum())} of them within {ONSET_WINDOW} tokens of it), "
                f"by a small fraction of the logprobs (median {relative:.1%}), as a weight update "
                "does: the weights changed while they were being generated (an in-flight "
                "update); record per-token weight versions and score each token with its own",
                details={"at": _position(batch, onset_seq), "relative_drift": relative},
                confidence=float(shared.sum() / late.sum()),
                first=onset_seq,
                runner_up=(
                    "position_ids",
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
            _finding(
                batch,
                "position_ids",
                positions,
                f"drift starts at position {_position(batch, first)} of seq {batch.ids[first]} "
                f"(clean before) and stays on ({float(np.mean(sig.bad_after_onset[positions])):.0%} "
                "of the later tokens over tau) in "
                f"{int(positions.sum())} sequences: position ids are offset from there "
                "(restarted at the completion, KV-cache or packing position bug)",
                details={"onset": _position(batch, first)},
                runner_up=(
                    "version_change",
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
    ceiling = _ceiling(batch)
    mean_abs = float(np.average(sig.mean_abs[open_], weights=sig.tokens[open_]))
    # Clean at the floor, not merely under tau; substantial: most tokens from the onset on.
    clean = _clean_at_floor(batch)
    substantial = open_ & (sig.bad >= MIN_TOKENS) & (sig.bad_after_onset >= 0.5)
    if clean.any() and substantial.any():
        # Precision and weights touch every sequence; some at the floor rule both out.
        yield from _context_findings(batch, substantial, clean)
        open_ = open_ & ~substantial
        if not open_.any():
            return
        mean_abs = float(np.average(sig.mean_abs[open_], weights=sig.tokens[open_]))
    if clean.any() and mean_abs > ceiling:
        # Weights, precision and prompts of the whole batch would reach the clean ones too.
        yield (_unexplained(batch, open_), open_.copy())
        return
    weights, why_weights, bias = _weight_like(sig, open_)
    if not weights and mean_abs <= ceiling:
        yield (
            _finding(
                batch,
                "dtype",
                open_,
                f"numeric drift in {int(open_.sum())} sequences: mean |d| {mean_abs:.3g} within "
                f"what precision gives ({ceiling:g} for {_low_dtype(batch)} sides: lower-precision "
                f"kernels, TF32, another reduction order), not biased as a weight change biases "
                f"sequences ({why_weights}); no semantic cause fits",
                severity="info",
                details={"dtype": _low_dtype(batch), "mean_abs_diff": mean_abs, "bias": bias},
                confidence=min(1.0, ceiling / max(mean_abs, 1e-12) / 2),
                runner_up=(
                    "stale_weights",
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
            _finding(
                batch,
                "prompt_mismatch",
                open_,
                f"drift in every sequence ({int(open_.sum())}) from the first tokens on, mean "
                f"|d| {mean_abs:.3g} (beyond the {ceiling:g} precision gives), not biased as a "
                f"weight change biases sequences ({why_weights}): the two sides scored different "
                "prompt tokens for the whole batch (a BOS added or dropped, another chat "
                "template); compare the prompt ids each side used",
                details={"mean_abs_diff": mean_abs, "bias": bias},
                confidence=0.6,
                runner_up=(
                    "stale_weights",
                    f"weights one step apart bias whole sequences, the same way or strongly; "
                    f"{why_weights}",
                ),
            ),
            open_.copy(),
        )
        return
    yield (
        _finding(
            batch,
            "stale_weights",
            open_,
            f"drift in every sequence ({int(open_.sum())}) from the first tokens on, mean |d| "
            f"{mean_abs:.3g} (beyond the {ceiling:g} precision gives), biased per sequence as "
            f"a weight change biases them ({why_weights}), with equal weight fingerprints on "
            "file: the engines likely hold different weights (stale policy version, wrong "
            "weight conversion or sharding)",
            details={"mean_abs_diff": mean_abs, "bias": bias},
            confidence=0.9,
            runner_up=(
                "prompt_mismatch",
                "a prompt mismatch moves each sequence its own way, and weakly on average",
            ),
        ),
        open_.copy(),
    )


def _context_findings(batch: Batch, open_, clean):
    """Some sequences drift from the start while others are clean at the noise floor:
    weights are shared by the batch, so it is each sequence's own input."""
    prompt_lengths = batch.context.get("prompt_lengths")
    lengths = batch.context.get("sequence_lengths")
    drift_ids = open_
    cause, why = "mask_padding", ""
    if prompt_lengths is not None and lengths is not None:
        longest_prompts = prompt_lengths[drift_ids].min() > prompt_lengths[clean].max()
        padded = lengths[drift_ids].max() < lengths[clean].max() or (
            np.median(lengths[drift_ids]) < np.median(lengths[clean])
        )
        if longest_prompts:
            cause = "prompt_mismatch"
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
    runner = "prompt_mismatch" if cause == "mask_padding" else "mask_padding"
    yield (
        _finding(
            batch,
            cause,
            open_,
            f"{int(open_.sum())} sequences drift from their first tokens while "
            f"{int(clean.sum())} are clean at the noise floor; {why}",
            confidence=0.8 if why else 0.5,
            runner_up=(
                "stale_weights",
                f"weights are shared by the whole batch, yet {int(clean.sum())} sequences are "
                f"clean (second: {runner})",
            ),
        ),
        open_.copy(),
    )


RULES = (
    fingerprint_rule,
    data_shift_rule,
    constant_fill_rule,
    label_shift_rule,
    precision_rounding_rule,
    claimed_version_rule,
    weight_version_rule,
    sampling_rule,
    onset_rule,
    from_start_rule,
)


# --- helpers -------------------------------------------------------------------------------


def weights_evidence(context: dict) -> str | None:
    """Why the two sides' weights differ, from fingerprints, or None when nothing says so."""
    fixture_fp, replay_fp = context.get("fixture_weights"), context.get("replay_weights")
    if fixture_fp and replay_fp and fixture_fp != replay_fp:
        return (
            f"weights fingerprint differs: fixture {fixture_fp[:19]}... vs replay {replay_fp[:19]}...; "
            "the two sides hold different weights"
        )
    checkpoint, held = context.get("checkpoint_tensors"), context.get("held_tensors")
    if checkpoint and held and checkpoint != held:
        return (
            f"the replay engine holds weights ({held[:19]}...) that differ from the checkpoint it "
            f"loaded ({checkpoint[:19]}...), gathered from all its shards: the weight conversion, "
            "sharding or loading changed them"
        )
    return None


def _clean_at_floor(batch: Batch) -> np.ndarray:
    """Sequences that agree at the noise floor, not merely under tau: what a batch-wide
    cause (weights, precision, sampling, a shared template) cannot leave untouched."""
    sig = batch.sig
    return ~batch.drifting & (sig.tokens >= MIN_TOKENS) & (sig.mean_abs <= batch.tau * PREFIX_FLOOR)


def _unexplained(batch: Batch, open_: np.ndarray) -> Finding:
    return _finding(
        batch,
        "unexplained",
        open_,
        f"drift above tau in {int(open_.sum())} sequences (RMS {_rms(batch, open_):.3g}) that no "
        "known cause explains; ruled out: a token shift, a constant fill, labels off by one, "
        "rounding, recorded weight versions, sampling processing, a position or version onset, "
        "precision noise, weights and per-sequence context; inspect the worst tokens",
        confidence=0.0,
    )


def _finding(
    batch,
    cause,
    claimed,
    evidence,
    severity=None,
    details=None,
    confidence=1.0,
    runner_up=None,
    first=None,
):
    """``first``: the sequence whose first bad token the finding points at (default: the
    first claimed one)."""
    index = np.flatnonzero(claimed)
    ids = [batch.ids[i] for i in index]
    where = {}
    if first is None and len(index):
        first = int(index[0])
    if first is not None:
        where = {"sequence_id": batch.ids[first], "position": _position(batch, first)}
    return Finding(
        cause,
        ids,
        where,
        evidence,
        severity or ("fault" if cause in FAULT_CAUSES else "info"),
        details or {},
        round(float(confidence), 3),
        None if runner_up is None else {"cause": runner_up[0], "why_not": runner_up[1]},
    )


def _position(batch: Batch, i: int) -> int:
    """Completion position of sequence i's first bad token (its first token when none)."""
    start, end = int(batch.offsets[i]), int(batch.offsets[i + 1])
    if start == end:
        return 0
    return int(batch.positions[start + max(int(batch.sig.first_bad[i]), 0)])


def _rms(batch: Batch, which: np.ndarray) -> float:
    sig = batch.sig
    weights = sig.tokens[which]
    return (
        float(np.sqrt(np.average(sig.rms[which] ** 2, weights=weights))) if weights.sum() else 0.0
    )


def _weight_like(sig: Signatures, which: np.ndarray) -> tuple[bool, str, float]:
    """Moved per sequence as one weight update moves them: most of each sequence's drifting
    tokens go one way (up for the sequences the step favoured, down for the others). A
    prompt change moves each token its own way; precision noise averages out.

    The statistic is a per-sequence sign test, mean z^2 over the sequences (1 by chance).
    Tokens of one sequence share their context, so their signs are not independent: the
    evidence must stand WEIGHT_SIGN_Z standard errors (of independent signs) above chance."""
    n = int(which.sum())
    score = _bias_score(sig, which)
    needed = 1.0 + WEIGHT_SIGN_Z * math.sqrt(2.0 / max(n, 1))
    why = f"sign test: mean z^2 {score:.2f} over {n} sequences, weights need > {needed:.2f}"
    return score > needed, why, score


def _bias_score(sig: Signatures, which: np.ndarray) -> float:
    """Mean squared per-sequence sign-test z of d: ~1 for drift that goes both ways."""
    t = np.minimum(sig.sign_z[which] ** 2, 100.0)
    return float(t.mean()) if len(t) else 0.0


def _low_dtype(batch: Batch) -> str:
    return batch.context.get("low_precision_dtype", "float32")


def _ceiling(batch: Batch) -> float:
    return NUMERIC_CEILING.get(_low_dtype(batch), NUMERIC_CEILING["float32"])


def _flat_bad_diff(batch: Batch, which: np.ndarray) -> np.ndarray:
    return batch.diff[which[batch.seq] & batch.bad_tokens]


def _truncated_sampling(batch: Batch) -> bool:
    sampling = batch.context.get("sampling") or {}
    return int(sampling.get("top_k") or 0) > 0 or float(sampling.get("top_p") or 1.0) < 1.0


def _fills_zero(batch: Batch, which: np.ndarray) -> np.ndarray:
    """Sequences whose repeated rollout value is exactly 0.0."""
    zeros = segment_sum(batch.bad_tokens & (batch.rollout == 0.0), batch.offsets)
    return which & (zeros >= EXPLAINS * np.maximum(batch.sig.bad, 1))


def _sharpening(batch: Batch, which: np.ndarray):
    """T < 1 raises the likely tokens and T > 1 lowers them, all the same way; weights and
    noise move them both ways."""
    rollout, train = batch.rollout.astype(np.float64), batch.train.astype(np.float64)
    likely = which[batch.seq] & ((rollout + train) / 2 > LIKELY_LOGPROB) & batch.bad_tokens
    if likely.sum() < 6:
        return None
    up = float(np.mean(rollout[likely] > train[likely]))
    if max(up, 1 - up) < 0.9:
        return None
    side = "rollout" if up >= 0.9 else "replay"
    return (
        f"on the {int(likely.sum())} likely tokens (p > 0.3) the {side} logprob is higher in "
        f"{max(up, 1 - up):.0%}: the {side} distribution is sharpened",
        {"sharpened_side": side, "agreement": max(up, 1 - up)},
    )


def _temperature_fit(batch: Batch, which: np.ndarray):
    """rollout - train linear in train over the drifting tokens, with a temperature's slope."""
    d = batch.diff
    keep = which[batch.seq] & batch.bad_tokens
    if keep.sum() < 3:
        return None
    x, gap = batch.train[keep].astype(np.float64), -d[keep]
    var_x = x.var()
    if var_x <= 0 or gap.var() <= 0:
        return None
    cov = np.mean((x - x.mean()) * (gap - gap.mean()))
    gap_slope = cov / var_x
    r2 = cov * cov / (var_x * gap.var())
    slope = 1.0 + gap_slope
    if r2 < 0.8 or abs(gap_slope) < 0.05 or not 0.2 <= slope <= 5.0:
        return None
    return (
        f"rollout = {slope:.3f} x replay + c (R^2 of the gap {r2:.3f}, temperature ~{1 / slope:.2f})",
        {"slope": float(slope), "estimated_temperature": float(1 / slope), "r2": float(r2)},
    )

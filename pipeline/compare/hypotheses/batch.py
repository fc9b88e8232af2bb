"""What the hypothesis rules read: the batch (signatures per sequence and its records), the
constants they share, and the helpers that turn claimed sequences into a finding."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from pipeline.compare.signatures import Signatures, segment_sum
from pipeline.contracts.causes import FAULT_CAUSES, Cause
from pipeline.contracts.report import Finding

EXPLAINS = 0.75  # fraction of a sequence's drifting tokens a signature must explain
MIN_TOKENS = 2
ONE_SIGNED = 0.95  # fraction of drifting tokens on which the same side is higher
LABEL_SHIFT_GAP = 2.0  # nats: a factor e^2 at the typical token, beyond any processing
# Mean |d| that precision alone gives, by the lowest precision declared by either side. fp32
# runs still meet TF32 matmuls, another reduction order or a head left in bf16 (~1e-3);
# bf16 engines of the same weights differ by a mean |d| of ~0.011-0.013 in public reports.
NUMERIC_CEILING = {"float32": 0.01, "float16": 0.01, "bfloat16": 0.03}
# With a calibration: a sequence's mean |d| under this many times its floor is at the floor;
# beyond CALIBRATED_CEILING times, its drift is more than precision gives.
MEAN_AT_FLOOR = 2.0
CALIBRATED_CEILING = 3.0
# A shared onset (shared_onset_rule): before it the batch's drift by index stays within
# SHARED_ONSET_QUIET times the floor; after it, SHARED_ONSET_STEP times what it was; each
# token's multiple is capped so one outlier cannot make a step; at least MIN sequences.
SHARED_ONSET_QUIET = 2.0
SHARED_ONSET_STEP = 2.0
SHARED_ONSET_CAP = 20.0
SHARED_ONSET_MIN = 3
WEIGHT_SIGN_Z = 8.0  # a weight change: per-sequence direction this many s.e. above chance
ONSET_WINDOW = 3  # tokens: a shared onset may show up to this late (drift under tau at first)
PREFIX_FLOOR = 0.1  # before an onset, |d| stays under this fraction of tau
# A weight update moves logprobs by a small fraction of their size (one RL step: KL ~1e-3,
# mean |d| a few % of mean |logprob|); a position bug scrambles attention, tens of %.
WEIGHT_STEP_RELATIVE = 0.3
LIKELY_LOGPROB = float(np.log(0.3))


@dataclass
class Context:
    """What the rules read beside the logprobs: each side's records and, with a calibration,
    the measured noise floor."""

    low_precision_dtype: str = "float32"  # the profile of the two sides' precisions
    sampling: dict | None = None  # the fixture's recorded sampling
    tf32_side: bool = False
    reference_weight_version: object = None  # the version the replay scored under
    temperature_hint: str | None = None  # the rollout's processed temperature vs the replay's
    fixture_weights: str | None = None  # weight fingerprints, each side's
    replay_weights: str | None = None
    checkpoint_tensors: str | None = None  # the replay engine's checkpoint vs held tensors
    held_tensors: str | None = None
    version_channels: dict | None = None
    prompt_lengths: np.ndarray | None = None  # in the aligned order
    sequence_lengths: np.ndarray | None = None
    noise_expected: np.ndarray | None = None  # per token: the calibrated floor's mean |d|
    beyond_precision: bool = False  # the batch fails the calibrated precision gate

    @property
    def weights_differ(self) -> bool:
        return weights_evidence(self) is not None


@dataclass
class Batch:
    """What the rules see: signatures per sequence plus the batch's own records."""

    sig: Signatures
    ids: list[str]
    positions: np.ndarray  # each token's position in its completion (masked tokens skipped)
    offsets: np.ndarray
    train: np.ndarray
    rollout: np.ndarray
    tau: float | np.ndarray  # a token drifts when |d| > tau: one value, or one per token
    versions: np.ndarray | None
    context: Context

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

    @property
    def calibrated(self) -> bool:
        """Whether a measured noise floor judges this batch (`lpx calibrate`)."""
        return self.context.noise_expected is not None

    @cached_property
    def noise_mean(self) -> np.ndarray:
        """Per sequence: the mean |d| precision alone gives its tokens (the calibrated floor),
        else the constant ceiling of the batch's lowest precision."""
        expected = self.context.noise_expected
        if expected is None:
            constant = NUMERIC_CEILING.get(low_dtype(self), NUMERIC_CEILING["float32"])
            return np.full(len(self.ids), constant / CALIBRATED_CEILING)
        lengths = np.maximum(np.diff(self.offsets), 1)
        return segment_sum(np.asarray(expected, dtype=np.float64), self.offsets) / lengths


def weights_evidence(context: Context) -> str | None:
    """Why the two sides' weights differ, from fingerprints, or None when nothing says so."""
    fixture_fp, replay_fp = context.fixture_weights, context.replay_weights
    if fixture_fp and replay_fp and fixture_fp != replay_fp:
        return (
            f"weights fingerprint differs: fixture {fixture_fp[:19]}... vs replay {replay_fp[:19]}...; "
            "the two sides hold different weights"
        )
    checkpoint, held = context.checkpoint_tensors, context.held_tensors
    if checkpoint and held and checkpoint != held:
        return (
            f"the replay engine holds weights ({held[:19]}...) that differ from the checkpoint it "
            f"loaded ({checkpoint[:19]}...), gathered from all its shards: the weight conversion, "
            "sharding or loading changed them"
        )
    return None


def clean_at_floor(batch: Batch) -> np.ndarray:
    """Sequences that agree at the noise floor, not merely under tau: what a batch-wide
    cause (weights, precision, sampling, a shared template) cannot leave untouched."""
    sig = batch.sig
    if batch.calibrated:
        at_floor = sig.mean_abs <= MEAN_AT_FLOOR * batch.noise_mean
    else:
        at_floor = sig.mean_abs <= batch.tau * PREFIX_FLOOR
    return ~batch.drifting & (sig.tokens >= MIN_TOKENS) & at_floor


def unexplained(batch: Batch, open_: np.ndarray) -> Finding:
    return finding(
        batch,
        Cause.UNEXPLAINED,
        open_,
        f"drift above tau in {int(open_.sum())} sequences (RMS {rms(batch, open_):.3g}) that no "
        "known cause explains; ruled out: a token shift, a constant fill, labels off by one, "
        "rounding, recorded weight versions, sampling processing, a position or version onset, "
        "precision noise, weights and per-sequence context; inspect the worst tokens",
        severity="fault",
        confidence=0.0,
    )


def finding(
    batch,
    cause,
    claimed,
    evidence,
    severity=None,
    details=None,
    confidence=1.0,
    runner_up=None,
    first=None,
    position=None,
    **verification,
):
    """``first``: the sequence whose first bad token the finding points at (default: the
    first claimed one), ``position``: where in it, when not its first bad token;
    ``verification``: status, residual_before, residual_after, floor."""
    index = np.flatnonzero(claimed)
    ids = [batch.ids[i] for i in index]
    where = {}
    if first is None and len(index):
        first = int(index[0])
    if first is not None:
        at = position_of(batch, first) if position is None else int(position)
        where = {"sequence_id": batch.ids[first], "position": at}
    return Finding(
        cause=cause,
        sequences=ids,
        first_position=where,
        evidence=evidence,
        severity=severity or ("fault" if cause in FAULT_CAUSES else "info"),
        details=details or {},
        confidence=round(float(confidence), 3),
        runner_up=None if runner_up is None else {"cause": runner_up[0], "why_not": runner_up[1]},
        **verification,
    )


def position_of(batch: Batch, i: int) -> int:
    """Completion position of sequence i's first bad token (its first token when none)."""
    start, end = int(batch.offsets[i]), int(batch.offsets[i + 1])
    if start == end:
        return 0
    return int(batch.positions[start + max(int(batch.sig.first_bad[i]), 0)])


def rms(batch: Batch, which: np.ndarray) -> float:
    sig = batch.sig
    weights = sig.tokens[which]
    return (
        float(np.sqrt(np.average(sig.rms[which] ** 2, weights=weights))) if weights.sum() else 0.0
    )


def weight_like(sig: Signatures, which: np.ndarray) -> tuple[bool, str, float]:
    """Moved per sequence as one weight update moves them: most of each sequence's drifting
    tokens go one way (up for the sequences the step favoured, down for the others). A
    prompt change moves each token its own way; precision noise averages out.

    The statistic is a per-sequence sign test, mean z^2 over the sequences (1 by chance).
    Tokens of one sequence share their context, so their signs are not independent: the
    evidence must stand WEIGHT_SIGN_Z standard errors (of independent signs) above chance."""
    n = int(which.sum())
    score = bias_score(sig, which)
    needed = 1.0 + WEIGHT_SIGN_Z * math.sqrt(2.0 / max(n, 1))
    why = f"sign test: mean z^2 {score:.2f} over {n} sequences, weights need > {needed:.2f}"
    return score > needed, why, score


def bias_score(sig: Signatures, which: np.ndarray) -> float:
    """Mean squared per-sequence sign-test z of d: ~1 for drift that goes both ways."""
    t = np.minimum(sig.sign_z[which] ** 2, 100.0)
    return float(t.mean()) if len(t) else 0.0


def low_dtype(batch: Batch) -> str:
    return batch.context.low_precision_dtype


def low_precision_side(batch: Batch) -> bool:
    """Whether a side computed in bf16, fp16 or with TF32 matmuls."""
    return low_dtype(batch) != "float32" or batch.context.tf32_side


def numeric_ceiling(batch: Batch) -> np.ndarray:
    """Per sequence: the mean |d| beyond which drift is more than precision."""
    return CALIBRATED_CEILING * batch.noise_mean


def weighted_ceiling(batch: Batch, which: np.ndarray) -> float:
    """The ceiling of a set of sequences, weighted by their tokens."""
    weights = batch.sig.tokens[which]
    ceilings = numeric_ceiling(batch)[which]
    return float(np.average(ceilings, weights=weights)) if weights.sum() else 0.0


def flat_bad_diff(batch: Batch, which: np.ndarray) -> np.ndarray:
    return batch.diff[which[batch.seq] & batch.bad_tokens]


def truncated_sampling(batch: Batch) -> bool:
    sampling = batch.context.sampling or {}
    return int(sampling.get("top_k") or 0) > 0 or float(sampling.get("top_p") or 1.0) < 1.0


def fills_zero(batch: Batch, which: np.ndarray) -> np.ndarray:
    """Sequences whose repeated rollout value is exactly 0.0."""
    zeros = segment_sum(batch.bad_tokens & (batch.rollout == 0.0), batch.offsets)
    return which & (zeros >= EXPLAINS * np.maximum(batch.sig.bad, 1))


def sharpening(batch: Batch, which: np.ndarray):
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


def temperature_fit(batch: Batch, which: np.ndarray):
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

"""The correction view: what a trainer's importance-sampling correction would do with this
drift, under verl's definitions (`rollout_corr/*`, verl-project/verl rollout_corr_helper.py
as of 2026-08; docs/reduced-precision.md lists every formula and where verl's own docs
differ from its code).

For every token d = logp_train - logp_rollout and the IS ratio r = exp(d) (train over
rollout), d clamped to [-20, 20] before exp where verl clamps it:
- token TIS at cap C (`rollout_is=token`, `rollout_is_threshold=C`): w = min(r, C);
- sequence IS (`rollout_is=sequence`): one ratio per sequence, exp(sum of its d), capped;
- IcePop (`rollout_is_threshold="L_U"`): ratios outside [L, U] weigh 0, the rest as they are;
- rejection (`rollout_rs`): tokens or whole sequences masked by a k1, k2 or k3 statistic
  (verl's code keeps a k1 band [L, U] on pi_rollout / pi_train; with L = 1/U, as in its
  presets, that is the same band on the ratio).

Each view gives verl's metrics (token-weighted means, as `masked_mean`; std over tokens with
ddof 0, over sequences with ddof 1) beside lpx's plain counts: the fraction of tokens and of
sequences it truncated or masked. Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SAFETY_BOUND = 20.0  # verl clamps log ratios to [-20, 20] before exp
EPS = 1e-8  # verl's masked_mean denominator guard
RS_MODES = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
            "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")  # fmt: skip
# Thresholds the rejection view uses where the policy names none: verl's presets
# (decoupled_seq_is_rs: seq_sum_k1 0.5_2.0; the geometric ones: seq_mean_k1 0.999_1.001; the
# k3 ones: seq_mean_k3 0.01), and for modes no preset uses, lpx's: the same band for the
# other k1 modes, 0.01 for a k2/k3 mean or a token's k2/k3 (|d| ~ 0.14), 0.5 for a sum or max.
RS_DEFAULT_THRESHOLDS = {
    "token_k1": "0.5_2.0", "seq_sum_k1": "0.5_2.0", "seq_mean_k1": "0.999_1.001",
    "token_k2": "0.01", "token_k3": "0.01", "seq_mean_k2": "0.01", "seq_mean_k3": "0.01",
    "seq_sum_k2": "0.5", "seq_sum_k3": "0.5", "seq_max_k2": "0.5", "seq_max_k3": "0.5",
}  # fmt: skip
ICEPOP_BAND = "0.5_5.0"  # verl's IcePop presets


@dataclass(frozen=True)
class CorrectionSettings:
    """What the correction gated by the policy is (verl's config names and defaults)."""

    rollout_is: str = "token"  # token | sequence
    rollout_is_threshold: str = "2.0"  # C (truncation) or "L_U" (IcePop)
    rollout_rs: str = ""  # comma-separated RS_MODES, "" for none
    rollout_rs_threshold: str = ""  # one per mode, or one for all; "" for the defaults

    def __post_init__(self):
        if self.rollout_is not in ("token", "sequence"):
            raise ValueError(f"rollout_is must be token or sequence, not {self.rollout_is!r}")
        parse_threshold(self.rollout_is_threshold)
        for mode, threshold in rs_thresholds(self).items():
            parse_rs_threshold(mode, threshold)


def parse_threshold(text) -> tuple[float | None, float]:
    """(lower, upper): ``"2.0"`` truncates at 2 (lower None); ``"0.5_5.0"`` is IcePop's band."""
    text = str(text).strip()
    low, sep, high = text.partition("_")
    try:
        values = (float(low), float(high)) if sep else (None, float(low))
    except ValueError:
        raise ValueError(
            f"IS threshold {text!r}: give a cap (2.0) or a band L_U (0.5_5.0)"
        ) from None
    lower, upper = values
    if not np.isfinite(upper) or upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"IS threshold {text!r}: need 0 < L <= U and U > 0")
    return lower, upper


def rs_thresholds(settings: CorrectionSettings) -> dict[str, str]:
    modes = [m.strip() for m in settings.rollout_rs.split(",") if m.strip()]
    given = [t.strip() for t in settings.rollout_rs_threshold.split(",") if t.strip()]
    for mode in modes:
        if mode not in RS_MODES:
            raise ValueError(f"rollout_rs mode {mode!r} is not one of {', '.join(RS_MODES)}")
    if given and len(given) not in (1, len(modes)):
        raise ValueError("rollout_rs_threshold: one threshold, or one per rollout_rs mode")
    if not given:
        return {mode: RS_DEFAULT_THRESHOLDS[mode] for mode in dict.fromkeys(modes)}
    return {mode: given[i if len(given) > 1 else 0] for i, mode in enumerate(dict.fromkeys(modes))}


def parse_rs_threshold(mode: str, text: str) -> tuple[float, float]:
    """(lower, upper) bounds on the mode's statistic: a k1 mode's band on its log (a bare U
    means 1/U to U); a k2/k3 mode's upper bound (lower -inf)."""
    if mode.endswith("k1"):
        lower, upper = parse_threshold(text)
        lower = 1.0 / upper if lower is None else lower
        return float(np.log(lower)), float(np.log(upper))
    if "_" in str(text):
        raise ValueError(f"{mode} takes an upper bound, not a band ({text!r})")
    upper = float(text)
    if not np.isfinite(upper) or upper <= 0:
        raise ValueError(f"{mode} threshold {text!r}: a positive number")
    return -np.inf, upper


# --- the views ------------------------------------------------------------------------------


def correction_view(train, rollout, offsets, settings: CorrectionSettings | None = None) -> dict:
    """Every view of the correction on one batch: the configured one (`rollout_corr`, verl's
    metric names), token TIS, sequence IS and IcePop, each rejection mode, verl's off-policy
    diagnostics and `training/rollout_probs_diff_*`."""
    settings = settings or CorrectionSettings()
    d, lengths = _log_ratios(train, rollout, offsets)
    _, cap = parse_threshold(settings.rollout_is_threshold)
    # the eleven modes read three token statistics and their sums, means and maxima per
    # sequence: computed once, each mode then only thresholds them
    statistics = RejectionStatistics.of(d, lengths)
    thresholds = {**RS_DEFAULT_THRESHOLDS, **rs_thresholds(settings)}
    rejection = {mode: statistics.view(mode, thresholds[mode]) for mode in RS_MODES}
    configured = is_view(d, lengths, settings.rollout_is, settings.rollout_is_threshold)
    configured.update(statistics.summary(rs_thresholds(settings)))
    return {
        "settings": {
            "rollout_is": settings.rollout_is,
            "rollout_is_threshold": settings.rollout_is_threshold,
            "rollout_rs": settings.rollout_rs,
            "rollout_rs_threshold": ",".join(rs_thresholds(settings).values()),
        },
        "rollout_corr": {**configured, **off_policy(d, train, rollout, lengths)},
        "probs_diff": probs_diff(train, rollout),
        "views": {
            "token_tis": is_view(d, lengths, "token", str(cap)),
            "sequence_is": is_view(d, lengths, "sequence", str(cap)),
            "icepop": is_view(d, lengths, "token", ICEPOP_BAND),
            "rejection": rejection,
        },
    }


def is_view(d: np.ndarray, lengths: np.ndarray, level: str, threshold: str) -> dict:
    """One IS correction: verl's `rollout_is_*` metrics (on the weights it applies) and lpx's
    fractions of tokens and sequences it truncated (a cap) or masked (IcePop)."""
    lower, upper = parse_threshold(threshold)
    band = lower is not None
    if level == "sequence":
        sums = _sequence_sums(d, lengths)
        raw = np.repeat(np.exp(np.clip(sums, -SAFETY_BOUND, SAFETY_BOUND)), lengths)
    else:
        raw = np.exp(np.clip(d, -SAFETY_BOUND, SAFETY_BOUND))
    if band:
        applied = np.where((raw >= lower) & (raw <= upper), raw, 0.0)
        acted = (raw < lower) | (raw > upper)
    else:
        applied = np.minimum(raw, upper)
        acted = raw > upper
    low_line = lower if band else 1.0 / upper
    n = len(d)
    mean = _mean(applied)
    clipped = np.clip(applied, 0.0, upper)
    std = float(np.sqrt(max(0.0, _mean(clipped**2) - _mean(clipped) ** 2))) if n > 1 else 0.0
    normalised = clipped / (_mean(clipped) + EPS)
    # at most 1: verl's epsilons put equal weights a hair past it (1 + 2e-8)
    ess = min(1.0 / _mean(normalised**2), 1.0) if n and _mean(normalised**2) > 0 else 0.0
    if level == "sequence":
        sums = _sequence_sums(d, lengths)
        high_fraction = float(np.mean(sums > np.log(upper))) if len(sums) else 0.0
        low_fraction = float(np.mean(sums < np.log(low_line))) if len(sums) else 0.0
        is_max = float(np.exp(min(float(sums.max(initial=-np.inf)), SAFETY_BOUND)))
        is_min = float(np.exp(float(sums.min(initial=np.inf))))
    else:
        high_fraction, low_fraction = _mean(raw > upper), _mean(raw < low_line)
        is_max = float(applied.max()) if n else 0.0
        is_min = float(applied.min()) if n else 0.0
    per_sequence = _sequence_means(applied, lengths)
    raw_per_sequence = _sequence_means(raw, lengths)
    view = {
        "rollout_is_mean": mean,
        "rollout_is_std": std,
        "rollout_is_min": is_min,
        "rollout_is_max": is_max,
        "rollout_is_eff_sample_size": float(ess),
        "rollout_is_ratio_fraction_high": high_fraction,
        "rollout_is_ratio_fraction_low": low_fraction,
        "rollout_is_seq_mean": float(per_sequence.mean()) if len(per_sequence) else 0.0,
        "rollout_is_seq_std": _std(per_sequence),
        "rollout_is_seq_max": float(per_sequence.max(initial=0.0)),
        "rollout_is_seq_min": float(per_sequence.min()) if len(per_sequence) else 0.0,
        "rollout_is_seq_max_deviation": float(np.abs(per_sequence - 1).max(initial=0.0)),
        "rollout_is_seq_fraction_high": _fraction(raw_per_sequence > upper),
        "rollout_is_seq_fraction_low": _fraction(raw_per_sequence < low_line),
        # lpx's: what the correction did, in plain counts
        ("masked_tokens_fraction" if band else "truncated_tokens_fraction"): _mean(acted),
        ("masked_sequences_fraction" if band else "truncated_sequences_fraction"): _fraction(
            _any_per_sequence(acted, lengths)
        ),
    }
    if band:
        view["rollout_is_oob_ratio"] = _mean(acted)
    return view


def rejection_view(d: np.ndarray, lengths: np.ndarray, mode: str, threshold: str) -> dict:
    """One rejection mode: its statistic's mean and max, and the tokens and sequences it
    masks (verl's `rollout_rs_{mode}_masked_fraction` and `_seq_masked_fraction`)."""
    return RejectionStatistics.of(d, lengths).view(mode, threshold)


def rejection_summary(d, lengths, thresholds: dict[str, str]) -> dict:
    """verl's `rollout_rs_masked_fraction` and `rollout_rs_seq_masked_fraction`: the tokens
    and sequences every configured mode together masks (0 with none)."""
    return RejectionStatistics.of(d, lengths).summary(thresholds)


@dataclass(frozen=True)
class RejectionStatistics:
    """What every rejection mode reads, computed once per batch: each token's k1, k2 and k3
    (d clamped as verl clamps it) and, per sequence, their sums, means and maxima. A token
    mode thresholds its tokens; a sequence mode thresholds one value per sequence and masks
    or keeps the sequence's tokens whole, so its counts need no per-token pass."""

    lengths: np.ndarray
    token: dict  # kind -> per-token statistic
    per_sequence: dict  # (reduction, kind) -> per-sequence statistic

    @classmethod
    def of(cls, d, lengths) -> RejectionStatistics:
        e = np.clip(np.asarray(d, dtype=np.float64), -SAFETY_BOUND, SAFETY_BOUND)
        token = {"k1": -e, "k2": 0.5 * e * e, "k3": np.expm1(e) - e}
        per_sequence = {}
        for kind, values in token.items():
            sums = _sequence_sums(values, lengths)
            per_sequence["sum", kind] = sums
            per_sequence["mean", kind] = sums / (lengths + EPS)
            if kind != "k1":  # no seq_max_k1 mode
                per_sequence["max", kind] = _sequence_maxima(values, lengths)
        return cls(np.asarray(lengths), token, per_sequence)

    def _sequence_statistic(self, mode: str) -> np.ndarray:
        _, reduction, kind = mode.split("_")
        return self.per_sequence[reduction, kind]

    def view(self, mode: str, threshold: str) -> dict:
        lower, upper = parse_rs_threshold(mode, threshold)
        lengths, n = self.lengths, int(self.lengths.sum())
        valid = lengths > 0
        if mode.startswith("token_"):
            statistic = self.token[mode.split("_")[1]]
            masked = ~((statistic >= lower) & (statistic <= upper))
            mean, top = _mean(statistic), float(statistic.max(initial=0.0))
            masked_fraction = _mean(masked)
            masked_sequences = _any_per_sequence(masked, lengths)
        else:
            statistic = self._sequence_statistic(mode)
            masked_sequences = ~((statistic >= lower) & (statistic <= upper)) & valid
            # the token-weighted mean of a value each sequence repeats on its tokens
            mean = float((statistic * lengths).sum() / (n + EPS))
            top = float(statistic[valid].max(initial=0.0))
            masked_fraction = float(lengths[masked_sequences].sum() / (n + EPS))
        return {
            "threshold": threshold,
            "mean": mean,
            "max": top,
            "masked_fraction": masked_fraction,
            "seq_masked_fraction": float(np.mean(masked_sequences[valid])) if valid.any() else 0.0,
        }

    def _keep(self, mode: str, threshold: str) -> np.ndarray:
        """Per token, whether the mode keeps it."""
        lower, upper = parse_rs_threshold(mode, threshold)
        if mode.startswith("token_"):
            statistic = self.token[mode.split("_")[1]]
            return (statistic >= lower) & (statistic <= upper)
        statistic = self._sequence_statistic(mode)
        kept = ((statistic >= lower) & (statistic <= upper)) | (self.lengths == 0)
        return np.repeat(kept, self.lengths)

    def summary(self, thresholds: dict[str, str]) -> dict:
        """verl's `rollout_rs_masked_fraction` and `rollout_rs_seq_masked_fraction`: what
        every mode of ``thresholds`` together masks (0 with none)."""
        keep = np.ones(int(self.lengths.sum()), dtype=bool)
        for mode, threshold in thresholds.items():
            keep &= self._keep(mode, threshold)
        return {
            "rollout_rs_masked_fraction": _mean(~keep),
            "rollout_rs_seq_masked_fraction": _fraction(_any_per_sequence(~keep, self.lengths)),
        }


def off_policy(d, train, rollout, lengths) -> dict:
    """verl's off-policy diagnostics: perplexities per sequence then averaged, the KL
    estimates and chi-squared divergences."""
    train = np.asarray(train, dtype=np.float64)
    rollout = np.asarray(rollout, dtype=np.float64)
    a = _sequence_means(train, lengths)
    b = _sequence_means(rollout, lengths)
    gap = b - a
    clamped = np.clip(d, -SAFETY_BOUND, SAFETY_BOUND)
    sums = _sequence_sums(d, lengths)
    with np.errstate(over="ignore"):
        k3 = np.exp(d) - d - 1.0  # verl leaves this one unclamped
    return {
        "training_ppl": _plain_mean(np.exp(-a)),
        "rollout_ppl": _plain_mean(np.exp(-b)),
        "training_log_ppl": _plain_mean(-a),
        "rollout_log_ppl": _plain_mean(-b),
        "log_ppl_diff": _plain_mean(gap),
        "log_ppl_abs_diff": _plain_mean(np.abs(gap)),
        "log_ppl_diff_max": float(gap.max(initial=0.0)),
        "log_ppl_diff_min": float(gap.min(initial=0.0)),
        "ppl_ratio": _plain_mean(np.exp(gap)),
        "kl": _mean(-d),
        "k3_kl": _mean(k3),
        "chi2_token": _mean(np.exp(2 * clamped)) - 1.0,
        "chi2_seq": _plain_mean(np.exp(2 * np.clip(sums, -SAFETY_BOUND, SAFETY_BOUND))) - 1.0,
    }


def probs_diff(train, rollout) -> dict:
    """verl's `training/rollout_probs_diff_*`: |p_train - p_rollout| over the tokens (its FAQ:
    a mean below 0.005 is normal, above 0.01 an inference-precision problem)."""
    gap = np.abs(np.exp(np.asarray(train, np.float64)) - np.exp(np.asarray(rollout, np.float64)))
    return {
        "rollout_probs_diff_mean": float(gap.mean()) if len(gap) else 0.0,
        "rollout_probs_diff_max": float(gap.max(initial=0.0)),
        "rollout_probs_diff_std": float(gap.std(ddof=1)) if len(gap) > 1 else 0.0,
    }


# The metrics of the view every report carries among its flat metrics (the history charts
# and judges those): the configured correction's, verl's names
FLAT = ("rollout_is_mean", "rollout_is_std", "rollout_is_min", "rollout_is_max",
        "rollout_is_eff_sample_size", "rollout_is_ratio_fraction_high",
        "rollout_is_ratio_fraction_low", "rollout_rs_masked_fraction",
        "rollout_rs_seq_masked_fraction", "kl", "k3_kl", "chi2_token", "chi2_seq",
        "log_ppl_diff", "log_ppl_abs_diff", "ppl_ratio")  # fmt: skip
# verl's docs/algo/rollout_corr.md health check: a correction outside these bounds is
# unhealthy (the bundled policy's correction checks; tests hold them equal)
HEALTH_CHECKS = {
    "rollout_corr/rollout_is_mean": (0.5, 2.0),
    "rollout_corr/rollout_is_eff_sample_size": (0.3, None),
    "rollout_corr/rollout_is_std": (None, 1.0),
    "rollout_corr/kl": (-0.1, 0.1),
    "rollout_corr/chi2_token": (None, 1.0),
}


def flat_metrics(view: dict) -> dict[str, float]:
    """The configured correction's metrics as report.metrics holds them:
    ``rollout_corr/<verl's name>``, ``training/rollout_probs_diff_*``, and lpx's counts as
    ``lpx_corr/<name>``."""
    configured = view["rollout_corr"]
    flat = {f"rollout_corr/{name}": configured[name] for name in FLAT if name in configured}
    flat.update({f"training/{name}": value for name, value in view["probs_diff"].items()})
    for name in ("truncated_tokens_fraction", "truncated_sequences_fraction",
                 "masked_tokens_fraction", "masked_sequences_fraction"):  # fmt: skip
        if name in configured:
            flat[f"lpx_corr/{name}"] = configured[name]
    return flat


def health_violations(metrics: dict, checks: dict) -> list[dict]:
    """The checks (metric -> (low, high), None for no bound) a batch's metrics fail; a NaN
    fails every check."""
    failed = []
    for name, (low, high) in checks.items():
        if name not in metrics:
            continue
        value = metrics[name]
        below = low is not None and not value >= low  # NaN is below and above
        if below or (high is not None and not value <= high):
            failed.append({"metric": name, "value": value, "limit": low if below else high,
                           "bound": "lower" if below else "upper",
                           "source": "correction health check"})  # fmt: skip
    return failed


# --- helpers --------------------------------------------------------------------------------


def _log_ratios(train, rollout, offsets) -> tuple[np.ndarray, np.ndarray]:
    d = np.asarray(train, dtype=np.float64) - np.asarray(rollout, dtype=np.float64)
    lengths = np.diff(np.asarray(offsets, dtype=np.int64))
    return d, lengths


def _per_sequence(reduce: np.ufunc, values, lengths) -> np.ndarray:
    """``reduce`` (np.add, np.maximum) over each sequence's tokens; 0 for an empty one."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    out = np.zeros(len(lengths))
    nonempty = lengths > 0
    if len(values):
        out[nonempty] = reduce.reduceat(values, starts[nonempty])
    return out


def _sequence_sums(values, lengths) -> np.ndarray:
    return _per_sequence(np.add, values, lengths)


def _sequence_means(values, lengths) -> np.ndarray:
    return _sequence_sums(values, lengths) / (lengths + EPS)


def _sequence_maxima(values, lengths) -> np.ndarray:
    return _per_sequence(np.maximum, values, lengths)


def _any_per_sequence(flags, lengths) -> np.ndarray:
    return _sequence_sums(np.asarray(flags, dtype=np.float64), lengths) > 0


def _mean(values) -> float:
    """verl's masked_mean over the compared tokens (token-weighted)."""
    values = np.asarray(values, dtype=np.float64)
    return float(values.sum() / (len(values) + EPS))


def _plain_mean(values) -> float:
    return float(np.mean(values)) if len(values) else 0.0


def _fraction(flags) -> float:
    return float(np.mean(flags)) if len(flags) else 0.0


def _std(values) -> float:
    return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0

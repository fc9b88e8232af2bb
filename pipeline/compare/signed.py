"""The drift's sign structure: what a systematic fault leaves and rounding noise does not.

The precision gate's magnitude tests (`precision_gate.py`) ask whether |d| is as large as
noise makes it. A fault smaller than a reduced precision's own noise (a trainer temperature
of 0.97 under an FP8 rollout, a penalty, a soft-cap) passes them, yet moves every token in a
direction fixed by the token: a temperature tilts each logprob in proportion to it, so d
leans on the token's surprisal; a cache read in another precision from a position on leans
on the position. Rounding noise has structure too, and none of it is zero:

- tokens a rollout sampled are those its own noise made likelier, so d = train - rollout is
  negative on average, about -mean(d^2) / 2 (E[exp d] = 1 over the rollout's own
  distribution), more so where the noise is larger (at high surprisal, late positions);
- a token's surprisal read off either side carries that side's noise (errors in variables):
  d regressed on the replay's surprisal has a slope of -0.040 on a clean FP8 pair of a
  24 x 2048 llama (H200), +0.045 on the rollout's, where a trainer temperature of 0.97 moves
  it by -0.03.

So each statistic is judged against its value under noise alone as `lpx calibrate` measures
it by sampling (`calibrate/run.py`: tokens drawn from the fp64 distribution at the fixture's
own contexts, weighted to the rollout precision's, scored by both sides), scaled by how much
noise the compared batch carries (both effects grow with the noise's variance), with the
calibration's own sampling error. The statistics:

- ``surprisal_slope``: the slope of d on the midpoint surprisal -(logprob_rollout +
  logprob_train) / 2, where the two sides' errors in variables cancel (clean FP8 pairs:
  +0.002 and -0.003 at 24 x 2048 and 16 x 1024; a temperature T gives about -(1/T - 1));
- ``position_slope``: the slope of d on the completion position, per 1,000 positions;
- ``seen_gap``: mean d on tokens that occurred earlier in their context (prompt or output)
  minus mean d on the rest: a repetition, presence or frequency penalty on one side;
- ``ratio_mean``: the mean of exp(d) - 1, the token-level importance ratio's mean minus one,
  which is zero for any trainer whatever the noise when the rollout reports the logprobs of
  the distribution it sampled from (temperature 1, no top-k or top-p, or processed
  logprobs): a rollout that samples from one distribution and reports another moves it.

Each has a standard error clustered by prompt (the tokens of one sequence, and the samples of
one prompt, share their context), read against Student's t with one fewer degree of freedom
than clusters. Pure
numpy and scipy.stats.
"""

from __future__ import annotations

import numpy as np

SLOPES = ("surprisal_slope", "position_slope")
STATISTICS = (*SLOPES, "seen_gap", "ratio_mean")
POSITION_UNIT = 1000.0  # position slopes are per this many positions
MIN_CLUSTERS = 8  # fewer clusters (distinct prompts) give no usable standard error
# How far the compared batch's noise may scale the calibrated null (observed mean d^2 over
# the calibration's): a real engine's noise is not the emulation's to the bit, yet a fault
# that adds variance must not buy itself an unbounded allowance.
SCALE_LIMITS = (0.25, 4.0)


def signed_statistics(
    diff, logprob_rollout, logprob_train, positions, sequence_of, weights=None, seen=None
) -> dict:
    """The sign statistics of tokens with drift ``diff`` = train - rollout, each with its
    standard error clustered by ``sequence_of`` (one label per token: `prompt_clusters`),
    ``weights`` per token (importance weights: the calibration's draws; None: the batch as
    sampled).

    ``seen``: per token, whether it occurred earlier in its context (prompt or output), for
    ``seen_gap``; without it that statistic is left out.

    Returns {name: {"value", "se"}} for STATISTICS, plus "mean_sq" (of d), "tokens",
    "sequences" (the clusters)."""
    d = np.asarray(diff, dtype=np.float64)
    w = np.ones_like(d) if weights is None else np.asarray(weights, dtype=np.float64)
    keep = np.isfinite(d) & np.isfinite(w)
    d, w = d[keep], w[keep]
    _, cluster = np.unique(np.asarray(sequence_of)[keep], return_inverse=True)
    mid = -(np.asarray(logprob_rollout, float) + np.asarray(logprob_train, float))[keep] / 2
    position = np.asarray(positions, dtype=np.float64)[keep] / POSITION_UNIT
    out = {
        "surprisal_slope": _slope(d, mid, w, cluster),
        "position_slope": _slope(d, position, w, cluster),
        "ratio_mean": _mean(np.expm1(d), w, cluster),
        "mean_sq": _mean(d * d, w, cluster),
    }
    if seen is not None:
        flag = np.asarray(seen, dtype=np.float64)[keep]
        if 0 < flag.sum() < len(flag):  # both kinds of token present
            out["seen_gap"] = _slope(d, flag, w, cluster)
    return out | {"tokens": int(len(d)), "sequences": int(cluster.max() + 1 if len(d) else 0)}


def signed_tests(null: dict, observed: dict, share: float, ratio_applies: bool) -> list[dict]:
    """Each sign statistic of ``observed`` (`signed_statistics` of the compared batch) against
    ``null`` (the calibration's, same form): two-sided at false-alarm rate ``share`` each.
    The null's value and error are scaled by the batch's mean d^2 over the calibration's
    (SCALE_LIMITS). ``ratio_applies``: whether the rollout reported the logprobs it sampled
    from (else the ratio's mean is left out). Tests as the precision gate's GateTest dicts,
    plus "scale"."""
    from scipy.stats import t as student

    sequences = int(observed.get("sequences", 0))
    if sequences < MIN_CLUSTERS:
        return []
    calibrated_sq = null["mean_sq"]["value"]
    scale = observed["mean_sq"]["value"] / calibrated_sq if calibrated_sq > 0 else 1.0
    scale = float(np.clip(scale, *SCALE_LIMITS))
    critical_t = float(student.isf(share / 2, sequences - 1))
    tests = []
    for name in STATISTICS:
        if name == "ratio_mean" and not ratio_applies:
            continue
        if name not in null or name not in observed:
            continue  # seen_gap: where both hold tokens seen before and tokens not
        expected = null[name]["value"] * scale
        known = np.hypot(null[name]["se"], null[name].get("spread", 0.0)) * scale
        sd = float(np.hypot(observed[name]["se"], known))
        value = observed[name]["value"]
        z = (value - expected) / sd if sd > 0 else 0.0
        tests.append(
            {
                "name": name,
                "observed": float(value),
                "expected": float(expected),
                "critical": float(expected + np.sign(value - expected) * critical_t * sd),
                "z": float(np.clip(z, -1e6, 1e6)),
                "passed": bool(abs(z) <= critical_t),
                "sd": sd,
                "scale": scale,
            }
        )
    return tests


def sampled_as_reported(sampling: dict | None) -> bool:
    """Whether a rollout's logprobs are those of the distribution it sampled its tokens from
    (so E[exp d] = 1 for any trainer): processed logprobs, or temperature 1 with no top-k
    and no top-p; not where the rollout does not record how it sampled."""
    if not sampling or sampling.get("temperature") is None:
        return False  # not recorded: unknown
    if sampling.get("logprobs_mode") == "processed":
        return True
    return (
        float(sampling["temperature"]) == 1.0
        and int(sampling.get("top_k", 0) or 0) <= 0
        and float(sampling.get("top_p", 1.0)) >= 1.0
    )


def _mean(values: np.ndarray, w: np.ndarray, cluster: np.ndarray) -> dict:
    total = w.sum()
    if total <= 0 or len(values) == 0:
        return {"value": 0.0, "se": 0.0}
    mean = float((w * values).sum() / total)
    score = np.bincount(cluster, w * (values - mean)) / total
    return {"value": mean, "se": _clustered(score)}


def _slope(d: np.ndarray, x: np.ndarray, w: np.ndarray, cluster: np.ndarray) -> dict:
    """Weighted least squares slope of d on x, with its cluster-robust (sandwich) error."""
    total = w.sum()
    if total <= 0 or len(d) < 3:
        return {"value": 0.0, "se": 0.0}
    xc = x - (w * x).sum() / total
    spread = float((w * xc * xc).sum())
    if spread <= 0:
        return {"value": 0.0, "se": 0.0}
    dc = d - (w * d).sum() / total
    slope = float((w * xc * dc).sum() / spread)
    score = np.bincount(cluster, w * xc * (dc - slope * xc)) / spread
    return {"value": slope, "se": _clustered(score)}


def _clustered(score: np.ndarray) -> float:
    """The sandwich standard error from per-cluster scores, with the small-sample factor
    G / (G - 1)."""
    groups = len(score)
    if groups < 2:
        return 0.0
    return float(np.sqrt((score * score).sum() * groups / (groups - 1)))


def signed_null_for(floor: dict, rollout_precision: str, sampling: dict | None):
    """(The calibration's sign statistics of noise with ``rollout_precision`` rolling out,
    "") for a rollout that sampled as ``sampling`` says; (None, why not) where there are none
    to judge by: a calibration made before them, a greedy rollout, or one sampled at another
    temperature than the calibration drew at."""
    signed = floor.get("signed")
    if not signed:
        return None, "the calibration predates the sign statistics (lpx calibrate again)"
    if not sampling or sampling.get("temperature") is None:
        # a dump that records no sampling may have drawn at any temperature, with top-k or
        # top-p: the structure its tokens carry is not the one the calibration drew
        return None, "the rollout does not record the temperature it sampled at"
    temperature = float(sampling.get("temperature") or 0.0)
    if temperature <= 0:
        return None, "a greedy rollout: its tokens were chosen, not drawn"
    if abs(temperature - float(signed["temperature"])) > 1e-6:
        return None, (
            f"the rollout sampled at temperature {temperature:g}, the calibration drew at "
            f"{float(signed['temperature']):g} (lpx calibrate on this fixture)"
        )
    null = signed["by_rollout"].get(rollout_precision)
    if null is None:
        return None, f"the calibration has no sign statistics with {rollout_precision} rolling out"
    return null, ""


def seen_before(prompt, completion, ids=None) -> np.ndarray:
    """Whether each completion token (or each of ``ids``, [completion, k] candidates at each
    position) occurred earlier in its context: in the prompt or the output before it."""
    prompt = np.asarray(prompt, dtype=np.int64)
    completion = np.asarray(completion, dtype=np.int64)
    candidates = completion[:, None] if ids is None else np.asarray(ids, dtype=np.int64)
    seen = set(prompt.tolist())
    out = np.zeros(candidates.shape, dtype=bool)
    for t in range(len(completion)):
        out[t] = [int(i) in seen for i in candidates[t]]
        seen.add(int(completion[t]))
    return out[:, 0] if ids is None else out


def prompt_clusters(prompts, lengths) -> np.ndarray:
    """One label per token: the index of its sequence's prompt among the distinct prompts.
    Samples of one prompt share its context, and so much of their noise's structure: they
    are one cluster, not several (a calibration of 16 prompts x 2 samples is 16 clusters)."""
    seen: dict[bytes, int] = {}
    labels = [seen.setdefault(np.asarray(p, dtype=np.int64).tobytes(), len(seen)) for p in prompts]
    return np.repeat(np.asarray(labels, dtype=np.int64), np.asarray(lengths, dtype=np.int64))

"""The logits-processing fitter: which processing (penalties, a soft-cap, a logit bias,
temperature, min-p, top-k, top-p) carries one side's logprobs from the head logits of a few
compared tokens, searched jointly:

- from the best of the seeds it is given;
- by groups of knobs, the one that closes the gap most joining first: the sampler
  (temperature fitted, top-k, top-p and min-p on grids, round again, so they move
  together), the penalties (fitted jointly by least squares, in each scope), the soft-cap,
  a logit bias (on the tokens the rest leaves furthest out);
- then every continuous knob kept fitted jointly, and a group the result does not need put
  back (the reproduction names only what it must).

No model here: `HeadLogits` holds the logits the family (`verify/families/processing.py`)
computed, and every fit re-processes them."""

from __future__ import annotations

import numpy as np

from pipeline.faults.processing import SCOPES, Processing, apply_seen

SAMPLER = ("temperature", "top_k", "top_p", "min_p")

TOP_K_GRID = (0, 1, 2, 5, 10, 20, 32, 40, 50, 64, 100, 200)
TOP_P_GRID = (1.0, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98)
MIN_P_GRID = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3)
SPANS = {  # continuous knobs: the interval searched (log scale for the multiplicative ones)
    "temperature": (np.log(0.2), np.log(3.0), True),
    "repetition_penalty": (np.log(0.5), np.log(2.5), True),
    "presence_penalty": (-2.0, 2.0, False),
    "frequency_penalty": (-2.0, 2.0, False),
    "soft_cap": (np.log(1.0), np.log(200.0), True),
}
BIAS_CANDIDATES = 6  # tokens the residual points at most, each tried as the next biased one
NEEDED = 1.02  # a knob stays when putting it back leaves this much more gap


class HeadLogits:
    """The head logits (before any soft-cap, in float64 so that a fit's finite differences
    see its knobs, not rounding) of the compared tokens a search fits on, stacked, with each
    token's penalty history in either scope (``history``) and its observed logprob:
    `gap(processing)` is how far that processing leaves them, `residual(processing)` per
    token. ``cap``: the model's own final-logit soft-cap (0 for none); ``vocab``: its
    vocabulary; ``noise``: the mean |d| the observed side's precision alone gives on these
    sequences, what a knob must close more than a share of to be needed."""

    def __init__(
        self,
        logits,
        targets: np.ndarray,
        observed: np.ndarray,
        history: dict,
        cap: float,
        vocab: int,
        noise: float = 0.0,
    ):
        import torch

        self.logits = logits
        self.targets = targets
        self.observed = observed
        self.history = history
        self._targets = torch.as_tensor(self.targets, device=self.logits.device)[:, None]
        self.cap = cap
        self.vocab = vocab
        self.noise = noise
        self.evaluations = 0
        # the search asks the same processing's gap many times over (each comparison of
        # candidates, each needed-check): one re-processing each
        self._scored: dict[Processing, np.ndarray] = {}

    def processed(self, processing: Processing):
        """The processed logits of the compared tokens, stacked."""
        history = self.history[processing.penalty_scope]
        return apply_seen(self.logits, processing, self.cap, history)

    def scores(self, processing: Processing) -> np.ndarray:
        known = self._scored.get(processing)
        if known is None:
            self.evaluations += 1
            logprobs = self.processed(processing).log_softmax(-1)
            known = logprobs.gather(-1, self._targets)[:, 0].cpu().numpy()
            if len(self._scored) < SCORES_KEPT:
                self._scored[processing] = known
        return known.copy()

    def residual(self, processing: Processing) -> np.ndarray:
        """Observed less re-processed, per token. A token the processing makes impossible
        counts nothing while such tokens are at most IMPOSSIBLE_SHARE (a truncation's
        boundary, where this float64 re-processing and the engine's float32 part ways),
        IMPOSSIBLE_GAP each beyond (not this side's processing)."""
        scores = self.scores(processing)
        scored = np.isfinite(self.observed)
        impossible = np.isneginf(scores) & scored
        out = self.observed - scores
        out[impossible] = IMPOSSIBLE_GAP if impossible.mean() > IMPOSSIBLE_SHARE else 0.0
        return np.nan_to_num(out[scored], nan=0.0)

    def gap(self, processing: Processing) -> float:
        residual = self.residual(processing)
        if (residual == IMPOSSIBLE_GAP).mean() > IMPOSSIBLE_SHARE:
            return np.inf  # it makes tokens impossible that this side scored
        return float(np.mean(np.abs(residual))) if residual.size else 0.0


SCORES_KEPT = 20_000  # processings whose scores a search keeps (256 floats each)
IMPOSSIBLE_GAP = 10.0  # nats: a token a processing rules out, counted in a least-squares fit
IMPOSSIBLE_SHARE = 0.02  # of the scored tokens: beyond it, a processing is not this side's
IMPROVES = 1.25  # a group of knobs joins the reproduction when it divides the gap by this


def find_processing(logits: HeadLogits, starts: list[Processing]) -> Processing:
    """The processing that leaves the least gap, as few groups of knobs as it takes, from
    the best seed and from no processing: the group (sampler, penalties, soft-cap, logit
    bias) whose fit closes the gap most joins, while one divides it by IMPROVES; then every
    continuous knob kept is fitted jointly, and a group the result does not need is put
    back. Drift that no single group's quick fit halves is not processing: the search stops
    there (other weights, a prompt edit), at the cost of one round of quick fits."""
    best_seed = min(starts, key=logits.gap)
    origins = list(dict.fromkeys([best_seed, Processing()]))
    quick = [fit(logits, origin, QUICK) for origin in origins for fit in GROUPS.values()]
    closest = min([best_seed, *quick], key=logits.gap)
    if logits.gap(closest) > SEARCHED_BELOW * logits.gap(Processing()):
        return closest
    found = [grown(logits, start) for start in origins]
    # fits within a share of the side's noise are equally good: the one with fewer knobs is
    # the explanation (where most tokens keep one token, many processings fit them alike)
    least = min(logits.gap(p) for p in found)
    tie = least + NOISE_SHARE * logits.noise
    return min(
        (p for p in found if logits.gap(p) <= tie), key=lambda p: (len(p.changed()), logits.gap(p))
    )


QUICK = 8  # least-squares evaluations per knob in the quick round
SEARCHED_BELOW = 0.5  # of the drift: one group's quick fit must leave less for a full search
# (named apart from the judge's screen, SCREEN_SEQUENCES, which rules hypotheses out on two)
NOISE_SHARE = 0.1  # of the side's noise floor: a knob closing less of the gap is not needed
# A reproduction that leaves less than this share of the side's noise floor is as close as
# the side's rounding lets anything come: no knob joins past it, and no knob is needed to
# get below it (on an fp32 side, six logit biases of 1e-6 fitted its rounding otherwise)
WITHIN_NOISE = 0.5


def grown(logits: HeadLogits, start: Processing) -> Processing:
    current, chosen = start, set()
    while len(chosen) < len(GROUPS):
        trials = {name: GROUPS[name](logits, current) for name in GROUPS if name not in chosen}
        name = min(trials, key=lambda n: logits.gap(trials[n]))
        if not logits.gap(trials[name]) * IMPROVES < logits.gap(current) or _within_noise(
            logits, current
        ):
            break
        current = trials[name]
        chosen.add(name)
    current = fit_continuous(logits, current, continuous_of(current))
    return needed(logits, current)


def fit_sampler(logits: HeadLogits, at: Processing, budget: int | None = None) -> Processing:
    """The sampler's knobs moved together: each round takes the one grid move (top-k, top-p
    or min-p) that closes the gap most, then fits the temperature, until a round moves
    nothing."""
    best = at
    for _ in range(1 if budget else SAMPLER_ROUNDS):
        before = best
        moves = [
            best.but(**{name: v})
            for name, grid in (("top_k", TOP_K_GRID), ("top_p", TOP_P_GRID), ("min_p", MIN_P_GRID))
            for v in grid
            if name != "top_k" or v < logits.vocab
        ]
        best = min([best, *moves], key=logits.gap)
        best = fit_continuous(logits, best, ("temperature",), budget)
        if best == before:
            break
    return best


SAMPLER_ROUNDS = 4


def fit_penalties(logits: HeadLogits, at: Processing, budget: int | None = None) -> Processing:
    """Repetition, presence and frequency penalties fitted jointly, in each scope."""
    names = ("presence_penalty", "frequency_penalty", "repetition_penalty")
    fits = [fit_continuous(logits, at.but(penalty_scope=scope), names, budget) for scope in SCOPES]
    return min(fits, key=logits.gap)


def fit_cap(logits: HeadLogits, at: Processing, budget: int | None = None) -> Processing:
    """A soft-cap fitted from the best of a few, or the model's own cap skipped."""
    tried = [at.but(soft_cap=cap) for cap in (1.0, 2.0, 5.0, 10.0, 30.0, 100.0)]
    start = min(tried, key=logits.gap)
    fitted = [fit_continuous(logits, start, ("soft_cap",), budget)]
    if logits.cap:
        fitted.append(at.but(soft_cap=0.0))  # the model's own cap skipped
    return min(fitted, key=logits.gap)


def fit_bias(logits: HeadLogits, at: Processing, budget: int | None = None) -> Processing:
    """A logit bias on the tokens the residual points at, one token a step: of the
    BIAS_CANDIDATES tokens the residual points at most, the one whose own fitted bias closes
    the gap most joins, and every bias is refitted jointly, while a step closes the gap by
    IMPROVES (BIAS_QUICK_STEPS steps in a quick fit). A bias b on token j moves each token's
    logprob by about c = e^b - 1 times (1[it is j] - p_j), the tokens whose column of that
    explains most of the residual are the candidates; that is a linearisation (a +2 on a
    likely token is far from linear), so each candidate is tried, not taken."""
    best = at
    for _ in range(BIAS_QUICK_STEPS if budget else BIAS_STEPS):
        tokens = _bias_candidates(logits, best)
        if not tokens:
            break
        trials = [
            fit_continuous(
                logits, best.but(logit_bias=(*best.logit_bias, (t, 0.0))), (f"bias:{t}",), QUICK
            )
            for t in tokens
        ]
        step = min(trials, key=logits.gap)
        if not logits.gap(step) * IMPROVES < logits.gap(best) or _within_noise(logits, best):
            break
        names = tuple(f"bias:{t}" for t, _ in step.logit_bias)
        best = fit_continuous(logits, step, names, budget)
    return best


def _bias_candidates(logits: HeadLogits, at: Processing) -> list[int]:
    import torch

    residual = logits.observed - logits.scores(at)
    finite = np.isfinite(residual) & np.isfinite(logits.observed)
    if not finite.any():
        return []
    probs = logits.processed(at).softmax(-1)[torch.as_tensor(finite)]
    targets = torch.as_tensor(logits.targets[finite])
    moved = -probs
    moved[torch.arange(len(targets)), targets] += 1.0
    r = torch.as_tensor(residual[finite], dtype=moved.dtype)
    score = (r @ moved).abs() / (moved.square().sum(0).sqrt() + 1e-12)
    score[[t for t, _ in at.logit_bias]] = 0.0  # already biased
    return [int(t) for t in score.topk(min(BIAS_CANDIDATES, score.numel())).indices]


BIAS_STEPS = 8  # tokens a logit bias is searched on, one a step
BIAS_QUICK_STEPS = 3  # in a quick (screening) fit


GROUPS = {
    "sampler": fit_sampler,
    "penalties": fit_penalties,
    "soft_cap": fit_cap,
    "logit_bias": fit_bias,
}
GROUP_OF = {
    **dict.fromkeys(SAMPLER, "sampler"),
    "repetition_penalty": "penalties",
    "presence_penalty": "penalties",
    "frequency_penalty": "penalties",
    "penalty_scope": "penalties",
    "soft_cap": "soft_cap",
    "logit_bias": "logit_bias",
}


def _touches(processing: Processing, group: str) -> bool:
    return any(GROUP_OF[name] == group for name in processing.changed())


def continuous_of(processing: Processing) -> tuple[str, ...]:
    changed = processing.changed()
    names = [n for n in SPANS if n in changed and not (n == "soft_cap" and changed[n] == 0.0)]
    return (*names, *(f"bias:{t}" for t, _ in processing.logit_bias))


def fit_continuous(
    logits: HeadLogits, at: Processing, names: tuple[str, ...], budget: int | None = None
) -> Processing:
    """``at`` with the continuous knobs ``names`` fitted jointly by least squares on the
    per-token residual (from their values in ``at``; the log of the multiplicative ones),
    ``budget`` evaluations per knob (LEAST_SQUARES_EVALUATIONS by default)."""
    from scipy.optimize import least_squares

    if not names:
        return at

    def unpack(x) -> Processing:
        changes, bias = {}, dict(at.logit_bias)
        for name, value in zip(names, x, strict=True):
            if name.startswith("bias:"):
                bias[int(name[5:])] = float(value)
            else:
                changes[name] = float(np.exp(value)) if SPANS[name][2] else float(value)
        return at.but(**changes, logit_bias=tuple(bias.items()))

    def start(name: str) -> float:
        if name.startswith("bias:"):
            return dict(at.logit_bias).get(int(name[5:]), 0.0)
        value = getattr(at, name)
        if name == "soft_cap" and value <= 0:
            value = logits.cap or 30.0
        low, high, logarithmic = SPANS[name]
        x = np.log(value) if logarithmic else value
        return float(np.clip(x, low + 1e-6, high - 1e-6))

    lows = [SPANS[n][0] if n in SPANS else -BIAS_SPAN for n in names]
    highs = [SPANS[n][1] if n in SPANS else BIAS_SPAN for n in names]
    try:
        fit = least_squares(
            lambda x: logits.residual(unpack(x)),
            [start(n) for n in names],
            bounds=(lows, highs),
            x_scale="jac",
            ftol=1e-14,
            xtol=1e-14,
            gtol=1e-14,
            max_nfev=(budget or LEAST_SQUARES_EVALUATIONS) * len(names),
        )
    except ValueError:  # nothing finite to fit
        return at
    found = unpack(fit.x)
    return found if logits.gap(found) <= logits.gap(at) else at


BIAS_SPAN = 20.0  # nats either side a logit bias is fitted within
LEAST_SQUARES_EVALUATIONS = 60  # per knob fitted


def _within_noise(logits: HeadLogits, at: Processing) -> bool:
    return logits.gap(at) <= WITHIN_NOISE * logits.noise


def needed(logits: HeadLogits, found: Processing) -> Processing:
    """``found`` with every group it does not need put back to no processing (the rest
    re-fitted without it), and every logit-biased token it does not need dropped. Needed:
    without it the gap grows by NEEDED and by more than NOISE_SHARE of the side's noise
    (below that, a knob fits the observed side's rounding, not its processing), and leaves
    more than WITHIN_NOISE of that noise."""
    neutral = Processing()
    gap = logits.gap(found)
    floor = max(gap * NEEDED, gap + NOISE_SHARE * logits.noise, WITHIN_NOISE * logits.noise)

    def unneeded(without: Processing, smooth: bool) -> bool:
        return logits.gap(without) <= floor or (smooth and _boundary_only(logits, found, without))

    for group in GROUPS:
        if not _touches(found, group):
            continue
        reset = {n: getattr(neutral, n) for n in found.changed() if GROUP_OF[n] == group}
        without = found.but(**reset)
        without = fit_continuous(logits, without, continuous_of(without))
        if unneeded(without, smooth=group != "sampler"):
            found = without
    for name in [n for n in found.changed() if n in SPANS or n in TRUNCATIONS]:
        without = found.but(**{name: getattr(neutral, name)})
        without = fit_continuous(logits, without, continuous_of(without))
        if unneeded(without, smooth=name not in TRUNCATIONS):
            found = without
    for bias in found.logit_bias:
        without = found.but(logit_bias=tuple(b for b in found.logit_bias if b != bias))
        if unneeded(without, smooth=True):
            found = without
    return found


TRUNCATIONS = ("top_k", "top_p", "min_p")  # act on the tokens they cut, not on every token


def _boundary_only(logits: HeadLogits, found: Processing, without: Processing) -> bool:
    """What ``found``'s smooth knobs (penalties, temperature, a soft-cap, a bias: each moves
    every token's logprob a little) do beyond ``without`` moves at most IMPOSSIBLE_SHARE of
    the tokens by more than the side's noise: they act only at a truncation's boundary (a
    token that one of them keeps in a min-p, top-p or top-k set and the other not), where
    this float64 re-processing and the engine's float32 part ways, so they fit that
    rounding, not a processing. (A truncation itself may rightly bind on a few tokens
    only: a top-k 20 under a top-p 0.8 on a flat model.) Measured at 16 x 1024 (fp32, noise 1.5e-5): a frequency penalty of -1.9e-6
    beside min-p 0.1 moved its median token 1.3e-7 and one token of 256 by 0.01, which
    closed 80 % of the gap min-p left."""
    if logits.noise <= 0:
        return False
    with_it, without_it = logits.scores(found), logits.scores(without)
    scored = np.isfinite(logits.observed)
    with np.errstate(invalid="ignore"):  # -inf - -inf: a token both cut, so not moved (0 below)
        moved = np.abs(with_it - without_it)[scored]
    return bool(np.mean(np.nan_to_num(moved, nan=0.0) > logits.noise) <= IMPOSSIBLE_SHARE)

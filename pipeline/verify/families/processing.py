"""Logits processing: what an engine does between the logits and the logprobs it returns
(penalties, a soft-cap, a logit bias, temperature, min-p, top-k, top-p), found by
re-scoring. One cause, `logits_processing`, whose parameters say which processing the
observed side carries, searched jointly:

- from the best of its seeds: no processing, the model's generation_config.json (what vLLM
  and SGLang apply where a request sets nothing), the sampling the fixture records, and the
  defaults engines ship for Qwen3 (its generation config, thinking and not);
- by groups of knobs, the one that closes the gap most joining first: the sampler
  (temperature fitted, top-k, top-p and min-p on grids, round again, so they move
  together), the penalties (fitted jointly by least squares, in each scope), the soft-cap,
  a logit bias (on the tokens the rest leaves furthest out);
- then every continuous knob kept fitted jointly, and a group the result does not need put
  back (the reproduction names only what it must).

The search re-processes one forward's head logits of one sequence; the judge then re-scores
the finding's sequences under what it found."""

from __future__ import annotations

import numpy as np

from pipeline.contracts.causes import Cause
from pipeline.contracts.report import Finding
from pipeline.engines.metadata import generation_sampling
from pipeline.faults import QWEN3_DEFAULTS, completion_logits, select_processed
from pipeline.faults.processing import (
    MODEL_CAP,
    SCOPES,
    Processing,
    apply,
    apply_seen,
    model_cap,
    seen_before,
    stacked,
)
from pipeline.verify.hypothesis import Candidate, Family
from pipeline.verify.search import SEARCH_LOGITS

KIND = "logits_processing"
SAMPLER = ("temperature", "top_k", "top_p", "min_p")
ENGINE_DEFAULTS = (  # what engines apply to Qwen3 unasked: its generation config, both modes
    QWEN3_DEFAULTS,
    {"temperature": 0.7, "top_k": 20, "top_p": 0.8},
)
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
SEARCH_TOKENS = 256  # compared tokens the search re-processes, spread over the sequences
SEARCH_ROWS = 8  # sequences they are spread over (one forward each)


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
        logits = HeadLogits(ref, rows, observed, clean, _noise(ref, rows, clean, side))
        earlier = ref.found.setdefault(KIND, [])
        again = [p for p in earlier if logits.gap(p) <= AGAIN * logits.gap(Processing())]
        if again:  # the same processing, its numbers refitted on these tokens
            found = fit_continuous(logits, again[0], _continuous_of(again[0]))
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


class HeadLogits:
    """The head logits (before any soft-cap, in float64 so that a fit's finite differences
    see its knobs, not rounding) of compared tokens spread evenly over the sequences (at
    most SEARCH_ROWS of them) and over each one's length, as many as SEARCH_LOGITS and
    SEARCH_TOKENS allow, stacked, with each token's penalty history in either scope and its
    observed logprob: `gap(processing)` is how far that processing leaves them,
    `residual(processing)` per token. Not the leading tokens: half are spread evenly, half
    are those the observed side moved furthest from the clean reference, where the
    processing acted most (a top-k under a top-p binds only where the distribution is
    flat, on a few tokens the first of one sequence may not hold).
    ``noise``: the mean |d| the observed side's precision alone gives on these sequences,
    what a knob must close more than a share of to be needed."""

    def __init__(self, ref, rows: list[int], observed: list, clean: list, noise: float = 0.0):
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
        self.logits = torch.cat(logits)
        self.targets = np.concatenate(targets)
        self.observed = np.concatenate(kept)
        self.history = {
            scope: stacked(histories[scope], widths, self.logits.device) for scope in SCOPES
        }
        self._targets = torch.as_tensor(self.targets, device=self.logits.device)[:, None]
        self.cap = model_cap(ref.model)
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
AGAIN = 0.01  # a processing found on other findings is taken where it leaves this of the gap


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
    current = fit_continuous(logits, current, _continuous_of(current))
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


def _continuous_of(processing: Processing) -> tuple[str, ...]:
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
        without = fit_continuous(logits, without, _continuous_of(without))
        if unneeded(without, smooth=group != "sampler"):
            found = without
    for name in [n for n in found.changed() if n in SPANS or n in TRUNCATIONS]:
        without = found.but(**{name: getattr(neutral, name)})
        without = fit_continuous(logits, without, _continuous_of(without))
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
        words.append(f"sampling penalties (counted over the {found.penalty_scope})")
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

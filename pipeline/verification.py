"""Verify a comparison's findings by reproducing them with the model.

A finding is a hypothesis the signatures propose: a cause, its parameters (a temperature,
an onset, a shift, a truncation length) and the sequences it explains. Verification commits
that bug in the reference model (`faults.py` re-scores the sequences with it, in fp32) and
asks whether one side now matches the re-score down to the noise floor, the mean |d| this
model's precision alone gives those tokens (`lpx calibrate`; without one, the profile's
constant floor). Then the finding is `verified`, and the side that committed the bug is
named. A finding whose every reproduction leaves drift is `ruled_out`: its runner-up cause
is tried, and what nothing reproduces is `unexplained`, listing what was ruled out.

Each hypothesis tested costs one re-score of (at most MAX_SEQUENCES of) its sequences; a
position offset is first searched for on one sequence. A flow beside inject and faults: it
calls an engine and hands compare/ back findings; compare/ never runs a model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from pipeline.compare.calibrated import calibrated_judging, pair_key, side_precision
from pipeline.compare.hypotheses.batch import NUMERIC_CEILING
from pipeline.faults import FaultSettings, rescore
from pipeline.fixture.table import REPLAY_CHANNEL, TokenTable

VERIFY_MARGIN = 3.0  # a reproduction leaves at most this many times the floor's mean |d|
EXPLAINED = 0.5  # and removes at least this fraction of the drift it set out to explain
MAX_SEQUENCES = 16  # re-scored per hypothesis, spread evenly over the finding's sequences
OFFSETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # position offsets searched on one sequence
UNEXPLAINED_KINDS = (
    "bos_extra",
    "bos_missing",
    "positions_restart",
    "label_shift",
    "pad_attended",
    "mask_dropped",
)
TEMPERATURE_STEPS = 24  # golden-section steps on log T: ~1e-5 relative
COMPETED = ("stale_weights",)  # tried against reproducible causes of the same shape
NOT_REPRODUCIBLE = {
    "stale_weights": "other weights cannot be re-created from one side's logprobs; give "
    "--weights-store to re-score under the published versions",
    "version_change": "the weights after the update are not at hand; give --weights-store",
    "claimed_version": "already decided by re-scoring under the store's versions",
    "missing_version": "the version is not in the store",
    "dtype": "precision is judged against the calibrated floor (lpx calibrate)",
}


@dataclass
class Candidate:
    """One hypothesis to re-score: a fault kind with its parameters."""

    cause: str
    kind: str
    settings: FaultSettings
    params: dict


@dataclass
class Outcome:
    candidate: Candidate
    side: str  # rollout or replay: the side the reproduction matches best
    before: float
    after: float
    floor: float
    verified: bool
    seconds: float


class Verifier:
    """Re-scores a fixture's sequences under hypothesised bugs and judges each one."""

    def __init__(
        self,
        fixture: TokenTable,
        replay: TokenTable,
        model_dir: Path,
        channel: str = "rollout",
        calibration: dict | None = None,
        device: str = "auto",
        say=lambda line: None,
    ):
        from pipeline.devices import resolve_device, set_tf32
        from pipeline.engines.hf_common import load_model

        self.fixture, self.replay, self.channel = fixture, replay, channel
        self.calibration = calibration
        self.device = resolve_device(device)
        self.model = load_model(Path(model_dir), "float32", device=self.device)
        set_tf32(self.device, False)
        self.rows = fixture.index_of()
        self.replay_rows = replay.index_of()
        self.say = say
        bos = self.model.config.bos_token_id
        self.base = FaultSettings(bos_id=int(bos) if bos is not None else 1)
        self._clean_scores: dict[int, np.ndarray] = {}

    # --- the whole diagnosis ---------------------------------------------------------------

    def verify(self, findings: list[dict]) -> list[dict]:
        """The findings with statuses, residuals and floors; ruled-out ones demoted, their
        runner-ups tried, and what nothing reproduces gathered as `unexplained`."""
        out: list[dict] = []
        unexplained_ids: list[str] = []
        ruled_out: list[dict] = []
        for finding in findings:
            if finding["cause"] in COMPETED and finding.get("sequences"):
                # Not reproducible itself; a cause that fits the same shape and reproduces
                # exactly beats it (a temperature or a BOS bug also moves every sequence).
                verified, tried = self._first_verified(finding, self.competitors(finding))
                if verified:
                    out.append(
                        _verified(
                            {**finding, "cause": verified.candidate.cause},
                            verified,
                            renamed_from=finding["cause"],
                        )
                    )
                elif tried:
                    out.append(
                        {
                            **finding,
                            "details": {**(finding.get("details") or {}), "ruled_out": tried},
                            "evidence": f"{finding['evidence']}; re-scoring reproduces none of: {', '.join(t['kind'] for t in tried)}",
                        }
                    )
                else:
                    out.append(finding)
                continue
            if finding["cause"] in NOT_REPRODUCIBLE or not finding.get("sequences"):
                out.append(finding)
                continue
            if finding["cause"] == "unexplained":
                verified, tried = self._first_verified(finding, _unexplained_candidates())
                if verified:
                    out.append(_verified(finding, verified))
                else:
                    unexplained_ids += finding["sequences"]
                    ruled_out += tried
                continue
            verified, tried = self._first_verified(finding, self.candidates(finding))
            if verified:
                out.append(_verified(finding, verified))
                continue
            if not tried:  # nothing to re-score with: it stays as the signatures said
                out.append(finding)
                continue
            out.append(_ruled_out(finding, tried))
            runner = (finding.get("runner_up") or {}).get("cause")
            if runner and runner not in NOT_REPRODUCIBLE:
                alternative = {**finding, "cause": runner, "details": {}}
                verified, also = self._first_verified(alternative, self.candidates(alternative))
                if verified:
                    out.append(_verified(alternative, verified, renamed_from=finding["cause"]))
                    continue
                tried += also
            unexplained_ids += finding["sequences"]
            ruled_out += tried
        if unexplained_ids:
            out.append(_unexplained(sorted(set(unexplained_ids)), ruled_out))
        return out

    def _first_verified(self, finding: dict, candidates: list[Candidate]):
        tried = []
        for candidate in candidates:
            outcome = self.test(candidate, finding["sequences"])
            if outcome is None:
                continue
            self.say(
                f"verify: {candidate.kind} {candidate.params or ''} on {finding['cause']}: "
                f"mean |d| {outcome.before:.3g} -> {outcome.after:.3g} on the {outcome.side} side "
                f"(floor {outcome.floor:.3g}): {'verified' if outcome.verified else 'ruled out'}"
            )
            if outcome.verified:
                return outcome, tried
            tried.append(_describe(outcome))
        return None, tried

    # --- one hypothesis --------------------------------------------------------------------

    def candidates(self, finding: dict) -> list[Candidate]:
        """The reproductions a finding's cause and parameters call for."""
        cause, details = finding["cause"], finding.get("details") or {}
        sampling = self.fixture.metadata.get("sampling") or {}
        base = self.base
        if cause == "temperature":
            fit = details.get("temperature_fit") or {}
            t = fit.get("estimated_temperature") or sampling.get("temperature")
            if not t or float(t) == 1.0:
                return []
            return [
                Candidate(
                    cause,
                    "temperature",
                    replace(base, temperature=float(t)),
                    {"T": round(float(t), 4)},
                )
            ]
        if cause in ("top_k", "top_p", "top_k+top_p"):
            k, p = int(sampling.get("top_k") or 0), float(sampling.get("top_p") or 1.0)
            if k and p < 1.0:
                return [
                    Candidate(
                        cause, "top_k_top_p", replace(base, top_k=k, top_p=p), {"k": k, "p": p}
                    )
                ]
            if k:
                return [Candidate(cause, "top_k", replace(base, top_k=k), {"k": k})]
            if p < 1.0:
                return [Candidate(cause, "top_p", replace(base, top_p=p), {"p": p})]
            return []
        if cause == "token_shift":
            shift = details.get("shift")
            if shift in (1, -1):
                return [Candidate(cause, f"data_shift{shift:+d}", base, {"shift": shift})]
            return [Candidate(cause, "label_shift", base, {})]
        if cause == "position_ids":
            onset = int(
                details.get("onset") or (finding.get("first_position") or {}).get("position") or 0
            )
            if onset <= 1:
                return [Candidate(cause, "positions_restart", base, {})]
            return [Candidate(cause, "position_ids", replace(base, at=onset), {"at": onset})]
        if cause == "prompt_mismatch":
            return [
                Candidate(cause, "bos_extra", base, {"extra_leading": base.bos_id}),
                Candidate(cause, "bos_missing", base, {"missing_leading": 1}),
                *self._truncation(finding),
            ]
        if cause == "mask_padding":
            if "fill_value" in details:
                params = {
                    "fill_value": details["fill_value"],
                    "side": details.get("side", "rollout"),
                }
                return [Candidate(cause, "data_fill", base, params)]
            size = self._micro_batch()
            settings = replace(base, micro_batch=size)
            return [
                Candidate(cause, kind, settings, {"micro_batch": size})
                for kind in ("pad_attended", "mask_dropped", "packed_no_reset")
            ]
        return []

    def competitors(self, finding: dict) -> list[Candidate]:
        """Reproducible causes with the shape of a weight change (drift in every sequence
        from its first token): a temperature on one side, a BOS added or dropped."""
        base = self.base
        return [
            Candidate("temperature", "temperature", base, {}),
            Candidate("prompt_mismatch", "bos_extra", base, {"extra_leading": base.bos_id}),
            Candidate("prompt_mismatch", "bos_missing", base, {"missing_leading": 1}),
        ]

    def _truncation(self, finding: dict) -> list[Candidate]:
        """A max prompt length that cut exactly the finding's prompts: the longest clean one."""
        drifting = set(finding["sequences"])
        clean = [
            len(self.fixture.prompt_of(row))
            for sid, row in self.rows.items()
            if sid not in drifting
        ]
        longest = max((len(self.fixture.prompt_of(self.rows[s])) for s in drifting), default=0)
        if not clean or max(clean) >= longest:
            return []
        limit = max(clean)
        return [
            Candidate(
                "prompt_mismatch",
                "prompt_truncated",
                replace(self.base, max_prompt=limit),
                {"max_prompt": limit},
            )
        ]

    def test(self, candidate: Candidate, sequence_ids: list[str]) -> Outcome | None:
        """Re-score (at most MAX_SEQUENCES of) the sequences under the candidate's bug; the
        side it reproduces, the drift before and after, and the floor they are judged by."""
        started = time.perf_counter()
        chosen = _spread(sequence_ids, MAX_SEQUENCES)
        rows = [self.rows[s] for s in chosen if s in self.rows and s in self.replay_rows]
        if not rows:
            return None
        rollout, replay, positions = self._observed(rows)
        before = _mean_abs(rollout, replay)
        if candidate.kind.startswith("data_"):
            # A data bug needs no model: the rollout's logprobs moved by one token, or one
            # side filled with a constant, set against the other side as it is.
            side, reproduced, against = _data_reproduction(candidate, rollout, replay)
            after = {side: _mean_abs(against, reproduced)}
            floor = self._floor(
                (side_precision(self.fixture.metadata), side_precision(self.replay.metadata)),
                replay,
                positions,
            )
        else:
            # The side the bug moved is the one farther from the clean reference; every
            # search and the verdict are about reproducing that side.
            clean = self._clean(rows)
            side = "rollout" if _mean_abs(rollout, clean) >= _mean_abs(replay, clean) else "replay"
            observed = rollout if side == "rollout" else replay
            if candidate.kind == "position_ids":
                candidate = self._search_offset(candidate, rows[0], observed[0])
            if candidate.kind == "temperature":
                candidate = self._search_temperature(candidate, rows[0], observed[0], clean[0])
            if candidate.kind == "prompt_truncated":
                candidate = self._search_truncation(candidate, rows, observed)
            reproduced = self._rescore(candidate, rows)
            after = {side: _mean_abs(observed, reproduced)}
            if _mean_abs(reproduced, clean) < EXPLAINED * before:
                # the bug barely changes these sequences: it cannot explain their drift
                after[side] = max(after[side], before)
            meta = self.fixture.metadata if side == "rollout" else self.replay.metadata
            floor = self._floor((side_precision(meta), "float32"), replay, positions)
        verified = after[side] <= VERIFY_MARGIN * floor and after[side] <= EXPLAINED * before
        return Outcome(
            candidate, side, before, after[side], floor, verified, time.perf_counter() - started
        )

    def _rescore(self, candidate: Candidate, rows: list[int]) -> list[np.ndarray]:
        kind, settings = candidate.kind, candidate.settings
        if kind in ("pad_attended", "mask_dropped", "packed_no_reset", "pad_positions"):
            # The micro-batches the engine formed, in fixture order, hold the sequences.
            size = settings.micro_batch
            groups = sorted({row // size for row in rows})
            members = [
                r
                for g in groups
                for r in range(g * size, min((g + 1) * size, self.fixture.num_sequences))
            ]
            pairs = [(self.fixture.prompt_of(r), self.fixture.completion_of(r)) for r in members]
            scored = dict(zip(members, rescore(self.model, pairs, kind, settings), strict=True))
            values = [scored[r] for r in rows]
        else:
            pairs = [(self.fixture.prompt_of(r), self.fixture.completion_of(r)) for r in rows]
            values = rescore(self.model, pairs, kind, settings)
        return [v[self._mask(r)].astype(np.float64) for v, r in zip(values, rows, strict=True)]

    def _search_offset(self, candidate, row: int, observed) -> Candidate:
        """The position offset that reproduces one sequence best (each try re-scores one
        sequence): what a KV-cache or cache-reuse bug shifted the positions by."""
        best, best_gap = candidate, np.inf
        for offset in OFFSETS:
            trial = replace(candidate, settings=replace(candidate.settings, position_offset=offset))
            (scored,) = self._rescore(trial, [row])
            gap = _mean_abs([observed], [scored])
            if gap < best_gap:
                best, best_gap = replace(trial, params={**candidate.params, "offset": offset}), gap
        return best

    def _search_truncation(self, candidate, rows: list[int], observed) -> Candidate:
        """The max prompt length between the longest clean prompt and the shortest cut one
        that reproduces the shortest cut prompt (each try re-scores one sequence)."""
        lengths = [len(self.fixture.prompt_of(r)) for r in rows]
        shortest = int(np.argmin(lengths))
        low = candidate.settings.max_prompt or 1
        best, best_gap = candidate, np.inf
        for limit in range(low, min(lengths[shortest], low + 64)):
            trial = replace(candidate, settings=replace(candidate.settings, max_prompt=limit))
            (scored,) = self._rescore(trial, [rows[shortest]])
            gap = _mean_abs([observed[shortest]], [scored])
            if gap < best_gap:
                best, best_gap = replace(trial, params={"max_prompt": limit}), gap
        return best

    def _search_temperature(self, candidate, row: int, observed, clean) -> Candidate:
        """The temperature that reproduces one sequence best, by golden-section search on
        log T from the fitted estimate (each try re-scores one sequence): the signatures'
        linear fit is an estimate, the reproduction must hold to the noise floor."""
        given = candidate.params.get("T")
        guess = (
            float(given) if given and float(given) != 1.0 else _slope_temperature(observed, clean)
        )
        settings = candidate.settings

        def gap(log_t: float) -> float:
            trial = replace(settings, temperature=float(np.exp(log_t)))
            (scored,) = self._rescore(replace(candidate, settings=trial), [row])
            return _mean_abs([observed], [scored])

        low, high = np.log(guess) - 0.7, np.log(guess) + 0.7
        ratio = (np.sqrt(5) - 1) / 2
        a, b = high - ratio * (high - low), low + ratio * (high - low)
        ga, gb = gap(a), gap(b)
        for _ in range(TEMPERATURE_STEPS):
            if ga < gb:
                high, b, gb = b, a, ga
                a = high - ratio * (high - low)
                ga = gap(a)
            else:
                low, a, ga = a, b, gb
                b = low + ratio * (high - low)
                gb = gap(b)
        t = float(np.exp((low + high) / 2))
        return replace(
            candidate, settings=replace(settings, temperature=t), params={"T": round(t, 5)}
        )

    def _clean(self, rows: list[int]) -> list[np.ndarray]:
        """The reference's own scores of the rows (fp32, no bug), computed once per row."""
        missing = [r for r in rows if r not in self._clean_scores]
        if missing:
            clean = Candidate("clean", "clean", self.base, {})
            self._clean_scores.update(zip(missing, self._rescore(clean, missing), strict=True))
        return [self._clean_scores[r] for r in rows]

    # --- observations and floors -----------------------------------------------------------

    def _observed(self, rows: list[int]):
        rollout, replay, positions = [], [], []
        for row in rows:
            mask = self._mask(row)
            rollout.append(
                self.fixture.channels[self.channel][self.fixture.completion_slice(row)][
                    mask
                ].astype(np.float64)
            )
            other = self.replay_rows[self.fixture.sequence_ids[row]]
            replay.append(
                self.replay.channels[REPLAY_CHANNEL][self.replay.completion_slice(other)][
                    mask
                ].astype(np.float64)
            )
            positions.append(np.flatnonzero(mask))
        return rollout, replay, positions

    def _mask(self, row: int) -> np.ndarray:
        return np.asarray(
            self.fixture.completion_mask[self.fixture.completion_slice(row)], dtype=bool
        )

    def _floor(self, precisions: tuple[str, str], replay, positions) -> float:
        """Mean |d| precision alone gives these tokens between two precisions: the
        calibrated floor, else the constant for the less precise one."""
        pair = pair_key(*precisions)
        if self.calibration and pair in self.calibration.get("pairs", {}):
            lengths = np.array([len(r) for r in replay])
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            floor = calibrated_judging(
                self.calibration,
                pair,
                np.concatenate(replay),
                np.concatenate(positions),
                offsets,
                "",
            )
            return float(floor.expected_mean.mean()) if len(floor.expected_mean) else 0.0
        dtypes = [p.removesuffix("+tf32") for p in precisions]
        least = max(dtypes, key=("float32", "float16", "bfloat16").index)
        return NUMERIC_CEILING.get(least, NUMERIC_CEILING["float32"]) / 3

    def _micro_batch(self) -> int:
        layout = self.replay.metadata.get("layout") or {}
        return int(layout.get("micro_batch_size") or 8)


def _slope_temperature(processed, raw) -> float:
    """T from the slope of the processed logprobs on the raw ones (processed = raw / T + c)."""
    x, y = np.asarray(raw, dtype=np.float64), np.asarray(processed, dtype=np.float64)
    keep = np.isfinite(x) & np.isfinite(y)
    if keep.sum() < 3 or x[keep].var() <= 0:
        return 1.0
    slope = np.cov(x[keep], y[keep])[0, 1] / x[keep].var()
    return float(1.0 / slope) if 0.2 <= slope <= 5.0 else 1.0


def _unexplained_candidates() -> list[Candidate]:
    base = FaultSettings()
    return [Candidate("unexplained", kind, base, {}) for kind in UNEXPLAINED_KINDS]


def _data_reproduction(candidate: Candidate, rollout, replay):
    """(side, reproduction, what it is set against) for a data bug."""
    if candidate.kind.startswith("data_shift"):
        shift = candidate.params["shift"]
        # replay[t] = rollout[t + shift]: the rollout's logprobs sit one token off
        moved = [np.roll(r, -shift) for r in rollout]
        return (
            "rollout",
            [m[:-1] if shift > 0 else m[1:] for m in moved],
            [r[:-1] if shift > 0 else r[1:] for r in replay],
        )
    side = candidate.params.get("side", "rollout")
    filled = rollout if side == "rollout" else replay
    value = float(candidate.params["fill_value"])
    return side, [np.full(len(f), value) for f in filled], filled


def _mean_abs(a: list, b: list) -> float:
    a, b = np.concatenate(a), np.concatenate(b)
    keep = np.isfinite(a) & np.isfinite(b)
    return float(np.mean(np.abs(a[keep] - b[keep]))) if keep.any() else 0.0


def _spread(ids: list[str], most: int) -> list[str]:
    if len(ids) <= most:
        return list(ids)
    return [ids[int(i)] for i in np.linspace(0, len(ids) - 1, most).round()]


def _describe(outcome: Outcome) -> dict:
    return {
        "cause": outcome.candidate.cause,
        "kind": outcome.candidate.kind,
        "params": outcome.candidate.params,
        "residual_before": outcome.before,
        "residual_after": outcome.after,
        "floor": outcome.floor,
        "side": outcome.side,
    }


def _verified(finding: dict, outcome: Outcome, renamed_from: str | None = None) -> dict:
    """The finding, verified. An unexplained one takes the cause its reproduction names; a
    runner-up says what was ruled out before it."""
    from pipeline.faults import FAULTS

    cause = finding["cause"]
    if cause == "unexplained":
        cause = (FAULTS.get(outcome.candidate.kind) or (None,))[0] or "unexplained"
    params = outcome.candidate.params
    how = (
        f"re-scored with {outcome.candidate.kind}"
        + (f" ({_params(params)})" if params else "")
        + f", the {outcome.side} side matches to mean |d| {outcome.after:.3g} (floor "
        f"{outcome.floor:.3g}; the drift was {outcome.before:.3g}): the bug is on the "
        f"{outcome.side} side"
    )
    if renamed_from:
        how = f"{renamed_from} did not reproduce the drift; {how}"
    return {
        **finding,
        "cause": cause,
        "evidence": f"{finding['evidence']}; {how}",
        "severity": "fault",
        "status": "verified",
        "residual_before": outcome.before,
        "residual_after": outcome.after,
        "floor": outcome.floor,
        "details": {**(finding.get("details") or {}), "verified_by": _describe(outcome)},
    }


def _ruled_out(finding: dict, tried: list[dict]) -> dict:
    best = min(tried, key=lambda t: t["residual_after"])
    return {
        **finding,
        "severity": "info",
        "status": "ruled_out",
        "residual_before": best["residual_before"],
        "residual_after": best["residual_after"],
        "floor": best["floor"],
        "evidence": (
            f"{finding['evidence']}; ruled out by re-scoring: "
            + "; ".join(
                f"{t['kind']}{' (' + _params(t['params']) + ')' if t['params'] else ''} leaves "
                f"mean |d| {t['residual_after']:.3g} (floor {t['floor']:.3g})"
                for t in tried
            )
        ),
        "details": {**(finding.get("details") or {}), "ruled_out": tried},
    }


def _unexplained(sequences: list[str], tried: list[dict]) -> dict:
    names = sorted({f"{t['cause']}/{t['kind']}" for t in tried})
    return {
        "cause": "unexplained",
        "sequences": sequences,
        "first_position": {},
        "evidence": (
            f"drift in {len(sequences)} sequences that no re-scored hypothesis reproduces; "
            f"ruled out: {', '.join(names) or 'nothing testable'}; inspect the worst tokens"
        ),
        "severity": "fault",
        "details": {"ruled_out": tried},
        "confidence": 0.0,
        "runner_up": None,
        "status": "plausible",
        "residual_before": min((t["residual_before"] for t in tried), default=None),
        "residual_after": min((t["residual_after"] for t in tried), default=None),
        "floor": min((t["floor"] for t in tried), default=None),
    }


def _params(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())

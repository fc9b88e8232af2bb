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

from pipeline.compare.calibrated import (
    TAU_MARGIN,
    expected_mean_abs,
    pair_key,
    side_precision,
)
from pipeline.compare.floor import expect
from pipeline.compare.hypotheses.batch import NUMERIC_CEILING
from pipeline.compare.noise_test import (
    FAULT_SIZE,
    bucket_level_tests,
    precision_gate,
    rules_out_faults,
)
from pipeline.faults import (
    FaultSettings,
    completion_logits,
    left_padded,
    rescore,
    select_processed,
)
from pipeline.fixture.table import REPLAY_CHANNEL, TokenTable

VERIFY_MARGIN = 3.0  # a reproduction leaves at most this many times the floor's mean |d|
DATA_DRIFT = 5.0  # a data bug is judged on tokens whose |d| is this many times their floor
EXPLAINED = 0.5  # and removes at least this fraction of the drift it set out to explain
MAX_SEQUENCES = 16  # re-scored per hypothesis, spread evenly over the finding's sequences
OFFSETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # position offsets searched on one sequence
TEMPERATURE_STEPS = 45  # golden-section steps on log T: to ~1e-9, an fp32 reproduction
FILL_EXACT = 1e-6  # a constant written into logprobs is the constant, to float32 rounding
ROUNDINGS = ("bfloat16", "float16")  # logprobs rounded to these after the forward
# faults.py kinds that compute in a lower precision than declared, and the floor they meet
UNDECLARED_PRECISIONS = {"bf16": "bfloat16", "fp16": "float16", "lm_head_bf16": "bfloat16"}
SEARCH_LOGITS = 1 << 26  # fp32 logits (256 MiB) kept for the temperature search
# Truncation searched for where the dump does not record it: a token whose kept mass is this
# far below 1 was truncated; the kept masses' low quantiles are the top-p values read off
# them (the least is the top-p in exact arithmetic; the others allow for the other side's
# noise), beside the settings engines ship.
TRUNCATED = 1e-4
READ_QUANTILES = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5)
TOP_P_GRID = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.92, 0.95, 0.97, 0.98, 0.99)
TOP_K_GRID = (1, 2, 3, 5, 8, 10, 16, 20, 32, 40, 50, 64, 100, 128, 200, 256, 500, 1000)
# A reproduction that leaves this much of the drift moved nothing toward the observation.
NOTHING_MOVED = 0.9
PAD_ROWS = 32  # pad counts scored per forward in the padding search
# Weights causes cannot be re-scored; reproducible causes of the same shape are tried instead
COMPETED = ("stale_weights", "version_change")
MAX_VERSIONS = 8  # published versions re-scored for a weights finding, newest first
WEIGHT_LIKE_SEQUENCES = 3  # the sign test needs a few sequences to say "weights"
WEIGHT_SIGN_Z = 8.0  # as the signature rule: standard errors above chance
NOT_REPRODUCIBLE = {
    "stale_weights": "other weights cannot be re-created from one side's logprobs; give "
    "--weights-store to re-score under the published versions",
    "version_change": "the weights after the update are not at hand; give --weights-store",
    "claimed_version": "already decided by re-scoring under the store's versions",
    "missing_version": "the version is not in the store",
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
        model=None,
        weights_store: Path | None = None,
    ):
        from pipeline.devices import resolve_device, set_tf32
        from pipeline.engines.hf_common import load_model

        self.fixture, self.replay, self.channel = fixture, replay, channel
        self.model_dir = Path(model_dir)
        self.calibration = calibration
        self.device = resolve_device(device)
        self.model = model or load_model(Path(model_dir), "float32", device=self.device)
        set_tf32(self.device, False)
        self.rows = fixture.index_of()
        self.replay_rows = replay.index_of()
        self.say = say
        bos = self.model.config.bos_token_id
        self.base = FaultSettings(bos_id=int(bos) if bos is not None else 1)
        self._clean_scores: dict[int, np.ndarray] = {}
        self.weights_store = Path(weights_store) if weights_store else None
        self._version_model = (None, None)  # (name, model): one version held at a time

    # --- the whole diagnosis ---------------------------------------------------------------

    def verify(self, findings: list[dict]) -> list[dict]:
        """The findings with statuses, residuals and floors. A finding whose own hypotheses
        fail is ruled out; what reproduced other findings, its runner-up and every other
        reproducible cause are tried on its sequences next; what nothing reproduces is
        gathered as `unexplained`, listing what was ruled out."""
        self.drifting = {
            s for f in findings if f.get("severity") == "fault" for s in f.get("sequences") or []
        }
        out: list[dict] = []
        leftover: list[str] = []
        said: list[str] = []
        ruled_out: list[dict] = []
        reproduced: list[Candidate] = []  # what verified: tried first on the rest
        for finding in findings:
            cause = finding["cause"]
            if not finding.get("sequences") or (
                cause in NOT_REPRODUCIBLE and cause not in COMPETED
            ):
                out.append(finding)
                continue
            if cause in COMPETED:  # weights: re-scored under the store's versions, if given
                own = self.store_candidates(finding)
            else:
                own = [] if cause == "unexplained" else self.candidates(finding)
            verified, tried = self._first_verified(finding, own)
            if verified:
                out.append(self._onset_of_shift(_verified(finding, verified), verified))
                reproduced.append(verified.candidate)
                continue
            if own and not tried:  # nothing could be re-scored: as the signatures said
                out.append(finding)
                continue
            if tried and tried[-1]["params"].get("inconclusive"):
                # consistent with precision, too few tokens to rule out a fault: a claim
                # that stays plausible, worded as one; no other cause to chase in noise
                out.append(_inconclusive_precision(finding, tried[-1]))
                continue
            runner = (finding.get("runner_up") or {}).get("cause")
            others = [
                *reproduced,
                # beyond the declared precisions: one side may compute in a lower one
                *(self.undeclared_precisions() if cause == "dtype" else []),
                # other weights explain any drift when the store holds them
                *self.store_candidates({**finding, "cause": "stale_weights"}),
                *(self.candidates({**finding, "cause": runner, "details": {}}) if runner else []),
                *(self.competitors(finding) if cause in COMPETED else self.any_cause(finding)),
            ]
            verified, also = self._first_verified(finding, _distinct(others, tried))
            if verified:
                if tried:
                    out.append(_ruled_out(finding, tried))
                renamed = _verified(finding, verified, renamed_from=cause)
                out.append(self._onset_of_shift(renamed, verified))
                reproduced.append(verified.candidate)
                continue
            tried += also
            if cause in COMPETED:  # weights stay the signatures' answer, now with what failed
                out.append(_not_reproduced(finding, tried))
                continue
            weights = self._untestable(finding, runner) if _moved_nothing(tried, cause) else None
            if weights is not None:
                # the signature's own bug, committed, left the drift where it was, and the
                # drift has the shape of other weights: that, not the signature, is plausible
                out.append(_not_reproduced(weights, tried))
                continue
            if cause not in ("unexplained", "dtype"):
                # Never worse than the signatures: a real engine commits a bug in more ways
                # than re-scoring can, so a cause the signature named and nothing verified
                # stays that cause, plausible, with what was tried and how close each came;
                # only a cause that verifies replaces it. (Precision is the exception: a
                # drift that fails the precision test is a fault, never "precision".)
                out.append(_unverified(finding, tried))
                continue
            if cause != "unexplained":
                out.append(_ruled_out(finding, tried))
            untestable = self._untestable(finding, runner)
            if untestable is not None:
                # every reproducible cause failed; weights (which cannot be re-scored without
                # the other weights) remain, and the drift has their shape
                out.append(_not_reproduced(untestable, tried))
                continue
            leftover += finding["sequences"]
            if cause == "unexplained":  # what the comparison said of it stays said
                said.append(finding["evidence"])
            ruled_out += tried
        if leftover:
            out.append(_unexplained(sorted(set(leftover)), ruled_out, said))
        out = self._fills_the_model_explains(out, reproduced)
        return _one_routing_flip(_both_truncations(_one_per_reproduction(out)))

    def _fills_the_model_explains(self, out: list[dict], reproduced: list[Candidate]):
        """A constant in the logprobs is also what a bug of the model gives: a top-p nucleus
        of one token scores exactly 0. A fill is judged on the median of its tokens, so a
        reproduction that verified elsewhere on the same side and also verifies a fill's
        sequences (on every token) is the better explanation, and replaces it."""
        models = [c for c in reproduced if not c.kind.startswith("data_")]
        if not models:
            return out
        for index, finding in enumerate(out):
            by = (finding.get("details") or {}).get("verified_by") or {}
            if finding.get("status") != "verified" or not by.get("kind", "").startswith("data_"):
                continue
            for candidate in models:
                outcome = self.test(candidate, finding["sequences"])
                if outcome and outcome.verified and outcome.side == by.get("side"):
                    said = finding["details"].get("signature_evidence", finding["evidence"])
                    fill = f"{by['kind']} ({_params(by['params'])}) matched the median token only"
                    out[index] = _verified({**finding, "evidence": f"{said}; {fill}"}, outcome)
                    break
        return out

    def _untestable(self, finding: dict, runner: str | None) -> dict | None:
        """After every reproduction failed: the runner-up when it is an in-flight update (a
        position onset's), or `weights_differ` when the drift covers the batch and moves whole
        sequences one way (the sign test a weight step passes and noise or a prompt change
        does not); else None."""
        if runner == "version_change":
            return {
                **finding,
                "cause": runner,
                "severity": "fault",
                "status": "plausible",
                "evidence": f"{finding['cause']} did not reproduce the drift; {runner}, the "
                "runner-up, fits its shape and needs the other weights to re-score "
                "(--weights-store)",
                "details": {"at": (finding.get("first_position") or {}).get("position")},
            }
        rows = [
            self.rows[s] for s in finding["sequences"] if s in self.rows and s in self.replay_rows
        ]
        # weights move the batch: most sequences past the floor (a small step hides in
        # some under noise), and the sign test over every sequence, drifting or not
        if len(rows) < max(WEIGHT_LIKE_SEQUENCES, 0.5 * self.fixture.num_sequences):
            return None
        every = [r for r, s in enumerate(self.fixture.sequence_ids) if s in self.replay_rows]
        rollout, replay, _ = self._observed(every)
        z2 = np.array([_sign_z(r, p) ** 2 for r, p in zip(rollout, replay, strict=True)])
        needed = 1.0 + WEIGHT_SIGN_Z * np.sqrt(2.0 / len(z2))
        if float(np.minimum(z2, 100.0).mean()) <= needed:
            return None
        return {
            **finding,
            "cause": "weights_differ",
            "severity": "fault",
            "status": "plausible",
            "evidence": f"no reproducible cause reproduces the drift of these {len(rows)} "
            f"sequences, and the batch's {len(z2)} sequences each move their own way "
            f"throughout (sign test: mean z^2 "
            f"{float(np.minimum(z2, 100.0).mean()):.2f} > {needed:.2f}), as a weight step "
            "does: the two sides likely hold different weights (give --weights-store to "
            "re-score under the published versions)",
        }

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
            # the recorded truncation is what is re-scored, and what a reproduction proves:
            # named by it, whichever truncation the signature guessed
            k, p = int(sampling.get("top_k") or 0), float(sampling.get("top_p") or 1.0)
            recorded = []
            if k and p < 1.0:
                recorded = [
                    Candidate(
                        "top_k", "top_k_top_p", replace(base, top_k=k, top_p=p), {"k": k, "p": p}
                    )
                ]
            elif k:
                recorded = [Candidate("top_k", "top_k", replace(base, top_k=k), {"k": k})]
            elif p < 1.0:
                recorded = [Candidate("top_p", "top_p", replace(base, top_p=p), {"p": p})]
            # a dump that does not record its sampling (or records it wrong): the truncation
            # is searched for, the signature's own guess first
            searched = [Candidate(c, f"{c}_search", base, {}) for c in ("top_p", "top_k")]
            if cause == "top_k":
                searched.reverse()
            return recorded + searched
        if cause == "dtype":
            if "mean_abs_diff" not in details and details.get("dtype") in ROUNDINGS:
                # one side's logprobs are exact values of a low precision: rounded after the
                # forward, a data bug of its own that re-scoring cannot give
                params = {"side": details.get("side", "rollout"), "dtype": details["dtype"]}
                return [Candidate(cause, "data_round", base, params)]
            precisions = {
                "rollout": side_precision(self.fixture.metadata),
                "replay": side_precision(self.replay.metadata),
            }
            return [Candidate(cause, "precision", base, precisions)]
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
        if cause == "routing_flip":
            return self._router_replay()
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
                *(
                    Candidate(cause, kind, settings, {"micro_batch": size})
                    for kind in ("pad_attended", "mask_dropped", "packed_no_reset")
                ),
                Candidate(cause, "left_pad_search", base, {}),
            ]
        return []

    def _router_replay(self) -> list[Candidate]:
        """A MoE whose two sides recorded routing: the reference re-scored with the drifting
        side's experts forced (router replay); it reproduces that side where routing alone
        made the drift."""
        if self.fixture.routed_experts is None or self.replay.routed_experts is None:
            return []
        return [Candidate("routing_flip", "router_replay", self.base, {})]

    def competitors(self, finding: dict) -> list[Candidate]:
        """Reproducible causes with the shape of a weight change: for drift from a shared
        index, positions offset from there; for drift from the first token, a temperature
        on one side, a BOS added or dropped, positions restarted at the completion, labels
        off by one, long prompts cut."""
        base = self.base
        if finding["cause"] == "version_change":
            at = int((finding.get("details") or {}).get("at") or 0)
            return [
                *_data_candidates(base),  # a fill from an index moves every token one way too
                *(
                    [Candidate("position_ids", "position_ids", replace(base, at=at), {"at": at})]
                    if at > 1
                    else []
                ),
            ]
        return [
            *_data_candidates(base),  # a constant fill moves every token one way, as weights do
            Candidate("temperature", "temperature", base, {}),
            Candidate("prompt_mismatch", "bos_extra", base, {"extra_leading": base.bos_id}),
            Candidate("prompt_mismatch", "bos_missing", base, {"missing_leading": 1}),
            Candidate("position_ids", "positions_restart", base, {}),
            Candidate("token_shift", "label_shift", base, {}),
            *self._truncation(finding),
        ]

    def undeclared_precisions(self) -> list[Candidate]:
        """A side that computed in a lower precision than it declares: the whole forward in
        bf16 or fp16, or only the LM head in bf16 (`faults.py` re-scores each)."""
        return [
            Candidate("dtype", kind, self.base, {"computed_in": computed})
            for kind, computed in UNDECLARED_PRECISIONS.items()
        ]

    def store_candidates(self, finding: dict) -> list[Candidate]:
        """Each published version of the weight store (newest first, at most MAX_VERSIONS):
        stale weights re-scored whole under it; a version change under it from the onset."""
        if self.weights_store is None:
            return []
        from pipeline.weights.store import list_versions

        names = [v["name"] for v in reversed(list_versions(self.weights_store))][:MAX_VERSIONS]
        at = int((finding.get("details") or {}).get("at") or 0)
        if finding["cause"] == "version_change":
            return [
                Candidate(finding["cause"], "store_version_from", replace(self.base, at=at),
                          {"version": name, "at": at})
                for name in names
            ]  # fmt: skip
        return [
            Candidate(finding["cause"], "store_version", self.base, {"version": name})
            for name in names
        ]

    def any_cause(self, finding: dict) -> list[Candidate]:
        """What drift no signature explained is tested against: the data bugs first (free),
        then each reproducible bug with parameters read from the drift."""
        base = self.base
        onset = int((finding.get("first_position") or {}).get("position") or 0)
        size = self._micro_batch()
        sampling = self.fixture.metadata.get("sampling") or {}
        truncated = int(sampling.get("top_k") or 0) > 0 or float(sampling.get("top_p") or 1) < 1
        return [
            # the rollout sampled with truncation: processed logprobs on one side (searched
            # for where the dump does not say: on a flat distribution a top-p moves every
            # token by about the same, which no signature takes for a truncation)
            *(
                self.candidates({**finding, "cause": "top_k", "details": {}})
                if truncated
                else [Candidate(c, f"{c}_search", base, {}) for c in ("top_p", "top_k")]
            ),
            *self._router_replay(),
            *self.competitors(finding),
            *(
                [Candidate("position_ids", "position_ids", replace(base, at=onset), {"at": onset})]
                if onset > 1
                else []
            ),
            *(
                Candidate(
                    "mask_padding", kind, replace(base, micro_batch=size), {"micro_batch": size}
                )
                for kind in ("pad_attended", "mask_dropped", "packed_no_reset")
            ),
            Candidate("mask_padding", "left_pad_search", base, {}),
        ]

    def _truncation(self, finding: dict) -> list[Candidate]:
        """A max prompt length that cut exactly the finding's prompts: the longest clean one."""
        drifting = set(finding["sequences"]) | getattr(self, "drifting", set())
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
        pair = (side_precision(self.fixture.metadata), side_precision(self.replay.metadata))
        if candidate.kind == "precision":
            return self._test_precision(candidate, rows, rollout, replay, positions, started)
        if candidate.kind.startswith("data_"):
            # A data bug needs no model: the rollout's logprobs moved by one token, or one
            # side filled with a constant, judged on the tokens that drift (beyond noise).
            token_floor = self._token_floors(pair, replay, positions)
            side, reproduced, against, drifting = _data_reproduction(
                candidate, rollout, replay, token_floor
            )
            if not drifting.any():
                return None
            before = float(
                np.mean(np.abs(np.concatenate(rollout) - np.concatenate(replay))[drifting])
            )
            after = {side: float(np.mean(np.abs(against - reproduced)[drifting]))}
            floor = float(np.mean(np.concatenate(token_floor)[drifting]))
            if candidate.kind in ("data_fill", "data_round"):
                # a fill writes its constant after the forward: no noise reaches it, so
                # logprobs merely near the constant (a confident model's near 0) are not one.
                # The median: noise tokens before the fill's onset drift too, and are not it.
                after = {side: float(np.median(np.abs(against - reproduced)[drifting]))}
                floor = FILL_EXACT
        else:
            # The side the bug moved is the one farther from the clean reference; every
            # search and the verdict are about reproducing that side.
            clean = self._clean(rows)
            side = "rollout" if _mean_abs(rollout, clean) >= _mean_abs(replay, clean) else "replay"
            observed = rollout if side == "rollout" else replay
            declared = side_precision(
                self.fixture.metadata if side == "rollout" else self.replay.metadata
            )
            if candidate.params.get("computed_in") == declared.removesuffix("+tf32"):
                return None  # that side declares this precision: the precision test's case
            if candidate.kind == "position_ids":
                candidate = self._search_offset(candidate, rows[0], observed[0])
            if candidate.kind == "temperature":
                candidate = self._search_temperature(candidate, rows[0], observed[0], clean[0])
            if candidate.kind == "prompt_truncated":
                candidate = self._search_truncation(candidate, rows, observed)
            if candidate.kind in ("top_p_search", "top_k_search"):
                candidate = self._search_sampling(candidate, rows[0], observed[0])
            if candidate.kind == "left_pad_search":
                candidate = self._search_padding(candidate, rows, observed)
            elif candidate.kind == "left_pad":  # found on other sequences: their own counts
                candidate = self._search_padding(candidate, rows, observed, candidate.params)
            reproduced = None
            if candidate.kind == "router_replay":  # the experts of the side it reproduces
                candidate = replace(candidate, params={"routing_of": side})
                reproduced = self._rescore(candidate, rows)
                # routing moves only the tokens routed differently: judged on those, or a
                # few flips among hundreds of noisy tokens could never explain anything
                routed = self._routed_differently(rows)
                if any(m.any() for m in routed):
                    rollout, replay, observed, clean, reproduced, positions = (
                        [a[m] for a, m in zip(values, routed, strict=True)]
                        for values in (rollout, replay, observed, clean, reproduced, positions)
                    )
                    before = _mean_abs(rollout, replay)
            if reproduced is None:
                reproduced = self._rescore(candidate, rows)
            after = {side: _mean_abs(observed, reproduced)}
            if _mean_abs(reproduced, clean) < EXPLAINED * before:
                # the bug barely changes these sequences: it cannot explain their drift
                after[side] = max(after[side], before)
            meta = self.fixture.metadata if side == "rollout" else self.replay.metadata
            # the precision the reproduction computed in: the side's declared one, or the
            # lower one an undeclared-precision candidate tries
            computed = candidate.params.get("computed_in") or side_precision(meta)
            # bucketed by the bug's own logprobs: a bug that scores unlikely tokens meets
            # the larger noise of unlikely tokens
            floors = self._token_floors((computed, "float32"), reproduced, positions)
            floor = float(np.mean(np.concatenate(floors)))
        verified = after[side] <= VERIFY_MARGIN * floor and after[side] <= EXPLAINED * before
        return Outcome(
            candidate, side, before, after[side], floor, verified, time.perf_counter() - started
        )

    def _test_precision(self, candidate, rows, rollout, replay, positions, started) -> Outcome:
        """Precision is a claim like any other: the rows re-scored in both sides' declared
        precisions, four correct ways each (`lpx calibrate` on exactly these rows), give the
        noise these very tokens meet; the observed drift must pass the precision gate against
        it, and in every surprisal bucket its level too. Otherwise the drift is beyond what
        precision gives, and a fault to explain."""
        from pipeline.calibrate.run import calibrate

        declared = [p.removesuffix("+tf32") for p in candidate.params.values()]
        self.say(
            f"verify: re-scoring {len(rows)} sequences in {' and '.join(sorted(set(declared)))}"
        )
        calibration = calibrate(
            self.fixture, self.model_dir, declared, device=self.device, rows=rows, keyed=False
        )
        pair = pair_key(*candidate.params.values())
        if pair not in calibration["pairs"]:  # TF32 declared where none can be measured here
            pair = pair_key(*declared)
        floor = calibration["pairs"][pair]
        lengths = [len(r) for r in rollout]
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        observed = np.abs(np.concatenate(rollout) - np.concatenate(replay))
        surprisal = -np.concatenate(replay)
        where = np.concatenate(positions)
        tau = TAU_MARGIN * np.maximum(expect(floor, surprisal, where)["q999"], 1e-12)
        gate = precision_gate(floor, observed, surprisal, where, offsets, tau)
        buckets = bucket_level_tests(floor, observed, surprisal, where, offsets)
        level = next(t for t in gate["tests"] if t["name"] == "mean_abs_diff")
        failed = [t["name"] for t in gate["tests"] if not t["passed"]]
        failed += [t["name"] for t in buckets if not t["passed"]]
        # consistent with precision, but too few tokens to rule out a fault of FAULT_SIZE
        inconclusive = not failed and not rules_out_faults(level)
        candidate = replace(
            candidate,
            params={
                **candidate.params,
                "reproduced_mean_abs": round(level["expected"], 6),
                "critical_mean_abs": round(level["critical"], 6),
                "tokens": int(len(observed)),
                **({"failed": failed} if failed else {}),
                **({"inconclusive": True} if inconclusive else {}),
            },
        )
        return Outcome(
            candidate,
            "both",
            float(observed.mean()) if len(observed) else 0.0,
            level["expected"],
            level["critical"],
            not failed and not inconclusive,
            time.perf_counter() - started,
        )

    def _rescore(self, candidate: Candidate, rows: list[int]) -> list[np.ndarray]:
        kind, settings = candidate.kind, candidate.settings
        if kind.startswith("store_version"):
            return self._rescore_version(candidate, rows)
        if kind == "router_replay":
            return self._rescore_routed(candidate, rows)
        if kind == "left_pad":
            params, ids = candidate.params, self.fixture.sequence_ids
            values = [
                left_padded(
                    self.model, self.fixture.prompt_of(r), self.fixture.completion_of(r),
                    [params["counts"][ids[r]]], params["shifted"], params["pad_id"],
                )[0]
                for r in rows
            ]  # fmt: skip
            return [v[self._mask(r)].astype(np.float64) for v, r in zip(values, rows, strict=True)]
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

    def _rescore_routed(self, candidate: Candidate, rows: list[int]) -> list[np.ndarray]:
        """The rows in fp32 with every router made to choose the given side's experts."""
        from pipeline.engines.hf_replay import ReplayKnobs, score_batch
        from pipeline.routing import sequence_routing

        side = candidate.params["routing_of"]
        table = self.fixture if side == "rollout" else self.replay
        own = self.rows if side == "rollout" else self.replay_rows
        ids = self.fixture.sequence_ids
        routing = [sequence_routing(table, own[ids[r]]) for r in rows]
        pairs = [(self.fixture.prompt_of(r), self.fixture.completion_of(r)) for r in rows]
        settings = ReplayKnobs(device=str(self.device), micro_batch_size=len(rows))
        scored = score_batch(self.model, pairs, settings, routing=routing)
        return [
            s.completion[self._mask(r)].astype(np.float64)
            for s, r in zip(scored, rows, strict=True)
        ]

    def _rescore_version(self, candidate: Candidate, rows: list[int]) -> list[np.ndarray]:
        """The rows under a published version: whole, or from completion index ``at`` on
        (the reference model before it), as a sequence generated across an update."""
        name = candidate.params["version"]
        if self._version_model[0] != name:
            from pipeline.engines.hf_common import load_model
            from pipeline.weights.store import materialize

            self._version_model = (None, None)  # one version in memory at a time
            path = materialize(self.weights_store, name)
            self._version_model = (name, load_model(path, "float32", device=self.device))
        pairs = [(self.fixture.prompt_of(r), self.fixture.completion_of(r)) for r in rows]
        scored = rescore(self._version_model[1], pairs, "clean", self.base)
        versioned = [v[self._mask(r)].astype(np.float64) for v, r in zip(scored, rows, strict=True)]
        if candidate.kind != "store_version_from":
            return versioned
        # before the update: the reference's own scores, already computed for these rows
        cuts = [int(self._mask(r)[: candidate.params["at"]].sum()) for r in rows]
        return [
            np.concatenate([c[:k], v[k:]])
            for c, v, k in zip(self._clean(rows), versioned, cuts, strict=True)
        ]

    def _search_offset(self, candidate, row: int, observed) -> Candidate:
        """The position offset, then the onset within two tokens, that reproduce one sequence
        best (each try re-scores one sequence): what a KV-cache or cache-reuse bug shifted
        the positions by, and from where (an onset reads late when its first tokens drift
        under tau)."""

        def gap(trial):
            (scored,) = self._rescore(trial, [row])
            return _mean_abs([observed], [scored])

        at = candidate.settings.at
        tries = [
            replace(candidate, settings=replace(candidate.settings, position_offset=offset),
                    params={"at": at, "offset": offset})
            for offset in OFFSETS
        ]  # fmt: skip
        best = min(tries, key=gap)
        offset = best.params["offset"]
        moved = [
            replace(best, settings=replace(best.settings, at=a), params={"at": a, "offset": offset})
            for a in (at - 2, at - 1, at + 1)
            if a >= 1
        ]
        return min([best, *moved], key=gap)

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

    def _search_logits(self, row: int, observed):
        """One forward's fp32 logits for a search that re-processes them (a temperature, a
        truncation): of as many leading completion tokens as SEARCH_LOGITS holds, with their
        mask and the observed logprobs cut to match."""
        vocab = self.model.get_output_embeddings().weight.shape[0]
        keep = max(8, SEARCH_LOGITS // vocab)
        completion = self.fixture.completion_of(row)[:keep]
        logits = completion_logits(self.model, self.fixture.prompt_of(row), completion)
        mask = self._mask(row)[:keep]
        return completion, logits, mask, observed[: int(mask.sum())]

    def _search_sampling(self, candidate, row: int, observed) -> Candidate:
        """The top-p (or top-k) that reproduces one sequence best, for a dump that does not
        say what it sampled with. A sampled token's processed logprob is its raw one less the
        log of the mass its truncation kept, so each token's drift gives that mass: a top-p is
        at most every token's kept mass, a top-k is how many tokens hold it. The values read
        so, and the usual settings, are each re-processed from one forward's logits."""
        import torch

        completion, logits, mask, observed = self._search_logits(row, observed)
        vocab = logits.shape[-1]
        raw = select_processed(logits, completion)[mask].astype(np.float64)
        kept = np.exp(np.minimum(raw - observed, 0.0))  # the mass each token's truncation kept
        truncated = kept < 1.0 - TRUNCATED
        cause = candidate.cause
        if cause == "top_p":
            read = np.quantile(kept[truncated], READ_QUANTILES) if truncated.any() else []
            grid = sorted({round(float(v), 6) for v in read} | set(TOP_P_GRID))
            settings = [{"top_p": v} for v in grid]
        else:
            read = []
            if truncated.any():
                rows = torch.as_tensor(np.flatnonzero(mask), device=logits.device)
                probs = logits[rows].softmax(-1).sort(-1, descending=True).values.cumsum(-1)
                mass = torch.as_tensor(kept, dtype=probs.dtype, device=probs.device)
                counts = torch.searchsorted(probs, (mass * (1 - TRUNCATED))[:, None])[:, 0] + 1
                counts = counts[torch.as_tensor(truncated, device=counts.device)].cpu().numpy()
                mode = int(np.bincount(counts).argmax())
                read = [mode - 1, mode, mode + 1, int(np.median(counts))]
            grid = sorted({int(k) for k in [*read, *TOP_K_GRID] if 0 < k < vocab})
            settings = [{"top_k": k} for k in grid]

        def gap(processing: dict) -> float:
            scored = select_processed(logits, completion, processing)[mask].astype(np.float64)
            return _mean_abs([observed], [scored])

        best = min(settings, key=gap)
        if cause == "top_p":
            return Candidate(
                cause, "top_p", replace(candidate.settings, top_p=best["top_p"]),
                {"p": best["top_p"], "searched": True},
            )  # fmt: skip
        return Candidate(
            cause, "top_k", replace(candidate.settings, top_k=best["top_k"]),
            {"k": best["top_k"], "searched": True},
        )  # fmt: skip

    def _search_padding(self, candidate, rows: list[int], observed, found=None) -> Candidate:
        """Left padding attended (no attention mask), the pads counted in the positions or
        not, searched per sequence. A sequence's pad count is the longest of its batch less
        its own length, and the batch is the engine's, unknown here: every count another
        sequence of the fixture could impose is tried (one forward per sequence, one row per
        count). The first sequence also decides the pad id and whether positions shifted."""
        fixture, ids = self.fixture, self.fixture.sequence_ids
        totals = {
            len(fixture.prompt_of(r)) + len(fixture.completion_of(r))
            for r in range(fixture.num_sequences)
        }
        config = self.model.config
        eos = (
            config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
        )
        pad_ids = list(dict.fromkeys(i for i in (config.pad_token_id, *eos, 0) if i is not None))

        def gaps(row: int, seen, shifted: bool, pad_id: int) -> dict:
            own = len(fixture.prompt_of(row)) + len(fixture.completion_of(row))
            counts = [0, *sorted({total - own for total in totals if total > own})]
            out = {}
            for start in range(0, len(counts), PAD_ROWS):
                chunk = counts[start : start + PAD_ROWS]
                scored = left_padded(
                    self.model, fixture.prompt_of(row), fixture.completion_of(row),
                    chunk, shifted, pad_id,
                )  # fmt: skip
                mask = self._mask(row)
                out.update(
                    {c: _mean_abs([seen], [s[mask]]) for c, s in zip(chunk, scored, strict=True)}
                )
            return out

        best = None
        shapes = [(found["shifted"], found["pad_id"])] if found else []
        for shifted, pad_id in shapes or [(s, p) for s in (True, False) for p in pad_ids]:
            tried = gaps(rows[0], observed[0], shifted, pad_id)
            count = min(tried, key=tried.get)
            if best is None or tried[count] < best[0]:
                best = (tried[count], shifted, pad_id, count)
        _, shifted, pad_id, first = best
        counts = {ids[rows[0]]: first}
        for row, seen in zip(rows[1:], observed[1:], strict=True):
            tried = gaps(row, seen, shifted, pad_id)
            counts[ids[row]] = min(tried, key=tried.get)
        params = {"attended": True, "shifted": shifted, "pad_id": pad_id, "counts": counts}
        return replace(candidate, kind="left_pad", params=params)

    def _search_temperature(self, candidate, row: int, observed, clean) -> Candidate:
        """The temperature that reproduces one sequence best, by golden-section search on
        log T from the fitted estimate (one forward of that sequence; each try re-processes
        its logits): the signatures' linear fit is an estimate, the reproduction must hold
        to the noise floor."""
        given = candidate.params.get("T")
        guess = (
            float(given) if given and float(given) != 1.0 else _slope_temperature(observed, clean)
        )
        settings = candidate.settings
        # one forward: each temperature tried is a log-softmax of the same logits
        completion, logits, mask, observed = self._search_logits(row, observed)

        def gap(log_t: float) -> float:
            processing = {"temperature": float(np.exp(log_t))}
            scored = select_processed(logits, completion, processing)[mask].astype(np.float64)
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

    def _onset_of_shift(self, finding: dict, outcome: Outcome) -> dict:
        """A verified logprob shift starts where the change point says, not at the first
        token past tau: under noise, a token whose neighbour scores alike drifts too little
        to cross it, so the first drifting token can come a few after the shift."""
        spot = finding.get("first_position") or {}
        sid = spot.get("sequence_id")
        if not outcome.candidate.kind.startswith("data_shift") or sid not in self.rows:
            return finding
        if sid not in self.replay_rows:
            return finding
        (rollout,), (replay,), (positions,) = self._observed([self.rows[sid]])
        onset = shift_onset(rollout, replay, outcome.candidate.params["shift"])
        if onset is None:
            return finding
        return {**finding, "first_position": {**spot, "position": int(positions[onset])}}

    def _clean(self, rows: list[int]) -> list[np.ndarray]:
        """The reference's own scores of the rows (fp32, no bug), computed once per row."""
        missing = [r for r in rows if r not in self._clean_scores]
        if missing:
            clean = Candidate("clean", "clean", self.base, {})
            self._clean_scores.update(zip(missing, self._rescore(clean, missing), strict=True))
        return [self._clean_scores[r] for r in rows]

    # --- observations and floors -----------------------------------------------------------

    def _routed_differently(self, rows: list[int]) -> list[np.ndarray]:
        """Per row, over its compared tokens: True where the two sides' recorded routing
        differs on some MoE layer (pipeline.routing.flipped)."""
        from pipeline.routing import completion_rows, flipped

        ours = completion_rows(self.fixture.prompt_offsets, self.fixture.completion_offsets)
        theirs = completion_rows(self.replay.prompt_offsets, self.replay.completion_offsets)
        out = []
        for row in rows:
            other = self.replay_rows[self.fixture.sequence_ids[row]]
            a = self.fixture.routed_experts[ours[self.fixture.completion_slice(row)]]
            b = self.replay.routed_experts[theirs[self.replay.completion_slice(other)]]
            out.append(flipped(a, b).any(axis=1)[self._mask(row)])
        return out

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

    def _token_floors(self, precisions: tuple[str, str], reference, positions) -> list:
        """Per token (one array per sequence): the mean |d| precision alone gives between
        two precisions, from the calibration (bucketed by ``reference`` logprobs), else the
        constant for the less precise one."""
        pair = pair_key(*precisions)
        lengths = [len(r) for r in reference]
        if self.calibration and pair in self.calibration.get("pairs", {}):
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            means = expected_mean_abs(
                self.calibration, pair, np.concatenate(reference), np.concatenate(positions)
            )
            return np.split(means, offsets[1:-1])
        dtypes = [p.removesuffix("+tf32") for p in precisions]
        least = max(dtypes, key=("float32", "float16", "bfloat16").index)
        constant = NUMERIC_CEILING.get(least, NUMERIC_CEILING["float32"]) / 3
        return [np.full(n, constant) for n in lengths]

    def _micro_batch(self) -> int:
        layout = self.replay.metadata.get("layout") or {}
        return int(layout.get("micro_batch_size") or 8)


def _data_candidates(base: FaultSettings) -> list[Candidate]:
    """The data bugs, tested without the model: logprobs one token off, or filled with 0."""
    return [
        Candidate("token_shift", "data_shift+1", base, {"shift": 1}),
        Candidate("token_shift", "data_shift-1", base, {"shift": -1}),
        Candidate("mask_padding", "data_fill", base, {"fill_value": 0.0, "side": "rollout"}),
        Candidate("mask_padding", "data_fill", base, {"fill_value": 0.0, "side": "replay"}),
    ]


def _one_per_reproduction(findings: list[dict]) -> list[dict]:
    """Findings verified by the same reproduction (kind and parameters) are one bug: one
    finding, over all their sequences."""
    out, seen = [], {}
    for finding in findings:
        by = (finding.get("details") or {}).get("verified_by")
        key = None
        if finding.get("status") == "verified" and by:
            # a searched padding's counts are per sequence: its shape is the reproduction
            params = {k: v for k, v in by["params"].items() if k != "counts"}
            key = (finding["cause"], by["kind"], repr(sorted(params.items())), by["side"])
        if key in seen:
            first = out[seen[key]]
            first["sequences"] = sorted(set(first["sequences"]) | set(finding["sequences"]))
            continue
        if key is not None:
            seen[key] = len(out)
        out.append(finding)
    return out


def _both_truncations(findings: list[dict]) -> list[dict]:
    """A reproduction by top-k then top-p verifies both causes: name each once."""
    out = list(findings)
    for finding in findings:
        verified = (finding.get("details") or {}).get("verified_by") or {}
        if finding.get("status") != "verified" or verified.get("kind") != "top_k_top_p":
            continue
        for cause in ("top_k", "top_p"):
            if not any(f["cause"] == cause and f.get("status") == "verified" for f in out):
                out.append({**finding, "cause": cause})
    return out


def _one_routing_flip(findings: list[dict]) -> list[dict]:
    """Routing flips verified from several findings (the routing claim, and drift another
    signature named first) are one cause: one finding, the routing claim's, over all their
    sequences."""
    verified = [f for f in findings if f["cause"] == "routing_flip" and f["status"] == "verified"]
    if len(verified) < 2:
        return findings
    keep = next((f for f in verified if "first_flip" in (f.get("details") or {})), verified[0])
    sequences = sorted({s for f in verified for s in f["sequences"]})
    merged = {**keep, "sequences": sequences}
    return [merged if f is keep else f for f in findings if f is keep or f not in verified]


def _sign_z(rollout: np.ndarray, replay: np.ndarray) -> float:
    """A sequence's direction: (tokens up - tokens down) / sqrt(tokens)."""
    d = np.asarray(replay) - np.asarray(rollout)
    d = d[np.isfinite(d) & (d != 0)]
    return float(np.sum(np.sign(d)) / np.sqrt(len(d))) if len(d) else 0.0


def _slope_temperature(processed, raw) -> float:
    """T from the slope of the processed logprobs on the raw ones (processed = raw / T + c)."""
    x, y = np.asarray(raw, dtype=np.float64), np.asarray(processed, dtype=np.float64)
    keep = np.isfinite(x) & np.isfinite(y)
    if keep.sum() < 3 or x[keep].var() <= 0:
        return 1.0
    slope = np.cov(x[keep], y[keep])[0, 1] / x[keep].var()
    return float(1.0 / slope) if 0.2 <= slope <= 5.0 else 1.0


def _data_reproduction(candidate: Candidate, rollout, replay, token_floor):
    """(side, reproduction, what it is set against, which tokens drift) for a data bug, as
    flat arrays over the sequences' tokens."""
    floor = np.concatenate(token_floor)
    drifting = np.abs(np.concatenate(rollout) - np.concatenate(replay)) > DATA_DRIFT * floor
    if candidate.kind.startswith("data_shift"):
        shift = candidate.params["shift"]
        # replay[t] = rollout[t + shift]: the rollout's logprobs sit one token off; a
        # sequence's last (or first) token has no neighbour there, and its first drifting
        # token's neighbour lies across the onset, where nothing moved: both left out
        moved, edge, start = [], [], 0
        for r in rollout:
            moved.append(np.roll(r, -shift))
            inside = np.ones(len(r), dtype=bool)
            if len(r):
                inside[-1 if shift > 0 else 0] = False
                first = np.flatnonzero(drifting[start : start + len(r)])
                if len(first):
                    inside[first[0]] = False
            edge.append(inside)
            start += len(r)
        return (
            "rollout",
            np.concatenate(moved),
            np.concatenate(replay),
            drifting & np.concatenate(edge),
        )
    side = candidate.params.get("side", "rollout")
    filled = np.concatenate(rollout if side == "rollout" else replay)
    if candidate.kind == "data_round":
        # the other side's logprobs rounded as this side's were: equal but where noise
        # crossed a rounding boundary
        other = np.concatenate(replay if side == "rollout" else rollout)
        return side, round_to(other, candidate.params["dtype"]), filled, drifting
    value = float(candidate.params["fill_value"])
    return side, np.full(len(filled), value), filled, drifting


def round_to(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 or float16 (ties to even), as float64."""
    single = np.asarray(values, dtype=np.float32)
    if dtype == "float16":
        return single.astype(np.float16).astype(np.float64)
    bits = single.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return rounded.astype(np.uint32).view(np.float32).astype(np.float64)


def shift_onset(rollout: np.ndarray, replay: np.ndarray, shift: int) -> int | None:
    """The first index whose rollout logprob belongs to a neighbour (replay[t] =
    rollout[t + shift] from there on): the change point that minimises the total |d| of
    "equal" before it and "shifted" after it."""
    n = len(rollout)
    if n < 2:
        return None
    plain = np.nan_to_num(np.abs(rollout - replay))
    moved = np.abs(rollout - np.roll(replay, shift))  # rollout[t] against replay[t - shift]
    moved[0 if shift > 0 else n - 1] = np.nan  # wrapped around: no neighbour there
    moved = np.where(np.isfinite(moved), moved, plain)
    cost = np.cumsum(np.concatenate([[0.0], plain]))[:n] + np.cumsum(moved[::-1])[::-1]
    return int(np.argmin(cost))


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
    """The finding, verified, named by the cause its reproduction stands for; a renamed one
    says what did not reproduce the drift first."""
    params = outcome.candidate.params
    how = (
        f"re-scored with {outcome.candidate.kind}"
        + (f" ({_params(params)})" if params else "")
        + f", the {outcome.side} side matches to mean |d| {outcome.after:.3g} (floor "
        f"{outcome.floor:.3g}; the drift was {outcome.before:.3g}): the bug is on the "
        f"{outcome.side} side"
    )
    cause = outcome.candidate.cause
    undeclared = outcome.candidate.kind in UNDECLARED_PRECISIONS
    if undeclared:
        how += (
            f": that side computed in {params['computed_in']}"
            + (" (its LM head)" if outcome.candidate.kind == "lm_head_bf16" else "")
            + ", not the precision it declares"
        )
    if outcome.candidate.kind == "precision":
        how = (
            f"re-scored in the declared precisions ({_params(_declared(params))}), four correct "
            f"ways each, these tokens drift by mean |d| {outcome.after:.3g}; the observed "
            f"{outcome.before:.3g} passes the precision gate against it (critical "
            f"{outcome.floor:.3g}) and in every surprisal bucket: the drift is precision"
        )
    if renamed_from and renamed_from != cause:
        how = f"{renamed_from} did not reproduce the drift; {how}"
    return {
        **finding,
        "cause": cause,
        "evidence": f"{finding['evidence']}; {how}",
        # declared precision is information; a precision other than declared is a fault
        "severity": "info" if cause == "dtype" and not undeclared else "fault",
        "status": "verified",
        "residual_before": outcome.before,
        "residual_after": outcome.after,
        "floor": outcome.floor,
        "details": {
            "signature_evidence": finding["evidence"],  # kept, should a better one replace it
            **(finding.get("details") or {}),
            "verified_by": _describe(outcome),
        },
    }


def _not_reproduced(finding: dict, tried: list[dict]) -> dict:
    return {
        **finding,
        "details": {**(finding.get("details") or {}), "ruled_out": tried},
        "evidence": f"{finding['evidence']}; re-scoring reproduces none of: "
        + ", ".join(t["kind"] for t in tried),
    }


def _moved_nothing(tried: list[dict], cause: str) -> bool:
    """Every re-score of `cause` itself left at least NOTHING_MOVED of the drift: committed,
    the bug does not go the observation's way at all (a wrong guess, not a variant)."""
    own = [t for t in tried if t["cause"] == cause and t["kind"] != "precision"]
    return bool(own) and all(
        t["residual_after"] >= NOTHING_MOVED * t["residual_before"] for t in own
    )


def _unverified(finding: dict, tried: list[dict]) -> dict:
    """A signature's cause that no reproduction verified: kept, plausible, saying what was
    tried and how close each try came (its residual in floors)."""
    closest = sorted(tried, key=lambda t: t["residual_after"] / max(t["floor"], 1e-12))
    own = [t for t in closest if t["cause"] == finding["cause"]]
    shown = (own or closest)[:3]
    how = "; ".join(
        f"{_tried_text(t)}, {t['residual_after'] / max(t['floor'], 1e-12):.1f}x the floor"
        for t in shown
    )
    return {
        **finding,
        "status": "plausible",
        "evidence": f"{finding['evidence']}; no reproduction verified it (the engine may commit "
        f"it in a way re-scoring does not), so it stays as its signature named it"
        + (f"; closest tries: {how}" if how else "; nothing could be re-scored"),
        "details": {**(finding.get("details") or {}), "tried": tried},
        **(
            {
                "residual_before": closest[0]["residual_before"],
                "residual_after": closest[0]["residual_after"],
                "floor": closest[0]["floor"],
            }
            if closest
            else {}
        ),
    }


def _distinct(candidates: list[Candidate], tried: list[dict]) -> list[Candidate]:
    """Each (kind, parameters) once, leaving out what was already tried."""
    seen = {(t["kind"], repr(sorted(t["params"].items()))) for t in tried}
    out = []
    for candidate in candidates:
        key = (candidate.kind, repr(sorted(candidate.params.items())))
        if key not in seen:
            seen.add(key)
            out.append(candidate)
    return out


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
            + "; ".join(_tried_text(t) for t in tried)
        ),
        "details": {**(finding.get("details") or {}), "ruled_out": tried},
    }


def _inconclusive_precision(finding: dict, tried: dict) -> dict:
    params = tried["params"]
    return {
        **finding,
        "status": "plausible",
        "evidence": (
            f"{finding['evidence']}; re-scored in the declared precisions "
            f"({_params(_declared(params))}) these {params['tokens']} tokens drift by mean |d| "
            f"{tried['residual_after']:.3g} and the observed {tried['residual_before']:.3g} "
            f"passes the precision gate, but so few tokens cannot rule out a fault of "
            f"{FAULT_SIZE:g}x the noise: plausibly precision, not verified (compare more tokens)"
        ),
        "details": {**(finding.get("details") or {}), "precision_check": tried},
        "residual_before": tried["residual_before"],
        "residual_after": tried["residual_after"],
    }


def _tried_text(tried: dict) -> str:
    """One ruled-out reproduction, in words."""
    params = tried["params"]
    if tried["kind"] == "precision":
        return (
            f"precision: re-scored in the declared precisions "
            f"({_params(_declared(params))}) these tokens drift by mean |d| "
            f"{tried['residual_after']:.3g}, and the observed {tried['residual_before']:.3g} "
            f"fails the precision gate ({', '.join(params.get('failed', [])) or 'level'}; "
            f"critical mean {tried['floor']:.3g})"
        )
    shown = f" ({_params(params)})" if params else ""
    return (
        f"{tried['kind']}{shown} leaves mean |d| {tried['residual_after']:.3g} "
        f"(floor {tried['floor']:.3g})"
    )


def _unexplained(sequences: list[str], tried: list[dict], said: list[str] = ()) -> dict:
    names = sorted({f"{t['cause']}/{t['kind']}" for t in tried})
    before = "".join(f"{text}; " for text in said)
    return {
        "cause": "unexplained",
        "sequences": sequences,
        "first_position": {},
        "evidence": (
            f"{before}drift in {len(sequences)} sequences that no re-scored hypothesis reproduces; "
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


def _declared(params: dict) -> dict:
    return {side: params[side] for side in ("rollout", "replay") if side in params}


def _params(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())

"""The reference side of verification: the fp32 model that re-commits bugs, the two tables it
is set against, and the shared re-scoring every family goes through (its own `commit` where
a bug needs batches, other weights or forced routing; `faults.rescore` otherwise)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np

from pipeline.compare.calibrated import (
    as_calibration,
    expected_mean_abs,
    pair_key,
    side_precision,
)
from pipeline.compare.hypotheses.batch import NUMERIC_CEILING
from pipeline.contracts.calibration import Calibration
from pipeline.contracts.numerics import base_dtype, numerics_of, split_precision
from pipeline.contracts.report import Finding
from pipeline.faults import FaultSettings, rescore
from pipeline.fixture.table import REPLAY_CHANNEL, TokenTable
from pipeline.verify.families import family_of
from pipeline.verify.hypothesis import Candidate

# How many times bf16's gap reduced-precision numerics give where no calibration measured
# them (docs/reduced-precision.md: FP8 and INT8 rollouts at three scales)
UNCALIBRATED_NUMERICS_FACTOR = 10.0


class Reference:
    """The model and the observations: per fixture row, its compared tokens' logprobs on
    both sides, the reference's own (clean) scores, and their noise floors."""

    def __init__(
        self,
        fixture: TokenTable,
        replay: TokenTable,
        model_dir: Path,
        channel: str = "rollout",
        calibration: Calibration | dict | None = None,
        device: str = "auto",
        model=None,
        weights_store: Path | None = None,
        say=lambda line: None,
    ):
        from pipeline.devices import resolve_device, set_tf32
        from pipeline.engines.hf.model import load_model

        self.fixture, self.replay, self.channel = fixture, replay, channel
        self.say = say
        self.model_dir = Path(model_dir)
        self.calibration = as_calibration(calibration)  # verify_report's callers give dicts
        self.device = resolve_device(device)
        self.model = model or load_model(Path(model_dir), "float32", device=self.device)
        self.fp32_model = self.model  # `model` is another while `computing_as` a side
        set_tf32(self.device, False)
        self.rows = fixture.index_of()
        self.replay_rows = replay.index_of()
        bos = self.model.config.bos_token_id
        self.base = FaultSettings(bos_id=int(bos) if bos is not None else 1)
        self.weights_store = Path(weights_store) if weights_store else None
        self.drifting: set[str] = set()  # every sequence some fault finding names
        self._clean_scores: dict[tuple[str, int], np.ndarray] = {}
        # what each side declares it computes with beyond its dtype (FP8 weights, an FP8 KV
        # cache): re-scoring for a bug on that side computes with it
        self.numerics = {"rollout": numerics_of(fixture.metadata),
                         "replay": numerics_of(replay.metadata)}  # fmt: skip
        self.version_model = (None, None)  # (name, model): one store version held at a time
        # what a family found searching earlier findings, by family name: one bug seen in
        # several findings is reproduced with the same parameters (and searched once)
        self.found: dict[str, list] = {}
        # the model cast to a side's declared dtype, made once, for families that re-score
        # in it (numerics)
        self.in_dtype: dict[str, object] = {}

    # --- re-scoring ------------------------------------------------------------------------

    def rescore(self, candidate: Candidate, rows: list[int]) -> list[np.ndarray]:
        """The rows' compared tokens re-scored under the candidate's bug (fp32, float64)."""
        committed = family_of(candidate.kind).commit(self, candidate, rows)
        if committed is not None:
            return committed
        values = rescore(self.model, self.pairs(rows), candidate.kind, candidate.settings)
        return self.compared(values, rows)

    def clean(self, rows: list[int], side: str | None = None) -> list[np.ndarray]:
        """The reference's own scores of the rows (fp32, no bug), computed once per row; with
        a ``side``, in that side's declared numerics (`computing_as`)."""
        numerics = self.numerics.get(side) if side else None
        key = self._side_precision(side) if numerics else ""
        missing = [r for r in rows if (key, r) not in self._clean_scores]
        if missing:
            with self.computing_as(side if numerics else None):
                values = rescore(self.model, self.pairs(missing), "clean", self.base)
            self._clean_scores.update(
                ((key, r), v) for r, v in zip(missing, self.compared(values, missing), strict=True)
            )
        return [self._clean_scores[key, r] for r in rows]

    @contextmanager
    def computing_as(self, side: str | None):
        """The reference computing as ``side`` declares it does, where it declares
        reduced-precision numerics: its dtype and its formats (`model` is that model meanwhile),
        while a bug on that side is re-scored. The bug is then judged against what two
        implementations of those numerics differ by, not against the whole gap they add (an
        FP8 rollout's temperature bug at 32 x 512 hid under it). Nothing to do for a side that
        declares none, or while another side's numerics are applied."""
        numerics = self.numerics.get(side) if side else None
        if not numerics or self.model is not self.fp32_model:
            yield
            return
        from pipeline.numerics.emulate import apply_numerics, remove_numerics

        model = self.in_precision(base_dtype(self._side_precision(side)))
        apply_numerics(model, numerics)
        self.model = model
        try:
            yield
        finally:
            self.model = self.fp32_model
            remove_numerics(model)

    def in_precision(self, dtype: str):
        """The reference model in ``dtype``, loaded once per dtype as an engine loads it (a
        cast copy of the fp32 model would hold its rotary tables in that dtype too)."""
        if dtype == "float32":
            return self.fp32_model
        if dtype not in self.in_dtype:
            from pipeline.engines.hf.model import load_model

            self.in_dtype[dtype] = load_model(self.model_dir, dtype, device=self.device)
        return self.in_dtype[dtype]

    def _side_precision(self, side: str) -> str:
        return side_precision((self.fixture if side == "rollout" else self.replay).metadata)

    def pairs(self, rows: list[int]) -> list[tuple]:
        return [(self.fixture.prompt_of(r), self.fixture.completion_of(r)) for r in rows]

    def compared(self, values, rows: list[int]) -> list[np.ndarray]:
        """Whole-completion scores cut to each row's compared tokens, as float64."""
        return [v[self.mask(r)].astype(np.float64) for v, r in zip(values, rows, strict=True)]

    # --- observations and floors -----------------------------------------------------------

    def observed(self, rows: list[int]):
        """Per row: the rollout's and the replay's logprobs of its compared tokens, and their
        completion indices."""
        rollout, replay, positions = [], [], []
        fixture = self.fixture
        for row in rows:
            mask = self.mask(row)
            ours = fixture.channels[self.channel][fixture.completion_slice(row)]
            rollout.append(ours[mask].astype(np.float64))
            other = self.replay_rows[fixture.sequence_ids[row]]
            theirs = self.replay.channels[REPLAY_CHANNEL][self.replay.completion_slice(other)]
            replay.append(theirs[mask].astype(np.float64))
            positions.append(np.flatnonzero(mask))
        return rollout, replay, positions

    def mask(self, row: int) -> np.ndarray:
        return np.asarray(
            self.fixture.completion_mask[self.fixture.completion_slice(row)], dtype=bool
        )

    def comparable(self, sequence_ids) -> list[int]:
        """The fixture rows of the sequences both sides hold."""
        return [self.rows[s] for s in sequence_ids if s in self.rows and s in self.replay_rows]

    def token_floors(self, precisions: tuple[str, str], reference, positions) -> list:
        """Per token (one array per sequence): the mean |d| precision alone gives between
        two precisions, from the calibration (bucketed by ``reference`` logprobs), else the
        constant for the less precise one."""
        pair = pair_key(*precisions)
        lengths = [len(r) for r in reference]
        if self.calibration is not None and pair in self.calibration.pairs:
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            means = expected_mean_abs(
                self.calibration, pair, np.concatenate(reference), np.concatenate(positions)
            )
            return np.split(means, offsets[1:-1])
        dtypes = [base_dtype(p) for p in precisions]
        least = max(dtypes, key=("float32", "float16", "bfloat16").index)
        constant = NUMERIC_CEILING.get(least, NUMERIC_CEILING["float32"]) / 3
        if any(split_precision(p)[2] for p in precisions):
            # uncalibrated reduced-precision numerics: their gap is measured per model (lpx
            # calibrate); without it, the bf16 constant times what FP8 added to bf16's gap
            # at every scale measured (docs/reduced-precision.md)
            constant = NUMERIC_CEILING["bfloat16"] / 3 * UNCALIBRATED_NUMERICS_FACTOR
        return [np.full(n, constant) for n in lengths]

    def micro_batch(self) -> int:
        layout = self.replay.metadata.get("layout") or {}
        return int(layout.get("micro_batch_size") or 8)

    def onset(self, finding: Finding) -> int:
        """The completion index a finding's drift starts at (its details' `at` or `onset`,
        else its first drifting token)."""
        details = finding.details
        at = details.get("at") or details.get("onset")
        return int(at or finding.first_position.get("position") or 0)

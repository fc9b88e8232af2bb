"""A toy hypothesis family, whole in one module: an engine that writes its logprobs in base 2
(log2 p, not ln p). It is what a new family costs: a cause name, its kinds, how it commits the
bug (here a data bug: the other side's logprobs divided by ln 2, no model needed) and nothing
else; `register(LogBase())` puts it in the flow (tests/verify/test_logits_processing.py)."""

from __future__ import annotations

import numpy as np

from pipeline.verify.hypothesis import Candidate, Family

CAUSE = "log_base"  # a cause lpx's Cause list does not know: kept as its string


class LogBase(Family):
    name = "log_base"
    causes = (CAUSE,)
    kinds = ("data_log2",)
    data_kinds = ("data_log2",)

    def alternatives(self, ref, finding) -> list[Candidate]:
        return [
            Candidate(CAUSE, "data_log2", ref.base, {"side": side})
            for side in ("rollout", "replay")
        ]

    def data(self, candidate, rollout, replay, drifting):
        side = candidate.params["side"]
        observed = np.concatenate(rollout if side == "rollout" else replay)
        other = np.concatenate(replay if side == "rollout" else rollout)
        return side, other / np.log(2.0), observed, drifting, False

"""Verify a comparison's findings by reproducing them with the model.

A finding is a hypothesis the signatures propose: a cause, its parameters (a temperature,
an onset, a shift, a truncation length) and the sequences it explains. Verification commits
that bug in the reference model, in fp32, and asks whether one side now matches the
re-score down to the noise floor, the mean |d| this model's precision alone gives those
tokens (`lpx calibrate`; without one, the profile's constant floor). Then the finding is
`verified`, and the side that committed the bug is named.

The package reads top to bottom:
- `hypothesis.py`: a hypothesis, its outcome, the family interface and the margins;
- `families/`: one module per family of bugs (its parameter space, how to commit it in the
  reference model, what it offers for drift no signature explained);
- `reference.py`: the model, the observations, the noise floors and the shared re-score;
- `search.py`: the shared search over a family's free parameters; `processing_fit.py`: the
  logits-processing family's fitter;
- `judge.py`: one hypothesis re-scored and judged; `report.py`: the shared outcome format;
- `flow.py`: the order hypotheses are tried in, and what a finding becomes;
- `rejudge.py`: a report's findings verified and its verdict judged again (what `lpx
  compare` and `lpx diagnose` call with a model, and the benches).

A flow beside inject and faults: it calls an engine and hands compare/ back findings;
compare/ never runs a model.
"""

from __future__ import annotations

from pipeline.verify.families.shifts import shift_onset
from pipeline.verify.flow import Verifier
from pipeline.verify.rejudge import needs_verifying, verify_report

__all__ = ["Verifier", "needs_verifying", "shift_onset", "verify_report"]

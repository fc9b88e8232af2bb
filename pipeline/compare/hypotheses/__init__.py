"""Hypotheses: the signature rules, run in order of how specific their evidence is; each
claims the drifting sequences its evidence explains and says why it beat the runner-up."""

from __future__ import annotations

from pipeline.compare.hypotheses.registry import RULES, propose

__all__ = ["RULES", "propose"]

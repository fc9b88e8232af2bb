"""The model families lpx knows, one module each: what `lpx make-model` builds, what the
Megatron converter and the capture boundaries read (attention biases, q/k norms, experts).

Adding a family is one module beside these (a `FAMILY = Family(...)`), its name in
`registry.families()`, and its rows in the engine matrix test (tests/compare/test_families.py)."""

from __future__ import annotations

from pipeline.families.family import Experts, Family, Routing
from pipeline.families.registry import families, family_of, routing

__all__ = ["Experts", "Family", "Routing", "families", "family_of", "routing"]

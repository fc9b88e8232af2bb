"""A deterministic, offline environment for agent loops: tools whose answers are text.

After each model turn the environment answers: a tool result (a calculator's sum, a lookup
in a small table) most turns, and a user's follow-up every ``user_every``-th turn, so that a
template that drops earlier thinking at a user message (Qwen3's) does so inside the loop. The
answers depend only on the seed, the trajectory and the turn, never on the network or the
clock, so every engine's loop meets the same environment.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SYSTEM_PROMPT = "You are a careful assistant. Use the tools: the calculator and the lookup."
FACTS = (
    ("the river", "it runs to the sea"),
    ("the old town", "it has a stone bridge"),
    ("the garden", "it has roses and a pond"),
    ("the market", "it opens at seven"),
    ("the library", "it keeps the maps"),
)
FOLLOW_UPS = ("Good. Now go on.", "Thank you. What else?", "And after that?")


@dataclass(frozen=True)
class ToolEnvironment:
    seed: int = 0
    user_every: int = 2  # a user follow-up after every this many model turns

    def opening(self, prompt_text: str) -> list[dict]:
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": prompt_text.strip() or "Begin."},
        ]

    def respond(self, trajectory: int, turn: int, model_text: str) -> dict:
        """The message after model turn ``turn`` (0-based) of trajectory ``trajectory``."""
        rng = random.Random(f"{self.seed}/{trajectory}/{turn}")
        if (turn + 1) % self.user_every == 0:
            return {"role": "user", "content": rng.choice(FOLLOW_UPS)}
        if rng.random() < 0.5:
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            return {"role": "tool", "content": f"calculator: {a} + {b} = {a + b}"}
        place, fact = rng.choice(FACTS)
        return {"role": "tool", "content": f"lookup: {place}: {fact}"}

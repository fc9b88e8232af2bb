"""Routing: a MoE whose two sides chose different experts. Where both sides recorded their
routing, the reference re-scores with the drifting side's experts forced (router replay); it
reproduces that side where routing alone made the drift, judged on the tokens routed
differently (a few flips among hundreds of noisy tokens could never explain anything)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pipeline.contracts.causes import Cause
from pipeline.contracts.report import Finding
from pipeline.verify.hypothesis import Candidate, Family


class Routing(Family):
    name = "routing"
    causes = (Cause.ROUTING_FLIP,)
    kinds = ("router_replay",)

    def hypotheses(self, ref, finding: Finding) -> list[Candidate]:
        if ref.fixture.routed_experts is None or ref.replay.routed_experts is None:
            return []
        return [Candidate(Cause.ROUTING_FLIP, "router_replay", ref.base, {})]

    def alternatives(self, ref, finding: Finding) -> list[Candidate]:
        return self.hypotheses(ref, finding)

    def search(self, ref, candidate, rows, observed, clean, side) -> Candidate:
        return replace(candidate, params={"routing_of": side})  # the experts of that side

    def commit(self, ref, candidate, rows):
        """The rows in fp32 with every router made to choose the given side's experts."""
        from pipeline.engines.hf.replay import ReplayKnobs, score_batch
        from pipeline.routing import sequence_routing

        side = candidate.params["routing_of"]
        table = ref.fixture if side == "rollout" else ref.replay
        own = ref.rows if side == "rollout" else ref.replay_rows
        ids = ref.fixture.sequence_ids
        routing = [sequence_routing(table, own[ids[r]]) for r in rows]
        settings = ReplayKnobs(device=str(ref.device), micro_batch_size=len(rows))
        scored = score_batch(ref.model, ref.pairs(rows), settings, routing=routing)
        return ref.compared([s.completion for s in scored], rows)

    def merged(self, findings: list[Finding]) -> list[Finding]:
        """Routing flips verified from several findings (the routing claim, and drift another
        signature named first) are one cause: one finding, the routing claim's, over all
        their sequences."""
        flips = [f for f in findings if f.cause == Cause.ROUTING_FLIP and f.verified]
        if len(flips) < 2:
            return findings
        keep = next((f for f in flips if "first_flip" in f.details), flips[0])
        merged = keep.but(sequences=sorted({s for f in flips for s in f.sequences}))
        return [merged if f is keep else f for f in findings if f is keep or f not in flips]

    def judged(self, ref, rows):
        """Per row, over its compared tokens: True where the two sides' recorded routing
        differs on some MoE layer (pipeline.routing.flipped); None where none does."""
        from pipeline.routing import completion_rows, flipped

        fixture, replay = ref.fixture, ref.replay
        ours = completion_rows(fixture.prompt_offsets, fixture.completion_offsets)
        theirs = completion_rows(replay.prompt_offsets, replay.completion_offsets)
        out = []
        for row in rows:
            other = ref.replay_rows[fixture.sequence_ids[row]]
            a = fixture.routed_experts[ours[fixture.completion_slice(row)]]
            b = replay.routed_experts[theirs[replay.completion_slice(other)]]
            out.append(np.asarray(flipped(a, b).any(axis=1))[ref.mask(row)])
        return out if any(m.any() for m in out) else None

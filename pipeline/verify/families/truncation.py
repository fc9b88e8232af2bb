"""Truncation: the rollout's logprobs processed by a top-k, a top-p or both. The recorded
sampling is re-scored as recorded; where the dump does not record it (or records it wrong)
the top-p and the top-k are searched: read off the tokens, beside the settings engines ship."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pipeline.contracts.causes import Cause
from pipeline.contracts.report import Finding
from pipeline.verify.hypothesis import Candidate, Family
from pipeline.verify.search import Processed, closest

# A sampled token's processed logprob is its raw one less the log of the mass its truncation
# kept: a token whose kept mass is this far below 1 was truncated. The kept masses' low
# quantiles are the top-p values read off them (the least is the top-p in exact arithmetic;
# the others allow for the other side's noise).
TRUNCATED = 1e-4
READ_QUANTILES = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5)
TOP_P_GRID = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.92, 0.95, 0.97, 0.98, 0.99)
TOP_K_GRID = (1, 2, 3, 5, 8, 10, 16, 20, 32, 40, 50, 64, 100, 128, 200, 256, 500, 1000)
SEARCHED = ("top_p_search", "top_k_search")


class Truncation(Family):
    name = "truncation"
    causes = ("top_k", "top_p", "top_k+top_p")
    kinds = ("top_k", "top_p", "top_k_top_p", *SEARCHED)
    explains_fills = True  # a one-token kept set scores exactly 0

    def hypotheses(self, ref, finding: Finding) -> list[Candidate]:
        # the recorded truncation is what is re-scored, and what a reproduction proves: named
        # by it, whichever truncation the signature guessed; then the searches, the
        # signature's own guess first
        searched = _searches(ref)
        if finding.cause == Cause.TOP_K:
            searched.reverse()
        return [*_recorded(ref), *searched]

    def alternatives(self, ref, finding: Finding) -> list[Candidate]:
        # processed logprobs on one side: recorded, else searched (on a flat distribution a
        # top-p moves every token by about the same, which no signature takes for one)
        return _recorded(ref) or _searches(ref)

    def search(self, ref, candidate, rows, observed, clean, side) -> Candidate:
        if candidate.kind not in SEARCHED:
            return candidate
        processed = Processed(ref, rows[0], observed[0])
        kept = _kept_mass(processed)
        if candidate.cause == Cause.TOP_P:
            read = np.quantile(kept[kept < 1 - TRUNCATED], READ_QUANTILES) if _cut(kept) else []
            values = sorted({round(float(v), 6) for v in read} | set(TOP_P_GRID))
            p = closest(values, lambda v: processed.gap({"top_p": v}))
            return Candidate(
                Cause.TOP_P,
                "top_p",
                replace(candidate.settings, top_p=p),
                {"p": p, "searched": True},
            )
        vocab = processed.logits.shape[-1]
        read = _counts_read(processed, kept) if _cut(kept) else []
        values = sorted({int(k) for k in [*read, *TOP_K_GRID] if 0 < k < vocab})
        k = closest(values, lambda v: processed.gap({"top_k": v}))
        return Candidate(
            Cause.TOP_K, "top_k", replace(candidate.settings, top_k=k), {"k": k, "searched": True}
        )

    def merged(self, findings: list[Finding]) -> list[Finding]:
        """A reproduction by top-k then top-p verifies both causes: name each once."""
        out = list(findings)
        for finding in findings:
            verified_by = finding.details.get("verified_by") or {}
            if not finding.verified or verified_by.get("kind") != "top_k_top_p":
                continue
            for cause in (Cause.TOP_K, Cause.TOP_P):
                if not any(f.cause == cause and f.verified for f in out):
                    out.append(finding.but(cause=cause))
        return out


def _recorded(ref) -> list[Candidate]:
    sampling = ref.fixture.metadata.get("sampling") or {}
    k, p, base = int(sampling.get("top_k") or 0), float(sampling.get("top_p") or 1.0), ref.base
    if k and p < 1.0:
        settings = replace(base, top_k=k, top_p=p)
        return [Candidate(Cause.TOP_K, "top_k_top_p", settings, {"k": k, "p": p})]
    if k:
        return [Candidate(Cause.TOP_K, "top_k", replace(base, top_k=k), {"k": k})]
    if p < 1.0:
        return [Candidate(Cause.TOP_P, "top_p", replace(base, top_p=p), {"p": p})]
    return []


def _searches(ref) -> list[Candidate]:
    return [
        Candidate(cause, f"{cause}_search", ref.base, {}) for cause in (Cause.TOP_P, Cause.TOP_K)
    ]


def _kept_mass(processed: Processed) -> np.ndarray:
    """The mass each observed token's truncation kept: exp(raw - processed), at most 1."""
    return np.exp(np.minimum(processed.scores() - processed.observed, 0.0))


def _cut(kept: np.ndarray) -> bool:
    return bool((kept < 1 - TRUNCATED).any())


def _counts_read(processed: Processed, kept: np.ndarray) -> list[int]:
    """The top-k values the truncated tokens' kept masses say: how many tokens hold each
    one's mass (its mode, either side of it, and the median)."""
    import torch

    logits, mask = processed.logits, processed.mask
    truncated = kept < 1 - TRUNCATED
    rows = torch.as_tensor(np.flatnonzero(mask), device=logits.device)
    probs = logits[rows].softmax(-1).sort(-1, descending=True).values.cumsum(-1)
    mass = torch.as_tensor(kept, dtype=probs.dtype, device=probs.device)
    counts = torch.searchsorted(probs, (mass * (1 - TRUNCATED))[:, None])[:, 0] + 1
    counts = counts[torch.as_tensor(truncated, device=counts.device)].cpu().numpy()
    mode = int(np.bincount(counts).argmax())
    return [mode - 1, mode, mode + 1, int(np.median(counts))]

"""What the report says about localization: on a run page, each localized pair's verdict,
first boundary, verification, drift-by-layer chart and the boundaries beyond the floor; on a
series page, the tracked boundary's ratio over runs and the first run that went beyond.

The chart is drawn again from the stored numbers (pipeline.localize.chart, which escapes every
name), never copied from the run directory's localize.svg: the report holds no markup it did
not make.
"""

from __future__ import annotations

from markupsafe import Markup

from pipeline.localize.chart import drift_chart
from pipeline.report.data import SeriesData

VERDICT_TEXT = {
    "clean": "nothing beyond the precision floor",
    "localized": "a boundary beyond the precision floor, not verified by a swap",
    "verified": "a boundary beyond the precision floor, verified by a swap",
    "error": "the localize stage failed",
    "skipped": "the localize stage was skipped",
}
TRACKED = "localize:"  # chart name prefix on a series page


def run_localize(comparison, rows: list[dict]) -> dict | None:
    """A comparison's localize section, or None when none ran for it."""
    verdict = comparison.localize_verdict
    if verdict is None:
        return None
    stored = comparison.localize or {}
    if verdict in ("error", "skipped"):
        return {"verdict": verdict, "text": VERDICT_TEXT[verdict], "message": stored.get("message")}
    first = stored.get("first") or {}
    margin = float(stored.get("margin") or 4.0)
    names = {row["boundary"] for row in rows}
    chart = drift_chart(
        {
            "verdict": verdict,
            "margin": margin,
            "first": first if first.get("boundary") in names else None,
            "boundaries": rows,
        }
    )
    sides = stored.get("sides") or {}
    return {
        "verdict": verdict,
        "text": VERDICT_TEXT[verdict],
        "first": first or None,
        "margin": margin,
        "verification": _verification(stored.get("verification")),
        "chart": Markup(chart),  # noqa: S704 - drawn here from numbers, every name escaped
        "beyond": [row for row in rows if row["beyond"]],
        "boundaries": len(rows),
        "sides": {side: (sides.get(side) or {}).get("spec") for side in ("a", "b")},
        "sequences": len(stored.get("sequences") or []),
        "tokens": stored.get("tokens"),
        "seconds": stored.get("seconds"),
    }


def series_localize(series: SeriesData, runs: list[dict]) -> tuple[dict | None, dict | None]:
    """(the series page's localize section, its chart for chart_data) or (None, None) when
    no point of the series was localized. ``runs`` are series_page's rows, one per point."""
    points = series.points
    localized = [
        i for i, p in enumerate(points) if p.localize in ("clean", "localized", "verified")
    ]
    if not localized:
        return None, None
    first_beyond = next(
        (i for i in localized if points[i].localize in ("localized", "verified")), None
    )
    tracked = series.localize_boundary
    section = {
        "boundary": tracked,
        "chart": f"{TRACKED}{tracked}" if tracked else None,
        "first_beyond": None
        if first_beyond is None
        else {
            **runs[first_beyond],
            "boundary": points[first_beyond].localize_boundary,
            "ratio": points[first_beyond].localize_first_ratio,
        },
        "rows": [
            {
                **runs[i],
                "localize": points[i].localize,
                "first": points[i].localize_boundary,
                "tracked": points[i].localize_tracked,
            }
            for i in localized
        ][::-1],
    }
    if not tracked:
        return section, None
    values = [p.localize_tracked[0] if p.localize_tracked else None for p in points]
    chart = {
        "unit": "x floor",
        "better": "lower",
        "values": values,
        "status": [
            None if p.localize_tracked is None else _status(p.localize_tracked[1]) for p in points
        ],
        # the band is what precision explains: drift below the margin times the floor
        "lower": [0.0 if p.localize_tracked else None for p in points],
        "upper": [p.localize_margin if p.localize_tracked else None for p in points],
        "changepoints": [],
    }
    return section, chart


def _status(beyond: bool) -> str:
    return "beyond_floor" if beyond else "within_floor"


def _verification(verification: dict | None) -> str:
    if not verification:
        return "not verified (nothing to swap)"
    attempts = verification.get("attempts") or []
    if verification.get("verified"):
        runner = verification.get("runner")
        by = verification.get("by") or "a swap"
        return f"verified by swapping {by}" + (f" (side {runner} ran it)" if runner else "")
    return (
        f"not verified: none of {len(attempts)} swap(s) brought every later boundary back "
        "within the floor"
    )

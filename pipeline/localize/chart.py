"""Drift by layer as an SVG: one line per boundary kind, drift over the precision floor on a log
scale, and the band below MARGIN that precision explains. Pure string building."""

from __future__ import annotations

import math
from html import escape

from pipeline.localize.boundaries import LAYER_KINDS

WIDTH, HEIGHT, PAD_LEFT, PAD_RIGHT, PAD_TOP, PAD_BOTTOM = 760, 320, 56, 130, 20, 40
COLORS = {
    "embed": "#555555",
    "input_norm": "#1f77b4",
    "q": "#ff7f0e",
    "k": "#ffbb78",
    "v": "#2ca02c",
    "attn_out": "#d62728",
    "mlp_in": "#9467bd",
    "router_logits": "#8c564b",
    "experts": "#e377c2",
    "mlp_out": "#17becf",
    "final_norm": "#7f7f7f",
    "logits": "#000000",
}


def drift_chart(result: dict) -> str:
    rows = result.get("boundaries") or []
    # --exact: a row's ratio is the share of elements that differ, and any share is beyond
    exact = result.get("mode") == "exact"
    margin = 1e-3 if exact else float(result.get("margin") or 4.0)
    layers = [row["layer"] for row in rows if row.get("layer") is not None]
    last = max(layers, default=0)
    ratios = [max(float(row["ratio"]), 1e-3) for row in rows] or [1.0]
    low = min(1e-2, min(ratios))
    high = max(margin * 10, max(ratios))

    def x(layer: int) -> float:
        span = max(last + 2, 1)
        return PAD_LEFT + (layer + 1) / span * (WIDTH - PAD_LEFT - PAD_RIGHT)

    def y(ratio: float) -> float:
        share = (math.log10(max(ratio, low)) - math.log10(low)) / (
            math.log10(high) - math.log10(low)
        )
        return HEIGHT - PAD_BOTTOM - share * (HEIGHT - PAD_TOP - PAD_BOTTOM)

    def place(row) -> float:
        if row["kind"] == "embed":
            return x(-1)
        if row["layer"] is None:
            return x(last + 1)
        return x(row["layer"])

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'width="{WIDTH}" height="{HEIGHT}" role="img" class="localize-chart">',
        f"<title>{escape(_title(result))}</title>",
        f'<rect x="{PAD_LEFT}" y="{y(margin):.1f}" width="{WIDTH - PAD_LEFT - PAD_RIGHT}" '
        f'height="{HEIGHT - PAD_BOTTOM - y(margin):.1f}" fill="#e8f4e8" class="floor-band"/>',
        f'<text x="{PAD_LEFT + 4}" y="{y(margin) + 12:.1f}" font-size="10" fill="#2a7a2a">'
        + (
            "bitwise equal (ratio: share of elements that differ)"
            if exact
            else f"within precision (drift &lt; {margin:g} x floor)"
        )
        + "</text>",
    ]
    for decade in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1):
        value = 10.0**decade
        if low <= value <= high:
            parts.append(
                f'<line x1="{PAD_LEFT}" x2="{WIDTH - PAD_RIGHT}" y1="{y(value):.1f}" '
                f'y2="{y(value):.1f}" stroke="#ddd"/><text x="{PAD_LEFT - 6}" '
                f'y="{y(value) + 3:.1f}" font-size="10" text-anchor="end">{value:g}</text>'
            )
    kinds = ["embed", *LAYER_KINDS, "final_norm", "logits"]
    for index, kind in enumerate(k for k in kinds if any(r["kind"] == k for r in rows)):
        mine = [row for row in rows if row["kind"] == kind]
        points = " ".join(f"{place(r):.1f},{y(max(r['ratio'], 1e-3)):.1f}" for r in mine)
        color = COLORS[kind]
        if len(mine) > 1:
            parts.append(
                f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="1.5" '
                f'class="kind-{kind}"/>'
            )
        for r in mine:
            parts.append(
                f'<circle cx="{place(r):.1f}" cy="{y(max(r["ratio"], 1e-3)):.1f}" r="2.5" '
                f'fill="{color}"><title>{escape(r["boundary"])}: {r["ratio"]:.3g} x floor'
                "</title></circle>"
            )
        legend_y = PAD_TOP + 12 + 14 * index
        parts.append(
            f'<rect x="{WIDTH - PAD_RIGHT + 10}" y="{legend_y - 8}" width="10" height="10" '
            f'fill="{color}"/><text x="{WIDTH - PAD_RIGHT + 24}" y="{legend_y}" '
            f'font-size="11">{kind}</text>'
        )
    first = result.get("first")
    if first:
        match = next(r for r in rows if r["boundary"] == first["boundary"])
        parts.append(
            f'<circle cx="{place(match):.1f}" cy="{y(max(match["ratio"], 1e-3)):.1f}" r="6" '
            f'fill="none" stroke="#d00" stroke-width="2" class="first-boundary"/>'
        )
    parts.append(
        f'<text x="{(WIDTH - PAD_RIGHT + PAD_LEFT) / 2}" y="{HEIGHT - 8}" font-size="11" '
        'text-anchor="middle">layer (embed at left, final norm and logits at right)</text>'
        f'<text x="12" y="{HEIGHT / 2}" font-size="11" transform="rotate(-90 12 {HEIGHT / 2})" '
        'text-anchor="middle">drift / precision floor</text></svg>'
    )
    return "\n".join(parts) + "\n"


def _title(result: dict) -> str:
    first = result.get("first")
    where = f"first beyond the floor: {first['boundary']}" if first else "nothing beyond the floor"
    return f"localize {result.get('verdict', '?')}: {where}"

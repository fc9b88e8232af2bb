"""A report's values as the history stores them: its tracked scalar metrics (non-finite ones as None), integers checked against the columns' range, and the container image each side ran in."""

from __future__ import annotations

import math

from pipeline.contracts.manifest import RunManifest, StageImage
from pipeline.contracts.report import Side
from pipeline.errors import BadInput
from pipeline.history.collect import PairInput

NOT_METRICS = ("tokens", "tau")  # context, not drift: stored on the comparison instead


NON_FINITE = ("nan", "inf", "-inf")  # how report.json writes non-finite metrics


def tracked_values(metrics: dict) -> dict[str, float | None]:
    """A report's scalar metrics (completion region, plus prompt.* when scored), with
    non-finite values as None (SQLite cannot store NaN; detection treats None as a
    violation)."""
    values = {}
    prompt = (metrics.get("by_region") or {}).get("prompt") or {}
    for prefix, region in (("", metrics), ("prompt.", prompt)):
        for name, value in region.items():
            if name in NOT_METRICS:
                continue
            if type(value) is float:  # nearly every value: skip the general checks
                values[prefix + name] = value if math.isfinite(value) else None
            elif is_number(value) or value in NON_FINITE:
                values[prefix + name] = finite_or_none(value)
    return values


def stage_images(manifest: RunManifest) -> dict[str, StageImage]:
    """Output path -> {ref, digest} from the manifest's containerised stages."""
    images = {}
    for stage in manifest.stages or []:
        image = stage.get("image")
        if isinstance(image, dict):
            for output in stage.get("outputs") or []:
                images[str(output)] = image
                images[str(output).rstrip("/").rsplit("/", 1)[-1]] = image
    return images


def image_of(images: dict[str, StageImage], side: Side) -> StageImage | None:
    path = str(side.get("path") or "")
    return images.get(path) or images.get(path.rstrip("/").rsplit("/", 1)[-1])


INT32_MAX = 2**31 - 1


def int32_value(value, field: str, pair: PairInput) -> int:
    """An integer for an INTEGER column: PostgreSQL's binary COPY would wrap a larger one
    silently, so it is refused here, naming the report."""
    value = int(value)
    if not -INT32_MAX <= value <= INT32_MAX:
        raise BadInput(
            f"{pair.report_path}: `{field}` is {value}, beyond what the history stores "
            f"(|n| <= {INT32_MAX}); rerun `lpx compare` for this directory or fix the file; "
            "nothing was recorded."
        )
    return value


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite_or_none(value) -> float | None:
    if not is_number(value):
        return None
    value = float(value)
    return value if math.isfinite(value) else None

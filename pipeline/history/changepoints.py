"""Change points of a series at report time: where a metric's level shifted.

ruptures' kernel change-point detection (linear kernel: the l2 cost of a piecewise-constant
fit, solved exactly by PELT in C) on log10 of the values, since drift metrics move by
factors; a 3-point rolling median first, so a single bad night never forms a segment of its
own (Otava's users asked for that); segments of at least 3 points; penalty
``3 x sigma^2 x ln(n)`` with sigma the robust night-to-night noise (MAD of first
differences / sqrt 2) of the raw series, floored at 0.01 decades (~2.3 %).

Chosen after measuring on seeded 365-point series (tests/history/test_changepoints.py, numbers in
docs/history.md): apache-otava 0.8 pins numpy 2.2 and brings BigQuery/Slack clients;
signal-processing-algorithms ships only an sdist; ruptures' PELT in Python took 0.37 s a
series, its C KernelCPD 0.3 ms.
"""

from __future__ import annotations

import math

import numpy as np

PENALTY_SCALE = 3.0
MIN_SEGMENT = 3
SIGMA_FLOOR = 0.01  # in the detection scale (decades for positive series)
MIN_POINTS = 2 * MIN_SEGMENT


def change_points(values: list) -> list[int]:
    """Indices i (into ``values``) where a new level starts; None/non-finite values skipped."""
    kept = [i for i, v in enumerate(values) if v is not None and math.isfinite(v)]
    if len(kept) < MIN_POINTS:
        return []
    raw = np.asarray([values[i] for i in kept], dtype=np.float64)
    if np.all(raw > 0):
        raw = np.log10(raw)
        floor = SIGMA_FLOOR
    else:  # zeros or signed values: judge on the linear scale
        floor = SIGMA_FLOOR * max(float(np.median(np.abs(raw))), 1e-12)
    if np.ptp(raw) == 0:
        return []
    steps = np.diff(raw)
    sigma = max(1.4826 * float(np.median(np.abs(steps - np.median(steps)))) / math.sqrt(2), floor)
    smooth = _rolling_median3(raw)
    import ruptures

    found = (
        ruptures.KernelCPD(kernel="linear", min_size=MIN_SEGMENT)
        .fit(smooth.reshape(-1, 1))
        .predict(pen=PENALTY_SCALE * sigma**2 * math.log(len(raw)))
    )
    return [kept[int(b)] for b in found[:-1]]


def _rolling_median3(x: np.ndarray) -> np.ndarray:
    padded = np.concatenate([x[:1], x, x[-1:]])
    return np.median(np.lib.stride_tricks.sliding_window_view(padded, 3), axis=1)

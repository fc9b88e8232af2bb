"""Does the history's rule for `chi2_token` hold on real bf16 noise? Per scale (issue 43).

For each scale (the tiny model; random llamas 16 x 1024 and 32 x 512) the HF fp32 rollout of
bench/calibration.py (32 sequences x 128 tokens, cached under ~/.cache/lpx/bench-calibration;
made here if missing) is scored by the HF engine as `lpx replay` does (SDPA, micro-batches of
8): in bf16, in bf16 again in shuffled order and micro-batches of 4 (is the CPU's bf16
batch-invariant? then fixed-seed nights are bitwise repeats), and in fp32 (the fp32 profile's
series, for the floor's other end). Replays are cached under ~/.cache/lpx/bench-chi2-floor.
From the per-token d = replay - rollout it makes nightly series (`--nights`, `--series` of
each kind):

* fixed: every night the same 32 sequences, each night one of the replays: what lpx's
  nightly plan does (one seed every night); the MAD is ~0, so the floor decides;
* varying: every night a bootstrap of the 32 sequences (a nightly whose seed changes samples
  other completions): the night-to-night noise of a 4,096-token nightly;
* workload change: fixed nights on one bootstrap, then from an onset on another (an upgrade
  that samples other completions with the same seed, as in bench/two_versions.py): any
  regression there is a false alarm.

Each night's metrics come from `pipeline.compare.metrics.batch_metrics`, judged by
`pipeline.history.detection.step` with `metric_spec(name)`, the profile's tau (the policy
file's; a bf16 replay of an fp32 rollout stores the bf16 tau as `Comparison.tau`) and
`DetectionConfig()`. It counts false `suspicious` / `regression` points, then shifts the
fixed and varying series from each onset (`--onsets`) and counts how often, and how many
nights after the onset, a regression is raised: "d x 2" scores the shifted nights on
rollout + 2 d (the drift doubled), "value x 2" doubles the metric itself. `mean_abs_diff`
and `k3` go through the same as references. Then chi2_token under other absolute floors,
each a function of tau, in bf16 and fp32 series, and the window a floor must fall in,
measured from the model: above the rise 99 % of workload changes stay under, below the rise
95 % of d x 2 nights clear.

    .venv/bin/python bench/chi2_floor.py                  # every scale, ~4 minutes on 2 cores
    .venv/bin/python bench/chi2_floor.py --scales tiny    # ~30 s
    .venv/bin/python bench/chi2_floor.py --json out.json

Delete ~/.cache/lpx/bench-chi2-floor to score again (the replays are ~3 of the 4 minutes).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--scales", default="tiny,16x1024,32x512")
ARGS.add_argument("--nights", type=int, default=60, help="nights in a series")
ARGS.add_argument("--series", type=int, default=50, help="series of each kind (seeds)")
ARGS.add_argument("--onsets", default="10,20,30,40,50", help="nights a shift starts at")
ARGS.add_argument("--metrics", default="chi2_token,mean_abs_diff,k3")
ARGS.add_argument("--json", type=Path, help="also write the numbers here")
OPTIONS = ARGS.parse_args()

import _bootstrap  # noqa: E402, F401
import models  # noqa: E402
import numpy as np  # noqa: E402

from pipeline.compare.metrics import batch_metrics  # noqa: E402
from pipeline.compare.policy import load_policy, profile_for  # noqa: E402
from pipeline.engines.hf.model import load_model  # noqa: E402
from pipeline.engines.hf.replay import ReplayKnobs, score_batches  # noqa: E402
from pipeline.fixture.io import read_table  # noqa: E402
from pipeline.history import detection  # noqa: E402

CACHE = Path.home() / ".cache" / "lpx" / "bench-chi2-floor"
SCALES = {
    "tiny": models.tiny,
    "16x1024": lambda: models.random_llama(16, 1024, 0.05),
    "32x512": lambda: models.random_llama(32, 512, 0.05),
}
# replay name -> (dtype, micro-batch size, shuffled order); each precision's first is what
# `lpx replay --dtype D` makes, the others check whether other batches change a logprob
REPLAYS = {
    "bfloat16": {"bf16-mb8": (8, False), "bf16-mb4-shuffled": (4, True)},
    "float32": {"fp32-mb8": (8, False)},
}
CHI2 = "chi2_token"
# chi2_token's absolute floor as a function of tau: the current one and candidates
FLOORS = {
    "4 tau/20": lambda tau: 4 * tau / 20,
    "2 tau/20 (now)": lambda tau: 2 * tau / 20,
    "tau/100": lambda tau: tau / 100,
    "tau/300": lambda tau: tau / 300,
    "2 (tau/20)^2": lambda tau: 2 * (tau / 20) ** 2,
    "none": lambda tau: 0.0,
}


def replays_of(scale: str, model_dir: Path, fixture, dtype: str) -> dict[str, np.ndarray]:
    """Each REPLAYS[dtype] entry's completion logprobs, flat in fixture order (cached)."""
    out, model = {}, None
    pairs = [(fixture.prompt_of(r), fixture.completion_of(r)) for r in range(fixture.num_sequences)]
    for name, (size, shuffled) in REPLAYS[dtype].items():
        path = CACHE / scale / f"replay-{name}.npy"
        if not path.is_file():
            if model is None:
                model = load_model(model_dir, dtype, device="cpu")
            order = list(range(len(pairs)))
            if shuffled:
                order = [int(i) for i in np.random.default_rng(1).permutation(len(pairs))]
            batches = [[pairs[i] for i in order[k : k + size]] for k in range(0, len(order), size)]
            knobs = ReplayKnobs(dtype=dtype, device="cpu", micro_batch_size=size)
            began = time.perf_counter()
            scored = score_batches(model, batches, knobs, progress=False)
            by_sequence = [None] * len(pairs)
            for i, sequence in zip(order, scored, strict=True):
                by_sequence[i] = sequence.completion
            path.parent.mkdir(parents=True, exist_ok=True)
            np.save(path, np.concatenate(by_sequence).astype(np.float32))
            print(f"  {scale}: {name} replay in {time.perf_counter() - began:.1f} s", flush=True)
        out[name] = np.load(path).astype(np.float64)
    return out


class Nights:
    """Nightly metric values of one scale and precision: a night is a list of sequences
    (the nightly's completions) scored by one of the replays, plain or with d doubled."""

    def __init__(self, fixture, replays: dict[str, np.ndarray], tau: float, names):
        self.rollout = np.asarray(fixture.channels["rollout"], dtype=np.float64)
        self.mask = np.asarray(fixture.completion_mask, dtype=bool)
        self.offsets = np.asarray(fixture.completion_offsets)
        first = next(iter(replays.values()))
        self.differing = {n: int(np.count_nonzero(r != first)) for n, r in replays.items()}
        # bitwise repeats are one replay: a fixed night is then the same night every time
        self.replays = [first] + [r for r in replays.values() if np.any(r != first)]
        self.tau, self.names, self.cache = tau, names, {}

    def night(self, sequences, replay: int) -> tuple[dict, dict, dict]:
        """(plain metrics, d x 2 metrics, chi2's parts) of one night."""
        key = (tuple(int(s) for s in sequences), replay)
        if key not in self.cache:
            tokens = np.concatenate(
                [np.arange(self.offsets[s], self.offsets[s + 1]) for s in key[0]]
            )
            tokens = tokens[self.mask[tokens]]
            rollout, train = self.rollout[tokens], self.replays[replay][tokens]
            d = train - rollout
            plain = batch_metrics(train, rollout, self.tau)
            doubled = batch_metrics(rollout + 2.0 * d, rollout, self.tau)
            parts = {"2 mean(d)": 2 * d.mean(), "2 mean(d^2)": 2 * (d * d).mean()}
            self.cache[key] = (
                {n: plain[n] for n in self.names},
                {n: doubled[n] for n in self.names},
                parts,
            )
        return self.cache[key]

    def series(self, kind: str, seed: int, nights: int, onset: int = 0):
        """(plain nights, d x 2 nights, parts) of one series; workload change switches its
        bootstrap at ``onset``."""
        rng = np.random.default_rng([seed, ["fixed", "varying", "workload change"].index(kind)])
        count = len(self.offsets) - 1
        every = np.arange(count)
        before, after = rng.integers(0, count, count), rng.integers(0, count, count)
        out = []
        for night in range(nights):
            replay = int(rng.integers(len(self.replays)))
            if kind == "fixed":
                sequences = every
            elif kind == "varying":
                sequences = rng.integers(0, count, count)
            else:
                sequences = before if night < onset else after
            out.append(self.night(sequences, replay))
        return [n[0] for n in out], [n[1] for n in out], [n[2] for n in out]


def judge(values, spec, tau, config):
    """Statuses and the band's deciding term of one series, night by night, via `step`."""
    state, statuses, deciders = detection.new_state(), [], []
    for night, value in enumerate(values):
        state, result = detection.step(state, night, value, spec, tau, config)
        statuses.append(result.status)
        b = result.boundary
        if b is None:
            deciders.append(None)
            continue
        floor = spec.floor(tau)
        relative = config.relative_floor * abs(b.baseline - spec.ideal)
        deciders.append("floor" if floor > 0 and b.band == floor else
                        "relative" if b.band == relative else "MAD")  # fmt: skip
    return statuses, deciders


def false_alarms(series_list, spec, tau, config) -> dict:
    """Violating points of unshifted series, and which term decided the bands."""
    counts = {"judged": 0, "suspicious": 0, "regression": 0, "decided": {}}
    for values in series_list:
        statuses, deciders = judge(values, spec, tau, config)
        for status, decider in zip(statuses, deciders, strict=True):
            if decider is not None:
                counts["judged"] += 1
                counts["decided"][decider] = counts["decided"].get(decider, 0) + 1
            counts["suspicious"] += status == detection.SUSPICIOUS
            counts["regression"] += status == detection.REGRESSION
    return counts


def detections(cases, spec, tau, config) -> dict:
    """Over (values, onset) cases: how many raise a regression at or after the onset, and
    the nights from the onset to it (1 = the onset night; 2 is the earliest possible)."""
    nights = []
    for values, onset in cases:
        statuses, _ = judge(values, spec, tau, config)
        hits = [i for i in range(onset, len(statuses)) if statuses[i] == detection.REGRESSION]
        if hits:
            nights.append(hits[0] - onset + 1)
    return {
        "rate": len(nights) / len(cases),
        "cases": len(cases),
        "median_nights": float(np.median(nights)) if nights else None,
        "max_nights": max(nights) if nights else None,
    }


def smallest_multiple(nights: Nights, name: str, spec, tau: float, config) -> float | None:
    """The smallest c (steps of 0.05, up to 20) for which a fixed night scored on rollout +
    c d is out of the band of fixed nights at c = 1 (MAD 0: the floor or the relative term)."""
    every = np.arange(len(nights.offsets) - 1)
    tokens = np.concatenate([np.arange(nights.offsets[s], nights.offsets[s + 1]) for s in every])
    tokens = tokens[nights.mask[tokens]]
    rollout, train = nights.rollout[tokens], nights.replays[0][tokens]
    value = batch_metrics(train, rollout, tau)[name]
    boundary = detection.robust_boundary([value] * config.min_points, spec, tau, config)
    for c in np.arange(1.05, 20.0001, 0.05):
        shifted = batch_metrics(rollout + c * (train - rollout), rollout, tau)[name]
        if detection.violates(shifted, boundary, spec.better):
            return round(float(c), 2)
    return None


def _onset_cases(plain, shifted, onsets):
    """Each series with its nights from each onset on taken from the shifted series."""
    pairs = zip(plain, shifted, strict=True)
    return [([*p[:onset], *v[onset:]], onset) for p, v in pairs for onset in onsets]


def study(nights: Nights, tau: float, names, onsets, config, floors) -> dict:
    """Every kind of series of one scale and precision, judged for every metric."""
    n_series, n_nights = OPTIONS.series, OPTIONS.nights
    runs = {
        kind: [nights.series(kind, s, n_nights) for s in range(n_series)]
        for kind in ("fixed", "varying")
    }
    changes = [
        (nights.series("workload change", s, n_nights, onset), onset)
        for s in range(n_series)
        for onset in onsets
    ]
    out = {"parts": {}, "metrics": {}}
    for kind, series in runs.items():
        parts = [p for _, _, night_parts in series for p in night_parts]
        out["parts"][kind] = {
            k: (float(np.median([p[k] for p in parts])), float(np.std([p[k] for p in parts])))
            for k in parts[0]
        }
    for name in names:
        spec = detection.metric_spec(name)
        specs = {"lpx": spec}
        if name == CHI2:
            specs.update({f: replace(spec, floor=fn) for f, fn in floors.items()})
        out["metrics"][name] = per_spec = {}
        for label, s in specs.items():
            entry = {"floor": s.floor(tau), "kinds": {}}
            for kind, series in runs.items():
                plain = [[night[name] for night in p] for p, _, _ in series]
                doubled = [[night[name] for night in d] for _, d, _ in series]
                values = np.asarray(plain)
                shifted = {"d x 2": doubled, "value x 2": (2 * values).tolist()}
                entry["kinds"][kind] = {
                    "median": float(np.median(values)),
                    "night_sd": float(values.std(axis=1, ddof=1).mean()),
                    "shifted_median": {k: float(np.median(v)) for k, v in shifted.items()},
                    "false": false_alarms(plain, s, tau, config),
                    "detect": {
                        k: detections(_onset_cases(plain, rows, onsets), s, tau, config)
                        for k, rows in shifted.items()
                    },
                }
                if label == "lpx":  # the largest floor that 95 % of d x 2 nights still pass
                    gaps = np.asarray(doubled) - np.median(values, axis=1, keepdims=True)
                    entry["kinds"][kind]["largest_floor_d_x_2"] = float(np.quantile(gaps, 0.05))
                    if kind == "varying":  # consecutive nights: independent workloads
                        jumps = np.diff(values, axis=1)
                        entry["smallest_floor_quiet"] = float(np.quantile(jumps, 0.99))
            if label == "lpx":
                entry["smallest_multiple_seen"] = smallest_multiple(nights, name, s, tau, config)
            change_cases = [([night[name] for night in p], o) for (p, _, _), o in changes]
            entry["workload_change"] = detections(change_cases, s, tau, config)
            per_spec[label] = entry
    return out


def main() -> None:
    names = OPTIONS.metrics.split(",")
    onsets = [int(o) for o in OPTIONS.onsets.split(",")]
    policy = load_policy()
    config = detection.DetectionConfig()
    # a bf16 replay of an fp32 rollout is judged at the bf16 profile (policy.profile_for)
    taus = {
        dtype: float(policy.profile(profile_for(["float32", dtype]))["tau"]) for dtype in REPLAYS
    }
    print(f"tau {taus}; {config}; {OPTIONS.nights} nights x {OPTIONS.series} series of each "
          f"kind; shifts and workload changes from nights {onsets}", flush=True)  # fmt: skip
    results = {}
    for scale in OPTIONS.scales.split(","):
        began = time.perf_counter()
        model_dir = SCALES[scale]()
        fixture = read_table(models.calibration_fixture(scale, model_dir))
        results[scale] = {}
        for dtype, tau in taus.items():
            nights = Nights(fixture, replays_of(scale, model_dir, fixture, dtype), tau, names)
            result = study(nights, tau, names, onsets, config, FLOORS if CHI2 in names else {})
            result["replays_differing_tokens"] = nights.differing
            result["tokens"] = int(nights.mask.sum())
            results[scale][dtype] = result
            print(f"  {scale} {dtype}: {result['tokens']} tokens a night; tokens differing from "
                  f"the first replay: {nights.differing}", flush=True)  # fmt: skip
            for kind, parts in result["parts"].items():
                print(f"    {kind:7s} chi2 = " + " + ".join(
                    f"{p} ({m:+.3g}, night sd {sd:.2g})" for p, (m, sd) in parts.items()
                ) + " + ...", flush=True)  # fmt: skip
        print(f"  {scale}: {time.perf_counter() - began:.0f} s", flush=True)
    report(results, names)
    if OPTIONS.json:
        OPTIONS.json.write_text(json.dumps(results, indent=1))


def report(results: dict, names) -> None:
    print("\nbf16 series (tau of the bf16 profile), each metric under lpx's rule:\n")
    print("| scale | nights | metric | typical | night sd | floor | band decided by | "
          "false susp / regr (judged) | at a workload change | d x 2: typical, regression "
          "rate, nights to it | value x 2: rate, nights |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for scale, by_dtype in results.items():
        for name in names:
            entry = by_dtype["bfloat16"]["metrics"][name]["lpx"]
            for kind, k in entry["kinds"].items():
                f, d2, v2 = k["false"], k["detect"]["d x 2"], k["detect"]["value x 2"]
                decided = max(f["decided"], key=f["decided"].get)
                change = _rate(entry["workload_change"]) if kind == "fixed" else ""
                print(f"| {scale} | {kind} | {name} | {k['median']:.3g} | {k['night_sd']:.2g} | "
                      f"{entry['floor']:g} | {decided} | {f['suspicious']} / {f['regression']} "
                      f"({f['judged']}) | {change} | {k['shifted_median']['d x 2']:.3g}, "
                      f"{_rate(d2)} | {_rate(v2)} |")  # fmt: skip
    if CHI2 not in names:
        return
    print("\nchi2_token under other absolute floors (floor value in that precision's tau):\n")
    print("| scale | precision | floor | value | false regr fixed / varying | regr at a workload "
          "change | d x 2 fixed | d x 2 varying |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for scale, by_dtype in results.items():
        for dtype, result in by_dtype.items():
            for label, e in result["metrics"][CHI2].items():
                if label == "lpx":
                    continue
                fixed, varying = e["kinds"]["fixed"], e["kinds"]["varying"]
                print(f"| {scale} | {dtype} | {label} | {e['floor']:.3g} | "
                      f"{fixed['false']['regression']} / {varying['false']['regression']} | "
                      f"{_rate(e['workload_change'])} | {_rate(fixed['detect']['d x 2'])} | "
                      f"{_rate(varying['detect']['d x 2'])} |")  # fmt: skip
    print("\nsmallest multiple c of d that a fixed bf16 night scored on rollout + c d must reach "
          "to leave lpx's band (fixed nights: the floor or the relative term decides):")  # fmt: skip
    for scale, by_dtype in results.items():
        seen = {
            n: by_dtype["bfloat16"]["metrics"][n]["lpx"]["smallest_multiple_seen"] for n in names
        }
        print(
            f"  {scale}: " + ", ".join(f"{n} {'> 20' if c is None else c}" for n, c in seen.items())
        )
    print("\nchi2_token's floor, measured: the smallest that 99 % of workload changes stay under "
          "(q99 of the rise between two independent nights) and the largest that 95 % of d x 2 "
          "nights clear over their series' median (fixed / varying):")  # fmt: skip
    for scale, by_dtype in results.items():
        for dtype, result in by_dtype.items():
            e = result["metrics"][CHI2]["lpx"]
            k = e["kinds"]
            print(f"  {scale} {dtype}: quiet from {e['smallest_floor_quiet']:.3g}; d x 2 seen up "
                  f"to {k['fixed']['largest_floor_d_x_2']:.3g} / "
                  f"{k['varying']['largest_floor_d_x_2']:.3g}")  # fmt: skip


def _rate(d: dict) -> str:
    if d["median_nights"] is None:
        return f"{d['rate']:.0%}"
    return f"{d['rate']:.0%}, {d['median_nights']:g} (max {d['max_nights']})"


if __name__ == "__main__":
    main()

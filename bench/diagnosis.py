"""Diagnosis confusion matrix over the fault zoo (issue 10).

For each architecture and seed, lpx builds its tiny model, samples fixtures with the HF
rollout engine (plain, temperature 0.7, top-k, top-p, top-k + top-p sampling), replays them
with HF in fp32, plants every zoo fault (pipeline/faults.py, re-scored by the real model) in
1, a few or all sequences, and compares. Clean runs: the fp32 replay (fp32 profile) and
bf16/fp16 replays (their own profiles). Prints the confusion matrix (true cause x named
causes), per-class precision/recall, the false-finding rate on clean runs and the
first-bad-position error of positional faults.

    .venv/bin/python bench/diagnosis.py                 # 2 archs x 2 seeds, ~3 min
    .venv/bin/python bench/diagnosis.py --seeds 0 --archs llama
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.compare.run import compare_tables  # noqa: E402
from pipeline.engines.base import SamplingParams  # noqa: E402
from pipeline.engines.hf_replay import HFScoringEngine  # noqa: E402
from pipeline.engines.hf_rollout import HFRolloutEngine  # noqa: E402
from pipeline.faults import FAULTS  # noqa: E402
from pipeline.inject import inject_fault  # noqa: E402
from pipeline.prompts import smoke_prompt_texts, tokenize  # noqa: E402
from pipeline.tinymodel.build import build_tiny_model  # noqa: E402

SAMPLINGS = {
    "plain": {},
    "temperature": {"temperature": 0.7},
    "top_k": {"top_k": 8},
    "top_p": {"top_p": 0.8},
    "top_k_top_p": {"top_k": 8, "top_p": 0.8},
}
# Batch properties (precision, sampling, weights, templates, label code) hit every sequence;
# the others are planted in 1, a few and all sequences.
BATCH_WIDE = {
    "temperature",
    "top_k",
    "top_p",
    "top_k_top_p",
    "stale_weights",
    "version_change",
    "version_change_unrecorded",
    "lm_head_bf16",
    "bf16",
    "fp16",
    "bos_extra",
    "bos_missing",
    "label_shift",
    "positions_restart",
    "pad_positions",
    "prompt_truncated",
    "noise",
    "dtype",
}
DATA_FAULTS = {
    "token_shift": "token_shift",
    "mask": "mask_padding",
    "dtype": "dtype",
    "noise": "dtype",
}
FEW = 3
TARGET_ACCURACY = 0.95
VERBOSE = "-v" in sys.argv
NO_CHANGE = 1e-4  # a planted fault that moves no logprob more than this cannot be seen


def expected(kind: str) -> frozenset:
    cause = DATA_FAULTS.get(kind) or FAULTS[kind][0]
    return frozenset() if cause is None else frozenset(cause.split("+"))


def named(report: dict) -> frozenset:
    return frozenset(f["cause"] for f in report["diagnosis"])


def cases(fixture, rng):
    """(kind, sequences, from_position) for every fault, count and a random onset."""
    ids = list(fixture.sequence_ids)
    for kind in [*FAULTS, *DATA_FAULTS]:
        if kind in ("top_k", "top_p", "top_k_top_p", "temperature"):
            continue  # planted in the fixtures sampled with that setting (below)
        counts = ["all"] if kind in BATCH_WIDE else [1, FEW, "all"]
        for count in counts:
            chosen = "all" if count == "all" else sorted(rng.choice(ids, count, replace=False))
            shortest = min(len(fixture.completion_of(i)) for i in range(len(ids)))
            position = int(rng.integers(2, max(3, shortest // 2)))
            yield kind, chosen, position


def run(archs, seeds, out: Path) -> dict:
    results = []  # (kind, count, expected, named, verdict, position error)
    clean = []  # (label, named causes that are faults, verdict)
    timings = []
    for arch in archs:
        for seed in seeds:
            model_dir = build_tiny_model(out / f"{arch}-{seed}", arch, seed)
            prompts = tokenize(model_dir, smoke_prompt_texts())
            fixtures = {}
            for name, sampling in SAMPLINGS.items():
                params = SamplingParams(
                    max_tokens=32,
                    seed=seed,
                    samples_per_prompt=2,
                    **{"temperature": 1.0, **sampling},
                )
                fixtures[name] = HFRolloutEngine().rollout(model_dir, prompts, params, {})
            replays = {n: HFScoringEngine().score(f, model_dir, {}) for n, f in fixtures.items()}
            for dtype in ("float32", "bfloat16", "float16"):
                replay = HFScoringEngine().score(fixtures["plain"], model_dir, {"dtype": dtype})
                report = compare_tables(fixtures["plain"], replay, "f", "r").report
                clean.append((f"{arch}/{seed} hf {dtype}", _semantic(report), report["verdict"]))
            rng = np.random.default_rng(seed)
            planted = list(cases(fixtures["plain"], rng))
            planted += [(k, "all", 8) for k in ("temperature", "top_k", "top_p", "top_k_top_p")]
            for kind, chosen, position in planted:
                source = kind if kind in SAMPLINGS and kind != "plain" else "plain"
                fixture = fixtures[source]
                start = time.perf_counter()
                faulted = inject_fault(fixture, kind, chosen, position, model_dir)
                changed = np.abs(faulted.channels["rollout"] - fixture.channels["rollout"])
                want = expected(kind) if np.nanmax(changed) > NO_CHANGE else frozenset()
                comparison = compare_tables(faulted, replays[source], "f", "r")
                timings.append(time.perf_counter() - start)
                report = comparison.report
                error = _position_error(report, kind, position)
                count = "all" if chosen == "all" else len(chosen)
                results.append((kind, count, want, named(report), report["verdict"], error))
                if VERBOSE and (named(report) != want or (want and report["verdict"] != "fail")):
                    print(f"MISS {arch}/{seed} {kind} x{count} @{position}: {report['verdict']}")
                    for f in report["diagnosis"]:
                        print(f"   {f['cause']} ({len(f['sequences'])} seqs) {f['evidence'][:230]}")
    return {"results": results, "clean": clean, "timings": timings}


def _semantic(report: dict) -> list[str]:
    return [f["cause"] for f in report["diagnosis"] if f["cause"] != "dtype"]


def _position_error(report, kind, position):
    if kind not in (
        "position_ids",
        "version_change",
        "version_change_unrecorded",
        "token_shift",
        "mask",
    ):
        return None
    positional = [f for f in report["diagnosis"] if f.get("first_position")]
    if not positional:
        return None
    return positional[0]["first_position"]["position"] - position


def render(outcome: dict) -> int:
    results, clean = outcome["results"], outcome["clean"]
    matrix = defaultdict(Counter)
    per_kind = defaultdict(lambda: [0, 0])
    for kind, _count, want, got, verdict, _ in results:
        matrix["+".join(sorted(want)) or "(none)"]["+".join(sorted(got)) or "(none)"] += 1
        ok = got == want and (verdict == "fail" or not want)
        per_kind[kind][0] += ok
        per_kind[kind][1] += 1
    print("\nconfusion matrix (rows: planted cause, columns: named causes; counts)")
    columns = sorted({c for row in matrix.values() for c in row})
    width = max(len(c) for c in columns + list(matrix)) + 1
    print(" " * width + " ".join(f"{c[:14]:>14}" for c in columns))
    for row in sorted(matrix):
        print(f"{row:<{width}}" + " ".join(f"{matrix[row][c] or '':>14}" for c in columns))
    print("\nper fault kind: accuracy (named causes exactly the planted ones, and the run fails)")
    worst = 1.0
    for kind in sorted(per_kind):
        good, total = per_kind[kind]
        worst = min(worst, good / total)
        print(
            f"  {kind:26s} {good:3d}/{total:<3d} {good / total:6.0%}  cause {'+'.join(sorted(expected(kind))) or '(none: invisible to RoPE)'}"
        )
    causes = sorted({c for _, _, want, got, _, _ in results for c in want | got})
    print("\nper cause: precision / recall")
    for cause in causes:
        tp = sum(
            cause in got and cause in want
            for *_, want, got, _, _ in [(0, 0) + r[2:] for r in results]
        )
        fp = sum(
            cause in got and cause not in want
            for *_, want, got, _, _ in [(0, 0) + r[2:] for r in results]
        )
        fn = sum(
            cause not in got and cause in want
            for *_, want, got, _, _ in [(0, 0) + r[2:] for r in results]
        )
        print(
            f"  {cause:18s} precision {tp / max(tp + fp, 1):6.1%}  recall {tp / max(tp + fn, 1):6.1%}"
        )
    false = sum(1 for _, semantic, _ in clean if semantic)
    print(
        f"\nclean runs: {len(clean)}, semantic findings on {false} ({false / max(len(clean), 1):.0%}); verdicts {Counter(v for *_, v in clean)}"
    )
    for label, semantic, verdict in clean:
        if semantic:
            print(f"  {label}: {semantic} ({verdict})")
    errors = [e for *_, e in results if e is not None]
    if errors:
        print(
            f"first-bad-position error (positional faults): exact in {np.mean(np.array(errors) == 0):.0%}, max {max(map(abs, errors))}"
        )
    timings = outcome["timings"]
    print(
        f"inject + compare per case: median {np.median(timings) * 1000:.0f} ms over {len(timings)} cases"
    )
    print(
        f"\nworst kind accuracy {worst:.0%} (target {TARGET_ACCURACY:.0%}): ratio {worst / TARGET_ACCURACY:.2f}"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default="llama,qwen2")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("-v", action="store_true", help="print every misnamed case")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        outcome = run(args.archs.split(","), [int(s) for s in args.seeds.split(",")], Path(tmp))
    return render(outcome)


if __name__ == "__main__":
    raise SystemExit(main())

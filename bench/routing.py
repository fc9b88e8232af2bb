"""Routing under bf16 at three scales, and the routing_flip rule against the faults that
move routing (issue 29).

For each scale (the tiny Qwen3-MoE lpx trains; random Qwen3-MoEs 16 x 1024 and 32 x 512, 8
experts, top-2, init std 0.05) an HF fp32 rollout (its routing recorded) is calibrated
(`lpx calibrate`, fp32 and bf16) and compared, calibrated and verified as `lpx compare`
does, with bf16 HF replays:

- plain: routing as bf16 gives it (near-tied routers flip on their own);
- R3: the rollout's routing forced (router replay), which must leave no flip;
- swapped: on one middle layer, a fraction (1 %, 3 %, 10 %) of the positions get one of
  their two experts replaced by another, as an engine that mis-indexes experts or breaks
  ties its own way would (3 seeds each on the tiny model, 1 at scale); the replay carries the experts it used and does
  not say it was forced;
- gate noise: the middle layer's router weights perturbed (relative 2 %, 10 %, 30 % of
  their spread), as a gate GEMM in another precision or tiling computes them (seeds as
  above); the replay
  records the routing it took.

Prints per case the flip rate (any layer; the middle layer), mean |d| on flipped tokens and
on the rest, the verdict, and whether `routing_flip` was claimed and verified. A clean
case (plain, R3) must PASS without routing_flip; a fault that fails the gate must be
named routing_flip.

    .venv/bin/python bench/routing.py                     # ~20 min on 2 cores
    .venv/bin/python bench/routing.py --scales tiny
Results are cached per scale under ~/.cache/lpx/bench-routing (delete it to re-run).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import _bootstrap  # noqa: F401
import models
import numpy as np

import pipeline.engines.hf.replay as hf_replay
from pipeline.calibrate.run import calibrate
from pipeline.compare.run import compare_tables
from pipeline.engines.base import SamplingParams
from pipeline.engines.hf.replay import HFScoringEngine
from pipeline.engines.hf.rollout import HFRolloutEngine
from pipeline.families import routing
from pipeline.fixture.io import read_table, write_table
from pipeline.prompts import smoke_prompt_texts, tokenize
from pipeline.verify import verify_report

CACHE = Path.home() / ".cache" / "lpx" / "bench-routing"
SCALES = {
    "tiny": {"model": lambda: models.family("qwen3_moe"), "samples": 4, "seeds": (0, 1, 2)},
    "16x1024": {
        "model": lambda: models.random_moe(16, 1024, 8, 2, 0.05, arch="qwen3_moe"),
        "samples": 1,
        "seeds": (0,),
    },
    "32x512": {
        "model": lambda: models.random_moe(32, 512, 8, 2, 0.05, arch="qwen3_moe"),
        "samples": 1,
        "seeds": (0,),
    },
}
TOKENS = 48
BF16 = {"dtype": "bfloat16", "device": "cpu"}
SWAP_FRACTIONS = (0.01, 0.03, 0.10)
GATE_NOISE = (0.02, 0.10, 0.30)


def swapped(routed: np.ndarray, layer: int, fraction: float, experts: int, seed: int):
    """``routed`` with one of the two experts of ``fraction`` of the rows on ``layer``
    replaced by an expert the row did not choose."""
    rng = np.random.default_rng(seed)
    out = routed.copy()
    chosen = rng.random(len(out)) < fraction
    keep, drop = out[:, layer, 0], out[:, layer, 1]
    other = (drop + rng.integers(1, experts, len(out))) % experts
    other = np.where(other == keep, (other + 1) % experts, other)
    other = np.where(other == drop, (other + 1) % experts, other)
    other = np.where(other == keep, (other + 1) % experts, other)
    out[chosen, layer, 1] = other[chosen]
    return np.sort(out, axis=-1)


def gate_noise_replay(fixture, model_dir: Path, layer: int, relative: float, seed: int):
    """A bf16 replay whose router on ``layer`` computes its logits from perturbed weights;
    its metadata names the unperturbed model, as a real engine's would."""
    import torch

    load = hf_replay.load_model

    def perturbed(*args, **kwargs):
        model = load(*args, **kwargs)
        gate = model.model.layers[layer].mlp.gate
        weight = gate.weight.data
        generator = torch.Generator().manual_seed(seed)
        noise = torch.randn(weight.shape, generator=generator, dtype=torch.float32)
        spread = weight.float().std()
        weight.copy_((weight.float() + relative * spread * noise).to(weight.dtype))
        return model

    hf_replay.load_model = perturbed
    try:
        return HFScoringEngine().score(fixture, model_dir, BF16)
    finally:
        hf_replay.load_model = load


def judged(fixture, replay, model_dir, calibration) -> dict:
    """Compare as `lpx compare` does (calibrated, findings verified by re-scoring)."""
    started = time.perf_counter()
    comparison = compare_tables(
        fixture, replay, "rollout", "replay", calibration=calibration, calibration_source="bench"
    )
    report = comparison.report
    verify_report(report, fixture, replay, model_dir, calibration=calibration)
    report = report.as_dict()
    routing = report["routing"]
    return {
        "verdict": report["verdict"],
        "causes": [(f["cause"], f["status"]) for f in report["diagnosis"]],
        "flip_rate": routing["flip_rate"],
        "layers": {str(layer["layer"]): layer["flip_rate"] for layer in routing["layers"]},
        "on_flipped": routing["drift_on_flipped"]["mean_abs_diff"],
        "on_rest": routing["drift_on_rest"]["mean_abs_diff"],
        "seconds": time.perf_counter() - started,
    }


def run_scale(name: str) -> dict:
    cached = CACHE / f"{name}.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    spec = SCALES[name]
    model_dir = spec["model"]()
    config = json.loads((model_dir / "config.json").read_text())
    moe = routing(config)
    layers, experts = config["num_hidden_layers"], moe.num_experts
    assert moe.layers == set(range(layers)), "every layer routes: slot = layer"
    middle = layers // 2
    work = CACHE / name
    work.mkdir(parents=True, exist_ok=True)
    fixture_path = work / "fixture.parquet"
    if not fixture_path.is_file():
        sampling = SamplingParams(
            max_tokens=TOKENS, samples_per_prompt=spec["samples"], seed=0, ignore_eos=True
        )
        prompts = tokenize(model_dir, smoke_prompt_texts())
        write_table(HFRolloutEngine().rollout(model_dir, prompts, sampling, {}), fixture_path)
    fixture = read_table(fixture_path)
    started = time.perf_counter()
    calibration = calibrate(fixture, model_dir, ["float32", "bfloat16"], 16, "cpu")
    calibrate_s = time.perf_counter() - started
    rows = {}
    rows["plain"] = judged(fixture, HFScoringEngine().score(fixture, model_dir, BF16),
                           model_dir, calibration)  # fmt: skip
    r3 = HFScoringEngine().score(fixture, model_dir, {**BF16, "router_replay": True})
    rows["R3"] = judged(fixture, r3, model_dir, calibration)
    for fraction in SWAP_FRACTIONS:
        for seed in spec["seeds"]:
            seeded = read_table(fixture_path)
            seeded.routed_experts = swapped(seeded.routed_experts, middle, fraction, experts, seed)
            replay = HFScoringEngine().score(seeded, model_dir, {**BF16, "router_replay": True})
            replay.metadata["knobs"]["router_replay"] = False  # the engine does not say it
            replay.routed_experts = seeded.routed_experts
            rows[f"swap {fraction:.0%} seed {seed}"] = judged(
                fixture, replay, model_dir, calibration
            )
    for relative in GATE_NOISE:
        for seed in spec["seeds"]:
            replay = gate_noise_replay(fixture, model_dir, middle, relative, seed)
            rows[f"gate noise {relative:.0%} seed {seed}"] = judged(
                fixture, replay, model_dir, calibration
            )
    outcome = {
        "tokens": fixture.num_completion_tokens,
        "layers": layers,
        "middle": middle,
        "calibrate_s": calibrate_s,
        "rows": rows,
    }
    cached.write_text(json.dumps(outcome))
    return outcome


def render(name: str, outcome: dict) -> None:
    middle = str(outcome["middle"])
    print(
        f"\n{name}: Qwen3-MoE, {outcome['layers']} layers, {outcome['tokens']:,} completion "
        f"tokens, calibrated in {outcome['calibrate_s']:.0f} s; fault layer {middle}"
    )
    print(
        f"  {'case':<24} {'flips':>7} {'layer':>7} {'|d| flipped':>11} {'|d| rest':>9} "
        f"{'verdict':>8}  causes"
    )
    for label, row in outcome["rows"].items():
        causes = ", ".join(f"{cause} ({status})" for cause, status in row["causes"]) or "-"
        on = "-" if row["on_flipped"] is None else f"{row['on_flipped']:.3g}"
        rest = "-" if row["on_rest"] is None else f"{row['on_rest']:.3g}"
        layer = row["layers"].get(middle, 0.0)
        print(
            f"  {label:<24} {row['flip_rate']:>7.2%} {layer:>7.2%} {on:>11} {rest:>9} "
            f"{row['verdict']:>8}  {causes}"
        )
    clean = [outcome["rows"][k] for k in ("plain", "R3")]
    false_alarms = sum(
        r["verdict"] != "pass" or any(c == "routing_flip" for c, _ in r["causes"]) for r in clean
    )
    faults = [r for k, r in outcome["rows"].items() if k not in ("plain", "R3")]
    failed = [r for r in faults if r["verdict"] != "pass"]
    named = [r for r in failed if any(c == "routing_flip" for c, _ in r["causes"])]
    verified = [r for r in failed if ("routing_flip", "verified") in r["causes"]]
    print(
        f"  clean cases with a false alarm: {false_alarms} of {len(clean)}; faults that failed "
        f"the gate: {len(failed)} of {len(faults)}, of them named routing_flip {len(named)}, "
        f"verified {len(verified)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scales", default=",".join(SCALES))
    args = parser.parse_args()
    for name in args.scales.split(","):
        render(name, run_scale(name))


if __name__ == "__main__":
    main()

"""Reduced-precision rollouts at three scales (issue 52): the gap each format gives, the gate
on a clean declared FP8 rollout and on a fault on top of it, undeclared numerics named, and
what calibrating and verifying them cost against one replay.

For each scale (the tiny model; random llamas 16 x 1024 and 32 x 512, init std 0.02) the HF
engine rolls out 48 sequences x 128 tokens in bf16 with
verl's FP8 recipe emulated (128 x 128 weight blocks, 1 x 128 activation groups, an E4M3 KV
cache: `fp8-block + kv fp8_e4m3`), decoding from its FP8 cache, and replays them in plain
bf16. Then:

- **gaps**: the same tokens scored teacher-forced in bf16 under each format (what a rollout
  under it would give, less the decode path's bf16 noise) against the plain bf16 scoring:
  mean |d|, q999 |d| and verl's `rollout_probs_diff_mean`;
- **gate**: the declared numerics calibrated on the first 16 sequences (`lpx calibrate`'s
  function, timed, and divided by one HF bf16 replay of the whole fixture); 200 random
  batches of held-out sequences at 128, 1,024 and 4,096 tokens judged by the precision gate
  alone (false alarms: the gate's rate is 1e-3); then the whole comparison of the held-out
  sequences, calibrated and verified (`lpx compare`'s functions): the clean rollout, the same
  with its logprobs processed at temperature 0.9 (committed in the FP8 model: a fault on top
  of FP8), and the same tokens with their numerics left out of the metadata, judged by a
  plain bf16 calibration (undeclared: the numerics family names them; its cost in replays).

    .venv/bin/python bench/numerics.py --scales tiny      # seconds
    .venv/bin/python bench/numerics.py                    # every scale, ~40 minutes on 2 cores
    .venv/bin/python bench/numerics.py --scales 16x1024 --std 0.05   # a chaotic model
Fixtures and calibrations are cached under ~/.cache/lpx/bench-numerics.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import _bootstrap  # noqa: F401
import models
import numpy as np

from pipeline.calibrate.run import calibrate
from pipeline.compare.calibrated import TAU_MARGIN
from pipeline.compare.floor import expect
from pipeline.compare.precision_gate import precision_gate
from pipeline.compare.run import compare_tables
from pipeline.contracts.numerics import Numerics, parse_kv_cache, parse_quantization
from pipeline.engines.base import SamplingParams
from pipeline.engines.hf.model import load_model
from pipeline.engines.hf.replay import HFScoringEngine, ReplayKnobs, score_batches
from pipeline.engines.hf.rollout import HFRolloutEngine
from pipeline.faults import FaultSettings, rescore
from pipeline.fixture.io import read_table, write_table
from pipeline.fixture.table import REPLAY_CHANNEL, select_sequences
from pipeline.verify import verify_report

CACHE = Path.home() / ".cache" / "lpx" / "bench-numerics"
# init std 0.02: bf16's own floor there is what trained models show (0.008 mean |d| at
# 16 x 1024; Qwen3-4B 0.011-0.013). At 0.05 (bench/gate.py's, to make noise large) a random
# llama is chaotic: bf16's floor is 0.15 nats and FP8's 0.94 (`--std 0.05`).
SCALES = {
    "tiny": lambda std: models.tiny(),
    "16x1024": lambda std: models.random_llama(16, 1024, std),
    "32x512": lambda std: models.random_llama(32, 512, std),
}
SEQUENCES, TOKENS, PROMPT_TOKENS = 48, 128, 24
CALIBRATION_SEQUENCES = 16
BATCH_TOKENS = (128, 1024, 4096)
DECLARED = {"quantization": "fp8-block", "kv_cache_dtype": "fp8_e4m3"}
DECLARED_PRECISION = "bfloat16+fp8-block+kv=fp8_e4m3"
GAP_FORMATS = ("none", "fp8", "fp8-tensor", "fp8-channel", "fp8-block", "fp8-block-ue8m0",
               "mxfp8", "mxfp8-w8a16", "int8", "kv=fp8_e4m3", "kv=fp8_e4m3:toward_zero",
               "kv=fp8_e5m2", "fp8-block+kv=fp8_e4m3")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", default=",".join(SCALES))
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--work", type=Path, default=CACHE)
    parser.add_argument("--std", type=float, default=0.02, help="the random llamas' init std")
    args = parser.parse_args()
    for scale in args.scales.split(","):
        model_dir = SCALES[scale](args.std)
        work = args.work / (scale if scale == "tiny" else f"{scale}-std{args.std:g}")
        work.mkdir(parents=True, exist_ok=True)
        print(f"\n== {scale}", flush=True)
        fixture, replay, replay_s = pool(scale, model_dir, work)
        gaps(model_dir, fixture)
        gate(model_dir, fixture, replay, replay_s, work, args.trials)


def pool(scale: str, model_dir: Path, work: Path):
    """The declared FP8 rollout (cached) and its plain bf16 replay, timed."""
    path = work / "fixture.parquet"
    if not path.is_file():
        prompts = models.corpus_prompts(model_dir, SEQUENCES, PROMPT_TOKENS)
        params = SamplingParams(max_tokens=TOKENS, seed=0, ignore_eos=True)
        began = time.perf_counter()
        table = HFRolloutEngine().rollout(model_dir, prompts, params,
                                          {"dtype": "bf16", "device": "cpu", **DECLARED})  # fmt: skip
        write_table(table, path)
        print(f"  rollout ({DECLARED_PRECISION}) in {time.perf_counter() - began:.0f} s")
    fixture = read_table(path)
    began = time.perf_counter()
    replay = HFScoringEngine().score(fixture, model_dir, {"dtype": "bf16", "device": "cpu"})
    replay_s = time.perf_counter() - began
    print(f"  {fixture.num_sequences} sequences x {TOKENS} tokens; one HF bf16 replay "
          f"{replay_s:.1f} s", flush=True)  # fmt: skip
    return fixture, replay, replay_s


def gaps(model_dir: Path, fixture) -> None:
    """Each format's gap against plain bf16 on the fixture's tokens (prefill, micro-batch 8)."""
    pairs = [(fixture.prompt_of(r), fixture.completion_of(r)) for r in range(fixture.num_sequences)]
    batches = [pairs[i : i + 8] for i in range(0, len(pairs), 8)]
    settings = ReplayKnobs(dtype="bfloat16", device="cpu")
    scored = {}
    for name in GAP_FORMATS:
        model = load_model(model_dir, "bfloat16", numerics=_numerics(name))
        values = score_batches(model, batches, settings, progress=False)
        scored[name] = np.concatenate([s.completion for s in values]).astype(np.float64)
    plain = scored["none"]
    print(f"  {'format':28s} {'mean|d|':>9s} {'q999|d|':>9s} {'probs_diff':>10s}")
    for name in GAP_FORMATS[1:]:
        d = np.abs(scored[name] - plain)
        probs = np.abs(np.exp(scored[name]) - np.exp(plain))
        print(f"  {name:28s} {d.mean():9.4f} {np.quantile(d, 0.999):9.3f} {probs.mean():10.4f}")


def gate(model_dir: Path, fixture, replay, replay_s: float, work: Path, trials: int) -> None:
    rows = list(range(CALIBRATION_SEQUENCES))
    path = work / "calibration.json"
    if not path.is_file():
        began = time.perf_counter()
        path.write_text(json.dumps(calibrate(fixture, model_dir, ["bfloat16", DECLARED_PRECISION],
                                             device="cpu", rows=rows)))  # fmt: skip
        print(f"  calibrate in {time.perf_counter() - began:.0f} s", flush=True)
    calibration = json.loads(path.read_text())
    timing = calibration["timing_s"]
    fp8_key = next(k for k in timing if "fp8" in k)
    print(
        f"  calibration: the FP8 precision {timing[fp8_key]:.1f} s = "
        f"{timing[fp8_key] / replay_s:.2f} replays (all: {sum(timing.values()) / replay_s:.2f})"
    )
    pair = next(k for k in calibration["pairs"] if k.startswith("bfloat16|bfloat16+"))
    floor = calibration["pairs"][pair]
    print(
        f"  floor {pair}: mean {floor['all']['mean']:.4f}, q999 {floor['all']['q999']:.3f}; "
        f"bf16|bf16 {calibration['pairs']['bfloat16|bfloat16']['all']['mean']:.4f}"
    )
    false_alarms(fixture, replay, floor, trials)
    held = list(range(CALIBRATION_SEQUENCES, fixture.num_sequences))
    part, replay_part = select_sequences(fixture, held), select_sequences(replay, held)
    cases = {
        "clean, declared": (part, calibration),
        "temperature 0.9 on top": (_processed(model_dir, part), calibration),
        "undeclared (bf16 calibration)": (_undeclared(part), _plain(calibration)),
    }
    for name, (rollout, judged_by) in cases.items():
        began = time.perf_counter()
        report = compare_tables(rollout, replay_part, "f", "r", calibration=judged_by).report
        verify_report(report, rollout, replay_part, model_dir, calibration=judged_by,
                      device="cpu")  # fmt: skip
        spent = time.perf_counter() - began
        found = ", ".join(f"{f.cause} ({f.status})" for f in report.diagnosis if f.is_fault)
        named = [f for f in report.diagnosis if str(f.cause) in ("quantization",
                                                                  "kv_cache_precision")]  # fmt: skip
        said = f"; found {named[0].details['verified_by']['params']['found']}" if named else ""
        violated = ", ".join(v["metric"] for v in report.policy["violations"])
        print(
            f"  {name:32s} {report.verdict.upper():4s} findings: {found or 'none'}{said} "
            f"({spent:.0f} s = {spent / replay_s:.1f} replays)"
            + (f"; violations: {violated}" if violated else ""),
            flush=True,
        )
        if name == "clean, declared":
            print("    " + correction_line(report))


def correction_line(report) -> str:
    """What token TIS at cap 2 would do with the clean FP8 drift (verl's names)."""
    corr = report.correction["rollout_corr"]
    probs = report.correction["probs_diff"]["rollout_probs_diff_mean"]
    return (
        f"correction: IS mean {corr['rollout_is_mean']:.3f}, std {corr['rollout_is_std']:.3f},"
        f" ESS {corr['rollout_is_eff_sample_size']:.3f}, kl {corr['kl']:.4f}, chi2_token "
        f"{corr['chi2_token']:.4f}, truncated {corr['truncated_tokens_fraction']:.2%} of "
        f"tokens; rollout_probs_diff_mean {probs:.4f}"
    )


def false_alarms(fixture, replay, floor: dict, trials: int) -> None:
    rng = np.random.default_rng(0)
    offsets = np.asarray(fixture.completion_offsets)
    rollout = np.asarray(fixture.channels["rollout"], dtype=np.float64)
    train = np.asarray(replay.channels[REPLAY_CHANNEL], dtype=np.float64)
    drift = np.abs(train - rollout)
    held = np.arange(CALIBRATION_SEQUENCES, fixture.num_sequences)
    cells = []
    for tokens in BATCH_TOKENS:
        count = min(max(tokens // TOKENS, 1), len(held))
        failed = 0
        for _ in range(trials):
            chosen = np.sort(rng.choice(held, count, replace=False))
            index = np.concatenate([np.arange(offsets[r], offsets[r + 1]) for r in chosen])
            lengths = offsets[chosen + 1] - offsets[chosen]
            positions = np.concatenate([np.arange(n) for n in lengths])
            surprisal = -train[index]
            tau = TAU_MARGIN * np.maximum(expect(floor, surprisal, positions)["q999"], 1e-12)
            batch = np.concatenate([[0], np.cumsum(lengths)])
            failed += not precision_gate(floor, drift[index], surprisal, positions, batch,
                                         tau)["passed"]  # fmt: skip
        cells.append(f"{count * TOKENS} tokens {failed}/{trials}")
    print("  clean batches failing the gate: " + "; ".join(cells), flush=True)


def _numerics(name: str) -> Numerics | None:
    if name == "none":
        return None
    linear, _, kv = name.partition("+kv=") if "+kv=" in name else ("", "", "")
    if name.startswith("kv="):
        return Numerics(None, parse_kv_cache(name))
    if kv:
        return Numerics(parse_quantization(linear), parse_kv_cache(kv))
    return Numerics(parse_quantization(name), None)


def _processed(model_dir: Path, fixture):
    """The rollout's logprobs processed at temperature 0.9, in the FP8 model (a bug on top)."""
    numerics = ReplayKnobs.from_dict({"dtype": "bf16", **DECLARED}).numerics()
    model = load_model(model_dir, "bfloat16", numerics=numerics)
    pairs = [(fixture.prompt_of(r), fixture.completion_of(r)) for r in range(fixture.num_sequences)]
    values = rescore(model, pairs, "temperature", FaultSettings(temperature=0.9))
    return replace(fixture, channels={**fixture.channels, "rollout": np.concatenate(values)})


def _undeclared(fixture):
    metadata = {k: v for k, v in fixture.metadata.items() if k != "numerics"}
    metadata["knobs"] = {k: v for k, v in metadata["knobs"].items() if k not in DECLARED}
    return replace(fixture, metadata=metadata)


def _plain(calibration: dict) -> dict:
    """The calibration of plain bf16 only: what a team that does not know it rolls out in FP8
    would have."""
    keep = {"bfloat16|bfloat16", "bfloat16|float32", "float32|float32"}
    return {**calibration, "precisions": ["bfloat16", "float32"],
            "pairs": {k: v for k, v in calibration["pairs"].items() if k in keep}}  # fmt: skip


if __name__ == "__main__":
    main()

"""Model-config misreads at three scales (issue 53): what each misread engines commit gives,
whether lpx names it (the key and the value), and what the family costs per comparison, as a
ratio to one replay of the fixture.

For each scale (the tiny Qwen3; random Qwen3s 16 x 1024 and 32 x 512, init std 0.02) the HF
engine rolls out 24 sequences x 96 tokens in fp32 (prompts of 24 tokens). Each misread is
then committed the way an engine commits it, by an implementation written here: the HF engine
scores the fixture from a model directory whose config.json reads the key otherwise (the
weights the same), in fp32 and in bf16, and its table records the checkpoint's own config
(an engine that reports the file it was given): a misread the files do not show. Compare
(`lpx compare`'s functions, the profile's constants), then the misread family alone on the
drifting sequences, timed (its search, then its judgement on every sequence; `--whole`: the
whole verification of `lpx compare --model`, every cheaper family first). One misread is also committed with the engine's resolved config recorded
(named from evidence, then verified by re-scoring the recorded reading).

    .venv/bin/python bench/model_config.py --scales tiny      # a minute
    .venv/bin/python bench/model_config.py                    # every scale, ~30 minutes on 2 cores
Fixtures are cached under ~/.cache/lpx/bench-model-config.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from importlib import resources
from pathlib import Path

import _bootstrap  # noqa: F401
import models

from pipeline.compare.run import compare_tables
from pipeline.engines.base import SamplingParams
from pipeline.engines.hf.replay import HFScoringEngine
from pipeline.engines.hf.rollout import HFRolloutEngine
from pipeline.engines.metadata import model_metadata
from pipeline.fixture.io import read_table, write_table
from pipeline.prompts import tokenize
from pipeline.verify import verify_report

CACHE = Path.home() / ".cache" / "lpx" / "bench-model-config"
SCALES = {
    "tiny": lambda: models.family("qwen3"),
    "16x1024": lambda: models.random_qwen3(16, 1024),
    "32x512": lambda: models.random_qwen3(32, 512),
}
SEQUENCES, TOKENS, PROMPT_TOKENS = 24, 96, 24
# what an engine read, as config.json changes (None: the loader ties the head)
MISREADS = {
    "rope theta x2": {"rope_parameters": {"rope_type": "default", "rope_theta": 20000.0}},
    "yarn factor 2": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0,
                                          "factor": 2.0,
                                          "original_max_position_embeddings": "max"}},
    "window 64 every layer": {"use_sliding_window": True, "sliding_window": 64,
                               "max_window_layers": 0, "layer_types": None},
    "window 80 upper half": {"use_sliding_window": True, "sliding_window": 80,
                              "max_window_layers": "half", "layer_types": None},
    "eps 1e-5 for 1e-6": {"rms_norm_eps": 1e-5},
    "tied head": None,
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", default=",".join(SCALES))
    parser.add_argument("--work", type=Path, default=CACHE)
    parser.add_argument("--misreads", default=",".join(MISREADS))
    parser.add_argument(
        "--whole",
        action="store_true",
        help="time the whole verification (every family), not this one alone",
    )
    args = parser.parse_args()
    for scale in args.scales.split(","):
        model_dir = SCALES[scale]()
        work = args.work / scale
        work.mkdir(parents=True, exist_ok=True)
        fixture = rollout(model_dir, work)
        began = time.perf_counter()
        HFScoringEngine().score(fixture, model_dir, {"dtype": "fp32", "device": "cpu"})
        replay_s = time.perf_counter() - began
        print(f"\n== {scale}: {fixture.num_sequences} x {TOKENS} tokens, one HF fp32 replay "
              f"{replay_s:.1f} s", flush=True)  # fmt: skip
        print(f"  {'misread':24s} {'dtype':9s} {'mean|d|':>8s} {'onset':>6s}  named "
              f"{'verify s':>9s} {'replays':>8s}")  # fmt: skip
        for name in args.misreads.split(","):
            for dtype in ("float32", "bfloat16"):
                case(scale, model_dir, work, fixture, name, dtype, replay_s, evidence=False)
        case(scale, model_dir, work, fixture, "rope theta x2", "bfloat16", replay_s, True)


def rollout(model_dir: Path, work: Path):
    path = work / "fixture.parquet"
    if not path.is_file():
        lines = resources.files("pipeline").joinpath("tinymodel/corpus.txt").read_text()
        texts = [x for x in lines.splitlines() if len(x.split()) > 12][:SEQUENCES]
        prompts = [p[:PROMPT_TOKENS] for p in tokenize(model_dir, texts)]
        params = SamplingParams(max_tokens=TOKENS, seed=0, ignore_eos=True)
        table = HFRolloutEngine().rollout(model_dir, prompts, params, {"device": "cpu"})
        write_table(table, path)
    return read_table(path)


def misread_dir(model_dir: Path, work: Path, name: str) -> Path:
    """The model directory as the engine read it (its weights linked, its config edited)."""
    out = work / ("engine-" + name.replace(" ", "_").replace(",", ""))
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for path in model_dir.iterdir():
        (out / path.name).symlink_to(path.resolve())
    config = json.loads((model_dir / "config.json").read_text())
    changes = dict(MISREADS[name] or {})
    if changes.get("max_window_layers") == "half":
        changes["max_window_layers"] = config["num_hidden_layers"] // 2
    rope = changes.get("rope_parameters") or {}
    if rope.get("original_max_position_embeddings") == "max":
        changes["rope_parameters"] = {**rope, "original_max_position_embeddings":
                                      config["max_position_embeddings"]}  # fmt: skip
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    (out / "config.json").unlink()
    (out / "config.json").write_text(json.dumps(config))
    return out


def case(scale, model_dir, work, fixture, name, dtype, replay_s, evidence: bool) -> None:
    import pipeline.engines.hf.replay as hf_replay

    engine_dir = misread_dir(model_dir, work, name)
    loader = hf_replay.load_model
    if MISREADS[name] is None:  # a loader that ties the head whatever the config says

        def tying(*args, **kwargs):
            model = loader(*args, **kwargs)
            model.get_output_embeddings().weight = model.get_input_embeddings().weight
            return model

        hf_replay.load_model = tying
    try:
        replay = HFScoringEngine().score(fixture, engine_dir, {"dtype": dtype, "device": "cpu"})
    finally:
        hf_replay.load_model = loader
    if not evidence:  # the engine reports the checkpoint's config, not what it computed with
        replay.metadata["model"] = model_metadata(model_dir)
    else:
        replay.metadata["model"] = {**model_metadata(model_dir),
                                    "config": replay.metadata["model"]["config"]}  # fmt: skip
    report = compare_tables(fixture, replay, "fixture", "replay").report
    if WHOLE:
        began = time.perf_counter()
        verify_report(report, fixture, replay, model_dir, device="cpu")
        spent = time.perf_counter() - began
        faults = [f for f in report.diagnosis or [] if f.is_fault]
        named = [f for f in faults if f.cause == "model_config" and f.verified]
        if named:
            said = named[0].evidence.split("computed as if the model config read ")[-1]
            said = said.split(":")[0]
        else:
            said = f"{report.verdict}: " + ", ".join(f"{f.cause} ({f.status})" for f in faults)
    else:
        said, spent = family_alone(report, fixture, replay, model_dir)
    onset = (report.onset or {}).get("position", "-")
    label = name + (" (recorded)" if evidence else "")
    print(f"  {label:24s} {dtype:9s} {report.metrics['mean_abs_diff']:8.4f} {onset!s:>6s}  "
          f"{said}  {spent:7.1f} {spent / replay_s:8.1f}", flush=True)  # fmt: skip


def family_alone(report, fixture, replay, model_dir: Path) -> tuple[str, float]:
    """The misread family alone on the comparison's drifting sequences (its search and its
    judgement on every sequence; the reference model loaded before the clock starts): what it
    names, and its seconds. The whole verification (--whole) first tries every cheaper family."""
    from pipeline.verify.families.model_config import ModelConfig
    from pipeline.verify.flow import Verifier
    from pipeline.verify.judge import judge

    drifting = [f for f in report.diagnosis or [] if f.sequences and f.cause != "model_config"]
    recorded = [f for f in report.diagnosis or [] if f.cause == "model_config" and f.sequences]
    if not drifting and not recorded:
        return f"{report.verdict}: no drift to explain", 0.0
    finding = (recorded or drifting)[0]
    verifier = Verifier(fixture, replay, model_dir, device="cpu")
    family = ModelConfig()
    offered = (family.hypotheses if recorded else family.alternatives)(verifier.ref, finding)
    began = time.perf_counter()
    outcome = judge(verifier.ref, offered[0], finding.sequences)
    spent = time.perf_counter() - began
    if outcome is None:
        return "nothing to re-score", spent
    value = outcome.candidate.params.get("value") or "(as recorded)"
    if not outcome.candidate.params.get("edits"):
        value = "no reading nearer"
    state = "verified" if outcome.verified else "not verified"
    return f"{value}, {state} ({outcome.after:.3g} left of {outcome.before:.3g})", spent


WHOLE = "--whole" in sys.argv


if __name__ == "__main__":
    main()

"""The CPU smoke: tiny model -> rollout -> replay in fp32 and bf16 -> compare -> verdict."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import click

from pipeline.errors import EXIT_PASS, EXIT_REGRESSION

SMOKE_SAMPLING = {"max_tokens": 32, "temperature": 1.0, "seed": 0, "samples_per_prompt": 2}
SMOKE_REPLAY_DTYPES = ("float32", "bfloat16")


def default_model_dir() -> Path:
    cache = Path(os.environ.get("LPX_CACHE", Path.home() / ".cache" / "lpx"))
    return cache / "models" / "tiny-llama-seed0"


def ensure_tiny_model(model_dir: Path, arch: str = "llama", seed: int = 0) -> Path:
    """Build the tiny model unless a complete one is already there."""
    from pipeline.tinymodel.build import build_tiny_model

    if (model_dir / "model.safetensors").is_file() and (model_dir / "tokenizer.json").is_file():
        return model_dir
    click.echo(f"building tiny {arch} model in {model_dir} ...", err=True)
    # Build beside the target and move it in whole, so a crash never leaves half a model.
    staging = model_dir.with_name(f".{model_dir.name}.building-{os.getpid()}")
    build_tiny_model(staging, arch=arch, seed=seed)
    if model_dir.exists():
        shutil.rmtree(model_dir)
    staging.replace(model_dir)
    return model_dir


def run_smoke(out_dir: Path, model_dir: Path | None = None, rollout_engine: str = "hf") -> int:
    from pipeline.compare.outputs import write_outputs
    from pipeline.compare.run import compare_files
    from pipeline.engines import rollout_engine as load_rollout
    from pipeline.engines import scoring_engine
    from pipeline.engines.base import SamplingParams
    from pipeline.fixture.io import write_table
    from pipeline.prompts import smoke_prompt_texts, tokenize

    out_dir = Path(out_dir)
    model_dir = ensure_tiny_model(Path(model_dir) if model_dir else default_model_dir())
    prompts = tokenize(model_dir, smoke_prompt_texts())
    fixture = load_rollout(rollout_engine).rollout(
        model_dir, prompts, SamplingParams(**SMOKE_SAMPLING), {}
    )
    fixture_path = write_table(fixture, out_dir / "fixture.parquet")
    versions = fixture.metadata["engine"]["versions"]
    click.echo(
        f"rollout {rollout_engine} {versions.get(rollout_engine, versions.get('transformers'))}: "
        f"{fixture.num_sequences} sequences, {fixture.num_completion_tokens} completion tokens "
        f"-> {fixture_path}\n  knobs as applied: {json.dumps(fixture.metadata.get('knobs', {}))}"
    )
    results = {}
    for dtype in SMOKE_REPLAY_DTYPES:
        replay = scoring_engine("hf").score(fixture, model_dir, {"dtype": dtype})
        replay_path = write_table(replay, out_dir / f"replay-hf-{dtype}.parquet")
        comparison = compare_files(
            fixture_path, replay_path, command_line=f"lpx smoke --out {out_dir}"
        )
        paths = write_outputs(comparison, out_dir / f"compare-hf-{dtype}")
        report = comparison.report
        metrics = report["metrics"]
        causes = ", ".join(f["cause"] for f in report["diagnosis"]) or "none"
        click.echo(
            f"{rollout_engine} vs hf {dtype:<8}  {report['verdict'].upper():4}  profile "
            f"{report['policy']['profile']:<8}  max|d| {metrics['max_abs_diff']:.3g}  "
            f"mean|d| {metrics['mean_abs_diff']:.3g}  k3 {metrics['k3']:.2g}  findings: {causes}"
        )
        results[dtype] = {"verdict": report["verdict"], "report": str(paths["report"])}
    (out_dir / "smoke.json").write_text(json.dumps(results, indent=1) + "\n")
    failed = [d for d, r in results.items() if r["verdict"] != "pass"]
    click.echo(
        f"smoke: {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'}; outputs in {out_dir}"
    )
    return EXIT_REGRESSION if failed else EXIT_PASS

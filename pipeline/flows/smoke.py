"""The CPU smoke: tiny model -> rollout -> replay in fp32 and bf16 -> compare -> verdict."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from pipeline.contracts.files import COMPARE_OUTPUTS
from pipeline.errors import EXIT_PASS, EXIT_REGRESSION, BadInput, Interrupted
from pipeline.paths import check_replaceable_in, output_lock, write_text_atomic
from pipeline.run_manifest import add_stage, finish, new_manifest, write_manifest

SMOKE_SAMPLING = {"max_tokens": 32, "temperature": 1.0, "seed": 0, "samples_per_prompt": 2}
SMOKE_REPLAY_DTYPES = ("float32", "bfloat16")
DEFAULT_REPORT = Path("runs") / "report"


def default_model_dir() -> Path:
    cache = Path(os.environ.get("LPX_CACHE", Path.home() / ".cache" / "lpx"))
    return cache / "models" / "tiny-llama-seed0"


MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json")
# What a current lpx build also writes: a tiny model built before its chat template was is
# built again (the same weights; agent loops render through the template)
BUILT_FILES = (*MODEL_FILES, "chat_template.jinja")


def ensure_tiny_model(model_dir: Path, arch: str = "llama", seed: int = 0) -> Path:
    """The tiny model in lpx's own cache, built on first use. Never deletes anything: an
    incomplete directory is replaced only when lpx built it (it holds lpx-model.json)."""
    from pipeline.tinymodel.build import install_tiny_model

    if all((model_dir / name).is_file() for name in BUILT_FILES):
        return model_dir
    if model_dir.exists() and not (model_dir / "lpx-model.json").is_file():
        raise BadInput(
            f"{model_dir}: exists but is not a model lpx built (no lpx-model.json); move it "
            "away or set LPX_CACHE to another directory. lpx never deletes what it did not create."
        )
    click.echo(f"building tiny {arch} model in {model_dir} ...", err=True)
    return install_tiny_model(model_dir, arch=arch, seed=seed)


def user_model_dir(model_dir: Path) -> Path:
    """A --model the user named: used as it is, never built or changed."""
    missing = [name for name in MODEL_FILES if not (model_dir / name).is_file()]
    if not model_dir.is_dir() or missing:
        what = "does not exist" if not model_dir.exists() else f"lacks {', '.join(missing)}"
        raise BadInput(
            f"--model {model_dir}: {what}; point it at a Hugging Face model directory with a "
            "tokenizer.json, build one with `lpx make-model DIR`, or leave --model out to use "
            "lpx's cached tiny model."
        )
    return model_dir


def run_smoke(
    out_dir: Path,
    model_dir: Path | None = None,
    rollout_engine: str = "hf",
    db: str | None = None,
    report_dir: Path | None = DEFAULT_REPORT,
) -> int:
    """The smoke's stages, each noted in the run manifest as it ends; then the run goes into
    the history and the report is rendered (``report_dir=None`` skips both). A failing stage
    still records the run, as an error run, before its error is raised."""
    out_dir = Path(out_dir)
    model_dir = user_model_dir(Path(model_dir)) if model_dir else None  # bad input: no run
    check_replaceable_in(out_dir, smoke_outputs(), "--out")  # a user's file there is kept
    out_dir.mkdir(parents=True, exist_ok=True)
    with output_lock(out_dir):  # a second smoke into the same --out fails at once
        manifest = new_manifest("smoke", f"lpx smoke --out {out_dir}")
        write_manifest(out_dir, manifest)
        try:
            code = _smoke_stages(out_dir, model_dir, rollout_engine, manifest)
        except BaseException as error:
            message = str(error.format_message() if isinstance(error, BadInput) else error)
            add_stage(manifest, "smoke", "error", f"{type(error).__name__}: {message}".strip())
            write_manifest(out_dir, finish(manifest))
            if report_dir is not None and not isinstance(error, (KeyboardInterrupt, Interrupted)):
                _record_and_report(out_dir, db, report_dir)
            raise
        write_manifest(out_dir, finish(manifest))
    if report_dir is not None:
        _record_and_report(out_dir, db, report_dir)
    return code


def smoke_outputs() -> list[str]:
    """What a smoke writes into --out, by path within it."""
    from pipeline.run_manifest import MANIFEST

    replays = [f"replay-hf-{dtype}.parquet" for dtype in SMOKE_REPLAY_DTYPES]
    compares = [
        f"compare-hf-{dtype}/{name}" for dtype in SMOKE_REPLAY_DTYPES for name in COMPARE_OUTPUTS
    ]
    return [MANIFEST, "smoke.json", "fixture.parquet", *replays, *compares]


def _record_and_report(out_dir: Path, db: str | None, report_dir: Path) -> None:
    from pipeline.history.collect import collect_run
    from pipeline.history.database import describe, open_history
    from pipeline.history.record import record_runs
    from pipeline.report.site import build_site

    history = open_history(db)
    try:
        (result,) = record_runs(history, [collect_run(out_dir)])
        click.echo(f"history: run {result.run_id} ({result.status}) -> {describe(history.url)}")
        index = build_site(history, report_dir)
    finally:
        history.dispose()
    click.echo(f"report: {index}")


def _smoke_stages(
    out_dir: Path, model_dir: Path | None, rollout_engine: str, manifest: dict
) -> int:
    from pipeline.compare.matrix import claim_text
    from pipeline.compare.outputs import write_outputs
    from pipeline.compare.run import compare_files
    from pipeline.engines import rollout_engine as load_rollout
    from pipeline.engines import scoring_engine
    from pipeline.engines.base import SamplingParams
    from pipeline.fixture.io import write_table
    from pipeline.prompts import smoke_prompt_texts, tokenize

    model_dir = model_dir or ensure_tiny_model(default_model_dir())
    prompts = tokenize(model_dir, smoke_prompt_texts())
    fixture = load_rollout(rollout_engine).rollout(
        model_dir, prompts, SamplingParams(**SMOKE_SAMPLING), {}
    )
    fixture_path = write_table(fixture, out_dir / "fixture.parquet")
    add_stage(manifest, "rollout", "ok", outputs=[str(fixture_path)])
    write_manifest(out_dir, manifest)
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
        add_stage(manifest, f"replay-hf-{dtype}", "ok", outputs=[str(replay_path)])
        comparison = compare_files(
            fixture_path, replay_path, command_line=f"lpx smoke --out {out_dir}"
        )
        paths = write_outputs(comparison, out_dir / f"compare-hf-{dtype}")
        report = comparison.report
        add_stage(manifest, f"compare-hf-{dtype}", "ok" if report.verdict == "pass" else "fail")
        write_manifest(out_dir, manifest)
        metrics = report.metrics
        causes = ", ".join(claim_text(f) for f in report.diagnosis) or "none"
        click.echo(
            f"{rollout_engine} vs hf {dtype:<8}  {report.verdict.upper():4}  profile "
            f"{report.policy['profile']:<8}  max|d| {metrics['max_abs_diff']:.3g}  "
            f"mean|d| {metrics['mean_abs_diff']:.3g}  k3 {metrics['k3']:.2g}  findings: {causes}"
        )
        results[dtype] = {"verdict": report.verdict, "report": str(paths["report"])}
    write_text_atomic(out_dir / "smoke.json", json.dumps(results, indent=1) + "\n")
    failed = [d for d, r in results.items() if r["verdict"] != "pass"]
    click.echo(
        f"smoke: {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'}; outputs in {out_dir}"
    )
    return EXIT_REGRESSION if failed else EXIT_PASS

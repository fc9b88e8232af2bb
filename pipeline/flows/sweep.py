"""Sweeps: one rollout engine over several knob settings, each compared with the first.

Engines that can reuse a loaded model across settings (vLLM: settings that differ only in
request-level knobs such as batch size) implement ``rollout_settings``; others are called
once per setting. Comparisons are token by token on the tokens both settings sampled: with
per-trajectory seeds the tokens agree unless the logprob drift flipped a sample, and where
they diverge only the common prefix is compared and the divergence is reported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.compare.outputs import write_outputs
from pipeline.compare.run import compare_tables
from pipeline.engines.base import SamplingParams
from pipeline.errors import BadInput
from pipeline.fixture.io import write_table
from pipeline.fixture.table import REPLAY_CHANNEL, TokenTable, table_from_sequences
from pipeline.paths import output_lock, safe_name, write_text_atomic


@dataclass
class Setting:
    name: str
    knobs: dict


def parse_setting(text: str) -> Setting:
    """'NAME:KNOB=VALUE,KNOB=VALUE' (or just 'NAME:' for the engine's defaults)."""
    name, sep, rest = text.partition(":")
    if not sep or not name.strip():
        raise BadInput(
            f"--setting {text!r}: expected NAME:KNOB=VALUE,... (e.g. batch1:batch_size=1)."
        )
    knobs, given = {}, {}
    for pair in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = pair.partition("=")
        key = key.strip()
        if not eq or not key:
            raise BadInput(f"--setting {text!r}: {pair!r} is not KNOB=VALUE.")
        if key in knobs:  # the later one would silently win; which one was meant is not ours
            raise BadInput(
                f"--setting {text!r}: {given[key]!r} and {pair!r} both set {key}; give it once."
            )
        knobs[key], given[key] = value.strip(), pair
    return Setting(safe_name(name.strip(), "--setting name"), knobs)


def run_sweep(
    engine,
    model_dir: Path,
    prompts,
    sampling: SamplingParams,
    settings: list[Setting],
    out_dir: Path,
) -> list[dict]:
    if len(settings) < 2:
        raise BadInput("a sweep needs at least two --setting (the first is the baseline).")
    names = [setting.name for setting in settings]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise BadInput(f"--setting names must differ; {', '.join(twice)} given more than once.")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with output_lock(out_dir):  # a second sweep into the same --out fails at once
        many = getattr(engine, "rollout_settings", None)
        if many is not None:
            fixtures = many(model_dir, prompts, sampling, [s.knobs for s in settings])
        else:
            fixtures = [engine.rollout(model_dir, prompts, sampling, s.knobs) for s in settings]
        return _write_sweep(out_dir, settings, fixtures)


def _write_sweep(out_dir: Path, settings, fixtures) -> list[dict]:
    baseline_name, baseline = settings[0].name, fixtures[0]
    write_table(baseline, out_dir / f"fixture-{baseline_name}.parquet")
    rows = [
        {
            "setting": baseline_name,
            "baseline": True,
            "knobs_applied": baseline.metadata.get("knobs"),
            "knobs_not_applied": baseline.metadata.get("knobs_not_applied") or {},
        }
    ]
    for setting, fixture in zip(settings[1:], fixtures[1:], strict=True):
        fixture_path = write_table(fixture, out_dir / f"fixture-{setting.name}.parquet")
        ours, theirs, diverged = common_prefix(fixture, baseline, baseline_name)
        comparison = compare_tables(ours, theirs, fixture_path, f"{baseline_name} (baseline)")
        paths = write_outputs(comparison, out_dir / f"compare-{setting.name}")
        metrics = comparison.report.metrics
        rows.append(
            {
                "setting": setting.name,
                "baseline": False,
                "knobs_applied": fixture.metadata.get("knobs"),
                "knobs_not_applied": fixture.metadata.get("knobs_not_applied") or {},
                "verdict": comparison.report.verdict,
                "tokens_compared": metrics.get("tokens", 0),
                "max_abs_diff": metrics.get("max_abs_diff", 0.0),
                "mean_abs_diff": metrics.get("mean_abs_diff", 0.0),
                "diverged_sequences": diverged,
                "report": str(paths["report"]),
            }
        )
    write_text_atomic(out_dir / "sweep.json", json.dumps(rows, indent=1, default=str) + "\n")
    return rows


def common_prefix(fixture: TokenTable, baseline: TokenTable, baseline_name: str):
    """The setting's fixture and the baseline (as a replay) cut to the tokens both sampled.

    Returns (fixture, baseline-as-replay, {sequence id: first diverging position}).
    """
    if fixture.sequence_ids != baseline.sequence_ids:
        raise BadInput("sweep settings produced different sequences; keep prompts and -n fixed.")
    prompts, completions, ours, theirs, diverged = [], [], [], [], {}
    for i, sequence_id in enumerate(fixture.sequence_ids):
        a, b = fixture.completion_of(i), baseline.completion_of(i)
        n = min(len(a), len(b))
        mismatch = np.flatnonzero(a[:n] != b[:n])
        keep = int(mismatch[0]) if len(mismatch) else n
        if keep < max(len(a), len(b)):
            diverged[sequence_id] = keep
        prompts.append(fixture.prompt_of(i))
        completions.append(a[:keep])
        ours.append(fixture.channels["rollout"][fixture.completion_slice(i)][:keep])
        theirs.append(baseline.channels["rollout"][baseline.completion_slice(i)][:keep])
    cut = table_from_sequences(
        "fixture",
        fixture.sequence_ids,
        prompts,
        completions,
        {"rollout": ours},
        metadata=fixture.metadata,
    )
    as_replay = table_from_sequences(
        "replay",
        fixture.sequence_ids,
        prompts,
        completions,
        {REPLAY_CHANNEL: theirs},
        metadata={**baseline.metadata, "sweep_baseline": baseline_name},
    )
    return cut, as_replay, diverged

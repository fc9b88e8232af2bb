"""Record finished runs into the history: one transaction, idempotent, judged on the way in.

Every run directory is read first (collect.py) so a corrupt one stops the command before
the database is touched; then all runs are written in one transaction. A run already in
the history (same manifest run id, or the same report bytes) is skipped, so recording the
same run twice — even at the same moment from two processes — stores it once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from pipeline.db.models import (
    Case,
    Comparison,
    EngineBuild,
    MetricValue,
    Run,
    Series,
    Testbed,
)
from pipeline.history import keys
from pipeline.history.collect import PairInput, RunInput
from pipeline.history.database import History
from pipeline.history.details import comparison_details
from pipeline.history.detection import DetectionConfig, metric_spec
from pipeline.history.evaluate import Point, judge_point, metric_fields, reevaluate_series, utc_now

NOT_METRICS = ("tokens", "tau")  # context, not drift: stored on the comparison instead
NON_FINITE = ("nan", "inf", "-inf")  # how report.json writes non-finite metrics


@dataclass
class Recorded:
    run_dir: str
    run_id: int
    status: str
    comparisons: int
    new: bool  # False: the run was already in the history


def record_runs(
    history: History, runs: list[RunInput], config: DetectionConfig | None = None
) -> list[Recorded]:
    """Write ``runs`` (oldest first) in one transaction; return what happened to each."""
    config = config or DetectionConfig()
    results = []
    with history.write() as session:
        recorder = _Recorder(session, config)
        for run in sorted(runs, key=lambda r: r.started_at):
            results.append(recorder.record(run))
        recorder.finish()
    return results


def tracked_metrics(report: dict) -> dict[str, float | None]:
    """The report's scalar metrics (completion region, plus prompt.* when scored), with
    non-finite values as None (SQLite cannot store NaN; detection treats None as a
    violation)."""
    metrics = report.get("metrics") or {}
    values = {}
    prompt = (metrics.get("by_region") or {}).get("prompt") or {}
    for prefix, region in (("", metrics), ("prompt.", prompt)):
        for name, value in region.items():
            if name not in NOT_METRICS and (_is_number(value) or value in NON_FINITE):
                values[prefix + name] = _finite(value)
    return values


class _Recorder:
    """Caches the rows every run shares (testbeds, builds, cases, series) across runs."""

    def __init__(self, session: Session, config: DetectionConfig):
        self.session = session
        self.config = config
        self.cache: dict[tuple[type, str], object] = {}
        self.tokenizers: dict = {}
        self.out_of_order: set[int] = set()

    def record(self, run: RunInput) -> Recorded:
        session = self.session
        existing = session.scalar(select(Run.id).where(Run.key == run.key))
        if existing is not None:
            return Recorded(str(run.run_dir), existing, run.status, 0, new=False)
        testbed = self._testbed(run.testbed)
        row = Run(
            key=run.key,
            kind=run.kind,
            status=run.status,
            started_at=run.started_at,
            ended_at=run.ended_at,
            recorded_at=utc_now(),
            trigger=run.trigger,
            command_line=run.command_line,
            lpx_version=run.lpx_version,
            lpx_revision=run.lpx_revision,
            run_dir=str(run.run_dir),
            testbed_id=testbed.id,
            errors=run.errors,
            manifest={**run.manifest, "testbed": run.testbed},
        )
        session.add(row)
        session.flush()
        images = _stage_images(run.manifest)
        metric_rows = []
        for pair in run.pairs:
            metric_rows += self._comparison(row, run, pair, testbed, images)
        if metric_rows:
            session.execute(insert(MetricValue), metric_rows)
        return Recorded(str(run.run_dir), row.id, run.status, len(run.pairs), new=True)

    def finish(self) -> None:
        """Series that got a point older than their newest are replayed whole."""
        for series_id in sorted(self.out_of_order):
            reevaluate_series(self.session, self.session.get(Series, series_id), self.config)

    def _comparison(
        self, run_row: Run, run: RunInput, pair: PairInput, testbed: Testbed, images: dict
    ) -> list[dict]:
        report = pair.report
        meta = report["metadata"]
        fixture, replay = meta["fixture"], meta["replay"]
        label = (run.manifest.get("cases") or {}).get(pair.pair)
        case_description = keys.case_description(report, label)
        case = self._case(case_description)
        series = self._series(case, case_description, fixture, replay, testbed)
        rollout_build = self._build(keys.build_description(fixture, _image(images, fixture)))
        replay_build = self._build(keys.build_description(replay, _image(images, replay)))
        policy = report.get("policy") or {}
        tau = _finite(policy.get("tau")) or 0.0
        comparison = Comparison(
            run_id=run_row.id,
            series_id=series.id,
            started_at=run.started_at,
            pair=pair.pair,
            rollout_build_id=rollout_build.id,
            replay_build_id=replay_build.id,
            verdict=report["verdict"],
            profile=str(policy.get("profile", "")),
            tau=tau,
            tokens=int((report.get("metrics") or {}).get("tokens") or 0),
            sequences=len(report.get("sequences") or []),
            seed=(fixture.get("sampling") or {}).get("seed"),
            findings=report.get("diagnosis") or [],
            violations=policy.get("violations") or [],
            details=comparison_details(report, pair.tokens_path, self.tokenizers),
        )
        self.session.add(comparison)
        self.session.flush()
        values = tracked_metrics(report)
        point = Point(
            comparison.id,
            run_row.id,
            report["verdict"],
            tau,
            run.status == "error",
            values,
            comparison.violations,
            policy.get("failing_findings") or [],
        )
        if series.last_started_at is not None and run.started_at < series.last_started_at:
            self.out_of_order.add(series.id)
            results = {}
        else:
            results = judge_point(self.session, series, point, self.config)
            series.last_started_at = run.started_at
        rows = []
        for name, value in values.items():
            spec = metric_spec(name)
            fields = metric_fields(results[name]) if name in results else {"status": "unevaluated"}
            rows.append(
                {
                    "comparison_id": comparison.id,
                    "series_id": series.id,
                    "started_at": run.started_at,
                    "name": name,
                    "value": value,
                    "unit": spec.unit,
                    "better": spec.better,
                    "baseline_points": 0,
                    **fields,
                }
            )
        return rows

    def _cached(self, model: type, key: str, make):
        found = self.cache.get((model, key))
        if found is None:
            found = self.session.scalar(select(model).where(model.key == key))
            if found is None:
                found = make()
                self.session.add(found)
                self.session.flush()
            self.cache[(model, key)] = found
        return found

    def _testbed(self, testbed: dict) -> Testbed:
        return self._cached(
            Testbed,
            keys.testbed_key(testbed),
            lambda: Testbed(
                key=keys.testbed_key(testbed),
                name=keys.testbed_name(testbed),
                host=testbed.get("host"),
                cpu_model=testbed.get("cpu_model"),
                cpu_count=testbed.get("cpu_count"),
                gpu_model=testbed.get("gpu_model"),
                gpu_count=int(testbed.get("gpu_count") or 0),
            ),
        )

    def _build(self, build: dict) -> EngineBuild:
        key = keys.digest(build)
        return self._cached(EngineBuild, key, lambda: EngineBuild(key=key, **build))

    def _case(self, case: dict) -> Case:
        key = keys.case_key(case)
        label = case["label"] or case["model"].rstrip("/").split("/")[-1]
        fields = {k: v for k, v in case.items() if k != "label"}
        return self._cached(Case, key, lambda: Case(key=key, label=label, **fields))

    def _series(self, case: Case, description: dict, fixture, replay, testbed: Testbed) -> Series:
        rollout, replay_name = keys.engine_name(fixture), keys.engine_name(replay)
        key = keys.series_key(case.key, rollout, replay_name, testbed.key)
        return self._cached(
            Series,
            key,
            lambda: Series(
                key=key,
                case_id=case.id,
                rollout_engine=rollout,
                replay_engine=replay_name,
                testbed_id=testbed.id,
                label=keys.series_label(description, rollout, replay_name, testbed.name),
                detection_state={},
            ),
        )


def _stage_images(manifest: dict) -> dict:
    """Output path -> {ref, digest} from the manifest's containerised stages."""
    images = {}
    for stage in manifest.get("stages") or []:
        image = stage.get("image")
        if isinstance(image, dict):
            for output in stage.get("outputs") or []:
                images[str(output)] = image
                images[str(output).rstrip("/").rsplit("/", 1)[-1]] = image
    return images


def _image(images: dict, side: dict) -> dict | None:
    path = str(side.get("path") or "")
    return images.get(path) or images.get(path.rstrip("/").rsplit("/", 1)[-1])


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value) -> float | None:
    if not _is_number(value):
        return None
    value = float(value)
    return value if math.isfinite(value) else None

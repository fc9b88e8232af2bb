"""Record finished runs into the history: one transaction, idempotent, judged on the way in.

Every run directory is read first (collect.py) so a corrupt one stops the command before
the database is touched; then all runs are written in one transaction. A run already in
the history (same manifest run id, or the same report bytes) is skipped, so recording the
same run twice — even at the same moment from two processes — stores it once.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from pipeline.contracts.files import TOKENS
from pipeline.contracts.sequences import SequencesUnreadable, sequence_count
from pipeline.db.models import (
    Case,
    Comparison,
    EngineBuild,
    LocalizeBoundary,
    MetricValue,
    Run,
    Series,
    Testbed,
)
from pipeline.errors import BadInput
from pipeline.history import keys
from pipeline.history.bulk import bind_value, insert_plain_rows, new_ids
from pipeline.history.calibrations import store_calibration
from pipeline.history.claims import failing_claims
from pipeline.history.collect import PairInput, RunInput
from pipeline.history.database import History, json_dumps
from pipeline.history.details import comparison_details
from pipeline.history.detection import DetectionConfig, metric_spec
from pipeline.history.evaluate import (
    BOUNDARY_COLUMNS,
    Point,
    boundary_values,
    judge_point,
    point_boundaries,
    reevaluate_series,
    utc_now,
)
from pipeline.history.localized import BOUNDARY_COLUMNS as LOCALIZE_BOUNDARY_COLUMNS
from pipeline.history.localized import boundary_rows, localize_columns
from pipeline.history.values import (
    finite_or_none,
    image_of,
    int32_value,
    stage_images,
    tracked_values,
)
from pipeline.history.workload import agreement, read_tokens, same_token_values

METRIC_COLUMNS = (
    "comparison_id",
    "series_id",
    "started_at",
    "name",
    "value",
    "unit",
    "better",
    *BOUNDARY_COLUMNS,
)
COMPARISON_COLUMNS = (
    "id",
    "run_id",
    "series_id",
    "started_at",
    "pair",
    "rollout_build_id",
    "replay_build_id",
    "verdict",
    "profile",
    "tau",
    "tokens",
    "sequences",
    "seed",
    "findings",
    "violations",
    "details",
    "localize_verdict",
    "localize_boundary",
    "localize",
    "workload",
)
COMPARISON_JSON = ("findings", "violations", "details")  # sent as JSON text
LOCALIZE_COLUMNS = ("comparison_id", "series_id", "started_at", *LOCALIZE_BOUNDARY_COLUMNS)


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
    with _gc_skips_the_runs(), history.write() as session:
        recorder = _Recorder(session, config)
        # No flush between runs: the series states and alerts the runs change are written
        # once, when the transaction commits. Flushing them after every run made PostgreSQL
        # keep a version of each series row per run, and every foreign-key check on it walk
        # them all (a year's import went quadratic: bench/history.py).
        with session.no_autoflush:
            for run in sorted(runs, key=lambda r: r.started_at):
                results.append(recorder.record(run))
        recorder.finish()
    return results


@contextmanager
def _gc_skips_the_runs() -> Iterator[None]:
    """The runs read for a record are a large heap (a year: 18,000 reports) that outlives the
    transaction; frozen, Python's cyclic GC stops rescanning it on each collection, which
    took a quarter of a year's import (bench/history.py). Unfrozen after, so any garbage
    among it is collected as usual."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@dataclass
class _Pair:
    """One pair's identities, computed before any row is looked up."""

    pair: PairInput
    case: dict
    case_key: str
    series_key: str
    rollout_build: dict
    replay_build: dict
    rollout_build_key: str
    replay_build_key: str


class _Recorder:
    """Writes runs; the rows runs share (testbeds, builds, cases, series) are looked up in
    bulk, a few queries a run, and cached for the rest of the transaction."""

    def __init__(self, session: Session, config: DetectionConfig):
        self.session = session
        self.config = config
        self.cache: dict[tuple[type, str], object] = {}
        self.tokenizers: dict = {}
        self.out_of_order: set[int] = set()
        self.statements: dict = {}  # compiled INSERTs per table and dialect
        # each series' newest point recorded so far: {id, started_at, workload, tokens_path}
        self.latest: dict[int, dict] = {}

    def record(self, run: RunInput) -> Recorded:
        session = self.session
        existing = session.scalar(select(Run.id).where(Run.key == run.key))
        if existing is not None:
            return Recorded(str(run.run_dir), existing, run.status, 0, new=False)
        testbed = self._testbed(run.testbed)
        run_id = session.execute(
            insert(Run.__table__).returning(Run.__table__.c.id),
            dict(
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
                manifest=run.stored_manifest,
            ),
        ).scalar_one()
        if run.calibration is not None:
            session.flush()  # a calibration an earlier run of this import stored is seen
            store_calibration(session, run.calibration, run_id)
        pairs = self._describe(run, testbed)
        self._resolve(pairs, testbed)
        comparisons = [self._comparison(run_id, run, p) for p in pairs]
        if comparisons:
            self._insert_comparisons(comparisons)
            self._insert_localize_rows(pairs, comparisons)
        points = [self._point(run_id, run, p, c) for p, c in zip(pairs, comparisons, strict=True)]
        # Boundaries in one batch for each series' first point of the run (a second point
        # of the same series is bounded after the first has moved its state).
        in_order, batched = [], set()
        for series, point in points:
            if series.last_started_at is None or run.started_at >= series.last_started_at:
                if series.id not in batched:
                    batched.add(series.id)
                    in_order.append((series, point))
        bounds = dict(
            zip(
                (point.comparison_id for _, point in in_order),
                point_boundaries(in_order, self.config),
                strict=True,
            )
        )
        started_at = bind_value(session, MetricValue.__table__.c.started_at, run.started_at)
        metric_rows = []
        for series, point in points:
            late = series.last_started_at is not None and run.started_at < series.last_started_at
            bound = None if late else bounds.get(point.comparison_id, {})
            metric_rows += self._judge(run, series, point, bound, started_at)
        if metric_rows:
            insert_plain_rows(
                self.session, self.statements, MetricValue.__table__, METRIC_COLUMNS, metric_rows
            )
        return Recorded(str(run.run_dir), run_id, run.status, len(run.pairs), new=True)

    def finish(self) -> None:
        """Series that got a point older than their newest are replayed whole."""
        for series_id in sorted(self.out_of_order):
            reevaluate_series(self.session, self.session.get(Series, series_id), self.config)

    def _describe(self, run: RunInput, testbed: Testbed) -> list[_Pair]:
        images = stage_images(run.manifest)
        labels = run.manifest.cases or {}
        pairs = []
        for pair in run.pairs:
            meta = pair.report.metadata
            fixture, replay = meta["fixture"], meta["replay"]
            case = keys.describe_case(meta, labels.get(pair.pair), str(run.run_dir))
            case_key = keys.case_key(case)
            series_key = keys.series_key(
                case_key, keys.engine_name(fixture), keys.engine_name(replay), testbed.key
            )
            rollout_build = keys.build_description(fixture, image_of(images, fixture))
            replay_build = keys.build_description(replay, image_of(images, replay))
            pairs.append(
                _Pair(
                    pair,
                    case,
                    case_key,
                    series_key,
                    rollout_build,
                    replay_build,
                    keys.digest(rollout_build),
                    keys.digest(replay_build),
                )
            )
        return pairs

    def _resolve(self, pairs: list[_Pair], testbed: Testbed) -> None:
        builds = {p.rollout_build_key: p.rollout_build for p in pairs} | {
            p.replay_build_key: p.replay_build for p in pairs
        }
        self._get_or_create(
            EngineBuild,
            {key: lambda b=b, key=key: EngineBuild(key=key, **b) for key, b in builds.items()},
        )
        self._get_or_create(Case, {p.case_key: lambda p=p: _new_case(p) for p in pairs})
        self._get_or_create(
            Series, {p.series_key: lambda p=p: self._new_series(p, testbed) for p in pairs}
        )

    def _get_or_create(self, model: type, makers: dict) -> None:
        missing = [key for key in makers if (model, key) not in self.cache]
        if not missing:
            return
        for found in self.session.scalars(select(model).where(model.key.in_(missing))):
            self.cache[(model, found.key)] = found
        created = []
        for key in missing:
            if (model, key) not in self.cache:
                self.cache[(model, key)] = makers[key]()
                created.append(self.cache[(model, key)])
        if created:
            self.session.add_all(created)
            self.session.flush()

    def _new_series(self, p: _Pair, testbed: Testbed) -> Series:
        meta = p.pair.report.metadata
        rollout, replay = keys.engine_name(meta["fixture"]), keys.engine_name(meta["replay"])
        return Series(
            key=p.series_key,
            case_id=self.cache[(Case, p.case_key)].id,
            rollout_engine=rollout,
            replay_engine=replay,
            testbed_id=testbed.id,
            label=keys.series_label(p.case, rollout, replay, testbed.name),
            detection_state={},
        )

    def _comparison(self, run_id: int, run: RunInput, p: _Pair) -> dict:
        report = p.pair.report
        fixture = report.metadata["fixture"]
        policy = report.policy
        return dict(
            run_id=run_id,
            series_id=self.cache[(Series, p.series_key)].id,
            started_at=run.started_at,
            pair=p.pair.pair,
            rollout_build_id=self.cache[(EngineBuild, p.rollout_build_key)].id,
            replay_build_id=self.cache[(EngineBuild, p.replay_build_key)].id,
            verdict=report.verdict,
            profile=str(policy.get("profile", "")),
            tau=finite_or_none(policy.get("tau")) or 0.0,
            tokens=int32_value(report.metrics.get("tokens") or 0, "metrics.tokens", p.pair),
            sequences=sequence_count(report),
            seed=(fixture.get("sampling") or {}).get("seed"),
            findings=report.diagnosis or [],
            violations=policy.get("violations") or [],
            details=self._details(p),
            workload=self._workload(run, p),
            **localize_columns(p.pair),
        )

    def _details(self, p: _Pair) -> dict:
        try:
            return comparison_details(
                p.pair.report, p.pair.tokens_path, self.tokenizers, p.pair.report_path
            )
        except SequencesUnreadable as error:  # in the transaction: nothing is recorded
            raise BadInput(f"{error} Nothing was recorded.") from None

    def _workload(self, run: RunInput, p: _Pair) -> dict | None:
        """The report's workload, with its agreement with the series' previous point: read
        from both nights' tokens.parquet only when their token digests differ."""
        measured = p.pair.report.workload
        if not measured:
            return None
        series_id = self.cache[(Series, p.series_key)].id
        previous = self._previous_point(series_id, run.started_at)
        workload = dict(measured)
        if previous is not None and (previous["workload"] or {}).get("tokens_digest"):
            workload["previous"] = previous["id"]
            if previous["workload"]["tokens_digest"] == measured.get("tokens_digest"):
                workload["agreement"] = {"same_tokens": True, "fraction_in_common": 1.0}
            else:
                before, now = read_tokens(previous["tokens_path"]), read_tokens(p.pair.tokens_path)
                if before is None or now is None:
                    missing = "the previous night's" if before is None else "this night's"
                    workload["agreement"] = {
                        "same_tokens": False,
                        "why": f"tokens differ; {missing} tokens.parquet is not on disk",
                    }
                else:
                    tau = finite_or_none(p.pair.report.policy.get("tau")) or 0.0
                    workload["agreement"] = agreement(before, now, tau)
        return workload

    def _previous_point(self, series_id: int, started_at) -> dict | None:
        latest = self.latest.get(series_id)
        if latest is not None and latest["started_at"] <= started_at:
            return latest
        row = self.session.execute(
            select(Comparison.id, Comparison.pair, Comparison.workload, Comparison.started_at,
                   Run.run_dir)
            .join(Run, Run.id == Comparison.run_id)
            .where(Comparison.series_id == series_id, Comparison.started_at < started_at)
            .order_by(Comparison.started_at.desc(), Comparison.id.desc())
            .limit(1)
        ).first()  # fmt: skip
        if row is None:
            return None
        return {
            "id": row.id,
            "started_at": row.started_at,
            "workload": row.workload,
            "tokens_path": Path(row.run_dir) / row.pair / TOKENS,
        }

    def _insert_localize_rows(self, pairs: list[_Pair], comparisons: list[dict]) -> None:
        """Each localized pair's boundaries (a few hundred rows for a 32-layer model)."""
        rows = []
        for p, comparison in zip(pairs, comparisons, strict=True):
            if p.pair.localize is None:
                continue
            head = (comparison["id"], comparison["series_id"])
            rows += [(*head, None, *row) for row in boundary_rows(p.pair.localize)]
        if rows:
            table = LocalizeBoundary.__table__
            started_at = bind_value(self.session, table.c.started_at, comparisons[0]["started_at"])
            rows = [(row[0], row[1], started_at, *row[3:]) for row in rows]
            insert_plain_rows(self.session, self.statements, table, LOCALIZE_COLUMNS, rows)

    def _point(self, run_id: int, run: RunInput, p: _Pair, comparison: dict):
        series = self.cache[(Series, p.series_key)]
        point = Point(
            comparison["id"],
            run_id,
            comparison["verdict"],
            comparison["tau"],
            run.status == "error",
            tracked_values(p.pair.report.metrics),
            comparison["violations"],
            failing_claims(
                p.pair.report.policy.get("failing_findings") or [], p.pair.report.diagnosis
            ),
            keys.segment_of(p.rollout_build, p.replay_build),
            same_token_values(comparison["workload"]),
        )
        if series.last_started_at is None or run.started_at >= series.last_started_at:
            self.latest[series.id] = {
                "id": comparison["id"],
                "started_at": run.started_at,
                "workload": comparison["workload"],
                "tokens_path": p.pair.tokens_path,
            }
        return series, point

    def _judge(
        self, run: RunInput, series: Series, point: Point, bounds, started_at
    ) -> list[tuple]:
        """Judge the new point against its series; the metric rows (METRIC_COLUMNS) to insert.
        A point older than the series' newest is left for finish() to replay."""
        values = point.values
        if bounds is None:
            self.out_of_order.add(series.id)
            results = {}
        else:
            results = judge_point(self.session, series, point, self.config, boundaries=bounds)
            series.last_started_at = run.started_at
        unevaluated = ("unevaluated", None, None, None, None, 0)
        rows = []
        for name, value in values.items():
            spec = metric_spec(name)
            fields = boundary_values(results[name]) if name in results else unevaluated
            rows.append(
                (
                    point.comparison_id,
                    series.id,
                    started_at,
                    name,
                    value,
                    spec.unit,
                    spec.better,
                    *fields,
                )
            )
        return rows

    def _insert_comparisons(self, comparisons: list[dict]) -> None:
        """Give the comparisons their ids first, then insert them as plain rows (COPY on
        PostgreSQL): a batched INSERT ... RETURNING was one long statement per run that
        psycopg re-parsed every time."""
        table = Comparison.__table__
        for comparison, comparison_id in zip(
            comparisons, new_ids(self.session, table, len(comparisons)), strict=True
        ):
            comparison["id"] = comparison_id
        started_at = bind_value(self.session, table.c.started_at, comparisons[0]["started_at"])
        rows = []
        for comparison in comparisons:
            values = comparison | {"started_at": started_at}
            values |= {name: json_dumps(comparison[name]) for name in COMPARISON_JSON}
            for name in ("localize", "workload"):  # none stays NULL, not JSON null
                if comparison[name] is not None:
                    values[name] = json_dumps(comparison[name])
            rows.append(tuple(values[name] for name in COMPARISON_COLUMNS))
        insert_plain_rows(self.session, self.statements, table, COMPARISON_COLUMNS, rows)

    def _testbed(self, testbed: dict) -> Testbed:
        key = keys.testbed_key(testbed)
        self._get_or_create(
            Testbed,
            {
                key: lambda: Testbed(
                    key=key,
                    name=keys.testbed_name(testbed),
                    host=testbed.get("host"),
                    cpu_model=testbed.get("cpu_model"),
                    cpu_count=testbed.get("cpu_count"),
                    gpu_model=testbed.get("gpu_model"),
                    gpu_count=int(testbed.get("gpu_count") or 0),
                )
            },
        )
        return self.cache[(Testbed, key)]


def _new_case(p: _Pair) -> Case:
    case = p.case
    label = case["label"] or case["model"].rstrip("/").split("/")[-1]
    fields = {k: v for k, v in case.items() if k != "label"}
    return Case(key=p.case_key, label=label, **fields)

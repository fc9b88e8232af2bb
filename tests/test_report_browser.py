"""The HTML report in a real headless Chromium (Debian's, driven by Playwright; no browser is
downloaded): it opens from disk with no console error and no network request, shows the
seeded regression with its attribution, filters, draws trend charts with hover, and shows
hostile strings from the data as text. Screenshots land in test-artifacts/."""

import copy
import os
import shutil
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from pipeline.history.collect import collect_run
from pipeline.history.database import open_history
from pipeline.history.record import record_runs
from pipeline.report.site import build_site
from tests import test_localize_history
from tests.synthetic_runs import BASE_METRICS, pair_report, write_run
from tests.test_localize_history import PAIR, localized_run

pytestmark = pytest.mark.browser
# The real binary, not Debian's /usr/bin wrapper script (it adds flags and noise).
CHROMIUM = next(
    (p for p in ("/usr/lib/chromium/chromium", shutil.which("chromium")) if p and Path(p).exists()),
    "/usr/lib/chromium/chromium",
)
ARTIFACTS = Path(os.environ.get("LPX_TEST_ARTIFACTS", Path(__file__).parents[1] / "test-artifacts"))
HOSTILE = "<script>alert('lpx')</script>"
NIGHTS = 14


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """14 nights: vllm->hf regresses at night 10 with vLLM 0.31 -> 0.32; vllm->megatron TP2
    stays flat; one error run; a sequence id that is a script tag."""
    root = tmp_path_factory.mktemp("history")
    start = datetime(2026, 3, 1, 3, 0)
    dirs = []
    for night in range(NIGHTS):
        upgraded = night >= 10
        version = "0.32.0" if upgraded else "0.31.0"
        hf = pair_report(
            rollout_version=version,
            metrics={
                m: BASE_METRICS[m] * (3 if upgraded else 1) * (1 + 0.01 * (night % 3))
                for m in ("mean_abs_diff", "k3", "max_abs_diff")
            },
            sequence_ids=["0-0", HOSTILE],
        )
        megatron = pair_report(
            replay="megatron", replay_version="0.16.1", rollout_version=version, tp=2
        )
        dirs.append(
            write_run(
                root / f"night-{night}",
                {"vllm-hf": hf, "vllm-megatron-tp2": megatron},
                started_at=start + timedelta(days=night),
                tokens=True,
            )
        )
    dirs.append(
        write_run(
            root / "broken",
            {"vllm-hf": pair_report(rollout_version="0.32.0")},
            started_at=start + timedelta(days=NIGHTS),
            stage_errors=["megatron: OOM"],
        )
    )
    url = f"sqlite:///{root / 'lpx.db'}"
    history = open_history(url)
    record_runs(history, [collect_run(d) for d in dirs])
    index = build_site(history, root / "site")
    history.dispose()
    return index.parent


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail("Debian's chromium is missing: ./scripts/setup installs it with apt-get")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                "--disable-quic",
            ],
        )
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    """A page that records console errors, page errors, dialogs and every request."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.problems, page.requests = [], []
    page.on("console", lambda m: m.type == "error" and page.problems.append(f"console: {m.text}"))
    page.on("pageerror", lambda e: page.problems.append(f"pageerror: {e}"))
    page.on("dialog", lambda d: (page.problems.append(f"dialog: {d.message}"), d.dismiss()))
    page.on("request", lambda r: page.requests.append(r.url))
    yield page
    context.close()


def open_page(page, path: Path):
    page.goto(path.as_uri())
    page.wait_for_load_state("load")


def shot(page, name: str):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def test_index_loads_from_disk_with_no_error_and_no_network(page, site):
    open_page(page, site / "index.html")
    shot(page, "report-index")
    assert page.problems == []
    assert page.requests and all(url.startswith("file://") for url in page.requests), page.requests
    assert page.locator("#count-regressions").inner_text() != "0"
    assert page.locator("#count-errors").inner_text() == "1"


def test_regressions_table_lists_the_seeded_regression_with_its_attribution(page, site):
    open_page(page, site / "index.html")
    rows = page.locator("table.alerts").first.locator("tbody tr")
    texts = [rows.nth(i).inner_text() for i in range(rows.count())]
    regression = [t for t in texts if "regression" in t and "mean_abs_diff" in t]
    assert len(regression) == 1, texts
    row = regression[0]
    assert "vllm 0.31.0 -> 0.32.0" in row  # what changed
    assert "run 10" in row and "run 11" in row  # last good -> first bad (night 9 -> night 10)
    assert "×3" in row  # the factor
    assert not any("megatron" in t for t in texts)  # the flat series raised nothing


def test_filters_change_what_is_shown(page, site):
    open_page(page, site / "index.html")
    series_rows = page.locator("table.series-table tbody tr")
    assert series_rows.count() == 2
    visible = lambda: [r for r in range(series_rows.count()) if series_rows.nth(r).is_visible()]  # noqa: E731
    assert len(visible()) == 2
    page.select_option("select[data-filter=engine]", "megatron")
    assert len(visible()) == 1 and "megatron" in series_rows.nth(visible()[0]).inner_text()
    assert not page.locator("table.alerts").first.locator("tbody tr").first.is_visible()
    page.select_option("select[data-filter=engine]", "")
    page.select_option("select[data-filter=metric]", "k3")
    shown = page.locator(".spark.shown")
    assert shown.count() == 2 and all(
        shown.nth(i).get_attribute("data-metric") == "k3" for i in range(2)
    )
    assert page.locator(".matrix.shown").first.get_attribute("data-metric") == "k3"
    shot(page, "report-index-filtered")
    assert page.problems == []


def test_trend_chart_renders_points_band_and_markers_with_hover(page, site):
    open_page(page, site / "series" / "1.html")
    chart = page.locator(".chart[data-chart=mean_abs_diff]")
    page.select_option("select[data-filter=metric]", "mean_abs_diff")
    assert chart.locator("circle").count() == NIGHTS + 1  # the error run's point too
    assert chart.locator("circle.bad").count() == 4  # nights 10-13 outside the band
    assert chart.locator("polygon.band").count() == 1
    assert chart.locator("line.vc").count() == 1  # the vLLM upgrade
    chart.locator("circle").nth(11).hover()
    tooltip = page.locator("#tooltip")
    assert tooltip.is_visible()
    text = tooltip.inner_text()
    assert (
        "mean_abs_diff" in text
        and "vllm 0.32.0" in text
        and "run 12" in text
        and "regression" in text
    )
    shot(page, "report-series")
    assert page.problems == []


def test_hostile_sequence_ids_render_as_text(page, site):
    open_page(page, site / "runs" / "1.html")
    cells = page.locator("td.seq", has_text=HOSTILE)
    assert cells.count() >= 1
    assert cells.first.inner_text() == HOSTILE
    row = cells.first.locator("xpath=..").inner_text().split("\t")
    assert row[1:4] == ["4", "completion", "18"]  # integers as integers
    heat_labels = page.locator(".heatmap text")
    assert heat_labels.count() >= 2
    assert page.locator("script:not([src]):not([type='application/json'])").count() == 0
    shot(page, "report-run")
    assert page.problems == []  # no alert() dialog, no error


def test_every_page_opens_without_errors_and_stays_under_2_mb(page, site):
    pages = sorted(site.rglob("*.html"))
    assert len(pages) == 1 + 2 + NIGHTS + 1
    for path in pages:
        assert path.stat().st_size < 2_000_000, path
    for path in (site / "runs" / f"{NIGHTS + 1}.html", site / "series" / "2.html"):
        open_page(page, path)
    assert page.problems == []
    assert all(url.startswith("file://") for url in page.requests)


# -- localization: a pair's localize.json on its run page, the tracked boundary on its series


localize_result = test_localize_history.localize_result  # the session's real localize.json


def clean_variant(result: dict) -> dict:
    """The same boundaries, every ratio 1e5 times smaller: nothing beyond the floor."""
    clean = copy.deepcopy(result)
    for row in clean["boundaries"]:
        row["ratio"] *= 1e-5
        row["beyond"] = False
    clean.update(verdict="clean", first=None, verification=None)
    return clean


@pytest.fixture(scope="module")
def localize_site(tmp_path_factory, localize_result) -> Path:
    """One series over 3 nights: a pass (no localize), a failing pair localized clean on
    vLLM 0.31, then vLLM 0.32 and layer 1's MLP output verified beyond the floor."""
    root = tmp_path_factory.mktemp("localize-history")
    start = datetime(2026, 3, 1, 3, 0)
    dirs = [
        write_run(root / "pass", {PAIR: pair_report(rollout_version="0.31.0")}, started_at=start)
    ]
    dirs.append(
        localized_run(root, clean_variant(localize_result), day=1, rollout_version="0.31.0")
    )
    dirs.append(localized_run(root, localize_result, day=2, rollout_version="0.32.0"))
    history = open_history(f"sqlite:///{root / 'lpx.db'}")
    record_runs(history, [collect_run(d) for d in dirs])
    index = build_site(history, root / "site")
    history.dispose()
    return index.parent


def test_run_page_shows_the_localize_verdict_chart_and_boundaries_beyond(
    page, localize_site, localize_result
):
    open_page(page, localize_site / "runs" / "3.html")
    section = page.locator("section.localize")
    assert section.count() == 1 and section.is_visible()
    first = localize_result["first"]
    verdict = section.locator(".localize-verdict").inner_text()
    assert verdict.startswith("verified") and first["boundary"] in verdict
    assert section.locator(".localize-ratio").inner_text() == f"{first['ratio']:.4g}"
    assert "verified by swapping" in section.locator(".localize-verification").inner_text()
    chart = section.locator(".localize-chart svg")
    assert chart.is_visible() and chart.bounding_box()["width"] > 300
    boundaries = localize_result["boundaries"]
    assert chart.locator("circle").count() == len(boundaries) + 1  # + the first's ring
    assert chart.locator("circle.first-boundary").count() == 1
    beyond = [row for row in boundaries if row["beyond"]]
    rows = section.locator("table.localize-beyond tbody tr")
    assert rows.count() == len(beyond) >= 1
    for i, want in enumerate(beyond):
        cells = rows.nth(i).locator("td").all_inner_texts()
        assert cells[0] == want["boundary"] and cells[2] == want["kind"]
        numbers = [want["drift"]["max"], want["drift"]["rms"], want["floor"]["max"]]
        numbers += [want["floor"]["rms"], want["ratio"]]
        assert cells[3:] == [f"{x:.4g}" for x in numbers]
    shot(page, "report-run-localize")
    assert page.problems == []


def test_series_page_names_the_first_run_beyond_the_floor_and_charts_the_boundary(
    page, localize_site, localize_result
):
    open_page(page, localize_site / "series" / "1.html")
    first = page.locator(".localize-first-beyond").inner_text()
    ratio = localize_result["first"]["ratio"]
    assert "run 3" in first and "vllm 0.32.0" in first and "layers.1.mlp_out" in first
    assert f"{ratio:.4g}" in first
    chart = page.locator(".localize-trend .chart")
    assert chart.is_visible()
    assert chart.locator("circle").count() == 2  # the two localized nights
    assert chart.locator("circle.bad").count() == 1  # only vLLM 0.32 went beyond
    chart.locator("circle.bad").hover()
    tip = page.locator("#tooltip").inner_text()
    mantissa, exponent = f"{ratio:.3e}".split("e")  # lpx.js: toExponential(3), 1.811e+4
    assert f"= {mantissa}e{int(exponent):+d} (beyond floor)" in tip, tip
    assert "run 3" in tip and "vllm 0.32.0" in tip
    rows = page.locator("table.localize-runs tbody tr").all_inner_texts()
    assert len(rows) == 2 and "run 3" in rows[0] and "run 2" in rows[1]
    assert f"{ratio * 1e-5:.4g}×" in rows[1]
    shot(page, "report-series-localize")
    assert page.problems == []

"""The HTML report in a real headless Chromium (Debian's, driven by Playwright; no browser is
downloaded): it opens from disk with no console error and no network request, shows the
seeded regression with its attribution, filters, draws trend charts with hover, and shows
hostile strings from the data as text. Screenshots land in test-artifacts/."""

import copy
import os
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from pipeline.history.collect import collect_run
from pipeline.history.database import open_history
from pipeline.history.record import record_runs
from pipeline.report.site import build_site
from support.chromium import CHROMIUM, headless_chromium, new_page
from support.synthetic_runs import BASE_METRICS, claimed_history, pair_report, write_run
from tests.localize import test_localize_history
from tests.localize.test_localize_history import PAIR, localized_run

pytestmark = pytest.mark.browser
ARTIFACTS = Path(os.environ.get("LPX_TEST_ARTIFACTS", Path(__file__).parents[2] / "test-artifacts"))
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
    with headless_chromium() as launched:
        yield launched


@pytest.fixture
def page(browser):
    """A page that records console errors, page errors, dialogs and every request."""
    context, page = new_page(browser)
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


# -- claims: each finding's status (verified, plausible, unexplained, ruled out) wherever it
# is shown, so a guess never reads as the established cause


@pytest.fixture(scope="module")
def claims_site(tmp_path_factory) -> Path:
    """claimed_history: run 3 fails on vllm-hf (verified temperature, plausible top_k, ruled
    out token_shift, unexplained drift) and on vllm-fsdp (stale_weights with no status)."""
    root = tmp_path_factory.mktemp("claims-history")
    history = open_history(f"sqlite:///{root / 'lpx.db'}")
    record_runs(history, [collect_run(d) for d in claimed_history(root)])
    index = build_site(history, root / "site")
    history.dispose()
    return index.parent


def claim_cells(cell) -> list[tuple[str, str, str]]:
    """(status, badge text, cause shown) of each finding listed in a table cell."""
    items = cell.locator(".finding-claim")
    out = []
    for i in range(items.count()):
        item = items.nth(i)
        cause = item.locator("code")
        out.append(
            (
                item.get_attribute("data-status"),
                item.locator(".claim").inner_text(),
                cause.inner_text() if cause.count() else "",
            )
        )
    return out


VERIFIED_HF = [
    ("verified", "verified", "temperature"),
    ("plausible", "plausible", "top_k"),
    ("ruled_out", "ruled out", "token_shift"),
    ("unexplained", "unexplained", ""),
]
GUESSED_FSDP = [("plausible", "plausible", "stale_weights")]


def test_run_page_marks_each_finding_with_its_status_and_words_a_guess_as_one(page, claims_site):
    open_page(page, claims_site / "runs" / "3.html")
    hf = page.locator("section.comparison", has_text="vllm-hf")
    findings = hf.locator("li.finding")
    assert [findings.nth(i).get_attribute("data-status") for i in range(4)] == [
        "verified",
        "plausible",
        "ruled_out",
        "unexplained",
    ]
    headlines = hf.locator(".claim-headline").all_inner_texts()
    assert headlines == [
        "temperature, verified by re-scoring",
        "plausible, not reproduced: top_k",
        "ruled out by re-scoring: token_shift",
        "unexplained: no re-scored cause reproduces this drift",
    ]
    badges = hf.locator("li.finding > .claim")
    assert badges.all_inner_texts() == ["verified", "plausible", "ruled out", "unexplained"]
    titles = [badges.nth(i).get_attribute("title") for i in range(4)]
    assert titles[0].startswith("Verified: lpx re-scored these sequences")
    assert titles[1].startswith("Plausible: the drift's signatures fit this cause, but no")
    assert "lpx diagnose FIXTURE REPLAY --model DIR" in titles[1] and "--no-verify" in titles[1]
    assert titles[2].startswith("Ruled out: re-scoring with this cause committed did not")
    assert titles[3].startswith("Unexplained: no cause lpx knows explains this drift.")
    # the status is apart from the severity; a ruled-out finding is not shown as a fault
    severities = [findings.nth(i).locator(".status").all_inner_texts() for i in range(4)]
    assert severities == [["fault"], ["fault"], [], ["fault"]]
    assert (
        "lpx compare FIXTURE REPLAY --model DIR"
        in findings.nth(1).locator(".claim-next").inner_text()
    )
    assert findings.nth(0).locator(".residuals").inner_text() == (
        "re-scored: mean |d| 0.21 -> 0.002 (floor 0.003)"
    )
    assert hf.locator(".verification").inner_text() == (
        "Verification: findings re-scored with /models/tiny."
    )
    # 40 sequences: 12 named, the rest counted; no position for a finding that has none
    assert findings.nth(3).locator(".where").inner_text().endswith("11-0 and 28 more")

    fsdp = page.locator("section.comparison", has_text="vllm-fsdp")
    guess = fsdp.locator("li.finding")
    assert guess.count() == 1 and guess.get_attribute("data-status") == "plausible"
    assert (
        guess.locator(".claim-headline").inner_text() == "plausible, not reproduced: stale_weights"
    )
    assert guess.locator(".where").inner_text() == "sequences 7-1 · from position 0 of 7-1"
    assert "--weights-store STORE" in guess.locator(".claim-next").inner_text()
    assert fsdp.locator(".verification").count() == 0  # an older report says nothing of it
    assert "7-1from" not in page.locator("body").inner_text()
    shot(page, "report-run-claims")
    assert page.problems == []


def test_status_badges_differ_in_more_than_colour(page, claims_site):
    open_page(page, claims_site / "runs" / "3.html")
    looks = {}
    for status in ("verified", "plausible", "ruled_out", "unexplained"):
        badge = page.locator(f"li.finding[data-status={status}] > .claim").first
        looks[status] = badge.evaluate(
            "e => { const s = getComputedStyle(e); return [s.backgroundColor, s.color, "
            "s.borderTopStyle, s.fontStyle, s.fontWeight].join(' ') }"
        )
    assert len(set(looks.values())) == 4, looks
    assert "dashed" in looks["plausible"] and "italic" in looks["plausible"]
    assert "double" in looks["unexplained"] and "solid" in looks["verified"]


def test_index_lists_causes_with_their_status_in_regressions_and_changes(page, claims_site):
    open_page(page, claims_site / "index.html")
    alerts = page.locator("table.alerts").first.locator("tbody tr")
    assert alerts.count() == 2
    by_pair = {alerts.nth(i).locator("td").nth(2).inner_text(): alerts.nth(i) for i in range(2)}
    hf, fsdp = by_pair["vllm → hf"], by_pair["vllm → fsdp"]
    assert claim_cells(hf.locator("td.causes")) == VERIFIED_HF
    assert claim_cells(fsdp.locator("td.causes")) == GUESSED_FSDP
    assert hf.locator("td.causes").inner_text() == (
        "temperature verified, top_k plausible, token_shift ruled out, unexplained"
    )
    # the rule that fired names the failing causes with their statuses too
    assert hf.locator("td.rule").inner_text() == (
        "policy: max_abs_diff 0.5 > 0.1; findings: temperature (verified), top_k (plausible), "
        "unexplained"
    )
    assert fsdp.locator("td.rule").inner_text().endswith("findings: stale_weights (plausible)")
    changes = page.locator("table.changes tbody tr")
    assert changes.count() == 2
    cells = sorted(claim_cells(changes.nth(i).locator("td.causes")) for i in range(2))
    assert cells == sorted([VERIFIED_HF, GUESSED_FSDP])
    title = fsdp.locator(".claim").get_attribute("title")
    assert title.startswith("Plausible:") and "--weights-store STORE" in title
    shot(page, "report-index-claims")
    assert page.problems == []


def test_series_page_lists_each_points_findings_with_their_status(page, claims_site):
    shown = {}
    for series_id in (1, 2):
        open_page(page, claims_site / "series" / f"{series_id}.html")
        rows = page.locator("table.points tbody tr")
        assert rows.count() == 3
        assert rows.nth(0).locator("td").first.inner_text() == "run 3"
        shown[page.locator("h1").inner_text()] = claim_cells(rows.nth(0).locator("td.causes"))
        assert [rows.nth(i).locator("td.causes").inner_text() for i in (1, 2)] == ["–", "–"]
        if series_id == 2:
            shot(page, "report-series-claims")
        assert page.problems == []
    assert sorted(shown.values()) == sorted([VERIFIED_HF, GUESSED_FSDP])
    assert any("hf" in label and cells == VERIFIED_HF for label, cells in shown.items())

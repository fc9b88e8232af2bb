"""`lpx report`: render the history into a static site that opens from disk.

index.html, one page per series and per run, and one CSS + one JS asset; all data is
inlined (JSON in <script type="application/json">), nothing is fetched. The site is built
in a staging directory and swapped in whole, so a reader never sees half a report, and an
existing directory is replaced only if lpx wrote it (it holds the .lpx-report marker).
"""

from __future__ import annotations

import os
import shutil
from datetime import UTC, datetime
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from markupsafe import Markup

from pipeline.errors import BadInput
from pipeline.history.database import History, describe
from pipeline.progress import progress_bar
from pipeline.report.data import load_history, run_comparisons
from pipeline.report.pages import index_page, run_page, series_page

MARKER = ".lpx-report"
ASSETS = ("lpx.css", "lpx.js")


def build_site(history: History, out_dir: Path) -> Path:
    """Render every page; return the path of index.html."""
    import pipeline.templates

    out_dir = Path(out_dir)
    _check_replaceable(out_dir)
    templates = Path(pipeline.templates.__file__).parent
    env = Environment(
        loader=FileSystemLoader(templates),
        autoescape=select_autoescape(["html"], default=True),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(num=format_number, verdict=verdict_badge, status=status_badge)
    common = {
        "generated_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "database": describe(history.url),
    }
    staging = out_dir.with_name(f".{out_dir.name}.building-{os.getpid()}")
    if staging.exists():
        shutil.rmtree(staging)
    (staging / "series").mkdir(parents=True)
    (staging / "runs").mkdir()
    (staging / "assets").mkdir()
    try:
        with history.read() as session:
            data = load_history(session)
            _render(
                env, "index.html", staging / "index.html", {**common, "root": ""}, index_page(data)
            )
            for series in progress_bar(list(data.series.values()), "series pages", "page"):
                if series.points:
                    _render(
                        env,
                        "series.html",
                        staging / "series" / f"{series.id}.html",
                        {**common, "root": "../"},
                        series_page(data, series),
                    )
            for run_id in progress_bar(data.run_order, "run pages", "page"):
                page = run_page(data, run_id, run_comparisons(session, run_id))
                _render(
                    env,
                    "run.html",
                    staging / "runs" / f"{run_id}.html",
                    {**common, "root": "../"},
                    page,
                )
        for asset in ASSETS:
            shutil.copyfile(templates / "assets" / asset, staging / "assets" / asset)
        (staging / MARKER).write_text("written by lpx report; replaced whole by the next one\n")
        _swap_in(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir / "index.html"


def format_number(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def verdict_badge(value) -> Markup:
    return Markup('<span class="badge {0}">{1}</span>').format(value, str(value).upper())


def status_badge(value) -> Markup:
    text = str(value or "–").replace("_", " ")
    return Markup('<span class="status {0}">{1}</span>').format(value or "none", text)


def _render(env: Environment, template: str, path: Path, common: dict, page: dict) -> None:
    path.write_text(env.get_template(template).render(**common, **page))


def _check_replaceable(out_dir: Path) -> None:
    if out_dir.exists() and not (out_dir.is_dir() and (out_dir / MARKER).is_file()):
        if out_dir.is_dir() and not any(out_dir.iterdir()):
            return
        raise BadInput(
            f"--out {out_dir}: exists and is not an lpx report (no {MARKER} in it); lpx replaces "
            "only reports it wrote. Choose a new or empty directory."
        )


def _swap_in(staging: Path, out_dir: Path) -> None:
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    if out_dir.exists():
        out_dir.rename(old)
    staging.rename(out_dir)
    if old.exists():
        shutil.rmtree(old)

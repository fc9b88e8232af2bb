"""`lpx report`: render the history into a static site that opens from disk.

index.html, one page per series and per run, and one CSS + one JS asset; all data is
inlined (JSON in <script type="application/json">), nothing is fetched. The site is built
in a staging directory from one snapshot of the history (a record committing meanwhile is
in the next report, never half in this one) and swapped in whole, in one atomic exchange
where the file system has one, so a reader never sees half a report, nor no report. An
existing directory is replaced only if lpx wrote it (it holds the .lpx-report marker).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from markupsafe import Markup, escape

from pipeline.errors import BadInput
from pipeline.history.claims import Claim
from pipeline.history.database import History, describe
from pipeline.history.queries import run_comparisons, run_localize_rows
from pipeline.progress import progress_bar
from pipeline.report.data import load_history
from pipeline.report.pages import index_page, run_page, series_page

if TYPE_CHECKING:  # the report reads the history through history/queries.py only
    from sqlalchemy.orm import Session

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
    env.filters.update(
        num=format_number,
        verdict=verdict_badge,
        status=status_badge,
        claim=claim_badge,
        claims=claim_list,
        code_spans=code_spans,
        script_json=script_json,
    )
    common = {
        "generated_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "database": describe(history.url),
    }
    staging = out_dir.with_name(f".{out_dir.name}.building-{os.getpid()}")
    try:
        # Made inside the try: a SIGTERM between two of these mkdirs left the staging
        # directory behind (seen once in tests/cli/test_interrupts.py on a loaded machine).
        if staging.exists():
            shutil.rmtree(staging)
        for part in ("series", "runs", "assets"):
            (staging / part).mkdir(parents=True)
        with snapshot(history) as session:
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
                comparisons = run_comparisons(session, run_id)
                rows = run_localize_rows(session, comparisons)
                page = run_page(data, run_id, comparisons, rows)
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


@contextmanager
def snapshot(history: History) -> Iterator[Session]:
    """A read session in which every query sees the same committed history. SQLite's read
    transaction is one snapshot already; PostgreSQL's default (read committed) takes a new
    one per statement, so a record committing between two queries would give a render runs
    without their comparisons, or comparisons of series it never loaded."""
    with history.read() as session:
        if session.get_bind().dialect.name == "postgresql":
            session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
        yield session


def script_json(value) -> Markup:
    """A page's inline data (`<script type="application/json">`) through orjson: Jinja's
    `tojson` (the standard encoder) took 4.4 of a year's 16 s report, on the run and series
    pages' data. Compact JSON, keys sorted, made safe inside <script> as Jinja makes it (<,
    >, & and ' escaped); a NaN or infinity, which JSON.parse refuses, is written null."""
    import orjson

    text = orjson.dumps(
        value, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS, default=str
    ).decode()
    for raw, safe in HTML_UNSAFE:
        text = text.replace(raw, safe)
    return Markup(text)


HTML_UNSAFE = (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("'", "\\u0027"))


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


def claim_badge(claim: Claim) -> Markup:
    """A finding's status as a badge whose text is the status (readable without colour) and
    whose tooltip says what it means and how to settle it."""
    return Markup('<span class="claim {0}" title="{1}">{2}</span>').format(
        claim.status, claim.meaning, claim.label
    )


def claim_list(claims: list[Claim]) -> Markup:
    """`stale_weights [plausible], token_shift [ruled out]`: a cause is never listed bare,
    where it would read as established."""
    if not claims:
        return Markup("–")
    items = []
    for claim in claims:
        cause = (
            "" if claim.cause == claim.status else Markup("<code>{0}</code> ").format(claim.cause)
        )
        items.append(
            Markup('<span class="finding-claim" data-status="{0}">{1}{2}</span>').format(
                claim.status, cause, claim_badge(claim)
            )
        )
    return Markup(", ").join(items)


def code_spans(text: str) -> Markup:
    """Text whose `backquoted` spans are commands, shown as code; the rest escaped."""
    parts = str(text).split("`")
    return Markup("").join(
        Markup("<code>{0}</code>").format(part) if i % 2 else escape(part)
        for i, part in enumerate(parts)
    )


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
    """Put the new site where the old one was in one step: a reader that opens --out at any
    moment finds the whole old site or the whole new one (never none, never a mix)."""
    try:
        staging.rename(out_dir)  # the first report (or an empty directory): atomic as is
        return
    except OSError as error:
        if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    if _exchange(staging, out_dir):
        shutil.rmtree(staging)  # the old site, now under the staging name
        return
    # No atomic exchange here (an old kernel, a network file system): two renames, with a
    # moment between them when --out is missing.
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    out_dir.rename(old)
    staging.rename(out_dir)
    shutil.rmtree(old)


def _exchange(first: Path, second: Path) -> bool:
    """Swap two directories atomically (Linux renameat2 RENAME_EXCHANGE, macOS renamex_np
    RENAME_SWAP); False where the system or file system cannot."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    paths = (os.fsencode(first), os.fsencode(second))
    if sys.platform == "linux" and hasattr(libc, "renameat2"):
        at_cwd, rename_exchange = -100, 2
        done = libc.renameat2(at_cwd, paths[0], at_cwd, paths[1], rename_exchange)
    elif sys.platform == "darwin" and hasattr(libc, "renamex_np"):
        done = libc.renamex_np(paths[0], paths[1], 2)  # RENAME_SWAP
    else:
        return False
    if done == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(second))

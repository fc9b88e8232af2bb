"""Debian's Chromium, headless, driven by Playwright: no browser is ever downloaded, and the
page can reach nothing but the files it opens."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# The real binary, not Debian's /usr/bin wrapper script (it adds flags and noise).
CHROMIUM = next(
    (p for p in ("/usr/lib/chromium/chromium", shutil.which("chromium")) if p and Path(p).exists()),
    "/usr/lib/chromium/chromium",
)
QUIET = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


@contextmanager
def headless_chromium() -> Iterator:
    """A launched Playwright browser; raises FileNotFoundError naming the binary when
    Debian's chromium is not installed (scripts/setup installs it with apt-get)."""
    if not Path(CHROMIUM).exists():
        raise FileNotFoundError(
            f"{CHROMIUM}: Debian's chromium is missing; ./scripts/setup installs it"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=QUIET)
        try:
            yield browser
        finally:
            browser.close()


def new_page(browser, width: int = 1400, height: int = 1000):
    """(context, page): the page records console errors, page errors and dialogs in
    ``page.problems`` and every request in ``page.requests``. Close the context when done."""
    context = browser.new_context(viewport={"width": width, "height": height})
    page = context.new_page()
    page.problems, page.requests = [], []
    page.on("console", lambda m: m.type == "error" and page.problems.append(f"console: {m.text}"))
    page.on("pageerror", lambda e: page.problems.append(f"pageerror: {e}"))
    page.on("dialog", lambda d: (page.problems.append(f"dialog: {d.message}"), d.dismiss()))
    page.on("request", lambda r: page.requests.append(r.url))
    return context, page


def open_page(browser, path: Path, width: int = 1400, height: int = 1000):
    """``new_page`` at ``path`` (a file) once it has loaded."""
    context, page = new_page(browser, width, height)
    page.goto(Path(path).resolve().as_uri())
    page.wait_for_load_state("load")
    return context, page

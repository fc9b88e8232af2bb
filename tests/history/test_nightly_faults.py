"""Faults in the nightly, each against the real parts (issue 22): PostgreSQL killed or
restarted mid-record, two nightlies recording into one history at once, the report site
rendered while a record runs. docs/orchestrator.md (Faults) says what each does and how to
recover. The Docker faults (the daemon restarted mid-run, a stage container killed for memory)
are in tests/project/test_containers.py, on the images it builds.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import psutil
import pytest
import yaml
from pipeline.db.models import Comparison, Run
from sqlalchemy import func, select

from pipeline.history.database import WRITE_LOCK_ID, open_history
from support.helpers import count, run_lpx
from support.synthetic_runs import nightly_history

PAIRS = tuple(f"pair-{i:02d}" for i in range(20))


def lpx(*args, **kwargs) -> subprocess.Popen:
    """`lpx ARGS` as its own process, the way a nightly's shell starts it."""
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def finish(process: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


def one_error_line(stderr: str) -> str:
    """The contract for a failed command: exactly one `Error:` line, and it is the last."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("Error:")]
    assert len(errors) == 1 and errors[0] == lines[-1], stderr
    assert "Traceback" not in stderr, stderr
    return errors[0]


def history_of(url: str) -> list[dict]:
    """`lpx history --json`: the runs the history holds."""
    result = run_lpx("history", "--db", url, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# --- PostgreSQL killed or restarted while `lpx record` writes --------------------------------


@pytest.fixture(scope="module")
def own_postgres(tmp_path_factory):
    """A PostgreSQL 16 server of this module's own (pgserver's binaries): killing it touches
    no other test's database."""
    import pgserver

    server = pgserver.get_server(tmp_path_factory.mktemp("pg-faults"), cleanup_mode="delete")
    yield server
    if not server.get_postmaster_info().is_running():
        server.ensure_postgres_running()  # cleanup stops it the normal way
    server.cleanup()


@pytest.fixture(scope="module")
def big_import(tmp_path_factory) -> list[Path]:
    """50 nightlies of 20 pairs each: 1,000 comparisons, a write transaction of a second or
    more, long enough to be caught in the middle."""
    return nightly_history(tmp_path_factory.mktemp("import"), 50, pairs=PAIRS)


def new_database(server, name: str) -> str:
    server.psql(f"DROP DATABASE IF EXISTS {name};")
    server.psql(f"CREATE DATABASE {name};")
    base, query = server.get_uri().split("?", 1)
    return (
        f"{base.rsplit('/', 1)[0].replace('postgresql://', 'postgresql+psycopg://')}/{name}?{query}"
    )


def wait_for_writing(server, database: str, process: subprocess.Popen) -> None:
    """Until `lpx record` holds the history's write lock and has written rows (its
    transaction has an id): the moment to pull the server away."""
    import psycopg

    query = (
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE l.locktype = 'advisory' AND l.objid = %s AND l.granted "
        "AND a.datname = %s AND a.backend_xid IS NOT NULL"
    )
    with psycopg.connect(server.get_uri(), autocommit=True) as connection:
        while process.poll() is None:
            if connection.execute(query, (WRITE_LOCK_ID, database)).fetchone()[0]:
                return
            time.sleep(0.005)
    pytest.fail(f"lpx record ended before its write was seen: {process.communicate()}")


def stop_postgres(server, how: str) -> None:
    """killed: an immediate shutdown (SIGQUIT: every backend dies, crash recovery on the next
    start); restarted: a fast shutdown (SIGINT: sessions are terminated), as a restart does."""
    process = psutil.Process(server.get_pid())
    process.send_signal(signal.SIGQUIT if how == "killed" else signal.SIGINT)
    process.wait(timeout=60)


@pytest.mark.parametrize("how", ["killed", "restarted"])
def test_postgres_going_away_mid_record_keeps_nothing_and_a_rerun_records_once(
    own_postgres, big_import, how
):
    url = new_database(own_postgres, f"faults_{how}")
    open_history(url).dispose()  # migrated first: the only writer below is the record
    record = lpx("record", *big_import, "--db", url)
    wait_for_writing(own_postgres, f"faults_{how}", record)
    stop_postgres(own_postgres, how)
    code, out, err = finish(record)
    assert code == 2, (out, err)
    line = one_error_line(err)
    assert "lost the history database" in line and "none of it is kept" in line, line
    assert "recorded:" not in out

    own_postgres.ensure_postgres_running()
    assert count(url, Run) == 0  # the transaction rolled back whole

    code, out, err = finish(lpx("record", *big_import, "--db", url))
    assert code == 0, err
    assert out.count("recorded: run") == len(big_import)
    assert count(url, Run) == len(big_import)
    assert count(url, Comparison) == len(big_import) * len(PAIRS)


# --- the report site rendered while records commit ------------------------------------------

SITE_PARTS = {"index.html", ".lpx-report", "assets", "runs", "series"}


def read_whole_site(site: Path) -> int:
    """Read the site as a browser would: index.html, then every page it links to. Each must
    be there and whole (the old site's or the new one's: a new one holds every old page).
    Returns the number of run pages the index's site holds."""
    names = set(os.listdir(site))
    assert SITE_PARTS <= names, f"a reader saw half a site: {sorted(names)}"
    index = (site / "index.html").read_text()
    assert index.rstrip().endswith("</html>"), "a reader saw half of index.html"
    for link in set(re.findall(r'href="((?:runs|series)/\d+\.html)"', index)):
        assert (site / link).read_text().rstrip().endswith("</html>"), link
    return len(os.listdir(site / "runs"))


def test_a_render_reads_one_snapshot_while_a_record_commits(history_url, tmp_path):
    """Every query of a render sees the history as of its first: a record committing in the
    middle (here, between two counts) is in the next render, never half in this one."""
    from pipeline.report.site import snapshot

    assert finish(lpx("record", *nightly_history(tmp_path / "a", 2), "--db", history_url))[0] == 0
    later = nightly_history(tmp_path / "b", 2, start=datetime(2026, 3, 1))
    history = open_history(history_url)
    try:
        with snapshot(history) as session:
            before = session.scalar(select(func.count()).select_from(Run))
            assert finish(lpx("record", *later, "--db", history_url))[0] == 0
            assert session.scalar(select(func.count()).select_from(Comparison)) == before
            assert session.scalar(select(func.count()).select_from(Run)) == before == 2
    finally:
        history.dispose()
    assert count(history_url, Run) == 4


def test_the_site_rendered_while_records_commit_is_always_the_old_or_the_new(
    own_postgres, tmp_path
):
    """Batches of runs recorded one commit each, `lpx report` rendering over and over into
    one site, and a reader going through that site the whole time (on PostgreSQL, the
    team's backend; the snapshot test above holds on both)."""
    history_url = new_database(own_postgres, "site")
    seed = nightly_history(tmp_path / "seed", 6, pairs=PAIRS[:6])
    assert finish(lpx("record", *seed, "--db", history_url))[0] == 0
    site = tmp_path / "site"
    assert finish(lpx("report", "--db", history_url, "--out", site))[0] == 0
    batches = [
        nightly_history(
            tmp_path / f"batch-{k}",
            3,
            start=datetime(2026, 2, 1 + 5 * k, 3, 0),
            pairs=tuple(f"batch-{k}-{name}" for name in PAIRS[:4]),  # new series each batch
            seed=k,
        )
        for k in range(2)
    ]
    writer = threading.Thread(
        target=lambda: [finish(lpx("record", *batch, "--db", history_url)) for batch in batches]
    )
    renders, reads, problems = [], [0], []
    rendering = threading.Event()
    rendering.set()

    def read_all_the_time():
        while rendering.is_set():
            try:
                read_whole_site(site)
                reads[0] += 1
            except (AssertionError, OSError) as error:
                problems.append(repr(error))
            time.sleep(0.005)

    reader = threading.Thread(target=read_all_the_time)
    writer.start()
    reader.start()
    try:
        while writer.is_alive():
            renders.append(finish(lpx("report", "--db", history_url, "--out", site)))
        renders.append(finish(lpx("report", "--db", history_url, "--out", site)))
    finally:
        rendering.clear()
        writer.join()
        reader.join()
    failed = [render for render in renders if render[0] != 0]
    assert failed == [], failed  # every render while records committed: exit 0
    assert problems == [], problems[:5]
    assert reads[0] > 10 and len(renders) >= 2, (reads, len(renders))
    assert read_whole_site(site) == 6 + 2 * 3  # the last render holds every run
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# --- two nightlies recording into one history at once --------------------------------------


def small_plan(path: Path, model: Path, db: str, site: Path, **changes) -> Path:
    """A plan of the smallest real nightly: the tiny model, an HF rollout, one HF replay."""
    plan = {
        "version": 1,
        "name": path.stem,
        "model": str(model),
        "sampling": {"max_tokens": 4, "samples_per_prompt": 1},
        "rollout": {"engine": "hf", "dtype": "fp32", "image": "lpx-train:cpu"},
        "replays": [{"name": "fp32", "engine": "hf", "dtype": "fp32", "image": "lpx-train:cpu"}],
        "diagnose": False,
        "history": {"db": db, "report": str(site), "kind": "nightly"},
        **changes,
    }
    path.write_text(yaml.safe_dump(plan))
    return path


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_two_nightlies_recording_into_one_history_at_once_are_both_kept_once(
    backend, request, tiny_model, tmp_path
):
    """Two `lpx run`s started together into one new history and one report site: one
    passes, one fails its policy; both are recorded, once each, and the site shows both."""
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'history.db'}"
    else:
        url = new_database(request.getfixturevalue("own_postgres"), "two_nightlies")
    site = tmp_path / "site"
    strict = tmp_path / "strict.yaml"
    strict.write_text(
        "version: 1\nprofiles:\n  bfloat16:\n    tau: 0.1\n    limits: {max_abs_diff: 1.0e-9}\n"
    )
    passing = small_plan(tmp_path / "night-a.yaml", tiny_model, url, site)
    failing = small_plan(
        tmp_path / "night-b.yaml",
        tiny_model,
        url,
        site,
        replays=[{"name": "bf16", "engine": "hf", "dtype": "bf16"}],
        policy=str(strict),
    )
    runs = {plan: tmp_path / plan.stem for plan in (passing, failing)}
    started = {plan: lpx("run", plan, "--out", run_dir) for plan, run_dir in runs.items()}
    ended = {plan: finish(process) for plan, process in started.items()}

    code, out, err = ended[passing]
    assert code == 0 and out.strip().endswith(f"run: PASS; outputs in {runs[passing]}"), err
    code, out, err = ended[failing]
    assert code == 1 and out.strip().endswith(f"run: FAIL; outputs in {runs[failing]}"), err
    assert not [e for _, _, e in ended.values() if "Error:" in e]
    history = history_of(url)
    assert sorted((r["run_dir"], r["status"], r["comparisons"]) for r in history) == [
        (str(runs[passing]), "pass", 1),
        (str(runs[failing]), "fail", 1),
    ]
    again = run_lpx("record", *runs.values(), "--db", url)
    assert again.output.count("already recorded") == 2, again.output
    assert count(url, Run) == 2
    assert read_whole_site(site) == 2  # the last render of the two holds both runs

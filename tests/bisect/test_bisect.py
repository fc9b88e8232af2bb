"""lpx bisect: the search's arithmetic and flake rule (pure, over every position and seeded
flakes), then real bisects over real transformers releases installed offline into layered
environments, with the Gemma-norm fault seeded into the later releases by a patch."""

from __future__ import annotations

import json
import math
import os
import random
import re
from pathlib import Path

import pytest

from pipeline.bisect.builds import between, load_builds, parse_build
from pipeline.bisect.search import BAD, ERROR, GOOD, bisect, run_count
from pipeline.errors import BadInput
from pipeline.faults.releases import FLAKY_PATTERN, flaky_failures, norm_patch
from support.helpers import run_lpx

WHEELS = Path(__file__).resolve().parents[2] / ".venv" / "engine-wheels"

# --- the search, pure ---------------------------------------------------------------------


def _steady(first_bad: int):
    return lambda index, attempt: BAD if index >= first_bad else GOOD


@pytest.mark.parametrize("runs,reconfirm", [(1, 0), (2, 3), (3, 1)])
def test_every_boundary_is_found_within_ceil_log2_probes_plus_confirmations(runs, reconfirm):
    for count in range(2, 34):
        for first_bad in range(1, count):
            answer = bisect(count, _steady(first_bad), runs, reconfirm)
            assert (answer.first_bad, answer.last_good) == (first_bad, first_bad - 1)
            interior = math.ceil(math.log2(count - 1))
            assert run_count(answer) <= runs * (2 + interior) + 2 * reconfirm
            assert len(answer.order) <= 2 + interior


def test_eight_builds_cost_exactly_ten_runs_plus_six_confirmations():
    # 8 builds: both ends, then ceil(log2 7) = 3 probes, two runs each; 3 more for each named
    answer = bisect(8, _steady(4), runs=2, reconfirm=3)
    assert run_count(answer) == 2 * (2 + 3) + 2 * 3 == 16
    assert answer.order == [0, 7, 3, 5, 4]


def test_a_build_that_disagrees_with_itself_is_skipped_never_named():
    outcomes = {2: iter([BAD, BAD, GOOD, BAD, BAD, BAD])}  # looks bad twice, then passes

    def run(index, attempt):
        if index in outcomes:
            return next(outcomes[index])
        return BAD if index >= 4 else GOOD

    answer = bisect(6, run, runs=2, reconfirm=3)
    assert answer.judged[2].verdict == "flaky"
    assert (answer.first_bad, answer.last_good) == (4, 3)
    assert 2 not in answer.skipped  # it lies below the last good: no doubt left about it


def test_a_flaky_build_is_named_at_most_at_its_bound_over_thousands_of_seeded_bisects():
    """A build before the real first bad that fails 30 % of its runs: named only if it fails
    all runs + reconfirm = 5 of them, 0.3 ** 5 = 0.243 %; 20,000 seeded bisects."""
    rng = random.Random(7)
    trials, named, right = 20_000, 0, 0
    for _ in range(trials):

        def run(index, attempt):
            if index == 3:
                return BAD if rng.random() < 0.3 else GOOD
            return BAD if index >= 4 else GOOD

        answer = bisect(8, run, runs=2, reconfirm=3)
        named += answer.first_bad == 3
        right += answer.first_bad == 4
    bound = 0.3**5
    assert named / trials < bound + 4 * math.sqrt(bound / trials)  # 0.35 %
    assert right + named == trials  # never a build after the real first bad


def test_a_build_that_errs_is_retried_then_skipped_never_bad():
    seen = []

    def run(index, attempt):
        seen.append((index, attempt))
        if index == 1:
            return ERROR
        return BAD if index >= 2 else GOOD

    answer = bisect(4, run, runs=2, reconfirm=1, retries=2)
    assert answer.judged[1].verdict == ERROR
    assert [s for s in seen if s[0] == 1] == [(1, 0), (1, 1), (1, 2)]  # once, then 2 retries
    assert (answer.first_bad, answer.last_good) == (2, 0)
    assert answer.skipped == [1]  # the first bad is build 1 or build 2


def test_ends_that_do_not_hold_stop_the_bisect_and_say_which():
    answer = bisect(5, lambda index, attempt: GOOD, runs=2)
    assert answer.first_bad is None
    assert "the bad build (4) is good" in answer.stopped
    assert answer.order == [0, 4]


# --- builds -------------------------------------------------------------------------------


def test_builds_are_read_in_every_spelling_and_bad_ones_say_what_to_write(tmp_path):
    assert parse_build("transformers==5.20.0").requirements == ("transformers==5.20.0",)
    assert parse_build("image:vllm/vllm-openai:v0.31.0").image == "vllm/vllm-openai:v0.31.0"
    assert parse_build("git:abc123").revision == "abc123"
    with pytest.raises(BadInput, match="say its kind"):
        parse_build("vllm")
    listed = tmp_path / "builds.yaml"
    listed.write_text("- pip:transformers==5.18.0\n- {name: x, image: a:b, git: c}\n")
    with pytest.raises(BadInput, match="entry 2: give exactly one of pip, image, git"):
        load_builds(listed)


@pytest.mark.skipif(not WHEELS.is_dir(), reason="scripts/setup fetches the engine wheels")
def test_a_package_s_releases_between_good_and_bad_come_from_the_wheelhouse():
    builds = between("pip:transformers==5.20.0", "transformers==5.21.1", wheelhouse=WHEELS)
    assert [b.requirements[0] for b in builds] == [
        f"transformers=={v}" for v in ("5.20.0", "5.20.1", "5.20.2", "5.21.0", "5.21.1")
    ]
    with pytest.raises(BadInput, match="must be older"):
        between("transformers==5.21.0", "transformers==5.20.0", wheelhouse=WHEELS)


def test_git_builds_are_the_first_parent_line_from_good_to_bad(tmp_path):
    import subprocess

    repo = tmp_path / "engine"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    for number in range(5):
        (repo / "version.txt").write_text(str(number))
        subprocess.run([*git, "add", "."], check=True)
        subprocess.run([*git, "commit", "-qm", f"c{number}"], check=True)
    revs = subprocess.run([*git, "rev-list", "--reverse", "HEAD"], capture_output=True, text=True)
    commits = revs.stdout.split()
    builds = between(f"git:{commits[1]}", f"git:{commits[4]}", source=repo)
    assert [b.revision for b in builds] == commits[1:]


def test_held_versions_are_the_environment_s_own_whatever_else_is_on_sys_path():
    """A layered environment's companions install under constraints read from lpx's
    site-packages. Once setuptools is imported, its _vendor folder is on sys.path with an
    older typing_extensions (4.12.2); held from there, pip could not install IPython into
    SGLang's environment (seen when a test imported setuptools before a bisect probe)."""
    import subprocess
    import sys

    code = (
        "import setuptools, sys, typing_extensions; from importlib import metadata; "
        "from pipeline.environments import held_versions; "
        "assert any('_vendor' in p for p in sys.path), 'setuptools no longer vendors'; "
        "held = [h for h in held_versions() if h.lower().startswith('typing_extensions==')]; "
        "print(held, metadata.version('typing_extensions'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    held, installed = done.stdout.rsplit(" ", 1)
    assert held == f"['typing_extensions=={installed.strip()}']"


# --- real bisects over real releases ------------------------------------------------------


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """The engine wheels, a plan of the failing pair, and one environment cache for the
    module (each environment is made once: ~8 s)."""
    if not WHEELS.is_dir():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but {WHEELS} is missing: scripts/setup fetches it")
        pytest.skip("scripts/setup fetches the engine wheels")
    root = tmp_path_factory.mktemp("bisect")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LPX_CACHE", str(root / "cache"))
        (root / "plan.yaml").write_text(
            "version: 1\nname: bisect-test\nmodel: tiny\n"
            "sampling: {max_tokens: 12, temperature: 1.0, seed: 0}\n"
            "rollout: {engine: hf, dtype: fp32}\n"
            "replays: [{name: hf-fp32, engine: hf, dtype: fp32}]\n"
            "diagnose: false\n"
        )
        yield root


def _wheel(version: str) -> Path:
    return WHEELS / f"transformers-{version}-py3-none-any.whl"


def _builds(root: Path, rows: list[tuple[str, str | None]]) -> Path:
    """A builds file: (version, None | "gemma" | "flaky") per build, patches made from the
    release's own wheel."""
    lines = []
    for version, fault in rows:
        if fault is None:
            lines.append(f"- pip:transformers=={version}")
            continue
        patch = norm_patch(_wheel(version), root / f"{fault}-{version}.patch", fault == "flaky")
        lines.append(
            f'- {{name: "{version}+{fault}", pip: transformers=={version}, patch: {patch}}}'
        )
    path = root / f"builds-{len(list(root.glob('builds-*.yaml')))}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_real_bisect_names_the_release_that_brought_the_fault_and_resumes(releases, tmp_path):
    rows = [
        ("5.18.0", None),
        ("5.19.0", None),
        ("5.20.0", None),
        ("5.20.1", "gemma"),
        ("5.20.2", "gemma"),
    ]
    builds = _builds(releases, rows)
    out = tmp_path / "bisect"
    argv = ["bisect", releases / "plan.yaml", "--pair", "hf-fp32", "--builds", builds]
    argv += ["--good", "pip:transformers==5.18.0", "--bad", "5.20.2+gemma", "--out", out]
    argv += ["--wheelhouse", WHEELS]
    argv += ["--runs", "1", "--reconfirm", "0"]  # the flake logic is the flaky test's point
    # under a plan that diagnoses, the probes judge only; the first bad is verified once
    diagnosing = releases / "plan-diagnose.yaml"
    text = (releases / "plan.yaml").read_text()
    diagnosing.write_text(text.replace("diagnose: false", "diagnose: true"))
    result = run_lpx(*[diagnosing if a == releases / "plan.yaml" else a for a in argv])
    assert result.exit_code == 0, result.output
    state = json.loads((out / "bisect.json").read_text())
    found = state["result"]
    probe_reports = [json.loads(p.read_text()) for p in out.glob("probes/*/*/compare/report.json")]
    assert len(probe_reports) == 4 and not any(r["verification"]["ran"] for r in probe_reports)
    explained = json.loads((out / found["explained"]).read_text())
    assert found["explained"].startswith("probes/5.20.1_gemma/0/")
    assert explained["verification"]["ran"] and explained["verdict"] == "fail"
    # modelling code that no family reproduces: no cause the evidence rules out is left
    # (prompt_mismatch, against the same prompt ids on both sides), the drift is unexplained
    assert [(c["cause"], c["status"]) for c in found["causes"]] == [("unexplained", "plausible")]
    assert {c["cause"] for c in found["causes"]} == {
        str(f["cause"]) for f in explained["diagnosis"] if f["severity"] == "fault"
    }
    assert "cause: " in result.output and "its comparison, verified: " in result.output
    assert (found["last_good"], found["first_bad"]) == ("pip:transformers==5.20.0", "5.20.1+gemma")
    assert found["maybe_first_bad"] == [] and found["flaky"] == [] and found["errors"] == []
    # 5 builds: both ends and ceil(log2 4) = 2 probes, one run each
    assert found["runs"] == 2 + 2 == len(state["runs"])
    assert found["changed"]["packages"] == {"transformers": ["5.20.0", "5.20.1"]}
    assert found["changed"]["patch"][0] is None and found["changed"]["patch"][1].endswith(".patch")
    bad_runs = [r for r in state["runs"] if r["outcome"] == BAD]
    assert all(r["metrics"]["mean_abs_diff"] > 1e-3 for r in bad_runs)
    assert all(r["metrics"]["mean_abs_diff"] < 1e-5 for r in state["runs"] if r["outcome"] == GOOD)
    assert "first bad: 5.20.1+gemma" in result.output
    # stopped before its last two runs, resumed: nothing runs twice, the answer is the same
    kept = found["runs"] - 2
    state["runs"], state["result"] = state["runs"][:kept], None
    (out / "bisect.json").write_text(json.dumps(state))
    unfinished = run_lpx("record", out, "--db", tmp_path / "unfinished.db")
    assert unfinished.exit_code == 2 and "--resume" in unfinished.output
    # the night of the same pair (the good end's first probe run) in a history: resumed with
    # it, the probes are judged by its series too (one night: no band yet, the policy rules)
    night = out / "probes" / "pip_transformers==5.18.0" / "0"
    db = f"sqlite:///{tmp_path / 'h.db'}"
    assert run_lpx("record", night, "--db", db).exit_code == 0
    resumed = run_lpx(*argv, "--resume", "--db", db)
    assert resumed.exit_code == 0, resumed.output
    again = json.loads((out / "bisect.json").read_text())
    assert again["result"]["first_bad"] == "5.20.1+gemma"
    assert len(again["runs"]) == found["runs"]
    ran = re.findall(r"^\[\d+\] \S+ run \d+: ", resumed.output, flags=re.M)
    assert len(ran) == 2  # only the missing runs ran
    # resumed with every run stored: nothing runs, and what changed still comes from the
    # builds' stored environments
    again["result"] = None
    (out / "bisect.json").write_text(json.dumps(again))
    idle = run_lpx(*argv, "--resume", "--db", db)
    assert not re.findall(r"^\[\d+\] \S+ run \d+: ", idle.output, flags=re.M)
    stored = json.loads((out / "bisect.json").read_text())["result"]
    assert stored["changed"]["packages"] == {"transformers": ["5.20.0", "5.20.1"]}
    assert again["judged_by"] == ["policy", "series"]
    # recorded beside that night, the series page shows the bisect: first bad, last good and
    # what changed
    recorded = run_lpx("record", night, out, "--db", db)
    assert recorded.exit_code == 0, recorded.output
    assert "recorded: bisect" in recorded.output
    assert "already recorded: bisect" in run_lpx("record", out, "--db", db).output
    assert run_lpx("report", "--db", db, "--out", tmp_path / "site").exit_code == 0
    pages = list((tmp_path / "site").rglob("series/*.html"))
    html = " ".join(page.read_text() for page in pages)
    assert f'data-bisect="{state["bisect_id"][:12]}"' in html
    assert "5.20.1+gemma" in html and "transformers 5.20.0 &rarr; 5.20.1" in html


def test_a_flaky_release_is_skipped_and_an_unbuildable_one_is_an_error_never_bad(
    releases, tmp_path, monkeypatch
):
    """Build 2 fails its first two runs (it looks bad) and passes its third: it must come out
    flaky, never the first bad. 9.9.9 does not exist: an error, never a verdict."""
    assert flaky_failures(10) == 3 and FLAKY_PATTERN.startswith("110")
    monkeypatch.setenv("LPX_SEEDED_FLAKE_COUNTER", str(tmp_path / "flake-count"))
    rows = [("5.18.0", None), ("5.19.0", None), ("5.20.0", "flaky"), ("5.20.1", None)]
    rows += [("5.20.2", "gemma"), ("5.21.0", "gemma")]
    builds = _builds(releases, rows)
    text = builds.read_text().replace("- pip:transformers==5.19.0", "- pip:transformers==9.9.9")
    builds.write_text(text)
    out = tmp_path / "bisect"
    argv = ["bisect", releases / "plan.yaml", "--pair", "hf-fp32", "--builds", builds]
    argv += ["--good", "pip:transformers==5.18.0", "--bad", "5.21.0+gemma", "--out", out]
    result = run_lpx(*argv, "--wheelhouse", WHEELS, "--reconfirm", "1", "--retries", "0")
    assert result.exit_code == 0, result.output
    found = json.loads((out / "bisect.json").read_text())["result"]
    assert found["flaky"] == ["5.20.0+flaky"]
    assert found["errors"] == ["pip:transformers==9.9.9"]
    assert (found["last_good"], found["first_bad"]) == ("pip:transformers==5.20.1", "5.20.2+gemma")
    verdicts = {row["build"]: row for row in found["probes"]}
    assert verdicts["5.20.0+flaky"]["runs"] == [BAD, BAD, GOOD]
    assert verdicts["pip:transformers==9.9.9"]["verdict"] == ERROR
    assert (tmp_path / "flake-count").read_text() == "3"  # the flaky build ran 3 times


def test_a_git_bisect_builds_each_revision_and_names_the_commit(releases, tmp_path):
    """A source tree the user has: transformers 5.20.0's package as a git repository, four
    commits, the third seeding the Gemma norm. Each revision is exported and built into its
    own environment by the build command; the commit that brought the fault is named."""
    import subprocess
    import zipfile

    from pipeline.faults.releases import GEMMA_NORM, LLAMA, NORM_LINE

    repo = tmp_path / "transformers"
    with zipfile.ZipFile(_wheel("5.20.0")) as wheel:
        wheel.extractall(repo)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]

    def commit(message: str) -> str:
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-qm", message], check=True)
        return subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout

    subprocess.run([*git, "init", "-q"], check=True)
    good = commit("5.20.0 as released").strip()
    (repo / "NOTES.md").write_text("a change that moves nothing\n")
    commit("docs")
    llama = repo / LLAMA
    llama.write_text(llama.read_text().replace(NORM_LINE, GEMMA_NORM))
    faulty = commit("norm: share the Gemma path").strip()
    (repo / "NOTES.md").write_text("another\n")
    bad = commit("docs again").strip()
    copy = "cp -r {source}/. $({python} -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')"
    out = tmp_path / "bisect"
    result = run_lpx(
        "bisect", releases / "plan.yaml", "--pair", "hf-fp32", "--source", repo,
        "--good", f"git:{good}", "--bad", f"git:{bad}", "--build-command", copy,
        "--runs", "1", "--reconfirm", "0", "--out", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    found = json.loads((out / "bisect.json").read_text())["result"]
    assert found["first_bad"] == f"git:{faulty[:12]}"
    assert found["runs"] == 2 + 2
    commits = found["changed"]["commits"]
    assert len(commits) == 1 and commits[0].endswith("norm: share the Gemma path")


def test_bad_input_is_one_line_naming_what_to_fix_and_exit_2(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        "version: 1\nname: p\nmodel: tiny\nrollout: {engine: hf}\n"
        "replays: [{name: hf-fp32, engine: hf}]\n"
    )
    base = ["bisect", plan, "--good", "transformers==5.18.0", "--bad", "transformers==5.19.0"]
    wrong_pair = run_lpx(*base, "--pair", "hf-bf16", "--out", tmp_path / "a")
    assert wrong_pair.exit_code == 2
    assert "--pair 'hf-bf16' is not a replay of plan p; its replays: hf-fp32" in wrong_pair.output
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    builds = tmp_path / "builds.yaml"
    builds.write_text("- pip:transformers==5.18.0\n- pip:transformers==5.19.0\n")
    argv = [*base, "--pair", "hf-fp32", "--builds", builds]
    full = run_lpx(*argv, "--out", tmp_path / "full")
    assert full.exit_code == 2 and "exists and is not empty" in full.output
    nothing = run_lpx(*argv, "--out", tmp_path / "b", "--resume")
    assert nothing.exit_code == 2 and "no bisect.json there" in nothing.output
    (tmp_path / "edited").mkdir()
    (tmp_path / "edited" / "bisect.json").write_text(json.dumps({"lpx_bisect": 1, "runs": {}}))
    edited = run_lpx(*argv, "--out", tmp_path / "edited", "--resume")
    assert edited.exit_code == 2
    assert f"{tmp_path / 'edited' / 'bisect.json'}: not a bisect.json as lpx writes it" in (
        edited.output
    )
    assert "start a new bisect in a new --out" in edited.output
    mixed = run_lpx(*base[:4], "--bad", "image:x:1", "--pair", "hf-fp32", "--out", tmp_path / "c")
    assert mixed.exit_code == 2 and "bisect one kind" in mixed.output


def test_a_rollout_side_bisect_runs_the_rollout_on_each_build(releases, tmp_path):
    """--side rollout (a rollout engine upgrade): only the model is shared; each probe samples
    its own fixture on the build and the plan's replay scores it as the plan says."""
    rows = [("5.19.0", None), ("5.20.0", None), ("5.20.1", "gemma")]
    builds = _builds(releases, rows)
    out = tmp_path / "bisect"
    result = run_lpx(
        "bisect", releases / "plan.yaml", "--pair", "hf-fp32", "--side", "rollout",
        "--builds", builds, "--good", "pip:transformers==5.19.0", "--bad", "5.20.1+gemma",
        "--wheelhouse", WHEELS, "--runs", "1", "--reconfirm", "0", "--out", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    found = json.loads((out / "bisect.json").read_text())["result"]
    assert (found["last_good"], found["first_bad"]) == ("pip:transformers==5.20.0", "5.20.1+gemma")
    assert found["runs"] == 2 + 1
    assert sorted(p.name for p in (out / "base").iterdir()) == [
        "logs", "lpx-run.json", "model", "prompts.txt"
    ]  # fmt: skip
    probe = out / "probes" / "5.20.1_gemma" / "0"
    stages = {s["name"]: s for s in json.loads((probe / "lpx-run.json").read_text())["stages"]}
    assert "kept" not in stages["rollout"]["message"]  # sampled on the build, not shared

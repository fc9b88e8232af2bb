"""lpx bisect: the search's arithmetic and flake rule (pure, over every position and seeded
flakes), then real bisects over real transformers releases installed offline into layered
environments, with the Gemma-norm fault seeded into the later releases by a patch."""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import Result

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
#
# Each probe run is a real `lpx run` of the pair in the build's environment (~7 s: a process
# that imports torch and the build's transformers, then a compare); the tests below read two
# bisects made once for the module, so every run they assert on runs once.


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """The engine wheels, a plan of the failing pair, and one environment cache for the
    module (each environment is made once: ~3 s)."""
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


@dataclass
class Bisected:
    out: Path
    result: Result  # what `lpx bisect` printed and its exit code
    argv: list  # the command again, to resume it


@pytest.fixture(scope="module")
def seeded(releases) -> Bisected:
    """One bisect over five builds: 5.18.0 (good), 9.9.9 (no such release: it cannot be
    built), 5.20.0 with the flaky fault, 5.20.1, and 5.20.2 with the Gemma norm (bad). Two
    runs a probe, one reconfirmation, no retries, under a plan that diagnoses: 12 runs."""
    rows = [("5.18.0", None), ("9.9.9", None), ("5.20.0", "flaky"), ("5.20.1", None)]
    builds = _builds(releases, [*rows, ("5.20.2", "gemma")])
    out = releases / "seeded"
    argv = ["bisect", releases / "plan.yaml", "--pair", "hf-fp32", "--builds", builds]
    argv += ["--good", "pip:transformers==5.18.0", "--bad", "5.20.2+gemma", "--out", out]
    argv += ["--wheelhouse", WHEELS, "--reconfirm", "1", "--retries", "0"]
    # under a plan that diagnoses, the probes judge only; the first bad is verified once
    diagnosing = releases / "plan-diagnose.yaml"
    diagnosing.write_text(
        (releases / "plan.yaml").read_text().replace("diagnose: false", "diagnose: true")
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LPX_SEEDED_FLAKE_COUNTER", str(releases / "flake-count"))
        result = run_lpx(*[diagnosing if a == releases / "plan.yaml" else a for a in argv])
    return Bisected(out, result, argv)


def test_a_real_bisect_names_the_release_that_brought_the_fault(seeded):
    """The seeded bisect's answer, what changed, and the first bad build's comparison
    verified once (the probes' own comparisons only judge)."""
    result, out = seeded.result, seeded.out
    assert result.exit_code == 0, result.output
    state = json.loads((out / "bisect.json").read_text())
    found = state["result"]
    assert (found["last_good"], found["first_bad"]) == ("pip:transformers==5.20.1", "5.20.2+gemma")
    assert "first bad: 5.20.2+gemma" in result.output
    assert found["maybe_first_bad"] == []  # 9.9.9 and the flaky build lie below the last good
    # five builds, four of them run: each run twice and once more to reconfirm it (12 runs),
    # and the one try of 9.9.9 that errs
    assert found["runs"] == 4 * (2 + 1) + 1 == len(state["runs"])
    probe_reports = [json.loads(p.read_text()) for p in out.glob("probes/*/*/compare/report.json")]
    assert len(probe_reports) == 12 and not any(r["verification"]["ran"] for r in probe_reports)
    explained = json.loads((out / found["explained"]).read_text())
    assert found["explained"].startswith("probes/5.20.2_gemma/2/")  # its last bad run
    assert explained["verification"]["ran"] and explained["verdict"] == "fail"
    # modelling code that no family reproduces: no cause the evidence rules out is left
    # (prompt_mismatch, against the same prompt ids on both sides), the drift is unexplained
    assert [(c["cause"], c["status"]) for c in found["causes"]] == [("unexplained", "plausible")]
    assert {c["cause"] for c in found["causes"]} == {
        str(f["cause"]) for f in explained["diagnosis"] if f["severity"] == "fault"
    }
    assert "cause: " in result.output and "its comparison, verified: " in result.output
    assert found["changed"]["packages"] == {"transformers": ["5.20.1", "5.20.2"]}
    assert found["changed"]["patch"][0] is None and found["changed"]["patch"][1].endswith(".patch")
    bad_runs = [r for r in state["runs"] if r["outcome"] == BAD]
    assert len(bad_runs) == 5 and all(r["metrics"]["mean_abs_diff"] > 1e-3 for r in bad_runs)
    good_runs = [r for r in state["runs"] if r["outcome"] == GOOD]
    assert len(good_runs) == 7 and all(r["metrics"]["mean_abs_diff"] < 1e-5 for r in good_runs)


def test_a_flaky_release_is_skipped_and_an_unbuildable_one_is_an_error_never_bad(seeded):
    """In the seeded bisect, 5.20.0+flaky fails its first two runs (it looks bad, and the
    search turns below it) and passes the third, its reconfirmation: it must come out flaky,
    never the first bad, and the search goes back above it. 9.9.9 does not exist: an error,
    never a verdict."""
    assert flaky_failures(10) == 3 and FLAKY_PATTERN.startswith("110")
    assert seeded.result.exit_code == 0, seeded.result.output
    found = json.loads((seeded.out / "bisect.json").read_text())["result"]
    assert found["flaky"] == ["5.20.0+flaky"]
    assert found["errors"] == ["pip:transformers==9.9.9"]
    assert (found["last_good"], found["first_bad"]) == ("pip:transformers==5.20.1", "5.20.2+gemma")
    verdicts = {row["build"]: row for row in found["probes"]}
    assert verdicts["5.20.0+flaky"]["runs"] == [BAD, BAD, GOOD]
    assert verdicts["pip:transformers==9.9.9"]["verdict"] == ERROR
    assert (seeded.out.parent / "flake-count").read_text() == "3"  # the flaky build ran 3 times


def test_a_stopped_bisect_resumes_running_only_what_is_missing_and_is_recorded(seeded, tmp_path):
    """The seeded bisect, stopped before its last two runs (a copy of it), resumed: nothing
    runs twice and the answer is the same; then judged by a history too, and recorded."""
    out = tmp_path / "bisect"
    shutil.copytree(seeded.out, out)
    argv = [out if a == seeded.out else a for a in seeded.argv]
    state = json.loads((out / "bisect.json").read_text())
    found = state["result"]
    kept = len(state["runs"]) - 2
    assert [r["outcome"] for r in state["runs"][kept:]] == [GOOD, BAD]  # 5.20.1's and 5.20.2's
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
    assert again["result"]["first_bad"] == "5.20.2+gemma"
    assert len(again["runs"]) == found["runs"]
    ran = re.findall(r"^\[\d+\] \S+ run \d+: ", resumed.output, flags=re.M)
    assert len(ran) == 2  # only the missing runs ran
    assert again["judged_by"] == ["policy", "series"]
    # resumed with every run stored: nothing runs, and what changed still comes from the
    # builds' stored environments
    again["result"] = None
    (out / "bisect.json").write_text(json.dumps(again))
    idle = run_lpx(*argv, "--resume", "--db", db)
    assert not re.findall(r"^\[\d+\] \S+ run \d+: ", idle.output, flags=re.M)
    stored = json.loads((out / "bisect.json").read_text())["result"]
    assert stored["changed"]["packages"] == {"transformers": ["5.20.1", "5.20.2"]}
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
    assert "5.20.2+gemma" in html and "transformers 5.20.1 &rarr; 5.20.2" in html


def test_a_patched_build_is_its_release_s_environment_copied_and_it_keeps_its_bytecode(
    releases,
):
    """A patched build whose release the cache holds is that environment copied, then
    patched: pip does not run again. An environment's interpreter writes the bytecode of
    what it imports even under PYTHONDONTWRITEBYTECODE (its packages are installed
    uncompiled); the copy leaves its release's bytecode behind."""
    import subprocess
    import sysconfig

    from pipeline import environments
    from pipeline.faults.releases import GEMMA_NORM, LLAMA, NORM_LINE

    def site(directory: Path) -> Path:
        paths = sysconfig.get_paths(vars={"base": str(directory), "platbase": str(directory)})
        return Path(paths["purelib"])

    release = environments.ensure(
        environments.for_requirement("transformers==5.20.1", wheelhouse=WHEELS)
    )
    patch = norm_patch(_wheel("5.20.1"), releases / "gemma-5.20.1.patch")
    log = releases / "build-5.20.1-gemma.log"
    patched = environments.ensure(
        environments.for_requirement("transformers==5.20.1", patch, WHEELS), log
    )
    assert patched != release and "-m pip" not in log.read_text()
    assert "patch -p1" in log.read_text()
    assert NORM_LINE in (site(release) / LLAMA).read_text()
    assert GEMMA_NORM in (site(patched) / LLAMA).read_text()
    described = environments.description(patched)
    assert described["installed"] == environments.description(release)["installed"]
    assert described["patch"] == str(patch)
    assert not list(site(patched).rglob("__pycache__"))
    subprocess.run(
        [environments.python_of(patched), "-c", "import transformers"],
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        check=True,
    )
    assert list((site(patched) / "transformers" / "__pycache__").glob("__init__.*.pyc"))


@pytest.fixture(scope="module")
def git_bisect(releases) -> tuple[Bisected, dict[str, str]]:
    """A source tree the user has: transformers 5.20.0's package as a git repository of three
    commits, the second seeding the Gemma norm, bisected on the rollout side (a rollout
    engine's commits). Returns the bisect and the commits by name (good, faulty, bad)."""
    import subprocess
    import zipfile

    from pipeline.faults.releases import GEMMA_NORM, LLAMA, NORM_LINE

    repo = releases / "transformers"
    with zipfile.ZipFile(_wheel("5.20.0")) as wheel:
        wheel.extractall(repo)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]

    def commit(message: str) -> str:
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-qm", message], check=True)
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
        return head.stdout.strip()

    subprocess.run([*git, "init", "-q"], check=True)
    commits = {"good": commit("5.20.0 as released")}
    llama = repo / LLAMA
    llama.write_text(llama.read_text().replace(NORM_LINE, GEMMA_NORM))
    commits["faulty"] = commit("norm: share the Gemma path")
    (repo / "NOTES.md").write_text("a change that moves nothing\n")
    commits["bad"] = commit("docs")
    copy = "cp -r {source}/. $({python} -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')"
    out = releases / "git"
    argv = [
        "bisect", releases / "plan.yaml", "--pair", "hf-fp32", "--side", "rollout",
        "--source", repo, "--good", f"git:{commits['good']}", "--bad", f"git:{commits['bad']}",
        "--build-command", copy, "--runs", "1", "--reconfirm", "0", "--out", out,
    ]  # fmt: skip
    return Bisected(out, run_lpx(*argv), argv), commits


def test_a_git_bisect_builds_each_revision_and_names_the_commit(git_bisect):
    """Each revision is exported and built into its own environment by the build command;
    the commit that brought the fault is named, and the commits from the last good to it."""
    bisected, commits = git_bisect
    assert bisected.result.exit_code == 0, bisected.result.output
    state = json.loads((bisected.out / "bisect.json").read_text())
    found = state["result"]
    assert found["first_bad"] == f"git:{commits['faulty'][:12]}"
    assert found["last_good"] == f"git:{commits['good'][:12]}"
    assert found["runs"] == 2 + 1
    built = [r["environment"]["source"] for r in state["runs"]]
    assert sorted(built) == sorted(commits.values())  # each run on its own revision's build
    changed = found["changed"]["commits"]
    assert len(changed) == 1 and changed[0].endswith("norm: share the Gemma path")


def test_a_rollout_side_bisect_runs_the_rollout_on_each_build(git_bisect):
    """--side rollout (a rollout engine upgrade), in the git bisect: only the model is
    shared; each probe samples its own fixture on the build and the plan's replay scores it
    as the plan says."""
    bisected, commits = git_bisect
    assert bisected.result.exit_code == 0, bisected.result.output
    out = bisected.out
    assert sorted(p.name for p in (out / "base").iterdir()) == [
        "logs", "lpx-run.json", "model", "prompts.txt"
    ]  # fmt: skip
    for revision in commits.values():
        probe = out / "probes" / f"git_{revision[:12]}" / "0"
        run = json.loads((probe / "lpx-run.json").read_text())
        stages = {s["name"]: s for s in run["stages"]}
        assert stages["rollout"]["status"] == "ok"
        assert "kept" not in stages["rollout"]["message"]  # sampled on the build, not shared
        assert "kept" in stages["model"]["message"]
    state = json.loads((out / "bisect.json").read_text())
    outcomes = {r["build"]: r["outcome"] for r in state["runs"]}
    assert outcomes == {
        f"git:{commits['good'][:12]}": GOOD,
        f"git:{commits['faulty'][:12]}": BAD,
        f"git:{commits['bad'][:12]}": BAD,
    }


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

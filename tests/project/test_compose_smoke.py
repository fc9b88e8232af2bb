"""The compose smoke as the README tells a new user to run it (issue 54): its line builds
everything `docker compose run smoke` needs, and the smoke is judged by what it produced, so
a failed build or a smoke that ran nothing fails it even where Compose exits 0 (engine 20.10
with Compose 2.40 does, after "failed to solve: /wheelhouse/sglang not found").

No Docker here: the README's line runs as written in a copy of the checkout whose
`scripts/docker-base`, `scripts/wheelhouse` and `docker` are fakes that log what they are
asked. The fake `docker` behaves as Compose 2.40 was seen to: a failed build prints its error
and exits 0. The images it "builds" carry the labels the real Dockerfiles give them with
compose.yaml's build args. tests/project/test_containers.py runs the real thing.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

from support.synthetic_runs import pair_report, write_run

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "docker"))
import compose_smoke_check as check  # noqa: E402

COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SMOKE_NEEDS = COMPOSE["services"]["smoke"]["depends_on"]


def readme_compose_lines() -> list[str]:
    """The README's compose smoke command block, as written."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Every engine in its own container", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.strip().splitlines() if line.strip()]


def dockerfile_labels(service: str) -> dict[str, str]:
    """The labels a real build of `service` gives its image: the LABEL of its Dockerfile's
    target stage, with compose.yaml's build args over the stage's ARG defaults."""
    build = COMPOSE["services"][service]["build"]
    text = (ROOT / build["dockerfile"]).read_text().replace("\\\n", " ")
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    target = build.get("target")
    stage = next(s for s in stages if re.match(rf"\S+ AS {target}\n", s)) if target else stages[-1]
    args = dict(re.findall(r"^ARG (\w+)=(\S*)$", stage, re.M))
    args.update({name: str(value) for name, value in build.get("args", {}).items()})
    labels = dict(re.findall(r'([\w.]+)="([^"]*)"', re.search(r"^LABEL (.*)$", stage, re.M)[1]))
    return {k: re.sub(r"\$\{(\w+)\}", lambda m: args.get(m[1], ""), v) for k, v in labels.items()}


BUILT_LABELS = {COMPOSE["services"][s]["image"]: dockerfile_labels(s) for s in SMOKE_NEEDS}
PLANS = check._load(ROOT, {})[1]

FAKE_DOCKER = """
import json, os, subprocess, sys
from pathlib import Path
import yaml

args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write("docker " + " ".join(args) + "\\n")
state_path = Path(os.environ["FAKE_DOCKER_STATE"])
state = json.loads(state_path.read_text())
if args[:2] == ["image", "inspect"]:
    if args[2] not in state["images"]:
        sys.exit(f"Error: No such image: {args[2]}")
    print(json.dumps(state["images"][args[2]]))
    sys.exit(0)
if args[:2] == ["image", "rm"]:
    for tag in args[2:]:
        state["images"].pop(tag, None)
elif args[:2] == ["compose", "build"]:
    services = yaml.safe_load(Path("compose.yaml").read_text())["services"]
    for name in args[2:]:
        if name in os.environ.get("FAKE_BUILD_FAILS", "").split():
            print(f"failed to solve: /wheelhouse/{name} not found", file=sys.stderr)
            continue  # and exit 0, as Compose 2.40 on engine 20.10 does
        state["images"][services[name]["image"]] = state["labels"][services[name]["image"]]
    failed = set(os.environ.get("FAKE_BUILD_FAILS", "").split()) & set(args[2:])
    if failed and os.environ.get("FAKE_BUILD_EXIT", "0") != "0":  # a Compose that says so
        state_path.write_text(json.dumps(state))
        sys.exit(int(os.environ["FAKE_BUILD_EXIT"]))
elif args[:3] == ["compose", "run", "--rm"] and args[3] == "smoke":
    if os.environ["FAKE_SMOKE"] == "record":  # what the smoke records and renders
        out = os.environ.get("LPX_COMPOSE_OUT", "runs/compose")
        lpx = [sys.executable, "-m", "pipeline"]
        runs = os.environ["FAKE_SMOKE_RUNS"].split(os.pathsep)
        subprocess.run([*lpx, "record", *runs, "--db", f"{out}/lpx.db"], check=True)
        subprocess.run([*lpx, "report", "--db", f"{out}/lpx.db", "--out", f"{out}/site"],
                       check=True)
else:
    sys.exit(f"fake docker: not faked: {args}")
state_path.write_text(json.dumps(state))
"""


DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def smoke_runs(root: Path, verdict: str = "pass") -> list[Path]:
    """A run directory per smoke plan, shaped as `lpx run` leaves it: a comparison per
    replay, the plan's name in lpx-run.json."""
    dirs = []
    for name, plan in PLANS.items():
        rollout = plan["rollout"]["engine"]
        pairs = {
            f"compare/{i}-{replay['name']}": pair_report(
                rollout=rollout, replay=replay["engine"], rollout_dtype="float32",
                replay_dtype=DTYPES[replay["dtype"]], verdict=verdict,
            )
            for i, replay in enumerate(plan["replays"])
        }  # fmt: skip
        run = write_run(root / name, pairs, started_at=datetime(2026, 11, 28), kind="smoke")
        manifest = json.loads((run / "lpx-run.json").read_text())
        manifest["plan"] = {"name": plan["name"]}
        (run / "lpx-run.json").write_text(json.dumps(manifest))
        dirs.append(run)
    return dirs


@pytest.fixture
def checkout(tmp_path):
    """A copy of the checkout's compose smoke with faked builders and Docker."""
    repo = tmp_path / "checkout"
    for name in ("compose.yaml", "scripts/compose-smoke", "docker/compose_smoke_check.py",
                 *(f"examples/{plan}.yaml" for plan in PLANS)):  # fmt: skip
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, repo / name)
    log = tmp_path / "log"
    for name, body in (
        ("docker-base", 'echo "docker-base $*" >> "$FAKE_LOG"'),
        ("wheelhouse", 'echo "wheelhouse $*" >> "$FAKE_LOG"; mkdir -p "wheelhouse/$1"'),
    ):
        (repo / "scripts" / name).write_text(f"#!/usr/bin/env bash\nset -eu\n{body}\n")
        (repo / "scripts" / name).chmod(0o755)
    python = repo / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "docker").write_text(f"#!{sys.executable}\n{FAKE_DOCKER}")
    (fake_bin / "docker").chmod(0o755)
    state = tmp_path / "docker-state.json"
    state.write_text(json.dumps({"images": {}, "labels": BUILT_LABELS}))
    # No PYTHONPATH: the script runs its check as `.venv/bin/python docker/...`, where Python
    # puts docker/ on the path, not the checkout's root
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("LPX_") and k != "PYTHONPATH"},
        "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}",
        "CI": "true",
        "FAKE_LOG": str(log),
        "FAKE_DOCKER_STATE": str(state),
        "FAKE_SMOKE": "record",
        "FAKE_SMOKE_RUNS": os.pathsep.join(map(str, smoke_runs(tmp_path / "plans"))),
    }
    return repo, env, log, state


def run_readme_lines(repo: Path, env: dict) -> subprocess.CompletedProcess:
    script = "set -e\n" + "\n".join(readme_compose_lines())
    return subprocess.run(
        ["bash", "-c", script], cwd=repo, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_readme_line_builds_everything_the_smoke_needs_before_running_it(checkout):
    repo, env, log, _ = checkout
    result = run_readme_lines(repo, env)
    assert result.returncode == 0, result.stdout + result.stderr
    calls = log.read_text().splitlines()
    smoke_at = calls.index("docker compose run --rm smoke")
    before = calls[:smoke_at]
    base = COMPOSE["x-cpu-args"]["BASE_IMAGE"]  # ${LPX_BASE_IMAGE:-lpx-base:bookworm}
    assert re.fullmatch(r"\$\{LPX_BASE_IMAGE:-(.+)\}", base)[1] == "lpx-base:bookworm"
    assert "docker-base lpx-base:bookworm" in before
    families = {
        COMPOSE["services"][s]["build"]["args"]["WHEELHOUSE"].removeprefix("wheelhouse/")
        for s in SMOKE_NEEDS
    }
    assert families == {"train", "vllm", "sglang"}
    assert {f"wheelhouse {family}" for family in families} <= set(before)
    built = {
        s for call in before if call.startswith("docker compose build ") for s in call.split()[3:]
    }
    assert built == set(SMOKE_NEEDS) == {"train-image", "vllm-image", "sglang-image"}
    # the images were checked after the build, the outputs after the smoke
    inspected = [c.split()[3] for c in calls if c.startswith("docker image inspect")]
    assert sorted(inspected) == sorted(BUILT_LABELS)
    assert "compose smoke: images: 3 built" in result.stdout
    assert "compose smoke: outputs: a passing run of each plan (smoke, smoke-sglang)" in (
        result.stdout
    )


def test_ci_runs_the_readmes_compose_smoke_line():
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())
    runs = [step.get("run", "") for step in workflow["jobs"]["test"]["steps"]]
    (line,) = readme_compose_lines()
    command = line.split("#", 1)[0].strip()
    assert command == "scripts/compose-smoke" and command in runs
    # nothing in CI runs the smoke bare, where Compose's exit code would be the verdict
    assert not any("compose run" in run for run in runs)


@pytest.mark.parametrize("compose_exit", ["0", "17"])
def test_a_failed_build_fails_before_the_smoke_in_one_line_naming_the_image(checkout, compose_exit):
    """Compose 2.40 on engine 20.10 exits 0 after a failed build; a newer one exits non-zero,
    which must not end the script before its one line naming the image."""
    repo, env, log, state = checkout
    # an older lpx-sglang:cpu from before must not pass for the one that failed to build
    images = json.loads(state.read_text())
    images["images"] = dict(BUILT_LABELS)
    state.write_text(json.dumps(images))
    failing = {"FAKE_BUILD_FAILS": "sglang-image", "FAKE_BUILD_EXIT": compose_exit}
    result = run_readme_lines(repo, {**env, **failing})
    assert result.returncode == 1
    assert "failed to solve" in result.stderr
    problems = [line for line in result.stderr.splitlines() if line.startswith("compose smoke:")]
    assert problems == [
        "compose smoke: lpx-sglang:cpu does not exist: its build failed; run "
        "`docker compose build sglang-image` and read its error"
    ]
    assert "docker compose run --rm smoke" not in log.read_text()


def test_a_smoke_that_ran_nothing_and_exited_0_fails(checkout):
    repo, env, log, _ = checkout
    result = run_readme_lines(repo, {**env, "FAKE_SMOKE": "nothing"})
    assert result.returncode == 1
    assert "docker compose run --rm smoke" in log.read_text()
    assert result.stderr.strip().splitlines()[-1] == (
        "compose smoke: runs/compose/lpx.db does not exist: the smoke recorded nothing; read "
        "the output of `docker compose run --rm smoke` above"
    )


def test_the_check_fails_on_a_fake_empty_runs_dir(tmp_path, capsys):
    fake_empty_runs = tmp_path / "fake-empty-runs"
    fake_empty_runs.mkdir()
    assert check.main(["outputs", str(fake_empty_runs), "--since", "2026-11-28T00:00:00"]) == 1
    assert f"{fake_empty_runs}/lpx.db does not exist" in capsys.readouterr().err


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A history and report holding a passing run of each smoke plan and a failing run of
    each, as the smoke leaves runs/compose; the time recording started."""
    root = tmp_path_factory.mktemp("compose-out")
    since = datetime.now(UTC).replace(tzinfo=None, microsecond=0)
    lpx = [sys.executable, "-m", "pipeline"]
    env = {**os.environ, "CI": "true"}
    for verdict in ("pass", "fail"):
        runs = smoke_runs(root / verdict, verdict)
        db = root / verdict / "out" / "lpx.db"
        subprocess.run([*lpx, "record", *map(str, runs), "--db", str(db)], check=True, env=env)
        subprocess.run([*lpx, "report", "--db", str(db), "--out", str(db.parent / "site")],
                       check=True, env=env)  # fmt: skip
    return root, since


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_the_check_runs_as_the_script_runs_it_from_the_root_and_from_elsewhere(
    recorded, where, tmp_path
):
    """`.venv/bin/python docker/compose_smoke_check.py outputs DIR --since UTC`, a process of
    its own with nothing on PYTHONPATH (it once died there: No module named 'db')."""
    root, since = recorded
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cwd = ROOT if where == "root" else tmp_path
    script = (
        "docker/compose_smoke_check.py"
        if where == "root"
        else ROOT / "docker" / "compose_smoke_check.py"
    )
    argv = [sys.executable, str(script), "outputs", str(root / "pass" / "out")]
    result = subprocess.run(
        [*argv, "--since", since.isoformat()], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    assert result.stdout == (
        f"compose smoke: outputs: a passing run of each plan (smoke, smoke-sglang) in "
        f"{root / 'pass' / 'out'}\n"
    )
    failing = subprocess.run(
        [*argv[:-1], str(root / "fail" / "out"), "--since", since.isoformat()],
        cwd=cwd, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert failing.returncode == 1 and len(failing.stderr.splitlines()) == 2, failing.stderr


def test_outputs_recorded_since_the_start_pass_and_older_ones_do_not(recorded):
    root, since = recorded
    out = root / "pass" / "out"
    assert check.output_problems(out, PLANS, since) == []
    later = since + timedelta(hours=1)  # as if these were an earlier smoke's outputs
    assert check.output_problems(out, PLANS, later) == [
        f"{out / 'lpx.db'} holds no run of plan smoke (examples/smoke.yaml) recorded since "
        f"{later.isoformat()} UTC: it did not run, or did not record",
        f"{out / 'lpx.db'} holds no run of plan smoke-sglang (examples/smoke-sglang.yaml) "
        f"recorded since {later.isoformat()} UTC: it did not run, or did not record",
        f"{out / 'site' / 'index.html'} was not rendered since {later.isoformat()} UTC",
    ]


def test_a_failed_plan_or_a_missing_run_page_fails(recorded):
    root, since = recorded
    out = root / "fail" / "out"
    problems = check.output_problems(out, PLANS, since)
    assert problems == [
        f"plan smoke: run 1 in {out / 'lpx.db'} is fail, not pass: "
        f"`lpx history runs --db {out / 'lpx.db'}` says why",
        f"plan smoke-sglang: run 2 in {out / 'lpx.db'} is fail, not pass: "
        f"`lpx history runs --db {out / 'lpx.db'}` says why",
    ]
    page = root / "pass" / "out" / "site" / "runs" / "2.html"
    page.rename(page.with_suffix(".moved"))
    try:
        assert check.output_problems(root / "pass" / "out", PLANS, since) == [
            f"{page} does not exist: the report lacks plan smoke-sglang's run"
        ]
    finally:
        page.with_suffix(".moved").rename(page)


def test_images_with_their_dockerfiles_labels_pass_and_others_do_not():
    assert BUILT_LABELS["lpx-vllm:cpu"]["ai.lpx.engine.versions"] == "vllm=0.32.0"
    assert BUILT_LABELS["lpx-sglang:cpu"]["ai.lpx.engine.versions"] == "sglang=0.5.23"
    assert check.image_problems(COMPOSE, PLANS, BUILT_LABELS.get) == []
    stale = {**BUILT_LABELS, "lpx-sglang:cpu": {
        **BUILT_LABELS["lpx-sglang:cpu"], "ai.lpx.engine.versions": "sglang=0.5.20",
        "ai.lpx.engines": "vllm,hf"}}  # fmt: skip
    assert check.image_problems(COMPOSE, PLANS, stale.get) == [
        "lpx-sglang:cpu has ai.lpx.engine.versions=sglang=0.5.20, not sglang=0.5.23 as "
        "compose.yaml builds it: rebuild with `docker compose build sglang-image`",
        "lpx-sglang:cpu has ai.lpx.engines=vllm,hf, but plan smoke-sglang runs sglang in it",
    ]
    foreign = {**BUILT_LABELS, "lpx-train:cpu": {}}
    problems = check.image_problems(COMPOSE, PLANS, foreign.get)
    assert problems[0] == (
        "lpx-train:cpu lacks the label org.opencontainers.image.source=https://github.com/lpx/lpx: "
        "not an lpx image"
    )
    assert len(problems) == 1 + 2 * 5  # and no engine either plan replays in it


def test_the_smoke_plans_follow_lpx_smoke_plans_as_compose_reads_it():
    assert check.smoke_plans(COMPOSE, {}) == ["smoke", "smoke-sglang"]
    assert check.smoke_plans(COMPOSE, {"LPX_SMOKE_PLANS": ""}) == ["smoke", "smoke-sglang"]
    assert check.smoke_plans(COMPOSE, {"LPX_SMOKE_PLANS": "smoke"}) == ["smoke"]

"""Judge `docker compose run smoke` by what it produced, not by Compose's exit code.

On Docker engine 20.10 with Compose 2.40, `docker compose build` exits 0 after a build that
failed ("failed to solve: /wheelhouse/sglang not found"), and `docker compose run smoke` then
exits 0 too, having run nothing. scripts/compose-smoke asks this module instead:

    python docker/compose_smoke_check.py images
        every image the smoke service depends on exists, with lpx's source label, the engine
        versions compose.yaml builds it with, and every engine a smoke plan runs in it;
    python docker/compose_smoke_check.py outputs DIR --since UTC
        DIR/lpx.db holds a passing run of every smoke plan recorded since UTC (ISO, UTC), with
        one comparison per replay of the plan, and DIR/site has its page and an index
        rendered since.

Each prints one line per problem and exits 1 when there is any, else one summary line and 0;
2 on bad usage. What the smoke needs is read from compose.yaml and the plans it runs
(LPX_SMOKE_PLANS, read as Compose reads it), so it is never written down twice.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SOURCE_LABEL = "org.opencontainers.image.source"
SOURCE = "https://github.com/lpx/lpx"


def smoke_plans(compose: dict, environ: Mapping[str, str]) -> list[str]:
    """The plans the smoke service runs: LPX_SMOKE_PLANS, or its default in the command."""
    command = "\n".join(compose["services"]["smoke"]["command"])
    default = re.search(r"\$\{LPX_SMOKE_PLANS:-([^}]*)\}", command).group(1)
    # Compose's `:-` takes the default for an unset and for an empty variable alike
    return (environ.get("LPX_SMOKE_PLANS") or default).split()


def image_problems(
    compose: dict, plans: dict[str, dict], labels_of: Callable[[str], dict | None]
) -> list[str]:
    """What is wrong with the images the smoke service needs; `labels_of(image)` gives an
    image's labels, or None when the image does not exist."""
    services = compose["services"]
    built = {services[name]["image"]: name for name in services["smoke"]["depends_on"]}
    problems = []
    for image, service in built.items():
        labels = labels_of(image)
        if labels is None:
            problems.append(
                f"{image} does not exist: its build failed; run `docker compose build {service}` "
                "and read its error"
            )
            continue
        if labels.get(SOURCE_LABEL) != SOURCE:
            problems.append(f"{image} lacks the label {SOURCE_LABEL}={SOURCE}: not an lpx image")
        versions = labels.get("ai.lpx.engine.versions", "").split(",")
        for arg, value in services[service]["build"].get("args", {}).items():
            want = f"{arg.removesuffix('_VERSION').lower()}={value}"
            if arg.endswith("_VERSION") and want not in versions:  # VLLM_VERSION -> vllm=...
                problems.append(
                    f"{image} has ai.lpx.engine.versions={','.join(versions)}, "
                    f"not {want} as compose.yaml builds it: rebuild with "
                    f"`docker compose build {service}`"
                )
        engines = labels.get("ai.lpx.engines", "").split(",")
        for plan, stage in _stages(plans):
            if stage["image"] == image and stage["engine"] not in engines:
                problems.append(
                    f"{image} has ai.lpx.engines={','.join(engines)}, but plan {plan} runs "
                    f"{stage['engine']} in it"
                )
    for plan, stage in _stages(plans):
        if stage["image"] not in built:
            problems.append(
                f"plan {plan} runs {stage['engine']} in {stage['image']}, which no service "
                "the compose smoke depends on builds: add it to compose.yaml's smoke.depends_on"
            )
    return problems


def output_problems(out: Path, plans: dict[str, dict], since: datetime) -> list[str]:
    """What the smoke's history (OUT/lpx.db) and report (OUT/site) lack: a passing run of
    every plan recorded since `since`, a comparison per replay, and the run's report page."""
    db = out / "lpx.db"
    if not db.is_file():
        return [
            f"{db} does not exist: the smoke recorded nothing; read the output of "
            "`docker compose run --rm smoke` above"
        ]
    runs = recorded_runs(db, since)
    if isinstance(runs, str):
        return [runs]
    problems = []
    site = out / "site"
    for file_stem, plan in plans.items():
        mine = [run for run in runs if run["plan"] == plan["name"]]
        if not mine:
            problems.append(
                f"{db} holds no run of plan {plan['name']} (examples/{file_stem}.yaml) recorded "
                f"since {since.isoformat()} UTC: it did not run, or did not record"
            )
            continue
        run = mine[-1]
        if run["status"] != "pass":
            problems.append(
                f"plan {plan['name']}: run {run['id']} in {db} is {run['status']}, not pass: "
                f"`lpx history runs --db {db}` says why"
            )
        if run["comparisons"] != len(plan["replays"]):
            problems.append(
                f"plan {plan['name']}: run {run['id']} in {db} holds {run['comparisons']} "
                f"comparisons, not one per replay ({len(plan['replays'])})"
            )
        page = site / "runs" / f"{run['id']}.html"
        if not page.is_file():
            problems.append(f"{page} does not exist: the report lacks plan {plan['name']}'s run")
    index = site / "index.html"
    if not index.is_file() or _utc(index.stat().st_mtime) < since:
        problems.append(f"{index} was not rendered since {since.isoformat()} UTC")
    return problems


def recorded_runs(db: Path, since: datetime) -> list[dict] | str:
    """Every run recorded into the SQLite history `db` since `since`, oldest first, with its
    plan's name and comparison count; a string naming the problem when `db` is no history."""
    # lpx as installed (the checkout's .venv, or the image's /opt/lpx), wherever this script
    # is started from: the history's models install as pipeline.db, not as a top-level db
    from pipeline.db.models import Comparison, Run
    from sqlalchemy import func, select

    from pipeline.errors import BadInput
    from pipeline.history.database import open_history

    try:
        history = open_history(str(db), migrate=False, create=False)
    except BadInput as error:
        return str(error)
    try:
        with history.read() as session:
            counts = dict(
                session.execute(
                    select(Comparison.run_id, func.count()).group_by(Comparison.run_id)
                ).all()
            )
            query = select(Run).where(Run.recorded_at >= since).order_by(Run.recorded_at, Run.id)
            return [
                {
                    "id": run.id,
                    "plan": ((run.manifest or {}).get("plan") or {}).get("name"),
                    "status": run.status,
                    "comparisons": counts.get(run.id, 0),
                }
                for run in session.scalars(query)
            ]
    finally:
        history.engine.dispose()


def docker_labels(image: str) -> dict | None:
    """An image's labels from `docker image inspect`; None when it does not exist."""
    result = subprocess.run(
        ["docker", "image", "inspect", image, "--format", "{{json .Config.Labels}}"],
        capture_output=True,
        text=True,
    )
    if result.returncode == 0:
        return json.loads(result.stdout) or {}
    if "no such image" in result.stderr.lower():
        return None
    # Docker not answering is no verdict on the images
    raise RuntimeError(f"docker image inspect {image}: {result.stderr.strip()}")


def _utc(timestamp: float) -> datetime:
    """A file time as the history stores times: naive UTC."""
    return datetime.fromtimestamp(timestamp, UTC).replace(tzinfo=None)


def _stages(plans: dict[str, dict]):
    for plan in plans.values():
        for stage in [plan["rollout"], *plan["replays"]]:
            yield plan["name"], stage


def _load(root: Path, environ: Mapping[str, str]) -> tuple[dict, dict[str, dict]]:
    compose = yaml.safe_load((root / "compose.yaml").read_text())
    # the smoke service mounts ./examples at /examples and runs /examples/<plan>.yaml
    plans = {
        name: yaml.safe_load((root / "examples" / f"{name}.yaml").read_text())
        for name in smoke_plans(compose, environ)
    }
    return compose, plans


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    views = parser.add_subparsers(dest="view", required=True)
    views.add_parser("images", help="the images the smoke needs, with their labels")
    outputs = views.add_parser("outputs", help="the smoke's history and report")
    outputs.add_argument("out", type=Path, help="the smoke's LPX_COMPOSE_OUT (runs/compose)")
    outputs.add_argument("--since", required=True, type=datetime.fromisoformat, help="UTC")
    args = parser.parse_args(argv)
    try:
        compose, plans = _load(ROOT, os.environ)
    except (OSError, yaml.YAMLError, KeyError, AttributeError) as error:
        print(f"error: cannot read compose.yaml's smoke and its plans: {error}", file=sys.stderr)
        return 2
    if args.view == "images":
        try:
            problems = image_problems(compose, plans, docker_labels)
        except RuntimeError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        done = f"images: {len(compose['services']['smoke']['depends_on'])} built, labels as compose.yaml builds them"
    else:
        problems = output_problems(args.out, plans, args.since)
        done = f"outputs: a passing run of each plan ({', '.join(plans)}) in {args.out}"
    for problem in problems:
        print(f"compose smoke: {problem}", file=sys.stderr)
    if not problems:
        print(f"compose smoke: {done}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

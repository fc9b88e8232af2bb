"""What a plan names outside its run directory: the checkpoint, the prompt file, the policy,
a calibration, weight stores, a SQLite history.

Each is checked before any stage starts (a missing one is one line naming the plan key), and
each stage carries the ones it reads (`Stage.reads`), so that a runner that moves the stage
elsewhere (a container, another node) can bring them along; the run directory itself is the
runner's business.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pipeline.errors import BadInput
from pipeline.orchestrator.plan import Plan


@dataclass(frozen=True)
class OutsidePath:
    """A path the plan names, as this process sees it (absolute)."""

    key: str  # the plan key that names it: model, prompts, replays[1].weights_store, ...
    path: str
    kind: Literal["dir", "file"]
    # The SQLite history the calibrate stage stores its calibration in: its folder, written.
    writable: bool = False
    # A stage that can do without it (a cache): a runner that cannot bring it leaves it out.
    optional: bool = False


def outside_paths(plan: Plan) -> dict[str, OutsidePath]:
    """Every path the plan names outside the run directory, by plan key (URLs are not paths,
    and `tiny`, `bundled` are built inside the run directory)."""
    found: dict[str, OutsidePath] = {}

    def add(key: str, value: str | None, kind: Literal["dir", "file"], keep=()) -> None:
        if value is not None and value not in keep and "://" not in value:
            found[key] = OutsidePath(key, str(Path(value).expanduser().absolute()), kind)

    add("model", plan.model, "dir", keep=("tiny",))
    add("prompts", plan.prompts, "file", keep=("bundled",))
    add("policy", plan.policy, "file")
    add("calibration", plan.calibration, "file")
    for index, replay in enumerate(plan.replays):
        add(f"replays[{index}].weights_store", replay.weights_store, "dir")
    sqlite = sqlite_history(plan.history.db)
    if sqlite is not None and plan.calibrate is not None:
        # the calibrate stage reuses and stores calibrations there; SQLite writes its journal
        # beside the file, so the folder is what it needs (made, as `lpx record` makes it)
        found["history.db"] = OutsidePath("history.db", str(sqlite.parent), "dir", writable=True)
    return found


MODEL_CACHE = "model cache"


def model_cache(plan: Plan) -> OutsidePath | None:
    """Where this host keeps the tiny models it built (tinymodel/cache.py), for a plan on
    `tiny`: a container runner lends it to the model stage, so that a build is trained once
    per image's libraries on a host, not once per run (14-16 s a run in a container on two
    cores; the compose smoke's two plans, and each container test, trained it again). None
    without a cache (LPX_MODEL_CACHE=off) or without `tiny`."""
    if plan.model != "tiny":
        return None
    from pipeline.tinymodel.cache import cache_root

    root = cache_root()
    if root is None:
        return None
    return OutsidePath(
        MODEL_CACHE, str(root.expanduser().absolute()), "dir", writable=True, optional=True
    )


def sqlite_history(db: str | None) -> Path | None:
    """The SQLite file a history setting names (a plain path, or a sqlite:/// URL), absolute
    against the directory `lpx run` was started in; None for none and for a server URL."""
    if not db:
        return None
    if db.startswith("sqlite:///"):
        db = db.removeprefix("sqlite:///")
    elif "://" in db:
        return None
    return Path(db).expanduser().absolute()


def check_outside_paths(plan: Plan, plan_path: Path) -> None:
    """Refuse a plan whose paths do not exist here, before any stage (or container) starts:
    one line naming the plan key. Inside a container, what is missing is usually a mount."""
    for key, outside in outside_paths(plan).items():
        path = Path(outside.path)
        if outside.writable:
            continue  # made where it is missing
        if outside.kind == "dir" and not path.is_dir():
            what = "is a file, not a directory" if path.is_file() else "does not exist"
        elif outside.kind == "file" and not path.is_file():
            what = "is a directory, not a file" if path.is_dir() else "does not exist"
        else:
            continue
        raise BadInput(f"{plan_path}: {key}: {path} {what}{_where(key)}.")


def _where(key: str) -> str:
    fix = "; relative paths are relative to the plan's folder"
    if in_container():
        return (
            f" in the container lpx runs in{fix}, and a host folder must be mounted into that "
            "container (compose.yaml's nightly service mounts LPX_MODELS at the same path)"
        )
    return f" on this host{fix}"


def in_container() -> bool:
    """Whether this process runs in a container (Docker writes /.dockerenv; Podman
    /run/.containerenv)."""
    return os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv")

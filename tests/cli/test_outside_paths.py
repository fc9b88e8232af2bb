"""What a plan names outside its run directory (issue 59): refused before any stage when it is
missing, carried by each stage that reads it, and mounted into the stage's container at the
path the plan names, from the host or from inside a container (the compose services).

No Docker here: the mounts are computed, not made. tests/project/test_containers.py runs a
plan on the user's own checkpoint (a plain folder and a hub-cache snapshot) in real containers,
from the host and the way the compose nightly service starts its stages.
"""

import os
from pathlib import Path

import pytest
import yaml

from pipeline.errors import BadInput
from pipeline.orchestrator.docker_mounts import HostView, MountSpec, stage_mounts, views
from pipeline.orchestrator.localize_stages import localize_stage
from pipeline.orchestrator.outside import OutsidePath, outside_paths
from pipeline.orchestrator.plan import load_plan
from pipeline.orchestrator.stages import calibrate_stage, compare_stage, expand
from support.helpers import run_lpx

ROOT = Path(__file__).parents[2]


def hub_snapshot(cache: Path, files=("config.json", "model.safetensors")) -> Path:
    """A Hugging Face hub cache repo as `huggingface_hub` leaves it: files in blobs/ under
    their digests, a snapshot of symbolic links to them, refs/main naming the snapshot."""
    repo = cache / "models--org--policy"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    for number, name in enumerate(files):
        (repo / "blobs" / f"blob{number}").write_text(name)
        os.symlink(f"../../blobs/blob{number}", snapshot / name)
    return snapshot


def plan_file(tmp_path: Path, **changes) -> Path:
    plan = {
        "version": 1,
        "name": "own",
        "model": str(tmp_path / "ckpt"),
        "rollout": {"engine": "hf"},
        "replays": [{"name": "fsdp", "engine": "fsdp", "nproc": 2}],
    }
    plan.update(changes)
    path = tmp_path / "plans" / "plan.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(plan))
    return path


@pytest.mark.parametrize(
    "change, key",
    [
        ({}, "model"),
        ({"prompts": "../missing-prompts.txt"}, "prompts"),
        ({"policy": "/nonexistent/policy.yaml"}, "policy"),
        ({"calibration": "calibration.json"}, "calibration"),
        (
            {
                "replays": [
                    {"name": "a", "engine": "hf"},
                    {"name": "b", "engine": "hf", "weights_store": "/no/store"},
                ]
            },
            "replays[1].weights_store",
        ),  # fmt: skip
    ],
)
def test_a_path_the_plan_names_that_does_not_exist_is_one_line_before_any_stage(
    tmp_path, change, key, monkeypatch
):
    monkeypatch.setattr("pipeline.orchestrator.outside.in_container", lambda: False)
    if key != "model":
        (tmp_path / "ckpt").mkdir()
    plan = plan_file(tmp_path, **change)
    run_dir = tmp_path / "run"
    result = run_lpx("run", plan, "--out", run_dir, "--runner", "docker")
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    named = outside_paths(load_plan(plan))[key].path
    assert line == (
        f"Error: {plan}: {key}: {named} does not exist on this host; relative paths are "
        "relative to the plan's folder."
    )
    # refused before the runner: no Docker was asked, no run directory made
    assert not run_dir.exists()


def test_a_file_where_a_folder_belongs_is_named(tmp_path):
    (tmp_path / "ckpt").write_text("not a folder")
    plan = plan_file(tmp_path)
    result = run_lpx("run", plan, "--out", tmp_path / "run")
    assert result.exit_code == 2
    assert f"model: {tmp_path / 'ckpt'} is a file, not a directory" in result.stderr


def test_in_a_container_a_missing_checkpoint_points_at_the_mount(tmp_path, monkeypatch):
    """lpx run in the compose nightly service: the path is missing there because the host
    folder was not mounted into it."""
    monkeypatch.setattr("pipeline.orchestrator.outside.in_container", lambda: True)
    plan = plan_file(tmp_path)
    result = run_lpx("run", plan, "--out", tmp_path / "run")
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"Error: {plan}: model: {tmp_path / 'ckpt'} does not exist in the container lpx runs "
        "in; relative paths are relative to the plan's folder, and a host folder must be "
        "mounted into that container (compose.yaml's nightly service mounts LPX_MODELS at the "
        "same path)."
    ]


def test_each_stage_carries_what_it_reads_outside_the_run_directory(tmp_path):
    for name in ("ckpt", "store"):
        (tmp_path / name).mkdir()
    for name in ("prompts.txt", "policy.yaml", "calibration.json"):
        (tmp_path / name).write_text("x")
    plan = load_plan(
        plan_file(
            tmp_path,
            prompts="../prompts.txt",
            policy="../policy.yaml",
            calibration="../calibration.json",
            replays=[
                {"name": "hf", "engine": "hf"},
                {"name": "versions", "engine": "hf", "weights_store": "../store"},
            ],
            history={"db": str(tmp_path / "hist" / "lpx.db")},
            localize=True,
        )
    )
    stages = {stage.name: stage for stage in expand(plan)}
    keys = {name: [read.key for read in stage.reads] for name, stage in stages.items()}
    assert keys == {
        "rollout": ["model", "prompts"],
        "replay-hf": ["model"],
        "replay-versions": ["replays[1].weights_store"],
    }
    argv = stages["replay-versions"].argv
    assert argv[argv.index("--weights-store") + 1] == str(tmp_path / "store")
    assert "--model" not in argv
    compare = compare_stage(plan, ["hf", "versions"])
    assert [read.key for read in compare.reads] == ["model", "policy", "calibration"]
    assert compare.argv[compare.argv.index("--calibration") + 1] == str(
        tmp_path / "calibration.json"
    )
    localize = localize_stage(plan, plan.replays[0], "compare/0-hf")
    assert [read.key for read in localize.reads] == ["model"]
    # no calibrate stage: the history is no stage's business
    assert "history.db" not in outside_paths(plan)


def test_the_calibrate_stage_gets_the_sqlite_history_as_lpx_record_finds_it(tmp_path, monkeypatch):
    """A relative --db is relative to where `lpx run` started (where `lpx record` runs), not
    to the run directory the stage runs in; its folder is written (SQLite's journal)."""
    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    plan = load_plan(plan_file(tmp_path, calibrate={}, history={"db": "team/lpx.db"}))
    stage = calibrate_stage(plan, plan.model)
    assert stage.argv[stage.argv.index("--db") + 1] == str(tmp_path / "team" / "lpx.db")
    assert [(r.key, r.path, r.writable) for r in stage.reads] == [
        ("model", str(tmp_path / "ckpt"), False),
        ("history.db", str(tmp_path / "team"), True),
    ]
    server = load_plan(
        plan_file(tmp_path, calibrate={}, history={"db": "postgresql+psycopg://u@db/lpx"})
    )
    assert [r.key for r in calibrate_stage(server, server.model).reads] == ["model"]


def test_a_plain_checkpoint_is_mounted_read_only_at_its_own_path(tmp_path):
    model = tmp_path / "ckpt"
    model.mkdir()
    reads = (OutsidePath("model", str(model), "dir"),)
    assert stage_mounts(tmp_path / "run", reads, HostView(None)) == [
        MountSpec(str(tmp_path / "run"), str(tmp_path / "run"), "bind", read_only=False),
        MountSpec(str(model), str(model), "bind", read_only=True),
    ]


def test_a_hub_cache_snapshot_brings_the_blobs_its_links_lead_to(tmp_path):
    snapshot = hub_snapshot(tmp_path / "hub")
    blobs = snapshot.parents[1] / "blobs"
    assert views(str(snapshot)) == {str(blobs): str(blobs), str(snapshot): str(snapshot)}
    # the links resolve in a container that has exactly those two mounts
    for link in snapshot.iterdir():
        lands = os.path.normpath(os.path.join(snapshot, os.readlink(link)))
        assert lands.startswith(str(blobs) + "/")
    # the whole repo named: the links lead inside it, one mount
    assert views(str(snapshot.parents[1])) == {str(snapshot.parents[1]): str(snapshot.parents[1])}


def test_a_checkpoint_named_through_a_link_is_mounted_from_where_it_lies(tmp_path):
    """`/ckpt/current -> /ckpt/step-900`: the container sees the step's files at `current`,
    and a shard linked from elsewhere by an absolute link is mounted where the link points."""
    step = tmp_path / "ckpt" / "step-900"
    step.mkdir(parents=True)
    shared = tmp_path / "shared-shards"
    shared.mkdir()
    (shared / "model-00001.safetensors").write_text("w")
    os.symlink(shared / "model-00001.safetensors", step / "model-00001.safetensors")
    os.symlink(step, tmp_path / "ckpt" / "current")
    current = str(tmp_path / "ckpt" / "current")
    assert views(current) == {str(shared): str(shared), current: str(step)}


# A container's Mounts as `docker inspect` gives them, for the compose nightly service with
# LPX_MODELS=/data/ckpt: the runs volume, the report folder, the checkpoints at the same path.
NIGHTLY_MOUNTS = [
    {"Type": "volume", "Name": "lpx-runs", "Source": "/var/lib/docker/volumes/lpx-runs/_data",
     "Destination": "/runs", "RW": True},
    {"Type": "bind", "Source": "/home/ci/lpx/runs/compose", "Destination": "/report", "RW": True},
    {"Type": "bind", "Source": "/data/ckpt", "Destination": "/data/ckpt", "RW": False},
    {"Type": "bind", "Source": "/srv/hf", "Destination": "/models", "RW": False},
]  # fmt: skip


def test_from_a_container_each_path_is_translated_through_its_own_mounts(tmp_path):
    host = HostView(NIGHTLY_MOUNTS)
    assert host.mount("/runs/runs/x", "/runs/runs/x", False, "run") == MountSpec(
        "/runs", "lpx-runs", "volume", read_only=False
    )
    assert host.mount("/models/qwen3", "/models/qwen3", True, "model") == MountSpec(
        "/models/qwen3", "/srv/hf/qwen3", "bind", read_only=True
    )
    assert host.mount("/report", "/report", False, "history.db") == MountSpec(
        "/report", "/home/ci/lpx/runs/compose", "bind", read_only=False
    )
    with pytest.raises(BadInput) as refused:
        host.mount("/opt/ckpt", "/opt/ckpt", True, "model")
    assert refused.value.format_message() == (
        "model: /opt/ckpt is inside the container lpx runs in, on no mount of it, so no stage "
        "container can see it; mount the host folder that holds it into lpx's container "
        "(compose.yaml's nightly service mounts LPX_MODELS at the same path)."
    )


def test_the_compose_nightly_mounts_the_checkpoints_where_a_plan_names_them():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    nightly = compose["services"]["nightly"]
    assert "${LPX_MODELS:-./runs/models}:${LPX_MODELS:-/models}:ro" in nightly["volumes"]
    # the runs volume is found from the container's own mounts, not named twice
    assert "LPX_DOCKER_VOLUME" not in nightly["environment"]
    assert "/var/run/docker.sock:/var/run/docker.sock" in nightly["volumes"]


def test_a_tiny_plans_model_stage_is_lent_the_hosts_kept_builds_where_a_container_can_see_them(
    tmp_path, monkeypatch
):
    """The model stage of a `tiny` plan carries the host's tiny-model cache, written: a
    container runner mounts it so that each run copies a build instead of training it again
    (14-16 s a run on two cores). Where no stage container can see it (only inside lpx's own
    container), the stage goes without, as it did before; LPX_MODEL_CACHE=off lends nothing."""
    from pipeline.orchestrator.docker_mounts import lent

    monkeypatch.setenv("LPX_MODEL_CACHE", str(tmp_path / "kept"))
    plan = load_plan(plan_file(tmp_path, model="tiny"))
    model = next(stage for stage in expand(plan) if stage.name == "model")
    (cache,) = model.reads
    assert (cache.key, cache.path, cache.writable, cache.optional) == (
        "model cache", str(tmp_path / "kept"), True, True
    )  # fmt: skip
    run = tmp_path / "run"
    mounts = stage_mounts(run, model.reads, HostView(None))
    assert MountSpec(cache.path, cache.path, "bind", read_only=False) in mounts
    assert lent(cache.path, mounts) and (tmp_path / "kept").is_dir()
    # in the compose smoke's container (its runs volume here at tmp_path/runs): the cache on
    # the volume travels with the run directory ...
    runs = tmp_path / "runs"
    smoke = HostView([{"Type": "volume", "Name": "lpx-runs", "Destination": str(runs)}])
    on_volume = OutsidePath("model cache", str(runs / ".cache/models"), "dir", True, True)
    mounts = stage_mounts(runs / "runs/x", (on_volume,), smoke)
    assert mounts == [MountSpec(str(runs), "lpx-runs", "volume", read_only=False)]
    assert lent(on_volume.path, mounts)
    # ... and one only lpx's own container holds is left behind, not refused
    inside = OutsidePath("model cache", str(tmp_path / "own"), "dir", True, True)
    mounts = stage_mounts(runs / "runs/x", (inside,), smoke)
    assert not lent(inside.path, mounts) and len(mounts) == 1
    monkeypatch.setenv("LPX_MODEL_CACHE", "off")
    assert next(s for s in expand(plan) if s.name == "model").reads == ()
    # a plan on its own checkpoint builds nothing and borrows nothing
    (tmp_path / "ckpt").mkdir()
    assert "model" not in {s.name for s in expand(load_plan(plan_file(tmp_path)))}


def test_the_compose_smoke_keeps_its_tiny_models_on_the_runs_volume():
    smoke = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["smoke"]
    kept = smoke["environment"]["LPX_MODEL_CACHE"]
    assert kept.startswith("/runs/") and "runs:/runs" in smoke["volumes"]

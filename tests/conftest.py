"""Shared fixtures: one tiny model and one real HF rollout/replay set per test session."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

# Each xdist worker, and every engine it starts, takes its share of the cores (before torch
# is imported). Left at torch's default, two workers on two cores ran four OpenMP threads
# that spun at every barrier while the other worker held the cores, and the tiny models'
# small ops are mostly barriers: test_logits_processing and test_verify_families took 235 s
# on two workers, 52 s with one thread each. An OMP_NUM_THREADS the user set is kept.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))

import pytest  # noqa: E402

from pipeline.engines.base import SamplingParams  # noqa: E402
from pipeline.engines.hf.replay import HFScoringEngine  # noqa: E402
from pipeline.engines.hf.rollout import HFRolloutEngine  # noqa: E402
from pipeline.fixture.io import write_table  # noqa: E402
from pipeline.prompts import smoke_prompt_texts, tokenize  # noqa: E402
from pipeline.tinymodel.build import install_tiny_model  # noqa: E402

# Seconds each test file took on a fresh clone (scripts/test-durations writes it from a
# --junitxml run). The two workers take whole files (--dist loadfile); xdist's own queue puts
# the files with the most tests first, which left the heaviest ones (an engine started once for
# a handful of tests) to one worker at the end while the other idled. Heaviest first, and
# --no-loadscope-reorder in pyproject keeps that order; an unmeasured file goes last.
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_collection_modifyitems(config, items):
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    root = config.rootpath

    def heaviest_first(item) -> float:
        try:
            return -seconds.get(item.path.relative_to(root).as_posix(), 0.0)
        except ValueError:  # a test outside the checkout
            return 0.0

    items.sort(key=heaviest_first)  # stable: a file's tests keep their order


@pytest.fixture(scope="session", autouse=True)
def floor_cache_of_the_session(tmp_path_factory):
    """lpx localize keeps floors in a cache under the home directory; tests keep theirs in the
    session's temporary directory, so no run reads another's or leaves files behind."""
    with pytest.MonkeyPatch.context() as patch:
        folder = tmp_path_factory.mktemp("localize-floors")
        patch.setenv("LPX_LOCALIZE_FLOOR_CACHE", str(folder))
        yield folder


@pytest.fixture(scope="session", autouse=True)
def built_models_shared_by_the_workers(tmp_path_factory):
    """lpx keeps the tiny models it builds (pipeline/tinymodel/cache.py); the session keeps
    them in one folder its workers share, so each arch and seed is trained once a session
    (12 s each here), not once in every worker, fixture and `lpx make-model` stage."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LPX_MODEL_CACHE", str(root / "built-models"))
        yield root / "built-models"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return install_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama", 0)


@pytest.fixture(scope="session")
def family_model(tmp_path_factory):
    """The tiny model of a family (pipeline/families), built once per session on first use."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            folder = tmp_path_factory.mktemp("models") / f"tiny-{arch}"
            built[arch] = install_tiny_model(folder, arch, 0)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def family_rollout(family_model, tmp_path_factory):
    """A family's fp32 HF rollout (8 prompts x 16 tokens) in its own folder, once per session:
    `family_rollout(arch) / "fixture.parquet"`."""
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            model = family_model(arch)
            out = tmp_path_factory.mktemp(f"rollout-{arch}")
            sampling = SamplingParams(max_tokens=16, seed=0, samples_per_prompt=1, ignore_eos=True)
            prompts = tokenize(model, smoke_prompt_texts())
            write_table(
                HFRolloutEngine().rollout(model, prompts, sampling, {}), out / "fixture.parquet"
            )
            made[arch] = out
        return made[arch]

    return get


@pytest.fixture(scope="session")
def prompts(tiny_model) -> list[list[int]]:
    return tokenize(tiny_model, smoke_prompt_texts())


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory, tiny_model, prompts) -> Path:
    """fixture.parquet (hf fp32 rollout) and replay-{float32,bfloat16}.parquet (hf replays)."""
    out = tmp_path_factory.mktemp("run")
    sampling = SamplingParams(max_tokens=24, temperature=1.0, seed=0, samples_per_prompt=2)
    fixture = HFRolloutEngine().rollout(tiny_model, prompts, sampling, {})
    write_table(fixture, out / "fixture.parquet")
    for dtype in ("float32", "bfloat16"):
        replay = HFScoringEngine().score(fixture, tiny_model, {"dtype": dtype})
        write_table(replay, out / f"replay-{dtype}.parquet")
    return out


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory):
    """A real PostgreSQL 16 server (the pgserver package's binaries) for the session."""
    import pgserver

    server = pgserver.get_server(tmp_path_factory.mktemp("pg"), cleanup_mode="delete")
    yield server
    server.cleanup()


@pytest.fixture(params=["sqlite", "postgresql"])
def history_url(request, tmp_path) -> str:
    """A fresh, empty history database URL on each backend lpx supports."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'history.db'}"
    server = request.getfixturevalue("postgres_server")
    name = f"lpx_{abs(hash(request.node.nodeid)) % 10**12}"
    server.psql(f"DROP DATABASE IF EXISTS {name};")
    server.psql(f"CREATE DATABASE {name};")
    base, query = server.get_uri().split("?", 1)
    return (
        f"{base.rsplit('/', 1)[0].replace('postgresql://', 'postgresql+psycopg://')}/{name}?{query}"
    )


@pytest.fixture
def small_volume(tmp_path):
    """A tmpfs of a given size at tmp_path/vol (root, as CI and the images' builders are)."""
    mount = tmp_path / "vol"
    mount.mkdir()

    def resize(kib: int) -> Path:
        options = f"{'remount,' if os.path.ismount(mount) else ''}size={kib}k"
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)])
        if done.returncode != 0:
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail("CI=true but a tmpfs cannot be mounted here (run CI as root)")
            pytest.skip("mounting a tmpfs needs root")
        return mount

    yield resize
    subprocess.run(["umount", str(mount)], capture_output=True)


@pytest.fixture(scope="session")
def bf16_calibration(run_dir, tmp_path_factory) -> Path:
    """`lpx calibrate` of the run's fixture (fp32, bf16, fp16 floors), for tests judged under
    bf16 noise."""
    from support.helpers import run_lpx

    calibration = tmp_path_factory.mktemp("calibration") / "calibration.json"
    assert run_lpx("calibrate", run_dir / "fixture.parquet", "--sequences", 8,
                   "--out", calibration).exit_code == 0  # fmt: skip
    return calibration


@pytest.fixture(scope="session")
def environment_cache(tmp_path_factory) -> Path:
    """One LPX_CACHE for the session's layered engine environments
    (pipeline/environments.py): each release is installed once (~8 s), whichever
    test needs it first. Set it with monkeypatch.setenv("LPX_CACHE", ...)."""
    return tmp_path_factory.mktemp("lpx-cache")


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    """The interpreter of the SGLang environment scripts/setup made. Where it is missing the
    SGLang tests skip, except under CI=true, where a missing SGLang fails."""
    from pipeline.engines.sglang.server import sglang_python as find
    from pipeline.errors import EngineNotInstalled

    try:
        return find()
    except EngineNotInstalled as error:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but SGLang is not installed: {error}")
        pytest.skip(str(error))

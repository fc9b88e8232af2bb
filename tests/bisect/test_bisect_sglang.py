"""lpx bisect --side rollout over SGLang builds: each probe runs on the build's environment
(environments.STACKS: the release without its pins, over lpx's venv), starts the real SGLang
server from it, samples its own fixture, and the plan's HF replay scores it. The fault, the
Gemma norm in SGLang's RMSNorm, is seeded into a build by a patch made from the wheel.

One release of SGLang runs on this machine (0.5.23), so the builds are that release and the
same release with the fault: the bisect must name the patched one. The release's environment
is the one scripts/setup made where the cache holds it (the same recipe, so the same key: a
bisect on a machine that ran setup finds it too), else made here; the patched build's is
that environment copied, then patched. Runs once, no reconfirmation (two probes, two server
starts, ~2 min). Skips without SGLang's wheels, except under CI=true.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline import environments
from pipeline.engines.sglang.server import SGLANG_RELEASE, default_environment
from pipeline.faults.releases import norm_patch
from support.helpers import run_lpx

pytestmark = [pytest.mark.sglang, pytest.mark.engine]

WHEELS = Path(__file__).resolve().parents[2] / ".venv" / "engine-wheels"


@pytest.fixture(scope="module")
def wheel() -> Path:
    found = sorted(WHEELS.glob(f"sglang-{SGLANG_RELEASE}-*.whl"))
    if not found:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but {WHEELS} has no SGLang wheel: scripts/setup fetches it")
        pytest.skip("scripts/setup fetches SGLang's wheel")
    return found[0]


def test_a_rollout_side_bisect_names_the_sglang_build_with_the_fault(wheel, tmp_path, monkeypatch):
    setup_made = environments.made(default_environment())  # in the cache setup fills
    monkeypatch.setenv("LPX_CACHE", str(tmp_path / "cache"))
    if setup_made is not None:
        environments.cache_root().mkdir(parents=True)
        (environments.cache_root() / setup_made.name).symlink_to(setup_made)
    monkeypatch.delenv("LPX_SGLANG_PYTHON", raising=False)
    patch = norm_patch(wheel, tmp_path / "gemma-norm.patch")
    (tmp_path / "builds.yaml").write_text(
        f"- pip:sglang=={SGLANG_RELEASE}\n"
        f'- {{name: "{SGLANG_RELEASE}+gemma", pip: sglang=={SGLANG_RELEASE}, patch: {patch}}}\n'
    )
    (tmp_path / "plan.yaml").write_text(
        "version: 1\nname: bisect-sglang\nmodel: tiny\n"
        "sampling: {max_tokens: 12, temperature: 1.0, seed: 0}\n"
        "rollout: {engine: sglang, dtype: fp32}\n"
        "replays: [{name: hf-fp32, engine: hf, dtype: fp32}]\n"
        "diagnose: false\n"
    )
    out = tmp_path / "bisect"
    result = run_lpx(
        "bisect", tmp_path / "plan.yaml", "--pair", "hf-fp32", "--side", "rollout",
        "--builds", tmp_path / "builds.yaml", "--good", f"pip:sglang=={SGLANG_RELEASE}",
        "--bad", f"{SGLANG_RELEASE}+gemma", "--wheelhouse", WHEELS, "--runs", "1",
        "--reconfirm", "0", "--out", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    found = json.loads((out / "bisect.json").read_text())["result"]
    assert found["first_bad"] == f"{SGLANG_RELEASE}+gemma"
    assert found["last_good"] == f"pip:sglang=={SGLANG_RELEASE}"
    assert found["runs"] == 2
    # each probe's rollout started SGLang's server with its build's own environment
    from pipeline.fixture.io import read_table

    release = environments.for_requirement(f"sglang=={SGLANG_RELEASE}", None, WHEELS)
    patched = environments.for_requirement(f"sglang=={SGLANG_RELEASE}", patch, WHEELS)
    for name, built in (
        (f"pip_sglang=={SGLANG_RELEASE}", release),
        (f"{SGLANG_RELEASE}_gemma", patched),
    ):
        probe = out / "probes" / name / "0"
        engine = read_table(probe / "fixture.parquet").metadata["engine"]
        assert engine["name"] == "sglang" and engine["versions"]["sglang"] == SGLANG_RELEASE
        assert engine["server"]["started_by_lpx"]
        launched = (probe / engine["server"]["log"]).read_text().splitlines()[0]
        python = environments.python_of(environments.cache_root() / built.key())
        assert launched.startswith(f"$ {python} -m pipeline.engines.sglang.launch ")

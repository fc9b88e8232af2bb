"""The real SGLang server (0.5.23 on its torch path, in the environment scripts/setup makes):
sampling, teacher-forced scoring, weight updates from disk and from tensors, aborted partial
rollouts resumed across an update, the knobs read back, and lpx starting and stopping the
server itself.

One server is shared by the module (fp32, tiny Llama, raw returned logprobs, weight version
1); the tests that lpx starts a server for are the bf16 replay and the interrupt. Where
SGLang is not installed they skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.compare.run import compare_tables
from pipeline.engines import sglang_api
from pipeline.engines.base import SamplingParams
from pipeline.engines.hf_replay import HFScoringEngine
from pipeline.engines.sglang_engine import SGLangRolloutEngine, SGLangScoringEngine
from pipeline.errors import BadInput
from pipeline.fixture.io import read_table, write_table
from pipeline.weights.hot_load import hot_load
from tests.helpers import publish_one_step, read_report, run_lpx, sglang_serving

pytestmark = [pytest.mark.sglang, pytest.mark.engine]

SAMPLING = SamplingParams(max_tokens=24, temperature=1.0, seed=0, samples_per_prompt=2)


@pytest.fixture(scope="module")
def server(sglang_python, tiny_model, tmp_path_factory):
    """(url, log): SGLang on the tiny model in fp32, returning raw logprobs (as lpx starts it
    for a raw rollout), its first weights named version 1."""
    log = tmp_path_factory.mktemp("sglang") / "server.log"
    env = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}
    with sglang_serving(sglang_python, tiny_model, log, env=env, weight_version="1") as url:
        yield url, log


def _rollout(url, model, prompts, sampling=SAMPLING, **knobs):
    return SGLangRolloutEngine().rollout(model, prompts, sampling, {"url": url, **knobs})


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def test_rollout_logprobs_agree_with_hf_fp32(server, tiny_model, prompts):
    url, _ = server
    table = _rollout(url, tiny_model, prompts)
    assert table.num_sequences == 16 and table.num_completion_tokens > 100
    replay = HFScoringEngine().score(table, tiny_model, {})
    # Measured here: max 4.3e-6 over 128 tokens (decode against HF's one prefill).
    assert _max_diff(table.channels["rollout"], replay.channels["replay"]) < 1e-5
    assert np.array_equal(table.channels["rollout_raw"], table.channels["rollout"])
    assert set(table.weight_versions) == {"1"}
    assert set(table.finish_reasons) <= {"length", "stop"}
    engine = table.metadata["engine"]
    assert engine["name"] == "sglang" and engine["versions"]["sglang"] == "0.5.23"
    assert engine["server"]["server_args"]["dtype"] == "float32"
    assert table.metadata["knobs"]["attention_backend"] == "torch_native"
    assert table.metadata["knobs_not_applied"] == {}


@pytest.mark.parametrize("top_k, top_p", [(20, 1.0), (0, 0.9)])
def test_processed_logprobs_are_the_distribution_sampled_from(
    server, tiny_model, prompts, top_k, top_p
):
    """Temperature 0.7 with top-k 20, or with top-p 0.9: the raw channel is SGLang's
    returned logprob, the processed one its sampling mask's, and HF recomputes both. (Both
    together differ by design: SGLang's top-p counts the mass of the distribution before
    top-k, HF's and vLLM's the renormalised top-k; docs/engines.md.)"""
    url, _ = server
    sampling = SamplingParams(max_tokens=16, temperature=0.7, top_k=top_k, top_p=top_p,
                              seed=3, logprobs_mode="processed")  # fmt: skip
    table = _rollout(url, tiny_model, prompts[:4], sampling)
    assert sglang_api.returns_original_logprobs(sglang_api.Connection(url), prompts[0])
    raw = HFScoringEngine().score(table, tiny_model, {})
    processed = HFScoringEngine().score(
        table, tiny_model, {"temperature": 0.7, "top_k": top_k, "top_p": top_p}
    )
    assert _max_diff(table.channels["rollout_raw"], raw.channels["replay"]) < 1e-5
    assert _max_diff(table.channels["rollout_processed"], processed.channels["replay"]) < 1e-5
    assert np.array_equal(table.channels["rollout"], table.channels["rollout_processed"])
    # processed and raw differ by far more than precision at this temperature
    assert _max_diff(table.channels["rollout_raw"], table.channels["rollout_processed"]) > 0.1
    applied = table.metadata["sampling_applied"]
    assert applied["returned_logprobs"] == "raw" and applied["top_k"] == (top_k or -1)


def test_scoring_agrees_with_hf_fp32(server, tiny_model, run_dir):
    url, _ = server
    fixture = read_table(run_dir / "fixture.parquet")
    replay = SGLangScoringEngine().score(
        fixture, tiny_model, {"url": url, "prompt_logprobs": True, "batch_size": 5}
    )
    hf = read_table(run_dir / "replay-float32.parquet")
    # Measured here: max 4.8e-7 over the completions.
    assert _max_diff(replay.channels["replay"], hf.channels["replay"]) < 1e-5
    assert replay.sequence_ids == fixture.sequence_ids
    hf_prompts = HFScoringEngine().score(fixture, tiny_model, {"prompt_logprobs": True})
    both = ~np.isnan(hf_prompts.prompt_logprobs)
    assert np.array_equal(both, ~np.isnan(replay.prompt_logprobs))
    assert _max_diff(replay.prompt_logprobs[both], hf_prompts.prompt_logprobs[both]) < 1e-5
    report = compare_tables(fixture, replay, "fixture", "sglang").report
    assert report.verdict == "pass"


def test_a_knob_the_server_does_not_run_with_is_named(server, tiny_model, prompts, tmp_path):
    """A server lpx did not start keeps its own settings: asked for chunked prefill at 64
    and no radix cache, it reports 4096 and its cache on, and lpx says so."""
    url, _ = server
    table = _rollout(url, tiny_model, prompts[:2], chunked_prefill_size="64", radix_cache="false")
    assert table.metadata["knobs_not_applied"] == {
        "chunked_prefill_size": {"requested": 64, "applied": 4096},
        "radix_cache": {"requested": False, "applied": True},
    }
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("The quick brown fox\nOnce upon a time\n")
    result = run_lpx("sweep", "--engine", "sglang", "--model", tiny_model, "--prompts",
                     prompts_file, "--max-tokens", "8", "--setting", f"base:url={url}",
                     "--setting", f"small-chunks:url={url},chunked_prefill_size=64",
                     "--out", tmp_path / "sweep")  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "small-chunks: SGLang did not apply chunked_prefill_size=64 (runs 4096)" in (
        result.output
    )


def test_weight_updates_tag_tokens_and_aborted_rollouts_resume(
    server, tiny_model, prompts, run_dir, tmp_path, monkeypatch
):
    """Seed 003 on the real server: a rollout in flight when version 2 is loaded from disk
    with --abort-running; its requests end with finish reason abort and are resumed under
    version 2, each token tagged with the version that sampled it. lpx replay
    --weights-store scores each token under its own version: clean; a fixture claiming the
    other version is named. Version 1 then goes back in by tensor."""
    monkeypatch.setenv("LPX_CACHE", str(tmp_path / "cache"))
    url, log = server
    store, _ = publish_one_step(tiny_model, run_dir / "fixture.parquet", tmp_path / "weights")
    long = SamplingParams(max_tokens=320, temperature=1.0, seed=7, ignore_eos=True)
    lines_before = log.read_text().count("Decode batch")
    result: dict = {}
    rolling = threading.Thread(
        target=lambda: result.update(
            table=_rollout(url, tiny_model, prompts[:6], long, concurrency=6)
        )  # fmt: skip
    )
    rolling.start()
    try:
        deadline = time.monotonic() + 120
        while log.read_text().count("Decode batch") <= lines_before + 1:  # 80 steps decoded
            assert time.monotonic() < deadline, "the rollout never started decoding"
            time.sleep(0.05)
        done = hot_load(url, store, "2", via="disk", abort_running=True)
        assert done == {**done, "server": "sglang", "version": "2"}
    finally:
        rolling.join(300)
    table = result["table"]
    versions = table.weight_versions.tolist()
    assert table.num_completion_tokens == 6 * 320
    for i in range(table.num_sequences):
        mine = versions[table.completion_slice(i)]
        switch = mine.index("2")
        assert 0 < switch and set(mine[:switch]) == {"1"} and set(mine[switch:]) == {"2"}
    assert table.finish_reasons == ["length"] * 6

    fixture = tmp_path / "fixture.parquet"
    write_table(table, fixture)
    replay = tmp_path / "replay.parquet"
    assert run_lpx("replay", fixture, "--weights-store", store, "--out", replay).exit_code == 0
    compared = run_lpx("compare", fixture, replay, "--allow-weight-mismatch",
                       "--out", tmp_path / "cmp")  # fmt: skip
    assert compared.exit_code == 0, compared.output
    report = read_report(tmp_path / "cmp")
    assert report["metrics"]["max_abs_diff"] < 1e-4  # decode on SGLang, prefill on HF
    assert {"1", "2"} <= set(report["metrics"]["by_weight_version"])

    lying = read_table(fixture)
    lying.weight_versions = np.full(lying.num_completion_tokens, "1", dtype=object)
    write_table(lying, tmp_path / "lying.parquet")
    replay = tmp_path / "replay-lying.parquet"
    assert run_lpx("replay", tmp_path / "lying.parquet", "--weights-store", store,
                   "--out", replay).exit_code == 0  # fmt: skip
    compared = run_lpx("compare", tmp_path / "lying.parquet", replay, "--allow-weight-mismatch",
                       "--out", tmp_path / "cmp-lying")  # fmt: skip
    assert compared.exit_code == 1
    causes = {f["cause"] for f in read_report(tmp_path / "cmp-lying")["diagnosis"]}
    assert "claimed_version" in causes

    done = hot_load(url, store, "1", via="tensor")
    assert done["server"] == "sglang" and done["version"] == "1"
    back = _rollout(url, tiny_model, prompts[:2])
    assert set(back.weight_versions) == {"1"}
    hf = HFScoringEngine().score(back, tiny_model, {})
    assert _max_diff(back.channels["rollout"], hf.channels["replay"]) < 1e-5


def test_lpx_starts_its_own_server_and_bf16_stays_within_the_calibrated_floor(
    sglang_python, tiny_model, run_dir, bf16_calibration, tmp_path
):
    out = tmp_path / "replay-sglang-bf16.parquet"
    result = run_lpx("replay", run_dir / "fixture.parquet", "--engine", "sglang",
                     "--dtype", "bf16", "--set", f"python={sglang_python}", "--out", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    replay = read_table(out)
    server = replay.metadata["engine"]["server"]
    assert server["started_by_lpx"] and Path(server["log"]).is_file()
    assert Path(server["log"]).parent == tmp_path / "replay-sglang-bf16.logs"
    assert replay.metadata["dtype"] == "bfloat16" and server["start_s"] > 0
    _assert_gone(server["log"])
    compared = run_lpx("compare", run_dir / "fixture.parquet", out, "--calibration",
                       bf16_calibration, "--out", tmp_path / "cmp")  # fmt: skip
    assert compared.exit_code == 0, compared.output
    metrics = read_report(tmp_path / "cmp")["metrics"]
    assert 1e-4 < metrics["mean_abs_diff"] < 0.05  # bf16 noise, not fp32 agreement


def test_an_interrupted_rollout_stops_the_server(sglang_python, tiny_model, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello\n")
    env = {**os.environ, "LPX_SGLANG_PYTHON": str(sglang_python)}
    process = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "rollout", "--engine", "sglang", "--model",
         str(tiny_model), "--prompts", str(prompts), "--out", str(tmp_path / "f.parquet")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    logs = tmp_path / "f.logs"
    deadline = time.monotonic() + 60
    while not (logs.is_dir() and any(logs.iterdir())):
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.1)
    time.sleep(3)  # SGLang is importing: its processes exist
    log = next(logs.iterdir())
    assert _group_members(_server_group(log))
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 130, output
    assert "Interrupted (SIGINT)" in output
    _assert_gone(log)
    assert not (tmp_path / "f.parquet").exists()


def test_a_missing_environment_or_a_dying_server_is_one_clear_error(tiny_model, tmp_path):
    with pytest.raises(BadInput, match="no such interpreter"):
        SGLangRolloutEngine().rollout(tiny_model, [[1, 2]], SAMPLING, {"python": "/no/python"})
    # an interpreter without SGLang: the server exits at once, and its log says why
    with pytest.raises(BadInput, match=r"exited \(1\) before it was ready.*sglang"):
        SGLangRolloutEngine().rollout(
            tiny_model, [[1, 2]], SAMPLING, {"python": sys.executable, "startup_timeout_s": 60}
        )


def _server_group(log) -> int:
    """The server's process group (lpx writes its pid, the group's leader, into the log)."""
    for line in Path(log).read_text().splitlines()[:3]:
        if line.startswith("# lpx: server pid "):
            return int(line.split()[4].rstrip(","))
    raise AssertionError(f"{log} names no server pid")


def _group_members(group: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == group and fields[0] != "Z":  # pgrp; zombies are gone
            members.append(int(stat.parent.name))
    return members


def _assert_gone(log) -> None:
    """No process of the server's group (launcher, scheduler, detokenizer) is left."""
    group = _server_group(log)
    deadline = time.monotonic() + 30
    while _group_members(group):
        assert time.monotonic() < deadline, f"SGLang processes left: {_group_members(group)}"
        time.sleep(0.2)

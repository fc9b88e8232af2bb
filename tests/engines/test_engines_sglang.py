"""The real SGLang server (0.5.23 on its torch path, in the environment scripts/setup makes):
sampling, teacher-forced scoring, weight updates from disk and from tensors, aborted partial
rollouts resumed across an update, the knobs read back, and lpx starting and stopping the
server itself.

One server is shared by the module: fp32 on the tiny Llama, as an RL deployment runs it
(returned logprobs temperature-scaled, SGLang's default), weight version 1, and server-side
sampling defaults (--preferred-sampling-params, the model's generation defaults as Qwen3
ships them) that fill what a request leaves out. lpx starts its own servers for the raw +
processed rollout, the bf16 replay and the interrupt. Where SGLang is not installed these
skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.compare.run import compare_tables
from pipeline.engines.base import SamplingParams
from pipeline.engines.hf.replay import HFScoringEngine
from pipeline.engines.metadata import model_metadata
from pipeline.engines.sglang import api as sglang_api
from pipeline.engines.sglang.engine import SGLangRolloutEngine, SGLangScoringEngine
from pipeline.errors import BadInput
from pipeline.fixture.io import read_table, write_table
from pipeline.fixture.table import table_from_sequences
from pipeline.weights.hot_load import hot_load
from support.helpers import publish_one_step, read_report, run_lpx, sglang_serving

pytestmark = [pytest.mark.sglang, pytest.mark.engine]

SAMPLING = SamplingParams(max_tokens=24, temperature=1.0, seed=0, samples_per_prompt=2)


# Qwen3's generation_config.json defaults, set server-side as a deployment may set them
GENERATION_DEFAULTS = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}


@pytest.fixture(scope="module")
def server(sglang_python, tiny_model, tmp_path_factory):
    """(url, log): SGLang on the tiny model in fp32, its first weights named version 1."""
    log = tmp_path_factory.mktemp("sglang") / "server.log"
    flags = f"--preferred-sampling-params '{json.dumps(GENERATION_DEFAULTS)}'"
    with sglang_serving(sglang_python, tiny_model, log, weight_version="1",
                        server_args=flags) as url:  # fmt: skip
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
    # every parameter that changes a logprob is sent: the server's defaults fill nothing
    applied = table.metadata["sampling_applied"]
    assert applied["server_preferred_sampling_params"] == GENERATION_DEFAULTS
    assert applied["taken_from_server_preferred"] == {}


def test_sglang_is_imported_once_and_only_the_served_model_s_module(server):
    """On a CPU host the launcher forks SGLang's scheduler and detokenizer, which then never
    import SGLang again, and SGLang finds the model's class among the modules lpx named
    (engines/sglang/launch.py): a start measured 41 CPU-s before, 16 with both. SGLang
    0.5.23 warns of AWQ once per process that imports it, and names each model module its
    full scan fails to import (four of them here)."""
    _, log = server
    text = log.read_text()
    assert text.count("UserWarning: Only CUDA, HIP and XPU support AWQ currently") == 1
    assert "Ignore import error when loading sglang.srt.models" not in text
    assert "type=LlamaForCausalLM" in text  # the class it loaded


@pytest.mark.parametrize("top_k, top_p", [(20, 1.0), (0, 0.9)])
def test_processed_logprobs_are_the_distribution_sampled_from(
    server, tiny_model, prompts, top_k, top_p
):
    """Temperature 0.7 with top-k 20, or with top-p 0.9 (sent as top-k = the vocabulary, so
    SGLang returns its sampling mask): the processed channel is the logprob under the
    distribution sampled from, as HF recomputes it. (Both together differ by design: SGLang's
    top-p counts the mass before top-k, HF's and vLLM's the renormalised top-k.) This server
    returns temperature-scaled logprobs, which lpx tells by asking it: no raw channel."""
    url, _ = server
    sampling = SamplingParams(max_tokens=16, temperature=0.7, top_k=top_k, top_p=top_p,
                              seed=3, logprobs_mode="processed")  # fmt: skip
    table = _rollout(url, tiny_model, prompts[:4], sampling)
    assert not sglang_api.returns_original_logprobs(sglang_api.Connection(url), prompts[0])
    processed = HFScoringEngine().score(
        table, tiny_model, {"temperature": 0.7, "top_k": top_k, "top_p": top_p}
    )
    assert _max_diff(table.channels["rollout_processed"], processed.channels["replay"]) < 1e-5
    assert np.array_equal(table.channels["rollout"], table.channels["rollout_processed"])
    assert "rollout_raw" not in table.channels
    applied = table.metadata["sampling_applied"]
    assert applied["returned_logprobs"] == "temperature-scaled"
    assert applied["top_k_sent"] == (top_k or 512)


def test_server_defaults_a_client_left_out_are_named_temperature(
    server, tiny_model, prompts, tmp_path
):
    """The generation-defaults fault, committed by the real server: a client that sends only
    max_new_tokens (as many RL loops do) is sampled under the server's defaults, and SGLang's
    returned logprobs are at temperature 0.6, while the rollout records temperature 1. lpx
    compare --model re-scores and names temperature 0.6, verified."""
    url, _ = server
    connection = sglang_api.Connection(url)
    completions, logprobs = [], []
    for index, prompt in enumerate(prompts[:8]):
        body = {"input_ids": prompt, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 24, "sampling_seed": index}}  # fmt: skip
        pieces = connection.request("POST", "/generate", body)["meta_info"]["output_token_logprobs"]
        completions.append([p[1] for p in pieces])
        logprobs.append([p[0] for p in pieces])
    believed = SamplingParams(max_tokens=24)  # what the client thought it asked for
    fixture = table_from_sequences(
        "fixture", [f"{i}-0" for i in range(8)], prompts[:8], completions,
        {"rollout": logprobs},
        metadata={"engine": {"name": "rl-loop", "role": "rollout"}, "dtype": "float32",
                  "sampling": believed.as_dict(), "model": model_metadata(tiny_model),
                  "position_id_rule": "arange"},
    )  # fmt: skip
    write_table(fixture, tmp_path / "fixture.parquet")
    replay = tmp_path / "replay.parquet"
    assert run_lpx("replay", tmp_path / "fixture.parquet", "--model", tiny_model,
                   "--out", replay).exit_code == 0  # fmt: skip
    compared = run_lpx("compare", tmp_path / "fixture.parquet", replay, "--model", tiny_model,
                       "--out", tmp_path / "cmp")  # fmt: skip
    assert compared.exit_code == 1, compared.output
    diagnosis = read_report(tmp_path / "cmp")["diagnosis"]
    (finding,) = [f for f in diagnosis if f["status"] == "verified"] or [diagnosis]
    assert finding["cause"] == "temperature" and finding["details"]["verified_by"]["side"] == (
        "rollout"
    )
    # measured: T 0.6 exactly, the rollout matched to mean |d| 9e-8 (drift 0.055)
    assert abs(finding["details"]["verified_by"]["params"]["T"] - 0.6) < 1e-3
    assert finding["details"]["verified_by"]["residual_after"] < 1e-5


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
    start = len(log.read_text())
    result: dict = {}
    rolling = threading.Thread(
        target=lambda: result.update(
            table=_rollout(url, tiny_model, prompts[:6], long, concurrency=6)
        )  # fmt: skip
    )
    rolling.start()
    try:
        # Abort only once all six requests decode together: a request still queued (or not yet
        # sent by its client thread) would sample its first token under version 2, and the
        # switch this test is about would not be inside it. CI once caught exactly that.
        deadline = time.monotonic() + 120
        while re.findall(r"Decode batch.*#running-req: (\d+)", log.read_text()[start:])[-1:] != [
            "6"
        ]:
            assert time.monotonic() < deadline, "the six requests never decoded together"
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


def test_lpx_starts_its_own_server_for_raw_and_processed_logprobs(
    sglang_python, tiny_model, tmp_path
):
    """lpx's own server returns raw logprobs (SGLANG_RETURN_ORIGINAL_LOGPROB=1), and the
    sampling mask gives the processed ones from the same requests; the log is kept beside the
    output and no process of the server outlives the command."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown fox\nOnce upon a time\nIn a galaxy far away\n")
    out = tmp_path / "fixture.parquet"
    result = run_lpx("rollout", "--engine", "sglang", "--model", tiny_model, "--prompts", prompts,
                     "--temperature", "0.7", "--top-k", "20", "-n", "2", "--max-tokens", "16",
                     "--set", f"python={sglang_python}", "--out", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    table = read_table(out)
    server = table.metadata["engine"]["server"]
    assert server["started_by_lpx"] and server["start_s"] > 0
    assert Path(server["log"]).parent == tmp_path / "fixture.logs"
    _assert_gone(server["log"])
    raw = HFScoringEngine().score(table, tiny_model, {})
    processed = HFScoringEngine().score(table, tiny_model, {"temperature": 0.7, "top_k": 20})
    assert _max_diff(table.channels["rollout_raw"], raw.channels["replay"]) < 1e-5
    assert _max_diff(table.channels["rollout_processed"], processed.channels["replay"]) < 1e-5
    assert np.array_equal(table.channels["rollout"], table.channels["rollout_raw"])
    assert _max_diff(table.channels["rollout_raw"], table.channels["rollout_processed"]) > 0.1
    assert table.metadata["sampling_applied"]["returned_logprobs"] == "raw"


def test_a_chunked_prefill_without_radix_cache_in_bf16_is_named_precision(
    sglang_python, tiny_model, run_dir, bf16_calibration, tmp_path
):
    """SGLang in bf16 with prefill chunks of 16 tokens and no radix cache, against the HF
    fp32 rollout: the schedule and the dtype move logprobs by bf16 noise, and lpx compare
    --model says precision, within the calibrated floor: a pass, not a fault."""
    out = tmp_path / "replay-sglang-bf16.parquet"
    result = run_lpx("replay", run_dir / "fixture.parquet", "--engine", "sglang",
                     "--dtype", "bf16", "--set", f"python={sglang_python}",
                     "--set", "chunked_prefill_size=16", "--set", "radix_cache=false",
                     "--out", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    replay = read_table(out)
    assert replay.metadata["dtype"] == "bfloat16"
    knobs = replay.metadata["knobs"]
    assert knobs["chunked_prefill_size"] == 16 and knobs["radix_cache"] is False
    assert replay.metadata["knobs_not_applied"] == {}
    _assert_gone(replay.metadata["engine"]["server"]["log"])
    compared = run_lpx("compare", run_dir / "fixture.parquet", out, "--model", tiny_model,
                       "--calibration", bf16_calibration, "--out", tmp_path / "cmp")  # fmt: skip
    assert compared.exit_code == 0, compared.output
    report = read_report(tmp_path / "cmp")
    assert 1e-4 < report["metrics"]["mean_abs_diff"] < 0.05  # bf16 noise, not fp32 agreement
    causes = {f["cause"] for f in report["diagnosis"]}
    assert causes <= {"dtype"}, report["diagnosis"]


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


def test_a_server_that_refuses_an_argument_is_named_by_argparse_s_sentence(tiny_model):
    """SGLang prints ~480 lines of usage before the sentence that says why; the error is that
    sentence (it was the usage's last lines, then the sentence)."""
    with pytest.raises(BadInput) as refused:
        SGLangRolloutEngine().rollout(
            tiny_model, [[1, 2]], SAMPLING, {"server_args": "--attention-backend nonsense"}
        )
    message = refused.value.format_message()
    assert message.startswith(
        "SGLang's server exited (2) before it was ready: error: argument --attention-backend: "
        "invalid choice: 'nonsense' (choose from "
    )
    assert "usage" not in message and "--tool-call-parser" not in message and "\n" not in message


# Stands in for SGLang's interpreter in the port test: it binds --port as uvicorn would and
# answers /health, so the bind that fails is the kernel's own "Address already in use".
STAND_IN_SERVER = """#!{python}
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

try:
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
except OSError as error:
    print(f"ERROR: [Errno {{error.errno}}] error while attempting to bind: {{error.strerror}}")
    sys.stdout.flush()
    import time
    time.sleep(600)  # as SGLang's launcher does: the scheduler keeps it alive
server.serve_forever()
"""


def test_a_port_taken_before_the_server_binds_it_is_retried_at_once(tmp_path, monkeypatch):
    """The CI failure of 2026-11-27: another process took the port between lpx picking it and
    SGLang binding it, and lpx waited its 600 s startup for a server that never answered."""
    import socket

    from pipeline.engines.sglang import server as sglang_server

    stand_in = tmp_path / "stand-in-sglang-python"
    stand_in.write_text(STAND_IN_SERVER.format(python=sys.executable))
    stand_in.chmod(0o755)
    # bound, not listening: the stand-in's bind fails all the same, and lpx's health probe is
    # refused at once instead of waiting out its 5 s timeout on a socket that never answers
    taken = [socket.socket() for _ in range(sglang_server.PORT_TRIES)]
    for sock in taken:
        sock.bind(("127.0.0.1", 0))
    taken_ports = [sock.getsockname()[1] for sock in taken]
    free = sglang_server._free_port
    picks = iter(taken_ports[:2])
    monkeypatch.setattr(sglang_server, "_free_port", lambda: next(picks, None) or free())
    words = []
    began = time.monotonic()
    with sglang_server.running_server(stand_in, [], tmp_path / "server.log", startup_s=600,
                                      say=words.append) as server:  # fmt: skip
        assert int(server.url.rsplit(":", 1)[1]) not in taken_ports
        assert time.monotonic() - began < 60  # not the 600 s startup
    assert sum("port was taken" in word for word in words) == 2
    # every port taken: one clear error, after PORT_TRIES starts
    picks = iter(taken_ports)
    monkeypatch.setattr(sglang_server, "_free_port", lambda: next(picks))
    with pytest.raises(BadInput, match=r"could not bind a loopback port in 3 tries.*bind"):
        with sglang_server.running_server(stand_in, [], tmp_path / "server.log", startup_s=600):
            pass
    for sock in taken:
        sock.close()


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


def test_torchvision_imports_beside_the_cpu_torch_only_with_the_guard(sglang_python):
    """The one workaround SGLang's import needs here (pipeline/torchvision_guard.py): without
    it the pinned torchvision fails to import beside torch 2.13's CPU build; with it (any
    process that imported `pipeline`) transformers' image utilities and SGLang's configs
    import."""
    bare = subprocess.run([str(sglang_python), "-c", "import torchvision"],
                          capture_output=True, text=True)  # fmt: skip
    assert bare.returncode != 0 and "operator torchvision::nms does not exist" in bare.stderr
    guarded = subprocess.run(
        [str(sglang_python), "-c", "import pipeline, torchvision, transformers.image_utils; "
         "import sglang.srt.configs; from pipeline.torchvision_guard import OPERATORS; "
         "import torch; print(sorted(n for n in OPERATORS if torch.ops.torchvision.__getattr__(n)))"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert guarded.returncode == 0, guarded.stderr[-800:]
    assert guarded.stdout.strip().splitlines()[-1] == "['nms', 'qnms']"

"""`lpx serve` for real: the server process on the tiny model on a free loopback port,
scored through the `logprob-server` engine and raw HTTP. Logprobs against the in-process HF
replay; weight updates under concurrent load, re-scored to prove each answer's version;
backpressure, timeouts, disconnects and malformed requests answered with a clear 4xx/5xx
while the server keeps serving."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from pipeline.engines.hf_common import load_model
from pipeline.engines.hf_replay import HFScoringEngine, ReplayKnobs, score_batch
from pipeline.engines.logprob_server import LogprobServerEngine
from pipeline.fingerprint import tensor_fingerprint
from pipeline.fixture.io import read_table
from pipeline.serve.process import ServerFailed, serving
from pipeline.tinymodel.build import build_tiny_model


@contextlib.contextmanager
def served(model_dir, *options, tmp_path):
    try:
        with serving(model_dir, *options, log_path=tmp_path / f"serve-{time.time_ns()}.log") as url:
            yield url
    except ServerFailed as failed:
        pytest.fail(str(failed))


def call(url, method, path, body=None, timeout=60):
    """(status, decoded JSON or text, headers) without raising on 4xx/5xx."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw, status, headers = response.read(), response.status, response.headers
    except urllib.error.HTTPError as error:
        raw, status, headers = error.read(), error.code, error.headers
    try:
        return status, json.loads(raw), headers
    except json.JSONDecodeError:
        return status, raw.decode(), headers


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with served(tiny_model, tmp_path=tmp_path_factory.mktemp("serve")) as url:
        yield url


def test_served_logprobs_equal_the_in_process_hf_replay(server, run_dir, tiny_model):
    fixture = read_table(run_dir / "fixture.parquet")
    replay = read_table(run_dir / "replay-float32.parquet")
    served_replay = LogprobServerEngine().score(
        fixture, tiny_model, {"url": server, "batch_size": "5"}
    )
    d = np.abs(served_replay.channels["replay"] - replay.channels["replay"])
    # other batch compositions (right padding, masked) leave fp32 on CPU bit-identical
    assert float(d.max()) == 0.0
    assert served_replay.metadata["engine"]["name"] == "logprob-server"
    held = served_replay.metadata["weights"]["held_tensor_fingerprint"]
    assert held.startswith("sha256:") and served_replay.metadata["weight_version"]


def test_replay_command_through_the_server_passes_compare(server, run_dir, tiny_model, tmp_path):
    from tests.helpers import read_report, run_lpx

    out = tmp_path / "served.parquet"
    result = run_lpx(
        "replay", run_dir / "fixture.parquet", "--engine", "logprob-server", "--model", tiny_model,
        "--set", f"url={server}", "--out", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    result = run_lpx("compare", run_dir / "fixture.parquet", out, "--out", tmp_path / "cmp")
    assert result.exit_code == 0, result.output
    assert read_report(tmp_path / "cmp")["metrics"]["max_abs_diff"] < 1e-5


def test_malformed_requests_get_a_clear_4xx_and_the_server_keeps_serving(server):
    good = {"sequences": [{"prompt_ids": [1, 5, 9], "completion_ids": [7, 8]}]}
    cases = [
        ({"sequences": [{"prompt_ids": "abc", "completion_ids": [1]}]}, 422, "prompt_ids"),
        ({"sequences": [{"prompt_ids": [1], "completion_ids": []}]}, 422, "completion_ids"),
        ({"sequences": [{"id": "s7", "prompt_ids": [1], "completion_ids": [10**6]}]}, 400, "s7"),
        ({"sequences": [{"prompt_ids": [1], "completion_ids": [2], "extra": 1}]}, 422, "extra"),
        ({"sequences": []}, 422, "sequences"),
        (
            {"sequences": [{"prompt_ids": [1], "completion_ids": [2]}] * 1025},
            413,
            "split the batch",
        ),
    ]
    for body, status, mentioned in cases:
        got, answer, _ = call(server, "POST", "/score", body)
        assert got == status, answer
        assert mentioned in json.dumps(answer)
    got, answer, _ = call(server, "POST", "/score", good)
    assert got == 200 and len(answer["results"][0]["logprobs"]) == 2
    assert call(server, "GET", "/health")[1]["status"] == "ok"


def test_prompt_logprobs_on_request(server, tiny_model):
    body = {
        "sequences": [{"prompt_ids": [1, 5, 9], "completion_ids": [7, 8]}],
        "prompt_logprobs": True,
    }
    status, answer, _ = call(server, "POST", "/score", body)
    assert status == 200
    prompt = answer["results"][0]["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == 3 and all(v < 0 for v in prompt[1:])


def _local_scores(model, pairs):
    scored = score_batch(model, pairs, ReplayKnobs(micro_batch_size=len(pairs)))
    return [s.completion for s in scored]


def test_updates_under_concurrent_load_never_mix_versions(server, tiny_model, run_dir, tmp_path):
    """Clients score while the weights change twice (v1 -> v2 -> v1): every answer's version
    is the one whose weights reproduce its logprobs; no request lost or answered twice."""
    other = build_tiny_model(tmp_path / "seed1", "llama", 1)
    (other / "WEIGHT_VERSION").write_text("v2\n")
    fixture = read_table(run_dir / "fixture.parquet")
    pairs = [(fixture.prompt_of(i), fixture.completion_of(i)) for i in range(6)]
    body = {
        "sequences": [
            {"id": f"{j}", "prompt_ids": p.tolist(), "completion_ids": c.tolist()}
            for j, (p, c) in enumerate(pairs)
        ]
    }
    answers, errors, stop = [], [], threading.Event()

    def client(n):
        while not stop.is_set():
            status, answer, _ = call(server, "POST", "/score", body)
            (answers if status == 200 else errors).append((n, status, answer))

    threads = [threading.Thread(target=client, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    first = call(server, "GET", "/health")[1]["weight_version"]
    status, update, _ = call(server, "POST", "/update_weights", {"path": str(other)})
    assert status == 200 and update["weight_version"] == "v2", update
    time.sleep(0.5)
    assert call(server, "POST", "/pause")[0] == 200
    paused_count = len(answers)
    time.sleep(0.3)
    assert len(answers) <= paused_count + 4  # only requests already scored come back
    status, update, _ = call(
        server, "POST", "/update_weights", {"path": str(tiny_model), "version": "v1"}
    )
    assert status == 200
    assert call(server, "POST", "/resume")[0] == 200
    time.sleep(0.5)
    stop.set()
    for thread in threads:
        thread.join(60)
    assert not errors, errors[:3]
    seen = {a["weight_version"] for _, _, a in answers}
    assert seen == {first, "v2", "v1"}, seen
    expected = {
        first: _local_scores(load_model(tiny_model), pairs),
        "v1": _local_scores(load_model(tiny_model), pairs),
        "v2": _local_scores(load_model(other), pairs),
    }
    for _, _, answer in answers:
        ids = [r["id"] for r in answer["results"]]
        assert ids == [str(j) for j in range(6)]  # every sequence once, in order
        want = expected[answer["weight_version"]]
        for result, logprobs in zip(answer["results"], want, strict=True):
            np.testing.assert_allclose(result["logprobs"], logprobs, atol=1e-5)
    metrics = call(server, "GET", "/metrics")[1]
    assert 'lpx_weight_version_info{fingerprint="sha256:' in metrics and 'version="v1"' in metrics
    assert "lpx_weight_updates_total 2.0" in metrics


def test_backpressure_timeouts_and_disconnects(tiny_model, tmp_path):
    with served(tiny_model, "--max-queue", "4", tmp_path=tmp_path) as url:
        one = {"prompt_ids": [1, 5], "completion_ids": [7, 8]}
        assert call(url, "POST", "/pause")[0] == 200
        # a held request past its deadline: 504, and its sequences leave the queue
        status, answer, _ = call(url, "POST", "/score", {"sequences": [one], "timeout_s": 0.3})
        assert status == 504 and "0.3" in answer["error"]
        assert call(url, "GET", "/health")[1]["queue_depth"] == 0

        # a client that hangs up while held: its sequences leave the queue too
        def hang_up():
            with contextlib.suppress(TimeoutError):
                call(url, "POST", "/score", {"sequences": [one] * 3}, timeout=0.5)

        held = threading.Thread(target=hang_up)
        held.start()
        time.sleep(0.2)
        assert call(url, "GET", "/health")[1]["queue_depth"] == 3
        status, answer, headers = call(url, "POST", "/score", {"sequences": [one] * 2})
        assert status == 429 and headers["Retry-After"] and "4" in answer["error"]
        held.join()
        deadline = time.monotonic() + 5
        while call(url, "GET", "/health")[1]["queue_depth"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert call(url, "GET", "/health")[1]["queue_depth"] == 0
        assert call(url, "POST", "/resume")[0] == 200
        assert call(url, "POST", "/score", {"sequences": [one]})[0] == 200
        metrics = call(url, "GET", "/metrics")[1]
        assert 'lpx_requests_total{code="429"} 1.0' in metrics
        assert 'lpx_requests_total{code="504"} 1.0' in metrics
        status, answer, _ = call(url, "POST", "/update_weights", {"path": str(tmp_path)})
        assert status == 400 and "config.json" in answer["error"]


def test_reject_when_paused_answers_503_with_retry_after(tiny_model, tmp_path):
    with served(tiny_model, "--reject-when-paused", tmp_path=tmp_path) as url:
        assert call(url, "POST", "/pause")[0] == 200
        body = {"sequences": [{"prompt_ids": [1], "completion_ids": [2]}]}
        status, answer, headers = call(url, "POST", "/score", body)
        assert status == 503 and headers["Retry-After"] == "1" and "paused" in answer["error"]
        call(url, "POST", "/resume")
        assert call(url, "POST", "/score", body)[0] == 200


def test_the_client_spreads_batches_over_replicas(server, tiny_model, run_dir, tmp_path):
    fixture = read_table(run_dir / "fixture.parquet")
    with served(tiny_model, tmp_path=tmp_path) as second:
        before = [_scored_tokens(u) for u in (server, second)]
        table = LogprobServerEngine().score(
            fixture, tiny_model, {"url": f"{server},{second}", "batch_size": "4"}
        )
        after = [_scored_tokens(u) for u in (server, second)]
    gained = [a - b for a, b in zip(after, before, strict=True)]
    assert all(g > 0 for g in gained) and sum(gained) == len(fixture.completion_ids)
    assert table.metadata["layout"]["replicas"] == 2


NGINX_EXAMPLE = Path(__file__).parents[1] / "examples" / "logprob-lb" / "nginx.conf"


@pytest.fixture
def nginx_binary() -> str:
    binary = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if binary is None:
        message = "nginx is missing: scripts/setup installs Debian's nginx-light"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return binary


@contextlib.contextmanager
def behind_nginx(binary, replicas, tmp_path):
    """examples/logprob-lb/nginx.conf with its upstream set to these replicas, in the
    foreground on a free loopback port; yields its URL."""
    conf = NGINX_EXAMPLE.read_text()
    upstream = "".join(f"server {url.removeprefix('http://')};\n        " for url in replicas)
    port = _unused_port()
    conf = conf.replace("server logprob-server:8400;\n        ", upstream)
    conf = conf.replace("listen 8400;", f"listen 127.0.0.1:{port};")
    assert upstream in conf and str(port) in conf, "the example's upstream or listen line moved"
    prefix = tmp_path / f"nginx-{port}"
    prefix.mkdir()
    (prefix / "nginx.conf").write_text(conf)
    log = open(prefix / "log", "w")
    process = subprocess.Popen(
        [binary, "-p", str(prefix), "-e", "stderr", "-c", str(prefix / "nginx.conf")],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not _answers(url + "/health"):
            assert process.poll() is None, (prefix / "log").read_text()
            assert time.monotonic() < deadline, (prefix / "log").read_text()
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(30)
        log.close()


def _answers(url) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def test_replicas_behind_nginx_answer_as_one_server(
    server, tiny_model, run_dir, tmp_path, nginx_binary
):
    """Scale-out with an existing load balancer: two replicas behind the example nginx
    config equal the in-process replay bit for bit, both take work, and a replica that
    rejects while paused (503) is skipped without the client seeing it."""
    fixture = read_table(run_dir / "fixture.parquet")
    replay = read_table(run_dir / "replay-float32.parquet")
    with (
        served(tiny_model, "--reject-when-paused", tmp_path=tmp_path) as second,
        behind_nginx(nginx_binary, [server, second], tmp_path) as lb,
    ):
        before = [_scored_tokens(u) for u in (server, second)]
        table = LogprobServerEngine().score(
            fixture, tiny_model, {"url": lb, "batch_size": "2", "concurrency": "4"}
        )
        after = [_scored_tokens(u) for u in (server, second)]
        gained = [a - b for a, b in zip(after, before, strict=True)]
        assert all(g > 0 for g in gained), gained  # least_conn under 4 requests in flight
        assert sum(gained) == len(fixture.completion_ids)
        assert float(np.abs(table.channels["replay"] - replay.channels["replay"]).max()) == 0.0

        body = {"sequences": [{"prompt_ids": [1, 5, 9], "completion_ids": [7, 8]}]}
        answered_by = {call(lb, "POST", "/score", body)[2]["X-Lpx-Upstream"] for _ in range(8)}
        assert answered_by == {server.removeprefix("http://"), second.removeprefix("http://")}
        assert call(second, "POST", "/pause")[0] == 200
        answers = [call(lb, "POST", "/score", body) for _ in range(8)]
        assert [status for status, _, _ in answers] == [200] * 8
        # the paused replica answered 503 and nginx went on to the other one
        assert any("," in headers["X-Lpx-Upstream"] for _, _, headers in answers)
        call(second, "POST", "/resume")


def _scored_tokens(url) -> float:
    metrics = call(url, "GET", "/metrics")[1]
    line = next(line for line in metrics.splitlines() if line.startswith("lpx_scored_tokens_total"))
    return float(line.split()[-1])


@pytest.mark.parametrize(
    "engine",
    [["--engine", "fsdp"], ["--engine", "megatron", "--set", "tensor_parallel_size=2"]],
    ids=["fsdp", "megatron-tp2"],
)
def test_a_two_rank_server_equals_hf_and_updates_on_every_rank(
    engine, tiny_model, run_dir, tmp_path
):
    fixture = read_table(run_dir / "fixture.parquet")
    replay = read_table(run_dir / "replay-float32.parquet")
    other = build_tiny_model(tmp_path / "seed1", "llama", 1)
    with served(tiny_model, *engine, "--nproc", "2", tmp_path=tmp_path) as url:
        health = call(url, "GET", "/health")[1]
        assert health["engine"] == engine[1] and health["status"] == "ok"
        served_replay = LogprobServerEngine().score(
            fixture, tiny_model, {"url": url, "batch_size": "5"}
        )
        d = np.abs(served_replay.channels["replay"] - replay.channels["replay"])
        assert float(d.max()) <= 1e-5  # 2 gloo ranks vs HF, fp32: measured ~1e-6
        # the gathered full weights are the checkpoint's: the fingerprint HF computes too
        hf_fingerprint = tensor_fingerprint(load_model(tiny_model).state_dict().items())
        assert served_replay.metadata["weights"]["held_tensor_fingerprint"] == hf_fingerprint
        status, update, _ = call(
            url, "POST", "/update_weights", {"path": str(other), "version": "v2"}
        )
        assert status == 200 and update["weight_version"] == "v2", update
        pairs = [(fixture.prompt_of(i), fixture.completion_of(i)) for i in range(3)]
        body = {
            "sequences": [
                {"prompt_ids": p.tolist(), "completion_ids": c.tolist()} for p, c in pairs
            ]
        }
        status, answer, _ = call(url, "POST", "/score", body)
        assert status == 200 and answer["weight_version"] == "v2"
        for result, want in zip(
            answer["results"], _local_scores(load_model(other), pairs), strict=True
        ):
            np.testing.assert_allclose(result["logprobs"], want, atol=1e-5)


def test_serve_from_a_weight_store_scores_each_version_it_loads(run_dir, tiny_model, tmp_path):
    """`lpx serve --model STORE` serves the store's latest; /update_weights {"path": STORE,
    "version": V} pulls, verifies and loads V. Each version's answers equal the in-process
    HF replay of that version's weights bit for bit, and carry its name."""
    from pipeline.weights.store import publish

    other = build_tiny_model(tmp_path / "seed1", "llama", 1)
    store = tmp_path / "store"
    publish(tiny_model, store)  # version 1
    publish(other, store, delta=True)  # version 2: every tensor differs, so stored full
    fixture = read_table(run_dir / "fixture.parquet")
    in_process = {
        "1": read_table(run_dir / "replay-float32.parquet").channels["replay"],
        "2": HFScoringEngine().score(fixture, other, {}).channels["replay"],
    }
    engine = LogprobServerEngine()
    with served(store, tmp_path=tmp_path) as url:
        assert call(url, "GET", "/health")[1]["weight_version"] == "2"
        for version in ("2", "1", "2"):
            if version != call(url, "GET", "/health")[1]["weight_version"]:
                status, update, _ = call(
                    url, "POST", "/update_weights", {"path": str(store), "version": version}
                )
                assert status == 200 and update["weight_version"] == version, update
            scored = engine.score(fixture, tiny_model, {"url": url})
            assert scored.metadata["weight_version"] == version
            d = np.abs(scored.channels["replay"] - in_process[version])
            assert float(d.max()) == 0.0, version
        assert float(np.abs(in_process["1"] - in_process["2"]).max()) > 0.1  # they differ
        status, answer, _ = call(
            url, "POST", "/update_weights", {"path": str(store), "version": "7"}
        )
        assert status == 400 and "7" in answer["error"]
        assert call(url, "GET", "/health")[1]["weight_version"] == "2"


def test_serve_refuses_a_directory_that_is_no_model(tmp_path):
    from tests.helpers import run_lpx

    (tmp_path / "empty").mkdir()
    result = run_lpx("serve", "--model", tmp_path / "empty", "--port", _unused_port())
    assert result.exit_code == 2 and "no config.json" in result.output
    result = run_lpx("serve", "--model", tmp_path / "missing")
    assert result.exit_code == 2 and "does not exist" in result.output


def _unused_port() -> int:
    from pipeline.serve.process import free_port

    return free_port()

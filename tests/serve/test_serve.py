"""`lpx serve` for real: the server process on the tiny model on a free loopback port,
scored through the `logprob-server` engine and raw HTTP. Logprobs against the in-process HF
replay; weight updates under concurrent load, re-scored to prove each answer's version;
backpressure, timeouts, disconnects and malformed requests answered with a clear 4xx/5xx
while the server keeps serving; bad requests mixed into a load, and a replica killed under
load behind nginx, with no good answer lost or wrong. Port and bind errors exit 2 before the
model loads. The HTTP API's fuzz is tests/serve/test_serve_fuzz.py."""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from pipeline.engines.hf.model import load_model
from pipeline.engines.hf.replay import HFScoringEngine, ReplayKnobs, score_batch
from pipeline.engines.logprob_server.replay import LogprobServerEngine
from pipeline.fingerprint import tensor_fingerprint
from pipeline.fixture.io import read_table
from pipeline.serve.process import ServerFailed, server_process, serving
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


def post(url, path, data: bytes, headers=None, timeout=60, chunked: bool = False):
    """(status, decoded JSON or text) of a POST of any bytes with exactly these headers;
    ``chunked``: sent as Transfer-Encoding chunked, without a Content-Length."""
    where = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=timeout)
    body = (data[k : k + 8192] for k in range(0, len(data), 8192)) if chunked else data
    try:
        connection.request("POST", path, body=body, headers=headers or {}, encode_chunked=chunked)
        response = connection.getresponse()
        status, raw = response.status, response.read()
    finally:
        connection.close()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


JSON = {"Content-Type": "application/json"}
VOCAB = 512  # the tiny model's
MAX_POSITIONS = 1024  # its max_position_embeddings


def _body(*sequences, **fields) -> bytes:
    return json.dumps({"sequences": list(sequences), **fields}).encode()


def _sequence(prompt=None, completion=None, **fields) -> dict:
    prompt = [1, 5, 9] if prompt is None else prompt
    completion = [7, 8] if completion is None else completion
    return {"prompt_ids": prompt, "completion_ids": completion, **fields}


# (name, body, headers, status, the field the answer names): every field and every way in
BAD_REQUESTS = [
    ("id 2**70", _body(_sequence(completion=[7, 2**70])), JSON, 400, "sequences[0].completion_ids[1]"),
    ("id 2**63", _body(_sequence(prompt=[2**63])), JSON, 400, "sequences[0].prompt_ids[0]"),
    ("id 2**31", _body(_sequence(), _sequence(prompt=[1, 2**31])), JSON, 400, "sequences[1].prompt_ids[1]"),
    ("id -1", _body(_sequence(prompt=[3, -1])), JSON, 400, "sequences[0].prompt_ids[1]"),
    ("id = vocab", _body(_sequence(completion=[VOCAB])), JSON, 400, "sequences[0].completion_ids[0]"),
    ("id 1.0", _body(_sequence(prompt=[1.0])), JSON, 422, "sequences[0].prompt_ids[0]"),
    ("id true", _body(_sequence(completion=[2, True])), JSON, 422, "sequences[0].completion_ids[1]"),
    ("id '5'", _body(_sequence(prompt=["5"])), JSON, 422, "sequences[0].prompt_ids[0]"),
    ("ids null", _body({"prompt_ids": None, "completion_ids": [1]}), JSON, 422, "sequences[0].prompt_ids"),
    ("ids empty", _body(_sequence(completion=[])), JSON, 422, "sequences[0].completion_ids"),
    ("ids missing", _body({"prompt_ids": [1]}), JSON, 422, "sequences[0].completion_ids"),
    ("sequences empty", _body(), JSON, 422, "sequences"),
    ("sequences object", b'{"sequences": {"a": 1}}', JSON, 422, "sequences"),
    ("sequences missing", b'{"prompt_logprobs": true}', JSON, 422, "sequences"),
    ("unknown field", _body(_sequence(), temperature=0.7), JSON, 422, "temperature"),
    ("unknown sequence field", _body(_sequence(mask=[1])), JSON, 422, "sequences[0].mask"),
    ("id a number", _body(_sequence(id=5)), JSON, 422, "sequences[0].id"),
    ("id too long", _body(_sequence(id="x" * 1025)), JSON, 422, "sequences[0].id"),
    ("prompt_logprobs 'yes'", _body(_sequence(), prompt_logprobs="yes"), JSON, 422, "prompt_logprobs"),
    ("timeout_s 0", _body(_sequence(), timeout_s=0), JSON, 422, "timeout_s"),
    ("timeout_s -1", _body(_sequence(), timeout_s=-1), JSON, 422, "timeout_s"),
    ("timeout_s a year", _body(_sequence(), timeout_s=3.2e7), JSON, 422, "timeout_s"),
    ("timeout_s '30'", _body(_sequence(), timeout_s="30"), JSON, 422, "timeout_s"),
    ("timeout_s NaN", b'{"sequences": [{"prompt_ids": [1], "completion_ids": [2]}], "timeout_s": NaN}', JSON, 400, "body"),
    ("timeout_s 1e999", b'{"sequences": [{"prompt_ids": [1], "completion_ids": [2]}], "timeout_s": 1e999}', JSON, 400, "body"),
    ("a list", b"[1, 2]", JSON, 422, "body"),
    ("a number", b"17", JSON, 422, "body"),
    ("not JSON", b"sequences=1", JSON, 400, "body"),
    ("empty", b"", JSON, 400, "body"),
    ("truncated", _body(_sequence())[:-9], JSON, 400, "body"),
    ("nested 100000 deep", b"[" * 100000 + b"]" * 100000, JSON, 400, "body"),
    ("5000 digits", b'{"sequences": [{"prompt_ids": [' + b"7" * 5000 + b'], "completion_ids": [1]}]}', JSON, 400, "body"),
    ("not UTF-8", b'{"sequences": [{"id": "\xff\xfe", "prompt_ids": [1]}]}', JSON, 400, "body"),
    ("form content type", _body(_sequence()), {"Content-Type": "application/x-www-form-urlencoded"}, 415, "Content-Type"),
    ("text content type", _body(_sequence()), {"Content-Type": "text/plain"}, 415, "Content-Type"),
    ("1025 sequences", _body(*[_sequence()] * 1025), JSON, 413, "sequences"),
    ("over max positions", _body(_sequence(), _sequence(prompt=[1] * 1000, completion=[2] * 25)), JSON, 413, "sequences[1]"),
]  # fmt: skip


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
    from support.helpers import read_report, run_lpx

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


def test_every_bad_field_is_a_4xx_naming_it_and_health_answers_after_each(server):
    """Each way a request can be wrong (BAD_REQUESTS) is refused with its 4xx and a JSON
    error whose `field` names the field and the index of the bad item, never a 500 (a token
    id of 2**70 was one); /health answers after every one."""
    wrong = []
    for name, body, headers, status, field in BAD_REQUESTS:
        got, answer = post(server, "/score", body, headers)
        if got != status or not isinstance(answer, dict) or answer.get("field") != field:
            wrong.append((name, got, answer))
        elif field != "body" and field not in answer["error"]:
            wrong.append((name, "the message does not name the field", answer))
        health = call(server, "GET", "/health")
        assert health[0] == 200 and health[1]["status"] == "ok", (name, health)
    assert not wrong, wrong
    status, answer = post(server, "/score", _body(_sequence(id="s7", completion=[7, 2**70])), JSON)
    assert "sequence s7" in answer["error"] and "2**70" not in answer["error"]
    assert "[0, 512)" in answer["error"]  # the model's vocabulary, and what to send instead


def test_update_weights_fields_and_unknown_endpoints_answer_json_errors(server):
    for body, field in [
        (b'{"path": "a\\u0000b"}', "path"),
        (b'{"path": ""}', "path"),
        (b'{"path": 7}', "path"),
        (b'{"path": "/tmp", "version": ""}', "version"),
        (b'{"path": "/tmp", "colour": 1}', "colour"),
        (json.dumps({"path": "a" * 300}).encode(), "path"),  # was a 500: File name too long
        (b'{"path": "/nonexistent/model"}', "path"),
        (b"{", "body"),
    ]:
        status, answer = post(server, "/update_weights", body, JSON)
        assert 400 <= status < 500 and answer["field"] == field, (body, status, answer)
    assert call(server, "GET", "/nowhere")[:2] == (404, {"error": ANY_ENDPOINTS_404})
    status, answer, _ = call(server, "GET", "/score")
    assert status == 405 and "POST /score" in answer["error"]
    assert call(server, "GET", "/health")[1]["status"] == "ok"


ANY_ENDPOINTS_404 = (
    "Not Found: the endpoints are POST /score, /capture, /pause, /resume, /update_weights and "
    "GET /health, /metrics, /capture"
)


def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    """Content-Length over --max-body-bytes (128 MiB by default) is refused on the headers:
    the body is never sent, let alone parsed."""
    where = urllib.parse.urlsplit(server)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
    connection.putrequest("POST", "/score")
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(200 * 2**20))
    connection.endheaders()
    response = connection.getresponse()
    answer = json.loads(response.read())
    connection.close()
    assert response.status == 413 and answer["field"] == "body"
    assert str(128 * 2**20) in answer["error"] and "--max-body-bytes" in answer["error"]
    assert call(server, "GET", "/health")[1]["status"] == "ok"


def test_prompt_logprobs_only_for_the_requests_that_ask(server):
    """Requests batched together: only the one that asked gets prompt logprobs."""
    plain = _body(_sequence(prompt=[4, 4, 4]))
    asking = _body(_sequence(prompt=[4, 4, 5]), prompt_logprobs=True)
    answers = [None] * 8

    def send(k):
        answers[k] = post(server, "/score", asking if k % 2 else plain, JSON)

    threads = [threading.Thread(target=send, args=(k,)) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for k, (status, answer) in enumerate(answers):
        assert status == 200
        assert ("prompt_logprobs" in answer["results"][0]) == bool(k % 2), (k, answer)


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


def _good_requests(count: int, seed: int) -> list[list[tuple[list[int], list[int]]]]:
    """``count`` requests of 1-4 (prompt, completion) pairs of 1-40 tokens each."""
    rng = np.random.default_rng(seed)
    return [
        [
            (rng.integers(0, VOCAB, rng.integers(1, 41)).tolist(),
             rng.integers(0, VOCAB, rng.integers(1, 41)).tolist())
            for _ in range(rng.integers(1, 5))
        ]
        for _ in range(count)
    ]  # fmt: skip


def _score_body(pairs) -> bytes:
    return _body(*(_sequence(prompt=p, completion=c, id=f"s{j}") for j, (p, c) in enumerate(pairs)))


def _run_load(url, plan, clients: int) -> list:
    """Send each (kind, index, body, headers) of ``plan`` from ``clients`` threads; the
    answers as (kind, index, status, answer, upstream header), in completion order."""
    todo = list(enumerate(plan))
    answers, lock = [], threading.Lock()

    def client():
        while True:
            with lock:
                if not todo:
                    return
                _, (kind, index, body, headers) = todo.pop()
            where = urllib.parse.urlsplit(url)
            connection = http.client.HTTPConnection(where.hostname, where.port, timeout=120)
            try:
                connection.request("POST", "/score", body=body, headers=headers)
                response = connection.getresponse()
                raw, status = response.read(), response.status
                upstream = response.getheader("X-Lpx-Upstream", "")
            except OSError as failure:  # a lost answer: counted, never raised here
                raw, status, upstream = str(failure).encode(), None, ""
            finally:
                connection.close()
            try:
                answer = json.loads(raw)
            except ValueError:
                answer = raw.decode(errors="replace")
            with lock:
                answers.append((kind, index, status, answer, upstream))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    return answers


def test_bad_requests_mixed_into_a_load_lose_no_good_answer(server, tiny_model):
    """8 clients send 240 good requests and 120 bad ones (BAD_REQUESTS, each several
    times) in a shuffled order: every good one is answered 200 with the logprobs of the
    in-process HF replay of its sequences, every bad one with its own 4xx."""
    goods = _good_requests(24, seed=22)
    model = load_model(tiny_model)
    reference = [_local_scores(model, pairs) for pairs in goods]
    plan = [("good", k % len(goods), _score_body(goods[k % len(goods)]), JSON) for k in range(240)]
    plan += [("bad", k % len(BAD_REQUESTS), *BAD_REQUESTS[k % len(BAD_REQUESTS)][1:3])
             for k in range(120)]  # fmt: skip
    np.random.default_rng(5).shuffle(plan)
    before = _requests_total(server)
    answers = _run_load(server, plan, clients=8)
    assert len(answers) == len(plan)
    wrong, worst = [], 0.0
    for kind, index, status, answer, _ in answers:
        if kind == "bad":
            name, _, _, want_status, field = BAD_REQUESTS[index]
            if status != want_status or answer.get("field") != field:
                wrong.append((name, status, answer))
            continue
        if status != 200:
            wrong.append(("good", index, status, answer))
            continue
        results = answer["results"]
        assert [r["id"] for r in results] == [f"s{j}" for j in range(len(goods[index]))]
        for result, want in zip(results, reference[index], strict=True):
            worst = max(worst, float(np.abs(np.asarray(result["logprobs"]) - want).max()))
    print(f"{len(plan)} requests: 240 good, 120 bad; {len(wrong)} wrong; max |d| {worst:.2g}")
    assert not wrong, wrong[:5]
    # other batch compositions than the replay's (padding, batch size): fp32 on CPU moves
    # a logprob of ~-10 by a few ulps, up to 9.5e-6 measured (what a default server's
    # /health states; tests/serve/test_serve_batch_invariant.py holds it to that)
    assert worst <= 1e-5, worst
    after = _requests_total(server)
    assert after.get("200", 0) - before.get("200", 0) == 240
    assert sum(after.values()) - sum(before.values()) == len(plan)
    assert call(server, "GET", "/health")[1] == {
        **call(server, "GET", "/health")[1],
        "status": "ok",
        "queue_depth": 0,
    }


def _requests_total(url) -> dict[str, float]:
    metrics = call(url, "GET", "/metrics")[1]
    found = re.findall(r'^lpx_requests_total\{code="(\d+)"\} (\S+)$', metrics, re.MULTILINE)
    return {code: float(value) for code, value in found}


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


NGINX_EXAMPLE = Path(__file__).parents[2] / "examples" / "logprob-lb" / "nginx.conf"


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
    config equal the in-process replay (1e-6), both take work, and a replica that
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
        # 4 requests in flight: the replicas may batch two together, and another batch
        # composition moves a logprob by a few fp32 ulps (1.1e-7 seen here once)
        assert float(np.abs(table.channels["replay"] - replay.channels["replay"]).max()) <= 1e-6

        body = {"sequences": [{"prompt_ids": [1, 5, 9], "completion_ids": [7, 8]}]}
        answered_by = {call(lb, "POST", "/score", body)[2]["X-Lpx-Upstream"] for _ in range(8)}
        assert answered_by == {server.removeprefix("http://"), second.removeprefix("http://")}
        assert call(second, "POST", "/pause")[0] == 200
        answers = [call(lb, "POST", "/score", body) for _ in range(8)]
        assert [status for status, _, _ in answers] == [200] * 8
        # the paused replica answered 503 and nginx went on to the other one
        assert any("," in headers["X-Lpx-Upstream"] for _, _, headers in answers)
        call(second, "POST", "/resume")


def test_a_replica_killed_under_load_behind_nginx_loses_no_answer(
    tiny_model, tmp_path, nginx_binary
):
    """Two replicas behind the example nginx config; 6 clients send 400 requests through it.
    Replica A is paused first, so that requests are certainly held in it, then SIGKILLed.
    nginx (`proxy_next_upstream error ... non_idempotent`) sends those and every later
    request to B: each of the 400 is answered 200, equal to a single healthy server's answer
    for its body, and the held ones name both replicas in X-Lpx-Upstream."""
    goods = _good_requests(12, seed=11)
    bodies = [_score_body(pairs) for pairs in goods]
    with (
        server_process(tiny_model, log_path=tmp_path / "a.log") as (first, first_process),
        served(tiny_model, tmp_path=tmp_path) as second,
        behind_nginx(nginx_binary, [first, second], tmp_path) as lb,
    ):
        reference = [post(second, "/score", body, JSON) for body in bodies]
        assert all(status == 200 for status, _ in reference)
        plan = [("good", k % len(bodies), bodies[k % len(bodies)], JSON) for k in range(400)]
        answers: list = []
        load = threading.Thread(target=lambda: answers.extend(_run_load(lb, plan, clients=6)))
        killed_at = {}

        def kill_first():
            deadline = time.monotonic() + 60
            while _requests_total(first).get("200", 0) < 10:  # the load reaches A
                assert time.monotonic() < deadline, "replica A answered nothing"
                time.sleep(0.01)
            assert call(first, "POST", "/pause")[0] == 200
            while call(first, "GET", "/health")[1]["queue_depth"] < 2:
                assert time.monotonic() < deadline, "no request reached the paused replica"
                time.sleep(0.01)
            killed_at["held"] = call(first, "GET", "/health")[1]["queue_depth"]
            first_process.send_signal(signal.SIGKILL)
            first_process.wait(30)

        load.start()
        kill_first()
        load.join(600)
    first_address, second_address = first.removeprefix("http://"), second.removeprefix("http://")
    assert len(answers) == len(plan)
    lost = [(i, status, answer) for _, i, status, answer, _ in answers if status != 200]
    assert not lost, lost[:5]
    worst = 0.0
    for _, i, _, answer, _ in answers:
        want = reference[i][1]
        assert answer["weights_fingerprint"] == want["weights_fingerprint"]
        assert [r["id"] for r in answer["results"]] == [r["id"] for r in want["results"]]
        for got, expected in zip(answer["results"], want["results"], strict=True):
            worst = max(
                worst, float(np.abs(np.subtract(got["logprobs"], expected["logprobs"])).max())
            )
    assert worst <= 1e-5, worst  # the same weights; batch compositions differ (fp32, CPU)
    upstreams = [upstream for *_, upstream in answers]
    retried = [u for u in upstreams if u == f"{first_address}, {second_address}"]
    print(
        f"{len(answers)} requests, {len(lost)} lost, {killed_at['held']} sequences held in A at "
        f"the kill, "
        f"{len(retried)} retried on B, {upstreams.count(first_address)} answered by A, "
        f"max |d| {worst:.2g}"
    )
    assert retried, set(upstreams)  # the held requests (queue_depth counts sequences)
    assert {first_address, second_address} <= set(upstreams)


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
    from support.helpers import run_lpx

    (tmp_path / "empty").mkdir()
    result = run_lpx("serve", "--model", tmp_path / "empty", "--port", _unused_port())
    assert result.exit_code == 2 and "no config.json" in result.output
    result = run_lpx("serve", "--model", tmp_path / "missing")
    assert result.exit_code == 2 and "does not exist" in result.output


def _serve_command(*options) -> list[str]:
    return [sys.executable, "-m", "pipeline", "serve", *(str(o) for o in options)]


def test_port_and_bind_errors_exit_2_with_one_line_before_the_model_loads(tiny_model):
    """A port in use exited 3 with uvicorn's line after the model had loaded; --port 70000
    served on 4464. Now each is one `Error:` line naming --host/--port, exit 2, before the
    model loads (no start-up line)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        cases = [
            (["--port", taken], f"--host 127.0.0.1 --port {taken}: the address is already in use"),
            (["--port", 70000], "'--port': 70000 is not in the range 0<=x<=65535"),
            (["--port", -1], "'--port': -1 is not in the range 0<=x<=65535"),
            (["--host", "192.0.2.1"], "--host 192.0.2.1 --port 8400: no interface of this machine"),
            (["--host", "no-such-host.invalid"], "cannot resolve host 'no-such-host.invalid'"),
        ]  # fmt: skip
        for options, message in cases:
            done = subprocess.run(
                _serve_command("--model", tiny_model, *options),
                capture_output=True,
                text=True,
                timeout=120,
            )
            errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
            assert done.returncode == 2 and len(errors) == 1, (options, done.stderr)
            assert message in errors[0], (options, errors)
            assert "lpx serve:" not in done.stderr and "Traceback" not in done.stderr


def test_a_privileged_port_says_to_use_1024_or_above(monkeypatch):
    from pipeline.errors import BadInput
    from pipeline.serve.bind import bind_listener

    def refuse(_sock, _address):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(socket.socket, "bind", refuse)
    with pytest.raises(
        BadInput,
        match=r"--port 80: permission denied: port 80 is privileged; use a --port of 1024 or above",
    ):
        bind_listener("0.0.0.0", 80)  # fmt: skip


def test_a_port_taken_before_the_replica_binds_it_is_started_again_on_another(
    tiny_model, tmp_path, monkeypatch
):
    """server_process picks a free port, then starts `lpx serve` on it; another process may
    take the port between the two. The server's own "already in use" exit is retried."""
    from pipeline.serve import process as serve_process

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([taken])
        free = serve_process.free_port
        monkeypatch.setattr(serve_process, "free_port", lambda: next(picks, None) or free())
        with server_process(tiny_model, log_path=tmp_path / "a.log") as (url, _):
            assert url != f"http://127.0.0.1:{taken}" and _answers(url + "/health")
        picks = iter([taken] * serve_process.PORT_TRIES)
        monkeypatch.setattr(serve_process, "free_port", lambda: next(picks))
        with pytest.raises(ServerFailed, match=f"--port {taken}: the address is already in use"):
            with server_process(tiny_model, log_path=tmp_path / "b.log"):
                pass


def test_port_0_serves_on_a_free_port_named_in_the_start_up_line(tiny_model, tmp_path):
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            _serve_command("--model", tiny_model, "--port", 0), stdout=log, stderr=log
        )
    try:
        deadline = time.monotonic() + 120
        while not re.search(r"on http://127\.0\.0\.1:(\d+)\n", log_path.read_text()):
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        port = int(re.search(r"on http://127\.0\.0\.1:(\d+)\n", log_path.read_text())[1])
        assert port != 0
        deadline = time.monotonic() + 30
        while not _answers(f"http://127.0.0.1:{port}/health"):
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
    finally:
        process.terminate()
        process.wait(30)


def _unused_port() -> int:
    from pipeline.serve.process import free_port

    return free_port()

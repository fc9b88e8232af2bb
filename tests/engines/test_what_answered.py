"""A `--set url=` that points at something other than the engine's server (a 404 page, a
web server's welcome page, another API's JSON, a port that does not speak HTTP, nothing at
all): one Error line naming the URL and what answered there, exit 2, never the page itself.

Every engine that takes a url is tried against real servers on loopback (stdlib http.server
and a plain TCP socket): sglang (rollout and replay), http (openai and sglang APIs) and
logprob-server."""

from __future__ import annotations

import http.client
import http.server
import json
import socket
import threading
import urllib.error

import pytest

from pipeline.engines.answered import describe_answer, describe_json, describe_unreachable
from pipeline.engines.base import SamplingParams
from pipeline.engines.hf.rollout import HFRolloutEngine
from pipeline.fixture.io import write_table
from pipeline.serve.process import free_port
from support.helpers import run_lpx

NGINX_404 = (
    b"<html>\r\n<head><title>404 Not Found</title></head>\r\n<body>\r\n<center><h1>404 Not "
    b"Found</h1></center>\r\n<hr><center>nginx/1.27.0</center>\r\n</body>\r\n</html>\r\n"
)
WELCOME = (
    b"<!DOCTYPE html>\n<html>\n<head>\n<title>Welcome to nginx!</title>\n<style>\nhtml { color-"
    b"scheme: light dark; }\n</style>\n</head>\n<body>\n<h1>Welcome to nginx!</h1>\n</body>\n</html>\n"
)


@pytest.mark.parametrize(
    "status, content_type, body, said",
    [
        (404, "text/html", NGINX_404, "answered HTTP 404 with an HTML page titled '404 Not Found'"),
        (200, "text/html; charset=utf-8", WELCOME,
         "answered HTTP 200 with an HTML page titled 'Welcome to nginx!'"),
        (502, "", b"<html><body><h1>Bad <b>Gateway</b></h1></body></html>",
         "answered HTTP 502 with an HTML page titled 'Bad Gateway'"),
        (500, "text/html", b"<html><body><p>the &amp; upstream\n  died</p></body></html>",
         "answered HTTP 500 with an HTML page saying 'the & upstream died'"),
        (404, "application/json", b'{"detail": "Not Found"}',
         "answered HTTP 404 with JSON saying 'Not Found'"),
        (400, "application/json", b'{"object": "error", "error": {"message": "bad model"}}',
         "answered HTTP 400 with JSON saying 'bad model'"),
        (422, "application/json", b'{"detail": [{"loc": ["body"], "msg": "Field required"}]}',
         "answered HTTP 422 with JSON saying 'Field required'"),
        (200, "application/json", b'{"status": "ok", "service": "billing"}',
         "answered HTTP 200 with a JSON object with keys status, service"),
        (200, "application/json", b"[1, 2, 3]", "answered HTTP 200 with a JSON list of 3 item(s)"),
        (200, "text/plain", b"", "answered HTTP 200 with an empty body"),
        (503, "text/plain", b"upstream connect error or disconnect/reset before headers. "
         b"reset reason: connection failure, transport failure reason: delayed connect error",
         "answered HTTP 503 with text 'upstream connect error or disconnect/reset before headers. "
         "reset reason: connect...'"),
        (200, "application/octet-stream", bytes(range(128, 256)) * 2,
         "answered HTTP 200 with 256 bytes of application/octet-stream"),
    ],
)  # fmt: skip
def test_an_answer_is_described_in_a_few_words_on_one_line(status, content_type, body, said):
    assert describe_answer(status, content_type, body) == said


def test_json_is_described_by_its_message_keys_or_kind():
    assert describe_json({"error": "no such route"}) == "JSON saying 'no such route'"
    assert describe_json({f"k{i}": i for i in range(8)}) == (
        "a JSON object with keys k0, k1, k2, k3, k4, k5, ..."
    )
    assert describe_json({}) == "an empty JSON object"
    assert describe_json("ok") == "JSON '\"ok\"'"


def test_no_answer_is_described_by_why():
    refused = urllib.error.URLError(ConnectionRefusedError(111, "Connection refused"))
    assert describe_unreachable(refused) == "Connection refused (nothing listens there)"
    not_http = http.client.BadStatusLine("SSH-2.0-OpenSSH_9.6\r\n")
    assert describe_unreachable(not_http) == (
        "answered something that is not HTTP (it began 'SSH-2.0-OpenSSH_9.6')"
    )
    closed = urllib.error.URLError(http.client.RemoteDisconnected("closed"))
    assert describe_unreachable(closed).startswith("closed the connection without an HTTP answer")
    assert describe_unreachable(TimeoutError("timed out")) == "did not answer in time (timed out)"
    assert describe_unreachable(http.client.IncompleteRead(b"12345", 100)) == (
        "cut its answer off after 5 bytes"
    )


class _Answers(http.server.BaseHTTPRequestHandler):
    status, content_type, body = 404, "text/html", NGINX_404

    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        self.send_response(self.status)
        self.send_header("Content-Type", self.content_type)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


def _http_server(status: int, content_type: str, body: bytes):
    handler = type(
        "Handler", (_Answers,), dict(status=status, content_type=content_type, body=body)
    )
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}", server.shutdown


def _ssh_like_server():
    """A port that speaks another protocol: it greets first, as SSH does, reads what the
    client says, and hangs up on it (OpenSSH: "Invalid SSH identification string")."""
    listener = socket.create_server(("127.0.0.1", 0))
    stopped = threading.Event()

    def greet():
        while not stopped.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            with connection:
                connection.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
                connection.settimeout(0.2)
                try:
                    while connection.recv(65536):
                        pass
                except OSError:
                    pass
                connection.sendall(b"Invalid SSH identification string.\r\n")

    threading.Thread(target=greet, daemon=True).start()

    def stop():
        stopped.set()
        listener.close()

    return f"http://127.0.0.1:{listener.getsockname()[1]}", stop


SERVERS = {
    "404 page": (lambda: _http_server(404, "text/html", NGINX_404),
                 "answered HTTP 404 with an HTML page titled '404 Not Found'"),
    "welcome page": (lambda: _http_server(200, "text/html", WELCOME),
                     "answered HTTP 200 with an HTML page titled 'Welcome to nginx!'"),
    "another API": (lambda: _http_server(200, "application/json", b'{"status": "ok", "service": '
                                         b'"billing"}'),
                    "a JSON object with keys status, service"),
    "not HTTP": (_ssh_like_server, "answered something that is not HTTP (it began 'SSH-2.0-"),
    "nothing": (lambda: (f"http://127.0.0.1:{free_port()}", lambda: None), "Connection refused"),
}  # fmt: skip


@pytest.fixture(scope="module")
def small_fixture(tiny_model, prompts, tmp_path_factory):
    sampling = SamplingParams(max_tokens=4, seed=0, ignore_eos=True)
    path = tmp_path_factory.mktemp("answered") / "fixture.parquet"
    write_table(HFRolloutEngine().rollout(tiny_model, prompts[:1], sampling, {}), path)
    return path


def _rollout(engine, url, tiny_model, tmp_path, *more):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    return run_lpx(
        "rollout", "--engine", engine, "--model", tiny_model, "--prompts", prompts,
        "--max-tokens", "4", "--set", f"url={url}", *more, "--out", tmp_path / "f.parquet",
    )  # fmt: skip


ENGINES = {
    "sglang rollout": lambda url, model, fixture, tmp: _rollout("sglang", url, model, tmp),
    "sglang replay": lambda url, model, fixture, tmp: run_lpx(
        "replay", fixture, "--engine", "sglang", "--model", model, "--set", f"url={url}",
        "--out", tmp / "r.parquet"),
    "http openai": lambda url, model, fixture, tmp: _rollout(
        "http", url, model, tmp, "--set", "retries=0"),
    "http sglang": lambda url, model, fixture, tmp: _rollout(
        "http", url, model, tmp, "--set", "api=sglang", "--set", "retries=0"),
    "logprob-server": lambda url, model, fixture, tmp: run_lpx(
        "replay", fixture, "--engine", "logprob-server", "--model", model,
        "--set", f"url={url}", "--set", "retries=0", "--out", tmp / "r.parquet"),
}  # fmt: skip


@pytest.mark.parametrize("server", list(SERVERS))
@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_url_that_is_not_the_engine_s_server_is_one_line_naming_it(
    engine, server, tiny_model, small_fixture, tmp_path
):
    start, said = SERVERS[server]
    url, stop = start()
    try:
        result = ENGINES[engine](url, tiny_model, small_fixture, tmp_path)
    finally:
        stop()
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert url in lines[0] and said in lines[0], lines[0]
    assert "<" not in lines[0] and "Traceback" not in result.output
    assert not list(tmp_path.glob("*.parquet"))


def test_sglang_names_json_of_another_api_as_not_its_server_info(tiny_model, tmp_path):
    url, stop = _http_server(200, "application/json", b'{"status": "ok", "service": "billing"}')
    try:
        result = _rollout("sglang", url, tiny_model, tmp_path)
    finally:
        stop()
    assert result.output.strip() == (
        f"Error: {url}/get_server_info answered a JSON object with keys status, service, not "
        "SGLang's server info; is an SGLang server listening there (python -m "
        "sglang.launch_server)?"
    )


def test_json_of_another_api_at_the_openai_model_list_says_what_to_do(tiny_model, tmp_path):
    url, stop = _http_server(200, "application/json", json.dumps({"models": ["a"]}).encode())
    try:
        result = _rollout("http", url, tiny_model, tmp_path, "--set", "retries=0")
    finally:
        stop()
    assert result.exit_code == 2
    assert result.output.strip() == (
        f"Error: {url}/v1/models answered a JSON object with keys models, not an OpenAI model "
        "list; is it an OpenAI-compatible server (for SGLang's /generate: --set api=sglang)?"
    )

"""The http rollout engine when an SGLang server misbehaves (a stand-in that fails on
purpose; the real server's sampling, weight updates and resumed aborts are in
test_engines_sglang.py) and, in test_engines_vllm.py, against a real `vllm serve`."""

import numpy as np
import pytest

from pipeline.engines.base import SamplingParams
from pipeline.engines.http.rollout import HTTPRolloutEngine
from pipeline.errors import BadInput
from support.stubs import MisbehavingSGLangStub

SAMPLING = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)


def rollout(url, prompts, model, **knobs):
    knobs = {
        "url": url,
        "api": "sglang",
        "dtype": "fp32",
        "concurrency": 1,
        "backoff_s": 0.01,
        **knobs,
    }
    return HTTPRolloutEngine().rollout(model, prompts, SAMPLING, knobs)


def test_a_malformed_answer_is_kept_as_an_error_naming_the_shape(tiny_model, prompts):
    with MisbehavingSGLangStub(tiny_model, malformed=True) as stub:
        with pytest.raises(BadInput, match="no trajectory succeeded.*unexpected response shape"):
            rollout(stub.url, prompts[:2], tiny_model, retries=0)


def test_transient_errors_are_retried(tiny_model, prompts):
    with MisbehavingSGLangStub(tiny_model, fail_first=2) as stub:
        table = rollout(stub.url, prompts[:1], tiny_model, retries=2)
        assert stub.requests == 3
    assert table.finish_reasons == ["length"] and table.num_completion_tokens == 12


def test_failed_trajectories_are_kept_as_errors_never_dropped(tiny_model, prompts):
    with MisbehavingSGLangStub(tiny_model, fail_first=1) as stub:
        table = rollout(stub.url, prompts[:2], tiny_model, retries=0)
    assert table.sequence_ids == ["0-0", "1-0"]
    assert table.finish_reasons == ["error", "length"]
    assert np.diff(table.completion_offsets).tolist() == [0, 12]
    assert "HTTP 503" in table.metadata["errors"]["0-0"]


def test_timeouts_and_dead_servers_are_clear(tiny_model, prompts):
    with (
        MisbehavingSGLangStub(tiny_model, delay_s=2.0) as stub,
        pytest.raises(BadInput, match="timed out|timeout"),
    ):
        rollout(stub.url, prompts[:1], tiny_model, timeout_s=0.3, retries=0)
    with pytest.raises(BadInput, match=r"no trajectory succeeded.*Connection refused"):
        rollout("http://127.0.0.1:9", prompts[:1], tiny_model, retries=0)
    with pytest.raises(BadInput, match="needs --set url="):
        HTTPRolloutEngine().rollout(tiny_model, prompts[:1], SAMPLING, {"api": "sglang"})


def test_an_answer_cut_off_mid_body_is_retried_then_named():
    """A replica killed after its headers went out leaves a truncated body (IncompleteRead):
    retried like a refused connection, and when it never completes, one line naming the URL
    (it was the generic "an engine or library failed")."""
    import http.server
    import threading

    from pipeline.engines.http_json import json_request

    calls = []

    class CutsOffTheFirstAnswer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            calls.append(self.path)
            body = b'{"ok": true}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body) + (100 if self.path == "/cut" else 0)))
            self.end_headers()
            self.wfile.write(body if len(calls) > 1 and self.path != "/cut" else body[:5])
            self.wfile.flush()
            self.connection.shutdown(2)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), CutsOffTheFirstAnswer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        assert json_request("GET", url + "/once", backoff_s=0.01) == {"ok": True}
        assert calls == ["/once", "/once"]
        with pytest.raises(BadInput, match=f"{url}/cut: .* after 3 attempt"):
            json_request("GET", url + "/cut", backoff_s=0.01)
    finally:
        server.shutdown()

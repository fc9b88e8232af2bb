"""A stand-in for an SGLang server that misbehaves on purpose, named as one.

The real SGLang server runs in the suite (tests/engines/test_engines_sglang.py: sampling, scoring,
weight updates, aborts and resumes). What it cannot be made to do on demand is fail: this
stand-in answers SGLang's `/generate` shape with real tokens and logprobs from the HF tiny
model, and can answer 503 first, answer late, or answer a malformed body, for the tests of
what lpx does when a server misbehaves.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from pipeline.engines.base import SamplingParams
from pipeline.engines.hf.model import load_model
from pipeline.engines.hf.rollout import _generate_batch


class MisbehavingSGLangStub:
    """A loopback HTTP server in a thread; use as a context manager.

    fail_first: answer the first N requests with HTTP 503 (for retry tests).
    delay_s: wait this long before answering (for timeout tests).
    malformed: answer 200 with a body that is not SGLang's shape (no meta_info logprobs).
    """

    def __init__(self, model_dir, fail_first=0, delay_s=0.0, malformed=False):
        self.model = load_model(model_dir)
        self.fail_first = fail_first
        self.delay_s = delay_s
        self.malformed = malformed
        self.requests = 0
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        # server_close() then waits for handlers still running (a delayed answer): a handler
        # thread still inside torch when the interpreter exits aborts the whole process.
        self.server.daemon_threads = False
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def generate(self, body: dict) -> dict:
        params = body["sampling_params"]
        sampling = SamplingParams(
            max_tokens=params["max_new_tokens"],
            temperature=params.get("temperature", 1.0),
            top_p=params.get("top_p", 1.0),
            top_k=max(0, params.get("top_k", -1)),
            ignore_eos=params.get("ignore_eos", False),
        )
        generator = torch.Generator().manual_seed(
            int(params.get("sampling_seed", 0)) + len(body["input_ids"])
        )
        with torch.no_grad():
            (row,) = _generate_batch(self.model, [body["input_ids"]], sampling, generator)
        tokens, logprobs, finish = row["tokens"], row["raw"], row["finish_reason"]
        if self.malformed:
            return {
                "output_ids": tokens,
                "meta_info": {"finish_reason": {"type": finish}, "output_token_logprobs": [[0.5]]},
            }
        return {
            "output_ids": tokens,
            "meta_info": {
                "output_token_logprobs": [
                    [lp, t, None] for lp, t in zip(logprobs, tokens, strict=True)
                ],
                "finish_reason": {"type": finish},
                "weight_version": "1",
                "completion_tokens": len(tokens),
            },
        }

    def _handler(self):
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, payload: dict):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/get_server_info":
                    self._send(200, {"version": "misbehaving-sglang-stub"})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.requests += 1
                    failing = stub.requests <= stub.fail_first
                if failing:
                    self._send(503, {"error": "stub: warming up"})
                    return
                time.sleep(stub.delay_s)
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self._send(200, stub.generate(body))  # the client may have given up

        return Handler

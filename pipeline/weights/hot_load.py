"""Load a store's version into a running server without restarting it: what a rollout fleet
does after the trainer publishes, done by lpx so a nightly job can drive a real fleet through
versions and check each one.

Three kinds of server answer:
- SGLang (0.5.23): `/update_weights_from_disk` with the version's name (SGLang tags every
  later token with it), or `/update_weights_from_tensor` (tensors by shared memory, inside
  its begin/end weight-update session). Both flush its radix cache. With ``abort_running``
  the requests in flight end with finish reason abort: the partial rollouts an RL loop
  resumes under the new version.
- vLLM (0.32) with its RL endpoints, which `VLLM_SERVER_DEV_MODE=1` turns on. Its documented
  in-place path for RL: pause (in-flight requests finish), `reload_weights` from a directory
  through `/collective_rpc`, reset the prefix cache (cached KV blocks were computed by the old
  weights; without the reset long shared prompts are scored with stale keys and values), name
  the new version, resume.
- `lpx serve`, whose `/update_weights` pulls a store version itself.

The version is pulled and verified into lpx's cache first (`materialize`); vLLM reads that
directory, so the server must see the same path (same host, or the same shared volume).
"""

from __future__ import annotations

import time
from pathlib import Path

from pipeline.engines.http_json import json_request
from pipeline.errors import BadInput


def server_kind(url: str, timeout_s: float = 10.0) -> str:
    """``vllm`` (its RL endpoints answer), ``sglang`` or ``lpx`` (lpx serve); BadInput
    otherwise."""
    try:
        json_request("GET", url + "/weight_info", timeout_s=timeout_s, retries=0)
        return "vllm"
    except BadInput:
        pass
    try:
        info = json_request("GET", url + "/get_server_info", timeout_s=timeout_s, retries=0)
        if isinstance(info, dict) and "version" in info and "model_path" in info:
            return "sglang"
    except BadInput:
        pass
    try:
        health = json_request("GET", url + "/health", timeout_s=timeout_s, retries=0)
    except BadInput as error:
        raise BadInput(f"{url}: no server answers ({error}).") from None
    if isinstance(health, dict) and "weight_version" in health:
        return "lpx"
    raise BadInput(
        f"{url}: neither vLLM with its RL endpoints (start it with VLLM_SERVER_DEV_MODE=1; "
        "GET /weight_info must answer) nor lpx serve."
    )


def hot_load(
    url: str,
    store: Path,
    version: str | None = None,
    timeout_s: float = 600.0,
    via: str = "disk",
    abort_running: bool = False,
) -> dict:
    """Make the server at ``url`` serve ``version`` (default: latest) of ``store``; SGLang
    takes it ``via`` disk or tensor, and may ``abort_running`` requests.

    Returns what was done: server kind, version, the directory loaded, seconds to pull and
    seconds the server was paused for the swap."""
    from pipeline.weights.store import latest_name, materialize

    url = url.rstrip("/")
    kind = server_kind(url)
    started = time.perf_counter()
    model_dir = materialize(store, version or latest_name(store))
    name = (model_dir / "WEIGHT_VERSION").read_text().strip()
    pulled = time.perf_counter()
    if kind != "sglang" and (via != "disk" or abort_running):
        raise BadInput(f"{url}: --via tensor and --abort-running are SGLang's; this is {kind}.")
    if kind == "sglang":
        served = _sglang_reload(url, model_dir, name, timeout_s, via, abort_running)
    elif kind == "lpx":
        answer = json_request(
            "POST", url + "/update_weights", {"path": str(store), "version": name}, timeout_s, 0
        )
        served = str(answer.get("weight_version"))
    else:
        served = _vllm_reload(url, model_dir, name, timeout_s)
    if served != name:
        raise BadInput(f"{url}: asked to serve version {name}, it reports {served!r}.")
    return {
        "server": kind,
        "version": name,
        "model_dir": str(model_dir),
        "pull_s": pulled - started,
        "swap_s": time.perf_counter() - pulled,
    }


def _vllm_reload(url: str, model_dir: Path, name: str, timeout_s: float) -> str:
    """pause -> reload_weights -> reset_prefix_cache -> name the version -> resume."""

    def post(path: str, body: dict | None = None):
        return json_request("POST", url + path, body, timeout_s, 0)

    post("/pause?mode=wait")
    try:
        post(
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": str(model_dir)}},
        )
        post("/reset_prefix_cache")
        post("/update_weight_version", {"new_version": name})
    finally:
        post("/resume")
    return str(json_request("GET", url + "/weight_info", timeout_s=timeout_s)["weight_version"])


def _sglang_reload(
    url: str, model_dir: Path, name: str, timeout_s: float, via: str, abort_running: bool
) -> str:
    from pipeline.engines.sglang import api as sglang_api

    connection = sglang_api.Connection(url, timeout_s, retries=0)
    if via == "tensor":
        from safetensors.torch import load_file

        tensors = {}
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            tensors.update(load_file(path))
        sglang_api.update_weights_from_tensor(connection, tensors.items(), name, abort_running)
    else:
        sglang_api.update_weights_from_disk(connection, model_dir, name, abort_running)
    return sglang_api.weight_version(connection)

"""SGLang's native HTTP protocol, as lpx speaks it: sampling with resumption of aborted
requests, teacher-forced scoring, what the server says of itself, and weight updates.

Shared by the `sglang` engine (a server lpx starts) and the `http` engine (``api=sglang``, a
server someone else runs). Shapes are SGLang 0.5.23's, checked against the real server in
tests/engines/test_engines_sglang.py:
- ``meta_info.output_token_logprobs`` / ``input_token_logprobs``: ``[logprob, token id, text]``
  per position (the first input position has no logprob). SGLang echoes an input id of
  vocab_size - 1 or more as 0 (it clips image-hash padding with ``x < vocab_size - 1``); the
  logprob is still the sent token's;
- ``meta_info.output_token_sampling_logprobs`` (``return_sampling_mask``): the logprob of the
  sampled token under the distribution it was drawn from, after top-k/top-p/min-p;
- ``meta_info.weight_versions``: ``[{version, start, end}]`` spans over the output tokens,
  ``meta_info.weight_version`` the version that finished the request;
- ``meta_info.routed_experts``: base64 of int32 [positions, MoE layers, top-k] over the
  request's input + output, last position excluded (``return_routed_experts``).
"""

from __future__ import annotations

import base64
import contextlib
from dataclasses import dataclass, field

import numpy as np

from pipeline.engines.answered import describe_json
from pipeline.engines.http_json import json_request
from pipeline.errors import BadInput

SHAPE_ERRORS = (KeyError, IndexError, TypeError, ValueError)
# what SGLang's /get_server_info always holds (older releases nest the arguments)
SERVER_INFO_KEYS = {"version", "server_args", "model_path"}


@dataclass(frozen=True)
class Connection:
    """Where the server is and how patiently to talk to it."""

    url: str
    timeout_s: float = 120.0
    retries: int = 2
    backoff_s: float = 0.5

    def request(self, method: str, path: str, body: dict | None = None, retries=None):
        retries = self.retries if retries is None else retries
        return json_request(
            method, self.url.rstrip("/") + path, body, self.timeout_s, retries, self.backoff_s
        )


@dataclass(frozen=True)
class Asked:
    """What one trajectory asks of the server beyond the sampling parameters."""

    resume_aborted: bool = True
    max_resumes: int = 4
    # the logprob under the distribution sampled from (SGLang's sampling mask), requested
    # only where it differs from the temperature-scaled one: top-k, top-p or min-p set
    sampling_logprobs: bool = False
    routed_experts: bool = False
    # top-k sent in place of "off" (-1): SGLang returns its sampling mask only under a
    # finite top-k, and top-k = the vocabulary size keeps every token
    top_k: int | None = None


@dataclass
class Trajectory:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampling_logprobs: list[float] = field(default_factory=list)
    weight_versions: list[str] = field(default_factory=list)
    top_ids: list[int] = field(default_factory=list)  # the OpenAI API's top-1 per token
    routed_experts: np.ndarray | None = None
    finish_reason: str = "length"
    error: str | None = None
    requests: int = 0


def sampling_params(sampling, seed: int, max_new_tokens: int, top_k: int | None = None) -> dict:
    """SGLang's sampling_params for lpx's SamplingParams, every field that changes a logprob
    set explicitly: a field left out takes the server's --preferred-sampling-params, and the
    fixture records what was asked."""
    return {
        "max_new_tokens": max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": top_k or sampling.top_k or -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "ignore_eos": sampling.ignore_eos,
        "sampling_seed": seed,
    }


def truncates(sampling) -> bool:
    """Whether the sampled distribution differs from the temperature-scaled one."""
    return bool(sampling.top_k) or sampling.top_p < 1.0


def render_chat(
    connection: Connection, conversation: list[dict], continue_final: bool
) -> list[int]:
    """The ids SGLang's OpenAI chat path renders a conversation to: the model's template
    through SGLang's own message handling and tokenization (with ``continue_final``, SGLang
    renders the messages before the last with the generation prompt and appends the last
    one's content tokenized on its own). One greedy token is asked, with
    ``return_prompt_token_ids``, and the prompt's ids are read back."""
    body = {
        "messages": conversation,
        "max_tokens": 1,
        "temperature": 0.0,
        "return_prompt_token_ids": True,
        "continue_final_message": continue_final,
    }
    answer = connection.request("POST", "/v1/chat/completions", body)
    try:
        ids = answer["choices"][0]["prompt_token_ids"]
        if not ids or not all(isinstance(i, int) for i in ids):
            raise ValueError("no prompt ids")
        return list(ids)
    except SHAPE_ERRORS as error:
        raise BadInput(
            f"{connection.url}/v1/chat/completions returned no prompt_token_ids ({error!r}; "
            f"{describe_json(answer)}); SGLang 0.5.23 or newer renders chats for lpx"
        ) from None


def generate_trajectory(
    connection: Connection, prompt: list[int], sampling, seed: int, asked: Asked
) -> Trajectory:
    """Sample one completion. A request the server aborted (a weight update paused it) is
    resumed from where it stopped, prompt + tokens so far, up to ``max_resumes`` times; each
    token keeps the weight version that produced it. A failure is kept in the trajectory
    (finish reason ``error``), never raised: one bad request must not lose the others."""
    trajectory = Trajectory()
    while True:
        remaining = sampling.max_tokens - len(trajectory.tokens)
        body = {
            "input_ids": list(prompt) + trajectory.tokens,
            "sampling_params": sampling_params(sampling, seed, remaining, asked.top_k),
            "return_logprob": True,
        }
        if asked.sampling_logprobs:
            body["return_sampling_mask"] = True
        if asked.routed_experts:
            body["return_routed_experts"] = True
        answer = None
        try:
            answer = connection.request("POST", "/generate", body)
            added = _add_piece(trajectory, answer["meta_info"], len(body["input_ids"]), asked)
        except SHAPE_ERRORS as error:
            # what answered, so another API's JSON reads as such
            trajectory.error = (
                f"unexpected response shape: {error!r} in {connection.url}/generate's answer, "
                f"{describe_json(answer)}"
            )
            trajectory.finish_reason = "error"
            return trajectory
        except BadInput as error:
            trajectory.error, trajectory.finish_reason = str(error), "error"
            return trajectory
        resumable = trajectory.finish_reason == "abort" and asked.resume_aborted
        if not resumable or trajectory.requests > asked.max_resumes or remaining - added <= 0:
            return trajectory


def _add_piece(trajectory: Trajectory, meta: dict, input_length: int, asked: Asked) -> int:
    pieces = meta.get("output_token_logprobs") or []
    tokens = [int(p[1]) for p in pieces]
    trajectory.tokens += tokens
    trajectory.logprobs += [float(p[0]) for p in pieces]
    if asked.sampling_logprobs:
        values = meta.get("output_token_sampling_logprobs")
        if values is None or len(values) != len(pieces):
            raise ValueError(
                "return_sampling_mask gave no output_token_sampling_logprobs per token "
                "(SGLang older than 0.5.23?)"
            )
        trajectory.sampling_logprobs += [float(v) for v in values]
    trajectory.weight_versions += versions_per_token(meta, len(pieces))
    if asked.routed_experts:
        trajectory.routed_experts = _merged_routing(
            trajectory.routed_experts, meta.get("routed_experts"), input_length + len(pieces)
        )
    finish = meta.get("finish_reason") or {}
    trajectory.finish_reason = str(
        finish.get("type", finish) if isinstance(finish, dict) else finish
    )
    trajectory.requests += 1
    return len(pieces)


def versions_per_token(meta: dict, count: int) -> list[str]:
    """The weight version of each output token: SGLang's spans where it gives them (a
    request that straddled an update), else the request's one version, else "unknown"."""
    spans = meta.get("weight_versions")
    if isinstance(spans, list) and spans and isinstance(spans[0], dict):
        versions = ["unknown"] * count
        for span in spans:
            start, end = int(span["start"]), min(int(span["end"]), count)
            versions[start:end] = [str(span["version"])] * max(0, end - start)
        return versions
    version = meta.get("weight_version")
    return [str(version) if version is not None else "unknown"] * count


def decode_routing(encoded: str | None, positions: int) -> np.ndarray | None:
    """SGLang's routed experts (base64 int32) as [positions, layers, k]; None when absent."""
    if not encoded:
        return None
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    if positions <= 0 or flat.size % positions:
        raise ValueError(
            f"routed_experts holds {flat.size} ids, not a whole number of rows for "
            f"{positions} positions"
        )
    return flat.reshape(positions, -1)


def _merged_routing(before, encoded, length: int):
    """A resumed request re-routes the whole prefix under the new weights; the rows the
    earlier request routed are the ones its tokens were sampled under, so they are kept."""
    rows = decode_routing(encoded, length - 1)
    if rows is None:
        return before
    if before is not None and len(before):
        rows = rows.copy()
        rows[: len(before)] = before
    return rows


def score(
    connection: Connection, sequences: list[list[int]], routed_experts: bool, vocab_size: int
):
    """Teacher-forced logprobs of whole sequences (prefill only, nothing sampled): per
    sequence the logprob of each token given the ones before it (NaN at position 0), and
    its routed experts [positions - 1, layers * k] where asked. The token ids SGLang echoes
    are checked against the ones sent, so a misaligned answer is never scored."""
    body = {
        "input_ids": sequences,
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    if routed_experts:
        body["return_routed_experts"] = True
    answers = connection.request("POST", "/generate", body)
    if isinstance(answers, dict):
        answers = [answers]
    if len(answers) != len(sequences):
        raise BadInput(
            f"{connection.url}/generate answered {len(answers)} results for "
            f"{len(sequences)} sequences."
        )
    scored, routing = [], []
    for sequence, answer in zip(sequences, answers, strict=True):
        meta = answer["meta_info"]
        pieces = meta["input_token_logprobs"]
        if len(pieces) != len(sequence):
            raise ValueError(
                f"input_token_logprobs has {len(pieces)} positions for {len(sequence)} tokens"
            )
        echoed = [int(p[1]) for p in pieces]
        wrong = [
            t for t, (sent, back) in enumerate(zip(sequence, echoed, strict=True))
            if back != sent and not (back == 0 and sent >= vocab_size - 1)
        ]  # fmt: skip
        if wrong:
            raise ValueError(
                f"input_token_logprobs echoes token {echoed[wrong[0]]} at position {wrong[0]}, "
                f"where {sequence[wrong[0]]} was sent"
            )
        scored.append(
            np.array([np.nan if p[0] is None else float(p[0]) for p in pieces], np.float64)
        )
        if routed_experts:
            routing.append(decode_routing(meta.get("routed_experts"), len(sequence) - 1))
    return scored, routing


def server_info(connection: Connection) -> dict:
    """GET /get_server_info: the resolved server arguments and the version. The first
    request to a server, so what answers a url that is not SGLang is named here."""
    hint = "is an SGLang server listening there (python -m sglang.launch_server)?"
    try:
        info = connection.request("GET", "/get_server_info", retries=0)
    except BadInput as error:
        raise BadInput(f"{error.format_message().rstrip('.')}; {hint}") from None
    if not isinstance(info, dict) or not SERVER_INFO_KEYS & set(info):
        raise BadInput(
            f"{connection.url}/get_server_info answered {describe_json(info)}, not SGLang's "
            f"server info; {hint}"
        )
    return info


def model_info(connection: Connection) -> dict:
    try:
        info = connection.request("GET", "/get_model_info", retries=0)
    except BadInput:
        return {}
    return info if isinstance(info, dict) else {}


def update_weights_from_disk(
    connection: Connection, model_dir, version: str, abort_running: bool = False
) -> dict:
    """Load a checkpoint directory into the running server (it must see the path); every
    later token is tagged ``version``. ``abort_running`` ends the requests in flight with
    finish reason abort (a partial rollout, resumed by its client under the new version)."""
    body = {
        "model_path": str(model_dir),
        "weight_version": str(version),
        "flush_cache": True,  # cached prefixes hold keys and values of the old weights
    }
    with _paused_if(connection, abort_running):
        return _succeeded(connection, "/update_weights_from_disk", body)


@contextlib.contextmanager
def _paused_if(connection: Connection, abort_running: bool):
    """With ``abort_running``: generation paused in abort mode around the update, then
    continued.

    SGLang's own ``abort_all_requests`` aborts the running requests and updates at once, but
    a client that resumes an aborted rollout sends it again at once, and a request running
    or queued when the update flushes the radix cache fails the call ("Weights were updated,
    but the cache was not flushed"): the new weights serve, the cache keeps keys and values
    of the old ones, and the version is not set (a CI run met this). Paused in abort mode,
    the server aborts what runs, waits until no request holds the weights, and holds new
    requests back until it continues; the update and its flush then meet an idle
    scheduler."""
    if not abort_running:
        yield
        return
    pause_generation(connection, "abort")
    try:
        yield
    finally:
        continue_generation(connection)


def update_weights_from_tensor(
    connection: Connection,
    named_tensors,
    version: str,
    abort_running: bool = False,
    bucket_bytes: int = 512 << 20,
) -> dict:
    """Send tensors to the running server by reference (shared memory on this host, as an RL
    trainer colocated with its rollout engine does), in buckets of about ``bucket_bytes``,
    inside SGLang's weight-update session; the last bucket names the new ``version``.

    The payload is what SGLang's MultiprocessingSerializer writes (torch's ForkingPickler,
    base64), made here without importing SGLang: torch's ``file_system`` sharing, because a
    server process cannot receive another process's file descriptors."""

    buckets, current, size = [], [], 0
    for name, tensor in named_tensors:
        current.append((name, tensor.contiguous()))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    buckets += [current] if current else []
    with _paused_if(connection, abort_running):
        return _send_buckets(connection, buckets, version)


def _send_buckets(connection: Connection, buckets: list, version: str) -> dict:
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as torch_mp

    strategy = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")
    _succeeded(connection, "/begin_weight_update", {})
    try:
        answer = {}
        for index, bucket in enumerate(buckets):
            buffer = io.BytesIO()
            ForkingPickler(buffer).dump(bucket)
            body = {
                "serialized_named_tensors": [base64.b64encode(buffer.getvalue()).decode()],
                "flush_cache": True,
            }
            if index == len(buckets) - 1:
                body["weight_version"] = str(version)
            answer = _succeeded(connection, "/update_weights_from_tensor", body)
    finally:
        _succeeded(connection, "/end_weight_update", {})
        torch_mp.set_sharing_strategy(strategy)
    return answer


def weight_version(connection: Connection) -> str:
    """The version the server tags new tokens with (GET /get_model_info)."""
    return str(model_info(connection).get("weight_version", "unknown"))


def _succeeded(connection: Connection, path: str, body: dict) -> dict:
    answer = connection.request("POST", path, body, retries=0)
    if not isinstance(answer, dict) or not answer.get("success", False):
        message = answer.get("message") if isinstance(answer, dict) else answer
        raise BadInput(f"{connection.url}{path}: {message}")
    return answer


def pause_generation(connection: Connection, mode: str = "abort") -> None:
    """Stop the server's running requests (mode abort: they return finish reason abort)."""
    connection.request("POST", "/pause_generation", {"mode": mode}, retries=0)


def continue_generation(connection: Connection) -> None:
    connection.request("POST", "/continue_generation", {}, retries=0)


@dataclass(frozen=True)
class _Probe:
    """The probe's sampling: one token from the top 2 at a temperature."""

    temperature: float
    top_k: int = 2
    top_p: float = 1.0
    ignore_eos: bool = True


def returns_original_logprobs(connection: Connection, prompt: list[int]) -> bool:
    """Whether a server returns raw logprobs (it runs with SGLANG_RETURN_ORIGINAL_LOGPROB=1)
    rather than temperature-scaled ones, asked with one token sampled at temperature 0.5 from
    the top 2: the sampling mask's logprob is the top-2 renormalisation of the temperature-
    scaled logprobs, and of the raw ones only once they are scaled."""
    temperature = 0.5
    body = {
        "input_ids": list(prompt),
        # every parameter explicit: the server's own defaults (top-p...) must not join in
        "sampling_params": sampling_params(_Probe(temperature), 0, 1),
        "return_logprob": True,
        "top_logprobs_num": 2,
        "return_sampling_mask": True,
    }
    meta = connection.request("POST", "/generate", body)["meta_info"]
    try:
        top = [float(entry[0]) for entry in meta["output_top_logprobs"][0]]
        selected = float(meta["output_token_logprobs"][0][0])
        behaviour = float(meta["output_token_sampling_logprobs"][0])
    except SHAPE_ERRORS as error:
        raise BadInput(
            f"{connection.url}: cannot tell whether its logprobs are raw ({error!r}); declare it "
            "with --set original_logprobs=true|false."
        ) from None
    as_scaled = selected - float(np.logaddexp.reduce(top))
    as_raw = selected / temperature - float(np.logaddexp.reduce(np.array(top) / temperature))
    return abs(as_raw - behaviour) < abs(as_scaled - behaviour)

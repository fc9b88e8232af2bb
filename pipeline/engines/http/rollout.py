"""Rollouts from a fleet behind one URL: OpenAI-compatible /v1/completions or SGLang /generate.

Nothing is known of the fleet but its URL, so everything it reports is recorded per
trajectory: token ids, the sampled token's logprob, finish reason, and the weight version
(SGLang per token from its weight-version spans, where a trajectory straddles a weight
update; vLLM per request, read from its RL endpoint GET /weight_info before and after,
"unknown" when an update fell between). SGLang's protocol is engines/sglang_api.py's. A trajectory that was
aborted or failed is kept and marked (finish_reason ``abort`` / ``error``), never dropped.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.engines.answered import describe_json
from pipeline.engines.base import SamplingParams, knobs_from_dict, trajectories
from pipeline.engines.http_json import json_request
from pipeline.engines.metadata import model_metadata, software_versions
from pipeline.engines.sglang.api import Asked, Connection, Trajectory, generate_trajectory
from pipeline.errors import BadInput
from pipeline.fixture.table import TokenTable, table_from_sequences
from pipeline.progress import progress_bar

APIS = ("openai", "sglang")


@dataclass(frozen=True)
class HTTPKnobs:
    url: str = ""
    api: str = "openai"
    # Served model name for /v1/completions; default: the first of GET /v1/models.
    model: str = ""
    concurrency: int = 8
    timeout_s: float = 120.0
    retries: int = 2
    backoff_s: float = 0.5
    # SGLang partial rollouts: continue a request the server aborted (e.g. for a weight
    # update) from where it stopped, tagging the new tokens with the new weight version.
    resume_aborted: bool = True
    max_resumes: int = 4
    # What the fleet runs in; it cannot be read back over HTTP, so it is declared.
    dtype: str = "bfloat16"

    @classmethod
    def from_dict(cls, knobs: dict) -> HTTPKnobs:
        knobs_obj = knobs_from_dict(cls, knobs, "http")
        if not knobs_obj.url.startswith(("http://", "https://")):
            raise BadInput(
                "the http engine needs --set url=http://HOST:PORT (the fleet's base URL)."
            )
        if knobs_obj.api not in APIS:
            raise BadInput(f"http api must be one of {', '.join(APIS)}.")
        return knobs_obj


class HTTPRolloutEngine:
    name = "http"
    knobs = HTTPKnobs

    def rollout(
        self, model_dir: Path, prompts: list[list[int]], sampling: SamplingParams, knobs: dict
    ) -> TokenTable:
        settings = HTTPKnobs.from_dict(knobs)
        client = _Client(settings)
        server = client.server_info()
        client.track_versions = settings.api == "openai" and client.reads_weight_versions()
        model_name = settings.model or (client.first_model() if settings.api == "openai" else "")
        work = trajectories(prompts, sampling)
        generate = (
            client.openai_trajectory if settings.api == "openai" else client.sglang_trajectory
        )
        with ThreadPoolExecutor(max_workers=max(1, settings.concurrency)) as pool:
            futures = [
                pool.submit(generate, prompt, sampling, seed, model_name)
                for _, prompt, seed in work
            ]
            results = [f.result() for f in progress_bar(futures, desc="http rollout", unit="seq")]
        if all(t.error for t in results):
            raise BadInput(
                f"{settings.url}: no trajectory succeeded; first error: {results[0].error}"
            )
        with_versions = any(t.weight_versions for t in results)
        table = table_from_sequences(
            "fixture",
            [sequence_id for sequence_id, _, _ in work],
            [prompt for _, prompt, _ in work],
            [t.tokens for t in results],
            {"rollout": [t.logprobs for t in results]},
            weight_versions=[t.weight_versions or ["unknown"] * len(t.tokens) for t in results]
            if with_versions
            else None,
            finish_reasons=[t.finish_reason for t in results],
            metadata={
                "engine": {
                    "name": "http",
                    "role": "rollout",
                    "versions": {**software_versions(), "server": server.get("version", "unknown")},
                    "server": server,
                },
                "dtype": settings.dtype,
                "dtype_source": "declared (--set dtype=...); not readable over HTTP",
                "knobs": {**asdict(settings), "served_model": model_name},
                "sampling": sampling.as_dict(),
                "logprob_channels": {
                    "rollout": "logprob of the sampled token as the server returned it"
                },
                "model": model_metadata(model_dir),
                "model_source": "declared: the local checkpoint the fleet is meant to serve",
                "errors": {
                    sid: t.error for (sid, _, _), t in zip(work, results, strict=True) if t.error
                },
                "position_id_rule": "arange",
            },
        )
        if all(len(t.top_ids) == len(t.tokens) for t in results) and any(
            t.top_ids for t in results
        ):
            import numpy as np

            table.top_ids = np.array([i for t in results for i in t.top_ids], dtype=np.int32)[
                :, None
            ]
            table.top_logprobs = np.full(table.top_ids.shape, np.nan, dtype=np.float32)
        return table


class _Client:
    def __init__(self, settings: HTTPKnobs):
        self.settings = settings
        self.base = settings.url.rstrip("/")
        self.track_versions = False

    def reads_weight_versions(self) -> bool:
        """Whether GET /weight_info answers (vLLM's RL endpoints, VLLM_SERVER_DEV_MODE=1)."""
        try:
            return isinstance(self._request("GET", "/weight_info", retries=0), dict)
        except BadInput:
            return False

    def weight_version(self) -> str:
        try:
            version = self._request("GET", "/weight_info").get("weight_version")
        except (BadInput, AttributeError):
            return "unknown"
        return "unknown" if version is None else str(version)

    def server_info(self) -> dict:
        """What the server says about itself (version), best effort."""
        for path in ("/version", "/get_server_info", "/server_info"):
            try:
                info = self._request("GET", path, retries=0)
            except BadInput:
                continue
            if isinstance(info, dict):
                return {"endpoint": path, "version": str(info.get("version", "unknown"))}
        return {"endpoint": None, "version": "unknown"}

    def first_model(self) -> str:
        answer = self._request("GET", "/v1/models")
        models = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(models, list):
            raise BadInput(
                f"{self.base}/v1/models answered {describe_json(answer)}, not an OpenAI model "
                "list; is it an OpenAI-compatible server (for SGLang's /generate: --set api=sglang)?"
            )
        if not models:
            raise BadInput(f"{self.base}/v1/models lists no model; pass --set model=NAME.")
        return models[0]["id"]

    def openai_trajectory(
        self, prompt, sampling: SamplingParams, seed: int, model: str
    ) -> Trajectory:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": seed,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "ignore_eos": sampling.ignore_eos,
        }
        if sampling.top_k:
            body["top_k"] = sampling.top_k
        trajectory = Trajectory()
        try:
            before = self.weight_version() if self.track_versions else None
            choice = self._request("POST", "/v1/completions", body)["choices"][0]
            after = self.weight_version() if self.track_versions else None
            logprobs = choice.get("logprobs") or {}
            trajectory.tokens = [_token_id(t) for t in logprobs.get("tokens", [])]
            trajectory.logprobs = [float(v) for v in logprobs.get("token_logprobs", [])]
            trajectory.top_ids = [
                _token_id(min(top, key=lambda k: -top[k]))
                for top in logprobs.get("top_logprobs") or []
                if top
            ]
            trajectory.finish_reason = str(choice.get("finish_reason") or "unknown")
            trajectory.requests = 1
            if self.track_versions:
                # an update between the two reads: which version sampled is not known
                version = before if before == after else "unknown"
                trajectory.weight_versions = [version] * len(trajectory.tokens)
        except (KeyError, IndexError, TypeError, ValueError) as error:
            trajectory.error, trajectory.finish_reason = (
                f"unexpected response shape: {error}",
                "error",
            )
        except BadInput as error:
            trajectory.error, trajectory.finish_reason = str(error), "error"
        return trajectory

    def sglang_trajectory(
        self, prompt, sampling: SamplingParams, seed: int, model: str
    ) -> Trajectory:
        settings = self.settings
        connection = Connection(self.base, settings.timeout_s, settings.retries, settings.backoff_s)
        asked = Asked(resume_aborted=settings.resume_aborted, max_resumes=settings.max_resumes)
        return generate_trajectory(connection, prompt, sampling, seed, asked)

    def _request(
        self, method: str, path: str, body: dict | None = None, retries: int | None = None
    ):
        settings = self.settings
        retries = settings.retries if retries is None else retries
        return json_request(
            method, self.base + path, body, settings.timeout_s, retries, settings.backoff_s
        )


def _token_id(token: str) -> int:
    """vLLM's `return_tokens_as_token_ids` writes tokens as 'token_id:123'."""
    if not token.startswith("token_id:"):
        raise ValueError(
            f"token {token!r} is not 'token_id:N'; the server ignored return_tokens_as_token_ids"
        )
    return int(token.split(":", 1)[1])

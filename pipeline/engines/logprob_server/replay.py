"""The `logprob-server` scoring engine: a fixture scored by a running `lpx serve` (or any
server with its /score schema, docs/logprob-server.md), so a team's old_log_prob server
stands in the nightly matrix beside the in-process engines.

Several URLs (comma-separated) are independent replicas: batches go to them round-robin,
several in flight at once. Every answer names the weight version it was scored with; a
replay that met more than one is refused, since its logprobs would mix policies.

The replay records whether every server was batch-invariant (`lpx serve --batch-invariant`)
and, when not, what the servers say about how far a logprob moves with its batch: logprobs
from a loaded default server are not exact, and the replay says so.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.engines.answered import describe_json
from pipeline.engines.base import knobs_from_dict
from pipeline.engines.http_json import json_request
from pipeline.engines.metadata import model_metadata, software_versions
from pipeline.engines.scoring import ScoredSequence, replay_table
from pipeline.errors import BadInput
from pipeline.fixture.table import TokenTable
from pipeline.names import canonical_dtype
from pipeline.progress import progress_bar


@dataclass(frozen=True)
class ServerKnobs:
    url: str = ""  # one base URL, or several separated by commas (replicas)
    batch_size: int = 16  # sequences per request
    concurrency: int = 4  # requests in flight at once
    timeout_s: float = 600.0
    retries: int = 3
    backoff_s: float = 0.5
    prompt_logprobs: bool = False

    @classmethod
    def from_dict(cls, knobs: dict) -> ServerKnobs:
        settings = knobs_from_dict(cls, knobs, "logprob-server")
        if not all(u.startswith(("http://", "https://")) for u in settings.urls):
            raise BadInput(
                "the logprob-server engine needs --set url=http://HOST:PORT (several replicas: "
                "--set url=http://a:8400,http://b:8400)."
            )
        if settings.batch_size < 1 or settings.concurrency < 1:
            raise BadInput("logprob-server batch_size and concurrency must be at least 1.")
        return settings

    @property
    def urls(self) -> list[str]:
        return [u.strip().rstrip("/") for u in self.url.split(",") if u.strip()]


class LogprobServerEngine:
    name = "logprob-server"
    knobs = ServerKnobs  # beside --dtype and --temperature, which it checks against the server

    def score(self, fixture: TokenTable, model_dir: Path, knobs: dict) -> TokenTable:
        knobs = dict(knobs)
        knobs.pop("micro_batch_size", None)  # the server batches for itself
        expected_dtype = canonical_dtype(str(knobs.pop("dtype", "float32")))
        if float(knobs.pop("temperature", 1.0)) != 1.0:
            raise BadInput(
                "the logprob server scores raw logprobs (temperature 1); drop --temperature."
            )
        settings = ServerKnobs.from_dict(knobs)
        health = [self._get(settings, url + "/health") for url in settings.urls]
        for url, info in zip(settings.urls, health, strict=True):
            if canonical_dtype(str(info.get("dtype", "float32"))) != expected_dtype:
                raise BadInput(
                    f"{url} serves {info.get('dtype')} but this replay expects {expected_dtype}; "
                    f"pass --dtype {info.get('dtype')} (or serve with --set dtype={expected_dtype})."
                )
        indices = list(range(fixture.num_sequences))
        batches = [
            indices[i : i + settings.batch_size]
            for i in range(0, len(indices), settings.batch_size)
        ]
        replicas = itertools.cycle(settings.urls)
        jobs = [(next(replicas), batch) for batch in batches]

        def run(job):
            url, batch = job
            body = {
                "sequences": [
                    {
                        "id": fixture.sequence_ids[i],
                        "prompt_ids": fixture.prompt_of(i).tolist(),
                        "completion_ids": fixture.completion_of(i).tolist(),
                    }
                    for i in batch
                ],
                "prompt_logprobs": settings.prompt_logprobs,
            }
            answer = json_request(
                "POST",
                url + "/score",
                body,
                settings.timeout_s,
                settings.retries,
                settings.backoff_s,
            )
            return url, batch, answer

        answers = []
        with ThreadPoolExecutor(settings.concurrency) as pool:
            for done in progress_bar(
                pool.map(run, jobs), total=len(jobs), desc="logprob-server", unit="req"
            ):
                answers.append(done)
        scored: list[ScoredSequence | None] = [None] * fixture.num_sequences
        versions: dict[tuple[str, str], list[str]] = {}
        for url, batch, answer in answers:
            try:
                key = (str(answer["weight_version"]), str(answer["weights_fingerprint"]))
                results = answer["results"]
                if len(results) != len(batch):
                    raise ValueError(f"{len(results)} results for {len(batch)} sequences")
                for i, result in zip(batch, results, strict=True):
                    scored[i] = _scored(fixture, i, result, settings.prompt_logprobs)
            except (KeyError, TypeError, ValueError) as error:
                raise BadInput(
                    f"{url}/score: unexpected answer ({error!r} in {describe_json(answer)}); "
                    "is it an lpx serve (docs/logprob-server.md)?"
                ) from None
            versions.setdefault(key, []).append(url)
        # The weights decide; replicas may name the same weights differently.
        fingerprints = {fp for _, fp in versions}
        if len(fingerprints) > 1:
            seen = "; ".join(
                f"{v} ({fp[:19]}...) from {', '.join(sorted(set(u)))}"
                for (v, fp), u in versions.items()
            )
            raise BadInput(
                f"the server(s) scored this fixture under several weight versions: {seen}; pause "
                "weight updates (POST /pause) or point every replica at one version, then replay again."
            )
        (fingerprint,) = fingerprints
        weight_version = " | ".join(sorted({v for v, _ in versions}))
        invariant, variance = batch_mode(health)
        metadata = {
            "engine": {
                "name": self.name,
                "role": "replay",
                "versions": software_versions(),
                "server": {
                    "urls": settings.urls,
                    "health": health,
                    "batch_invariant": invariant,
                    "logprob_variance": variance,
                },
            },
            "dtype": str(health[0].get("dtype", "float32")),
            "knobs": {"batch_size": settings.batch_size, "concurrency": settings.concurrency},
            "layout": {
                "world_size": 1,
                "replicas": len(settings.urls),
                "batch_invariant": invariant,
            },
            "model": model_metadata(model_dir),
            "weight_version": weight_version,
            "weights": {"held_tensor_fingerprint": fingerprint},
            "position_id_rule": "arange",
        }
        table = replay_table(fixture, scored, metadata, settings.prompt_logprobs)
        table.top_ids = table.top_logprobs = None  # the schema returns no top-1 tokens
        return table

    @staticmethod
    def _get(settings: ServerKnobs, url: str) -> dict:
        answer = json_request(
            "GET", url, None, settings.timeout_s, settings.retries, settings.backoff_s
        )
        if not isinstance(answer, dict):
            raise BadInput(
                f"{url} answered {describe_json(answer)}, not an object; is it an lpx serve "
                "(docs/logprob-server.md)?"
            )
        return answer


def batch_mode(health: list[dict]) -> tuple[bool, str]:
    """Whether every server scored each sequence alone, and what the first that did not says
    about how far a logprob moves with its batch (its /health statement)."""
    for info in health:
        if info.get("batch_invariant") is not True:
            return False, str(
                info.get("logprob_variance")
                or "batch-dependent: the server does not say how far (an lpx serve older "
                "than --batch-invariant, or another server with this schema)"
            )
    return True, str(health[0].get("logprob_variance", "batch-invariant"))


def _scored(fixture: TokenTable, i: int, result: dict, with_prompt: bool) -> ScoredSequence:
    completion = np.asarray(result["logprobs"], dtype=np.float32)
    if len(completion) != len(fixture.completion_of(i)):
        raise ValueError(f"sequence {fixture.sequence_ids[i]}: {len(completion)} logprobs")
    prompt = None
    if with_prompt:
        prompt = np.asarray(
            [np.nan if v is None else v for v in result["prompt_logprobs"]], dtype=np.float32
        )
    unknown = np.zeros(len(completion), dtype=np.int32)
    return ScoredSequence(completion, prompt, unknown, np.zeros(len(completion), np.float32))

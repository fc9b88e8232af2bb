"""The log-prob server's HTTP surface (FastAPI): score, capture, pause, resume,
update_weights, health, metrics. The schema is in docs/logprob-server.md."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from pipeline.errors import BadInput, DeviceOutOfMemory
from pipeline.serve.capture import CaptureService
from pipeline.serve.metrics import ServerMetrics
from pipeline.serve.model_slot import resolve_model_dir
from pipeline.serve.requests import (
    CaptureRequest,
    Refusal,
    ScoreRequest,
    UpdateRequest,
    check_capture_request,
    check_score_request,
    read_request,
)
from pipeline.serve.scheduler import BatchScheduler, Paused, QueueFull
from pipeline.serve.variance import logprob_variance

DISCONNECT_POLL_S = 0.05


@dataclass(frozen=True)
class ServeSettings:
    token_budget: int = 16384  # padded tokens per scored batch
    max_batch: int = 64  # sequences per scored batch
    max_wait_s: float = 0.005  # how long a batch may wait to fill
    max_queue: int = 4096  # sequences queued before 429
    max_request_sequences: int = 1024  # sequences in one request before 413
    max_sequence_tokens: int = 8192  # prompt + completion tokens of one sequence before 413
    max_body_bytes: int = 128 * 2**20  # a request body before 413
    timeout_s: float = 600.0  # a request's default deadline (504 after it)
    reject_when_paused: bool = False  # 503 + Retry-After instead of waiting
    retry_after_s: int = 1
    # each sequence in its own forward (the slot's micro-batch is 1): logprobs that do not
    # depend on what else is queued
    batch_invariant: bool = False


def create_app(slot, settings: ServeSettings = ServeSettings()) -> FastAPI:
    """``slot``: a ModelSlot (or any object with score, load, version, vocab_size, engine)."""
    state: dict = {}
    metrics = ServerMetrics()
    captures = CaptureService(slot)
    variance = logprob_variance(
        slot.engine, slot.settings.dtype, slot.settings.device, settings.batch_invariant
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        scheduler = BatchScheduler(
            slot.score,
            settings.token_budget,
            settings.max_batch,
            settings.max_wait_s,
            settings.max_queue,
            settings.reject_when_paused,
            settings.batch_invariant,
        )
        scheduler.start()
        state.update(scheduler=scheduler, update_lock=asyncio.Lock(), updating=False)
        yield
        await scheduler.stop()

    app = FastAPI(title="lpx log-prob server", lifespan=lifespan)

    def error(status: int, message: str, **headers) -> JSONResponse:
        metrics.count_request(status)
        return JSONResponse({"error": message}, status_code=status, headers=headers or None)

    def refused(refusal: Refusal) -> JSONResponse:
        metrics.count_request(refusal.status)
        return JSONResponse(refusal.body(), status_code=refusal.status)

    @app.exception_handler(HTTPException)
    async def http_error(_request, failure: HTTPException):  # 404, 405: the same JSON shape
        return JSONResponse(
            {"error": f"{failure.detail}: the endpoints are POST /score, /capture, "
             "/pause, /resume, /update_weights and GET /health, /metrics, /capture"},
            status_code=failure.status_code,
            headers=failure.headers,
        )  # fmt: skip

    @app.post("/score")
    async def score(request: Request):
        started = time.perf_counter()
        scheduler: BatchScheduler = state["scheduler"]
        try:
            body = await read_request(request, ScoreRequest, settings.max_body_bytes)
            checked = check_score_request(
                body,
                slot.vocab_size,
                settings.max_request_sequences,
                settings.max_sequence_tokens,
                getattr(slot, "max_positions", None),
            )
        except Refusal as refusal:
            return refused(refusal)
        pairs = [(prompt, completion, body.prompt_logprobs) for prompt, completion in checked]
        try:
            items = scheduler.submit(pairs)
        except QueueFull as full:
            return error(
                429, f"{full}; retry later", **{"Retry-After": str(settings.retry_after_s)}
            )
        except Paused as paused:
            return error(
                503,
                f"the server is {paused}; retry after {settings.retry_after_s} s",
                **{"Retry-After": str(settings.retry_after_s)},
            )
        outcome = await _wait(items, request, body.timeout_s or settings.timeout_s)
        if outcome != "done":
            scheduler.cancel(items)
            if outcome == "timeout":
                return error(504, f"not scored within {body.timeout_s or settings.timeout_s} s")
            metrics.count_request(499)
            return JSONResponse({"error": "client went away"}, status_code=499)
        try:
            answers = [item.future.result() for item in items]
        except DeviceOutOfMemory as full:  # this batch did not fit: another replica may
            return error(503, str(full), **{"Retry-After": str(settings.retry_after_s)})
        except Exception as failure:  # the engine failed on this batch
            return error(500, f"scoring failed: {failure}")
        versions = {answer[1] for answer in answers}
        if len(versions) != 1:  # cannot happen: updates wait for a paused, idle scheduler
            return error(500, f"one request met several weight versions: {versions}")
        (version,) = versions
        metrics.count_request(200)
        metrics.observe_latency(time.perf_counter() - started)
        results = [
            {"id": s.id if s.id is not None else str(i), **_asked(answer[0], body.prompt_logprobs)}
            for i, (s, answer) in enumerate(zip(body.sequences, answers, strict=True))
        ]
        # orjson straight to bytes: FastAPI's default encoder walks every float in Python
        return Response(
            orjson.dumps(
                {
                    "weight_version": version.weight_version,
                    "weights_fingerprint": version.weights_fingerprint,
                    "results": results,
                }
            ),
            media_type="application/json",
        )

    @app.get("/capture")
    async def describe_capture():
        try:
            return await asyncio.to_thread(captures.describe)
        except Exception as failure:  # noqa: BLE001 - a config the capture adapter cannot read
            return error(500, f"cannot capture from this model: {failure}")

    @app.post("/capture")
    async def capture(request: Request):
        try:
            body = await read_request(request, CaptureRequest, settings.max_body_bytes)
            widths = await asyncio.to_thread(captures.widths)
            token_ids, replace = check_capture_request(
                body,
                slot.vocab_size,
                settings.max_sequence_tokens,
                getattr(slot, "max_positions", None),
                widths,
            )
        except Refusal as refusal:
            return refused(refusal)
        metrics.count_request(200)
        return StreamingResponse(
            captures.stream(token_ids, body.precision, replace), media_type="application/x-ndjson"
        )

    @app.post("/pause")
    async def pause():
        await state["scheduler"].pause("user")
        return {"paused": True, **_version(slot)}

    @app.post("/resume")
    async def resume():
        state["scheduler"].resume("user")
        return {"paused": state["scheduler"].paused, **_version(slot)}

    @app.post("/update_weights")
    async def update_weights(request: Request):
        try:
            body = await read_request(request, UpdateRequest, settings.max_body_bytes)
        except Refusal as refusal:
            return refused(refusal)
        try:
            # a store's version is pulled and verified before pausing: scoring goes on meanwhile
            path = await asyncio.to_thread(resolve_model_dir, Path(body.path), body.version)
        except BadInput as bad:
            return refused(Refusal(400, str(bad), "path"))
        except OSError as failure:  # a name too long, a directory it may not read, ...
            return refused(
                Refusal(400, f"path {body.path[:200]!r}: {failure.strerror or failure}", "path")
            )
        scheduler: BatchScheduler = state["scheduler"]
        async with state["update_lock"]:
            await scheduler.pause("update")
            state["updating"] = True
            started = time.perf_counter()
            try:
                version = await asyncio.to_thread(slot.load, path, body.version)
            except BadInput as bad:
                return error(400, str(bad))
            except Exception as failure:  # noqa: BLE001 - the old weights stay in service
                return error(
                    400, f"could not load {path}: {failure}; still serving the old weights"
                )
            finally:
                state["updating"] = False
                scheduler.resume("update")
        metrics.updates += 1
        return {**asdict(version), "load_s": round(time.perf_counter() - started, 3)}

    @app.get("/health")
    async def health():
        scheduler: BatchScheduler = state["scheduler"]
        return {
            "status": "updating" if state["updating"] else "paused" if scheduler.paused else "ok",
            "engine": slot.engine,
            "dtype": slot.settings.dtype,
            "device": slot.settings.device,
            "queue_depth": scheduler.queue_depth,
            **_version(slot),
            **variance,
        }

    @app.get("/metrics")
    async def prometheus():
        scheduler: BatchScheduler = state["scheduler"]
        text = metrics.render(scheduler, slot.version)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


async def _wait(items, request: Request, timeout_s: float) -> str:
    """ "done", "timeout" or "gone" (the client disconnected)."""
    results = asyncio.gather(*(item.future for item in items), return_exceptions=True)
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            results.cancel()
            return "timeout"
        done, _ = await asyncio.wait({results}, timeout=min(DISCONNECT_POLL_S, left))
        if done:
            return "done"
        if await request.is_disconnected():
            results.cancel()
            return "gone"


def _asked(result: dict, prompt_logprobs: bool) -> dict:
    """A batch scores prompt logprobs when any of its requests asks; only those get them."""
    return (
        result if prompt_logprobs else {k: v for k, v in result.items() if k != "prompt_logprobs"}
    )


def _version(slot) -> dict:
    return {
        "weight_version": slot.version.weight_version,
        "weights_fingerprint": slot.version.weights_fingerprint,
    }

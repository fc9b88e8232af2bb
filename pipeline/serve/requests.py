"""What the log-prob server accepts: the request schema, and every check between the raw
body and the scheduler. A refused request is a 4xx whose JSON names the field and the
index of the bad item ({"error": ..., "field": "sequences[3].completion_ids[17]"}); bad
input never reaches the model, so it never becomes a 500."""

from __future__ import annotations

import email.message
import json
import math
from typing import Annotated, Literal

import numpy as np
from fastapi import Request
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)

MAX_TIMEOUT_S = 86400.0
MAX_ID_CHARS = 1024
MAX_PATH_CHARS = 4096
MAX_VERSION_CHARS = 256


def _no_nul(text: str) -> str:
    if "\x00" in text:
        raise ValueError("holds a NUL character")
    return text


NoNul = AfterValidator(_no_nul)


class Sequence(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: Annotated[StrictStr, Field(max_length=MAX_ID_CHARS)] | None = None
    # ints of any size here: the range is checked against the model's vocabulary, by index
    prompt_ids: list[StrictInt] = Field(min_length=1)
    completion_ids: list[StrictInt] = Field(min_length=1)


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sequences: list[Sequence] = Field(min_length=1)
    prompt_logprobs: StrictBool = False
    timeout_s: (
        Annotated[float, Strict(), Field(gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)] | None
    ) = None


class UpdateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: Annotated[StrictStr, Field(min_length=1, max_length=MAX_PATH_CHARS), NoNul]
    version: (
        Annotated[StrictStr, Field(min_length=1, max_length=MAX_VERSION_CHARS), NoNul] | None
    ) = None


class Rows(BaseModel):
    """One boundary's rows: dtype, [T, F] and base64 little-endian bytes (serve/capture.py)."""

    model_config = ConfigDict(extra="forbid")
    dtype: Literal["float32", "float64", "int64"]
    shape: list[StrictInt] = Field(min_length=2, max_length=2)
    data: StrictStr


class CaptureRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    token_ids: list[StrictInt] = Field(min_length=1)
    precision: Literal["declared", "reference"] = "declared"
    replace: dict[StrictStr, Rows] | None = None


class Refusal(Exception):
    """A request the server will not serve: an HTTP status and a JSON body."""

    def __init__(self, status: int, message: str, field: str | None = None):
        super().__init__(message)
        self.status, self.message, self.field = status, message, field

    def body(self) -> dict:
        return {"error": self.message, **({"field": self.field} if self.field else {})}


async def read_request(request: Request, model: type[BaseModel], max_body_bytes: int):
    """The body of ``request`` as ``model``, or a Refusal: 413 over ``max_body_bytes``
    (checked on Content-Length before reading, then while reading), 415 for a body that is
    not JSON by its Content-Type, 400 for bytes that are not JSON, 422 for JSON that does
    not fit the schema."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise _too_large(f"{int(declared)} bytes", max_body_bytes)
    _check_content_type(request.headers.get("content-type"))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise _too_large(f"more than {max_body_bytes} bytes", max_body_bytes)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise Refusal(400, "empty body: send a JSON object (docs/logprob-server.md)", "body")
    value = parse_json(raw)
    try:
        return model.model_validate(value)
    except ValidationError as invalid:
        raise schema_refusal(invalid) from None


def parse_json(raw: bytes):
    """Strict JSON: no NaN or Infinity (nor numbers that overflow to it); depth and integer
    size within what Python's parser takes."""

    def no_constant(name: str):
        raise ValueError(f"{name} is not JSON; send finite numbers")

    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"{text[:20]} overflows a double; send finite numbers")
        return value

    try:
        return json.loads(raw, parse_constant=no_constant, parse_float=finite)
    except RecursionError:
        raise Refusal(400, "the JSON body is nested too deeply to parse", "body") from None
    except ValueError as bad:  # JSONDecodeError, UnicodeDecodeError, int digit limit, ours
        why = str(bad)
        if "integer string conversion" in why:
            why = "a number has more digits than Python parses (4300)"
        raise Refusal(400, f"the body is not valid JSON: {_clip(why, 160)}", "body") from None


def schema_refusal(invalid: ValidationError) -> Refusal:
    """422 naming the first field that does not fit (and how many more do not)."""
    errors = invalid.errors(include_url=False)
    first = errors[0]
    field = field_path(first["loc"])
    message = f"{field}: {first['msg']}"
    if "input" in first and first["type"] not in ("missing", "extra_forbidden"):
        message += f" (got {_clip(_show(first['input']), 60)})"
    if len(errors) > 1:
        message += f"; and {len(errors) - 1} more problem(s)"
    return Refusal(422, message, field)


def check_score_request(
    body: ScoreRequest,
    vocab_size: int,
    max_sequences: int,
    max_tokens: int,
    max_positions: int | None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each sequence's (prompt, completion) as int64 arrays, or a Refusal: 413 for too many
    sequences or tokens, 400 for a token id outside [0, vocab_size)."""
    if len(body.sequences) > max_sequences:
        raise Refusal(
            413,
            f"{len(body.sequences)} sequences in one request; the limit is {max_sequences}: "
            "split the batch",
            "sequences",
        )
    limit, why = max_tokens, "the server's limit"
    if max_positions is not None and max_positions < limit:
        limit, why = max_positions, "the model's max_position_embeddings"
    pairs = []
    for i, s in enumerate(body.sequences):
        name = f" (sequence {s.id})" if s.id is not None else ""
        tokens = len(s.prompt_ids) + len(s.completion_ids)
        if tokens > limit:
            raise Refusal(
                413,
                f"sequences[{i}]{name}: {tokens} prompt + completion tokens; {why} is {limit}",
                f"sequences[{i}]",
            )
        arrays = []
        for field, ids in (("prompt_ids", s.prompt_ids), ("completion_ids", s.completion_ids)):
            where = _outside_vocabulary(ids, vocab_size)
            if where is not None:
                raise Refusal(
                    400,
                    f"sequences[{i}].{field}[{where}]{name}: token id {_show(ids[where])} is "
                    f"outside the model's vocabulary [0, {vocab_size}); send token ids of this "
                    "model's tokenizer",
                    f"sequences[{i}].{field}[{where}]",
                )
            arrays.append(np.asarray(ids, dtype=np.int64))
        pairs.append((arrays[0], arrays[1]))
    return pairs


def check_capture_request(
    body: CaptureRequest,
    vocab_size: int,
    max_tokens: int,
    max_positions: int | None,
    widths: dict[str, int],
) -> tuple[list[int], dict[str, np.ndarray]]:
    """The token ids and the replacement rows by boundary, or a Refusal: 413 for too many
    tokens, 400 for an id outside the vocabulary, a boundary the model does not have, or rows
    whose shape or bytes do not fit it."""
    from pipeline.localize.wire import decode_rows

    limit, why = max_tokens, "the server's limit"
    if max_positions is not None and max_positions < limit:
        limit, why = max_positions, "the model's max_position_embeddings"
    length = len(body.token_ids)
    if length > limit:
        raise Refusal(413, f"token_ids: {length} tokens; {why} is {limit}", "token_ids")
    where = _outside_vocabulary(body.token_ids, vocab_size)
    if where is not None:
        raise Refusal(
            400,
            f"token_ids[{where}]: token id {_show(body.token_ids[where])} is outside the "
            f"model's vocabulary [0, {vocab_size}); send token ids of this model's tokenizer",
            f"token_ids[{where}]",
        )
    replace = {}
    for name, rows in (body.replace or {}).items():
        field = f"replace.{_clip(name, 80)}"
        if name not in widths:
            raise Refusal(
                400,
                f"{field}: not a boundary of this model; GET /capture lists them "
                "(embed, layers.0.q, ..., logits)",
                field,
            )
        expected = [length, widths[name]]
        if rows.shape != expected:
            raise Refusal(
                400,
                f"{field}: shape {rows.shape}; {name} of {length} tokens is {expected}",
                f"{field}.shape",
            )
        try:
            replace[name] = decode_rows(rows.model_dump())
        except ValueError as bad:
            raise Refusal(400, f"{field}.data: {_clip(str(bad), 160)}", f"{field}.data") from None
    return [int(t) for t in body.token_ids], replace


def field_path(loc) -> str:
    """("sequences", 0, "prompt_ids", 2) -> "sequences[0].prompt_ids[2]"; () -> "body"."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path or "body"


def _outside_vocabulary(ids: list[int], vocab_size: int) -> int | None:
    """The index of the first id outside [0, vocab_size), else None."""
    try:
        values = np.asarray(ids, dtype=np.int64)
    except OverflowError:  # beyond int64: find it in Python
        return next(k for k, v in enumerate(ids) if not 0 <= v < vocab_size)
    outside = np.flatnonzero((values < 0) | (values >= vocab_size))
    return int(outside[0]) if outside.size else None


def _check_content_type(value: str | None) -> None:
    if value is None:  # curl -d without -H, most scripts: JSON is the only body there is
        return
    header = email.message.Message()
    header["content-type"] = value
    subtype = header.get_content_subtype()
    if header.get_content_maintype() != "application" or not (
        subtype == "json" or subtype.endswith("+json")
    ):
        raise Refusal(
            415,
            f"Content-Type {_clip(value, 60)!r}: the body must be JSON; send "
            "Content-Type: application/json",
            "Content-Type",
        )


def _too_large(size: str, limit: int) -> Refusal:
    return Refusal(
        413,
        f"the body holds {size}; this server takes at most {limit} (--max-body-bytes): "
        "split the batch",
        "body",
    )


def _show(value) -> str:
    """A short rendering of a bad value: never the whole of a large one."""
    if isinstance(value, (list, dict)):
        return f"{type(value).__name__} of {len(value)} items"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"{str(value)[:12]}... ({value.bit_length()} bits)"
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."

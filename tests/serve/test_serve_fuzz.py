"""`lpx serve`'s HTTP API under hypothesis, against a real server on the tiny model.

Every generated request is answered either 200, with one result per sequence in order, the
right lengths and the logprobs of an in-process HF scoring of the same sequences (1e-5), or
a 4xx whose JSON error names the field the request got wrong (the exact field and index
where the generator knows it); /health answers 200 "ok" after every request. The requests:
valid ones (hostile ids included); valid ones with one field broken (token ids out of the
vocabulary up to 2**80, wrong types, NaN and infinities, empty and missing lists, unknown
keys, limits exceeded, deep nesting); and raw bodies (bytes, truncations, content types,
chunked bodies over --max-body-bytes).

Profiles as support/fuzzing.py: `fast` (default, derandomized, in CI) and

    LPX_FUZZ=long .venv/bin/python -m pytest tests/serve/test_serve_fuzz.py
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from pipeline.engines.hf.model import load_model
from pipeline.engines.hf.replay import ReplayKnobs, score_batch
from support.fuzzing import HOSTILE_IDS, JSON_VALUES, PROFILE
from tests.serve.test_serve import JSON, MAX_POSITIONS, VOCAB, call, post, served

MAX_BODY = 2**19  # the fuzzed server's --max-body-bytes: 1025 sequences fit, 413 is cheap
# examples per test; the broken and raw ones per kind of breakage, so each kind is run
EXAMPLES = {"fast": {"good": 20, "broken": 8, "raw": 5}, "long": {"good": 500, "broken": 200, "raw": 100}}[PROFILE]  # fmt: skip
FIELDS = ("prompt_ids", "completion_ids")


@pytest.fixture(scope="module")
def fuzz_server(tiny_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("serve-fuzz")
    with served(tiny_model, "--max-body-bytes", str(MAX_BODY), tmp_path=path) as url:
        yield url


@pytest.fixture(scope="module")
def direct(tiny_model):
    """In-process HF scoring of (prompt, completion) pairs, for comparison."""
    model = load_model(tiny_model)

    def score(pairs, want_prompt: bool):
        knobs = ReplayKnobs(micro_batch_size=len(pairs), prompt_logprobs=want_prompt)
        return score_batch(model, [(np.asarray(p), np.asarray(c)) for p, c in pairs], knobs)

    return score


# -- the requests ---------------------------------------------------------------------------

TOKENS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)


@st.composite
def good_requests(draw) -> dict:
    n = draw(st.integers(1, 4))
    ids = draw(st.one_of(st.none(), st.lists(HOSTILE_IDS, min_size=n, max_size=n)))
    sequences = []
    for k in range(n):
        sequence = {"prompt_ids": draw(TOKENS), "completion_ids": draw(TOKENS)}
        if ids is not None:
            sequence["id"] = ids[k]
        sequences.append(sequence)
    request = {"sequences": sequences}
    if draw(st.booleans()):
        request["prompt_logprobs"] = draw(st.booleans())
    if draw(st.booleans()):
        request["timeout_s"] = draw(st.one_of(st.floats(60.0, 600.0), st.integers(60, 86400)))
    return request


NOT_INTEGERS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.text(max_size=4),
    st.none(),
    st.lists(st.integers(0, 3), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
)
NOT_STRINGS = st.one_of(st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                       st.booleans(), st.lists(st.text(max_size=2), max_size=2))  # fmt: skip
NOT_LISTS = st.one_of(st.integers(), st.text(max_size=4), st.none(), st.booleans(),
                      st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))  # fmt: skip
OUT_OF_VOCABULARY = st.one_of(st.integers(VOCAB, 2**80), st.integers(-(2**80), -1))


@st.composite
def broken_requests(draw, how: str):
    """(request, the status, the field): a good request with one thing wrong, ``how``."""
    request = draw(good_requests())
    sequences = request["sequences"]
    i = draw(st.integers(0, len(sequences) - 1))
    field = draw(st.sampled_from(FIELDS))
    ids = sequences[i][field]
    j = draw(st.integers(0, len(ids) - 1))
    at = f"sequences[{i}].{field}"
    if how == "id outside the vocabulary":
        ids[j] = draw(OUT_OF_VOCABULARY)
        return request, 400, f"{at}[{j}]"
    if how == "id not an integer":
        ids[j] = draw(NOT_INTEGERS)
        return request, 422, f"{at}[{j}]"
    if how == "id NaN or infinite":
        ids[j] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        return request, 400, "body"
    if how == "ids empty":
        sequences[i][field] = []
        return request, 422, at
    if how == "ids not a list":
        sequences[i][field] = draw(NOT_LISTS)
        return request, 422, at
    if how == "ids missing":
        del sequences[i][field]
        return request, 422, at
    if how == "ids nested":  # deeper than the parser goes: raw_bodies
        sequences[i][field] = _nested(draw(st.integers(2, 300)))
        return request, 422, f"{at}[0]"
    if how == "unknown key":
        key = draw(st.text(min_size=1, max_size=6).filter(lambda k: k not in KNOWN_KEYS))
        where = draw(st.sampled_from(["top", "sequence"]))
        value = draw(JSON_VALUES)
        (request if where == "top" else sequences[i])[key] = value
        if not _finite(value):
            return request, 400, "body"
        return request, 422, key if where == "top" else f"sequences[{i}].{key}"
    if how == "sequence id wrong":
        sequences[i]["id"] = draw(st.one_of(NOT_STRINGS, st.text(min_size=1025, max_size=1030)))
        return request, 422, f"sequences[{i}].id"
    if how == "prompt_logprobs wrong":
        request["prompt_logprobs"] = draw(st.one_of(st.integers(), st.text(max_size=4), st.none(),
                                                    st.floats(allow_nan=False, allow_infinity=False)))  # fmt: skip
        return request, 422, "prompt_logprobs"
    if how == "timeout_s wrong":
        request["timeout_s"] = draw(st.one_of(st.floats(max_value=0.0, allow_nan=False, allow_infinity=False),
                                              st.floats(min_value=86400.5, allow_infinity=False),
                                              st.booleans(), st.text(max_size=4)))  # fmt: skip
        return request, 422, "timeout_s"
    if how == "sequences wrong":
        request["sequences"] = draw(st.one_of(st.just([]), NOT_LISTS))
        return request, 422, "sequences"
    if how == "too many sequences":
        request["sequences"] = sequences * (1025 // len(sequences) + 1)
        return request, 413, "sequences"
    if how == "over max positions":
        sequences[i][field] = ids * (MAX_POSITIONS // len(ids) + 1)
        return request, 413, f"sequences[{i}]"
    assert how == "not an object"
    value = draw(JSON_VALUES.filter(lambda v: not isinstance(v, dict)))
    return value, 422 if _finite(value) else 400, "body"


BREAKS = [
    "id outside the vocabulary", "id not an integer", "id NaN or infinite", "ids empty",
    "ids not a list", "ids missing", "ids nested", "unknown key", "sequence id wrong",
    "prompt_logprobs wrong", "timeout_s wrong", "sequences wrong", "too many sequences",
    "over max positions", "not an object",
]  # fmt: skip
KNOWN_KEYS = {"sequences", "prompt_logprobs", "timeout_s", "id", *FIELDS}


def _finite(value) -> bool:
    """No NaN or infinity anywhere in ``value`` (they are not JSON: 400, not 422)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


def _nested(depth: int):
    value: list = [1]
    for _ in range(depth - 1):
        value = [value]
    return value


RAW = ["bytes", "truncated", "nested too deep", "content type", "JSON type", "over the limit",
       "chunked over the limit", "chunked"]  # fmt: skip


@st.composite
def raw_bodies(draw, how: str):
    """(body bytes, headers, chunked, status or None for any 4xx, field or None)."""
    good = json.dumps(draw(good_requests())).encode()
    if how == "bytes":
        return draw(st.binary(max_size=64)), JSON, False, None, None
    if how == "nested too deep":
        depth = draw(st.integers(2000, 200000))
        body = b'{"sequences": [{"prompt_ids": ' + b"[" * depth + b"]" * depth + b"}]}"
        return body, JSON, False, 400, "body"
    if how == "truncated":
        return good[: draw(st.integers(0, len(good) - 1))], JSON, False, 400, "body"
    if how == "content type":
        kind = draw(st.sampled_from(["text/plain", "application/x-www-form-urlencoded",
                                     "multipart/form-data; boundary=x", "application/xml",
                                     "json", "", "application/jsonp"]))  # fmt: skip
        return good, {"Content-Type": kind}, False, 415, "Content-Type"
    if how == "JSON type":
        kind = draw(st.sampled_from([None, "application/json; charset=utf-8",
                                     "application/vnd.lpx+json", "Application/JSON"]))  # fmt: skip
        return good, {} if kind is None else {"Content-Type": kind}, False, 200, None
    padded = good + b" " * (MAX_BODY + 1 - len(good) + draw(st.integers(0, 1000)))
    if how == "over the limit":
        return padded, JSON, False, 413, "body"
    if how == "chunked over the limit":
        return padded, JSON, True, 413, "body"
    return good, JSON, True, 200, None


# -- the properties -------------------------------------------------------------------------


@settings(max_examples=EXAMPLES["good"])
@given(request=good_requests())
def test_good_requests_are_scored_as_in_process(fuzz_server, direct, request):
    status, answer = post(fuzz_server, "/score", json.dumps(request).encode(), JSON)
    assert status == 200, answer
    _check_scored(request, answer, direct)
    _check_health(fuzz_server)


@pytest.mark.parametrize("how", BREAKS)
@settings(max_examples=EXAMPLES["broken"])
@given(data=st.data())
def test_a_broken_field_is_a_4xx_naming_it(fuzz_server, how, data):
    request, status, field = data.draw(broken_requests(how))
    got, answer = post(fuzz_server, "/score", json.dumps(request, allow_nan=True).encode(), JSON)
    event(f"status {got}")
    assert 400 <= got < 500 and isinstance(answer, dict), (got, answer)
    assert isinstance(answer.get("error"), str) and answer["error"], answer
    if status is not None:
        assert (got, answer.get("field")) == (status, field), answer
    _check_health(fuzz_server)


@pytest.mark.parametrize("how", RAW)
@settings(max_examples=EXAMPLES["raw"])
@given(data=st.data())
def test_raw_bodies_and_headers(fuzz_server, direct, how, data):
    body, headers, chunked, status, field = data.draw(raw_bodies(how))
    got, answer = _send(fuzz_server, body, headers, chunked)
    event(f"status {got}")
    if status == 200:
        assert got == 200, answer
        _check_scored(json.loads(body), answer, direct)
    else:
        assert 400 <= got < 500 and isinstance(answer, dict) and answer.get("error"), answer
        if status is not None:
            assert (got, answer.get("field")) == (status, field), answer
    _check_health(fuzz_server)


@settings(max_examples=EXAMPLES["good"])
@given(
    path=st.one_of(
        st.text(alphabet=st.sampled_from(list("/.a~-\x00\n")), max_size=600),
        st.text(max_size=20),
    ),
    version=st.one_of(st.none(), st.text(max_size=300)),
)
def test_update_weights_with_any_path_keeps_the_old_weights(fuzz_server, path, version):
    """A path that holds no model: 400 or 422 naming `path` or `version`, and the server
    goes on serving the weights it had."""
    before = call(fuzz_server, "GET", "/health")[1]["weights_fingerprint"]
    body = {"path": path} if version is None else {"path": path, "version": version}
    status, answer = post(fuzz_server, "/update_weights", json.dumps(body).encode(), JSON)
    event(f"status {status}")
    assert status in (400, 422) and answer.get("field") in ("path", "version"), answer
    _check_health(fuzz_server)
    assert call(fuzz_server, "GET", "/health")[1]["weights_fingerprint"] == before


def _check_scored(request: dict, answer: dict, direct) -> None:
    sequences = request["sequences"]
    want_prompt = bool(request.get("prompt_logprobs", False))
    assert answer["weights_fingerprint"].startswith("sha256:") and answer["weight_version"]
    results = answer["results"]
    assert [r["id"] for r in results] == [s.get("id", str(k)) for k, s in enumerate(sequences)]
    expected = direct([(s["prompt_ids"], s["completion_ids"]) for s in sequences], want_prompt)
    for sequence, result, scored in zip(sequences, results, expected, strict=True):
        logprobs = np.asarray(result["logprobs"], dtype=np.float64)
        assert logprobs.shape == (len(sequence["completion_ids"]),)
        assert np.all(np.isfinite(logprobs)) and np.all(logprobs <= 0)
        np.testing.assert_allclose(logprobs, scored.completion, rtol=0, atol=1e-5)
        assert ("prompt_logprobs" in result) == want_prompt, result
        if want_prompt:
            prompt = result["prompt_logprobs"]
            assert len(prompt) == len(sequence["prompt_ids"]) and prompt[0] is None
            np.testing.assert_allclose(prompt[1:], scored.prompt[1:], rtol=0, atol=1e-5)


def _check_health(url: str) -> None:
    status, health, _ = call(url, "GET", "/health")
    assert status == 200 and health["status"] == "ok", health


def _send(url: str, body: bytes, headers: dict, chunked: bool):
    """(status, JSON or text); ``chunked``: Transfer-Encoding chunked, no Content-Length."""
    return post(url, "/score", body, headers, chunked=chunked)

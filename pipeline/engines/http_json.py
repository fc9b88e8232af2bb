"""JSON over HTTP for the HTTP engine adapters: stdlib only, a timeout, retries with
backoff on transient statuses, and errors that name the URL and what answered there."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request

from pipeline.engines.answered import describe_answer, describe_unreachable
from pipeline.errors import BadInput

RETRY_STATUS = (408, 429, 500, 502, 503, 504)


def json_request(
    method: str,
    url: str,
    body: dict | None = None,
    timeout_s: float = 120.0,
    retries: int = 2,
    backoff_s: float = 0.5,
):
    """The decoded JSON answer; BadInput naming the URL when it never comes. A 429 or 503
    with Retry-After waits that long before the next attempt."""
    data = None if body is None else json.dumps(body).encode()
    for attempt in range(retries + 1):
        request = urllib.request.Request(
            url, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        wait = backoff_s * 2**attempt
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                raw = response.read()
                return json.loads(raw)
        except urllib.error.HTTPError as error:
            if error.code not in RETRY_STATUS or attempt == retries:
                said = describe_answer(error.code, error.headers.get("Content-Type"), error.read())
                raise BadInput(f"{url}: {said}") from None
            retry_after = error.headers.get("Retry-After")
            if retry_after and retry_after.isdigit():
                wait = max(wait, float(retry_after))
        # A server that dies mid-answer (a replica killed after its headers went out) leaves
        # a truncated body: http.client's IncompleteRead, transient like a refused connect.
        except (
            urllib.error.URLError,
            TimeoutError,
            ConnectionError,
            http.client.HTTPException,
        ) as error:
            if attempt == retries:
                raise BadInput(
                    f"{url}: {describe_unreachable(error)} after {retries + 1} attempt(s) "
                    f"(timeout {timeout_s:g} s)"
                ) from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            said = describe_answer(response.status, response.headers.get("Content-Type"), raw)
            raise BadInput(f"{url}: {said}, not JSON.") from None
        time.sleep(wait)
    raise AssertionError("unreachable")

"""What answered at a URL, in a few words, when it was not what an engine expected there.

A `--set url=` that points at the wrong server (a 404 page, a proxy's welcome page, another
API's JSON, a port that does not speak HTTP) should read as one line naming the URL and what
answered, e.g. "answered HTTP 404 with an HTML page titled 'Not Found'", never as the page
itself. Pure functions of what came back, so each case is tested without a network.
"""

from __future__ import annotations

import contextlib
import html
import http.client
import json
import re
import socket

GIST_CHARS = 80  # enough to recognise a page or a message, short enough for one line


def describe_answer(status: int, content_type: str, body: bytes) -> str:
    """``answered HTTP <status> with <what the body is>``: an HTML page by its title, JSON by
    its error message or its keys, text by its first words, anything else by its size."""
    return f"answered HTTP {status} with {describe_body(content_type, body)}"


def describe_body(content_type: str, body: bytes) -> str:
    """The body of an HTTP answer in a few words (see `describe_answer`)."""
    content_type = (content_type or "").lower()
    if not body.strip():
        return "an empty body"
    text = body.decode("utf-8", errors="replace")
    if "html" in content_type or re.match(r"\s*<(!doctype|html|head|body)", text, re.I):
        return _html_page(text)
    with contextlib.suppress(ValueError):
        return describe_json(json.loads(text))
    if text.count("\ufffd") > len(text) // 10:
        return f"{len(body)} bytes of {content_type.split(';')[0] or 'binary data'}"
    return f"text {_quoted(text)}"


def describe_json(value) -> str:
    """A decoded JSON answer in a few words: its error message, its keys or its kind."""
    message = _error_message(value)
    if message:
        return f"JSON saying {_quoted(message)}"
    if isinstance(value, dict):
        keys = ", ".join(str(k) for k in list(value)[:6]) + (", ..." if len(value) > 6 else "")
        return f"a JSON object with keys {keys}" if value else "an empty JSON object"
    if isinstance(value, list):
        return f"a JSON list of {len(value)} item(s)"
    return f"JSON {_quoted(json.dumps(value))}"


def describe_unreachable(error: BaseException) -> str:
    """Why no HTTP answer came: nothing listening, a port that speaks something else, a host
    that does not resolve, a timeout. ``error`` is urllib's URLError or what it wraps."""
    reason = getattr(error, "reason", error)
    if isinstance(reason, ConnectionRefusedError):
        return "Connection refused (nothing listens there)"
    if isinstance(reason, http.client.RemoteDisconnected):
        return "closed the connection without an HTTP answer (is it an HTTP server?)"
    if isinstance(reason, http.client.BadStatusLine):
        # repr: a binary protocol's first bytes are control characters
        first = str(reason.args[0] if reason.args else reason).strip()[:GIST_CHARS]
        return f"answered something that is not HTTP (it began {first!r})"
    if isinstance(reason, BrokenPipeError | ConnectionResetError):
        return "closed the connection while lpx sent its request (is it an HTTP server?)"
    if isinstance(reason, http.client.IncompleteRead):
        return f"cut its answer off after {len(reason.partial)} bytes"
    if isinstance(reason, socket.gaierror):
        return f"host not found ({reason.strerror or reason})"
    if isinstance(reason, TimeoutError | socket.timeout) or "timed out" in str(reason):
        return "did not answer in time (timed out)"
    return _one_line(str(reason)) or type(reason).__name__


def _html_page(text: str) -> str:
    title = re.search(r"<title[^>]*>(.*?)</title>", text, re.I | re.S)
    heading = re.search(r"<h1[^>]*>(.*?)</h1>", text, re.I | re.S)
    for found in (title, heading):
        if found and _tag_stripped(found.group(1)):
            return f"an HTML page titled {_quoted(_tag_stripped(found.group(1)))}"
    words = _tag_stripped(re.sub(r"<(script|style)[^>]*>.*?</\1>", " ", text, flags=re.I | re.S))
    return f"an HTML page saying {_quoted(words)}" if words else "an empty HTML page"


def _error_message(value) -> str:
    """The message of an error answer in the shapes servers use: FastAPI's {"detail": ...},
    OpenAI's {"error": {"message": ...}}, {"message": ...} and {"error": "..."}."""
    if not isinstance(value, dict):
        return ""
    for key in ("detail", "error", "message"):
        said = value.get(key)
        if isinstance(said, dict):
            said = said.get("message") or said.get("detail")
        if isinstance(said, list) and said and isinstance(said[0], dict):
            said = said[0].get("msg")  # FastAPI's validation errors
        if isinstance(said, str) and said.strip():
            return said
    return ""


def _tag_stripped(fragment: str) -> str:
    return _one_line(html.unescape(re.sub(r"<[^>]+>", " ", fragment)))


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _quoted(text: str) -> str:
    """The first GIST_CHARS characters on one line, quoted."""
    text = _one_line(text)
    return f"'{text[:GIST_CHARS]}{'...' if len(text) > GIST_CHARS else ''}'"

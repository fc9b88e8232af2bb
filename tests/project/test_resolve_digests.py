"""scripts/resolve-digests, run for real against a registry on localhost (issue 31).

`local_registry` is a real HTTP server speaking the part of the OCI distribution API the script
uses: HEAD/GET /v2/<name>/manifests/<tag> answering Docker-Content-Digest (the sha256 of the
index it serves), behind Docker Hub's anonymous bearer-token challenge. The script reaches it
through --registry-override (or LPX_REGISTRY_OVERRIDE); nothing in the script is replaced.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts" / "resolve-digests"
TOKEN = "anonymous-pull-token"
STALE = "sha256:" + "0" * 64


def _index(name: str) -> bytes:
    manifest = {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": STALE}
    return json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [{**manifest, "annotations": {"name": name}}],
        }
    ).encode()


class LocalRegistry:
    """Serves one index per repository:tag; every request is kept for the assertions.
    Repositories in `bare_head` answer HEAD without Docker-Content-Digest (the header is
    optional there), so a client must GET the index and hash it."""

    def __init__(self, images: dict[str, bytes], bare_head: set[str]):
        self.images = images
        self.bare_head = bare_head
        self.requests: list[tuple[str, str, str | None]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def digest(self, repository_tag: str) -> str:
        return "sha256:" + hashlib.sha256(self.images[repository_tag]).hexdigest()

    def _handler(self):
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self._answer(body=True)

            def do_HEAD(self):
                self._answer(body=False)

            def _answer(self, body: bool):
                authorization = self.headers.get("Authorization")
                registry.requests.append((self.command, self.path, authorization))
                if self.path.startswith("/token?"):
                    return self._send(200, json.dumps({"token": TOKEN}).encode(), body)
                if authorization != f"Bearer {TOKEN}":
                    # Docker Hub's challenge: fetch an anonymous token from the realm, retry.
                    challenge = f'Bearer realm="{registry.url}/token",service="local-registry"'
                    return self._send(401, b"{}", body, {"WWW-Authenticate": challenge})
                repository, _, tag = self.path.removeprefix("/v2/").partition("/manifests/")
                index = registry.images.get(f"{repository}:{tag}")
                if index is None:
                    return self._send(404, b"{}", body)
                headers = {"Content-Type": "application/vnd.oci.image.index.v1+json"}
                if body or repository not in registry.bare_head:
                    digest = "sha256:" + hashlib.sha256(index).hexdigest()
                    headers["Docker-Content-Digest"] = digest
                return self._send(200, index, body, headers)

            def _send(self, status, payload, body, headers=None):
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if body:
                    self.wfile.write(payload)

            def log_message(self, *args):
                pass

        return Handler


@pytest.fixture
def local_registry():
    registry = LocalRegistry(
        {
            "library/engine:v2": _index("engine v2"),
            "nvidia/pytorch:26.09-py3": _index("pytorch 26.09"),
        },
        bare_head={"nvidia/pytorch"},
    )
    serve = {"poll_interval": 0.05}  # a quick shutdown at teardown
    thread = threading.Thread(target=registry.server.serve_forever, kwargs=serve, daemon=True)
    thread.start()
    yield registry
    registry.server.shutdown()
    registry.server.server_close()


def _versions(tmp_path: Path, engine_digest: str, train_digest: str) -> Path:
    """A matrix like .github/engine-versions.json: a Docker Hub official image (library/) and
    an nvcr.io image, the first shared by both rows."""
    rows = [
        {
            "name": name,
            "vllm_base": f"engine:v2@{engine_digest}",
            "train_base": f"nvcr.io/nvidia/pytorch:26.09-py3@{train_digest}",
            "sglang_base": f"engine:v2@{engine_digest}",
        }
        for name in ("current", "previous")
    ]
    path = tmp_path / "engine-versions.json"
    path.write_text(json.dumps({"include": rows}, indent=2) + "\n")
    return path


def _run(*args, env=None, timeout=60) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    return result


def _overrides(url: str) -> list[str]:
    return ["--registry-override", f"docker.io={url}", "--registry-override", f"nvcr.io={url}"]


def test_the_script_is_an_executable_with_a_python_shebang():
    assert os.access(SCRIPT, os.X_OK)
    assert SCRIPT.read_text().startswith("#!/usr/bin/env python3\n")


def test_pins_that_match_the_registry_are_ok(local_registry, tmp_path):
    engine = local_registry.digest("library/engine:v2")
    train = local_registry.digest("nvidia/pytorch:26.09-py3")
    versions = _versions(tmp_path, engine, train)
    before = versions.read_text()
    result = _run("--versions", versions, *_overrides(local_registry.url))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        "engine:v2: ok",
        "nvcr.io/nvidia/pytorch:26.09-py3: ok",
        "2 ok, 0 changed, 0 not checked",
    ]
    assert versions.read_text() == before
    manifests = [r for r in local_registry.requests if "/manifests/" in r[1]]
    # each image asked once though two rows share one, and answered after the token challenge;
    # the HEAD without a digest header is followed by a GET, whose index the script hashes
    bearer = f"Bearer {TOKEN}"
    assert Counter(manifests) == Counter(
        [
            ("GET", "/v2/nvidia/pytorch/manifests/26.09-py3", None),
            ("GET", "/v2/nvidia/pytorch/manifests/26.09-py3", bearer),
            ("HEAD", "/v2/library/engine/manifests/v2", None),
            ("HEAD", "/v2/library/engine/manifests/v2", bearer),
            ("HEAD", "/v2/nvidia/pytorch/manifests/26.09-py3", None),
            ("HEAD", "/v2/nvidia/pytorch/manifests/26.09-py3", bearer),
        ]
    )
    tokens = [path for _, path, _ in local_registry.requests if path.startswith("/token?")]
    assert "/token?scope=repository%3Alibrary%2Fengine%3Apull&service=local-registry" in tokens


def test_a_moved_tag_is_changed_and_exits_1_without_touching_the_file(local_registry, tmp_path):
    train = local_registry.digest("nvidia/pytorch:26.09-py3")
    versions = _versions(tmp_path, STALE, train)
    before = versions.read_text()
    result = _run("--versions", versions, *_overrides(local_registry.url))
    assert result.returncode == 1
    engine = local_registry.digest("library/engine:v2")
    assert f"engine:v2: changed: pinned {STALE}, registry {engine}" in result.stdout.splitlines()
    assert "nvcr.io/nvidia/pytorch:26.09-py3: ok" in result.stdout.splitlines()
    assert result.stdout.splitlines()[-1] == "1 ok, 1 changed, 0 not checked"
    assert versions.read_text() == before


def test_write_repins_every_row_with_the_registrys_digest(local_registry, tmp_path):
    train = local_registry.digest("nvidia/pytorch:26.09-py3")
    versions = _versions(tmp_path, STALE, train)
    result = _run("--versions", versions, "--write", *_overrides(local_registry.url))
    assert result.returncode == 1
    assert "wrote 1 digest(s) to" in result.stdout
    engine = local_registry.digest("library/engine:v2")
    assert json.loads(versions.read_text()) == json.loads(
        _versions(tmp_path, engine, train).read_text()
    )
    again = _run("--versions", versions, *_overrides(local_registry.url))
    assert (
        again.returncode == 0 and again.stdout.splitlines()[-1] == "2 ok, 0 changed, 0 not checked"
    )


def test_a_tag_the_registry_does_not_have_is_not_checked(local_registry, tmp_path):
    versions = _versions(tmp_path, STALE, STALE)
    text = versions.read_text().replace("26.09-py3", "26.99-py3")
    versions.write_text(text)
    result = _run("--versions", versions, *_overrides(local_registry.url))
    assert result.returncode == 1  # engine:v2 still changed
    assert (
        "nvcr.io/nvidia/pytorch:26.99-py3: not checked: the registry has no tag 26.99-py3 "
        "for nvidia/pytorch (HTTP 404)"
    ) in result.stdout.splitlines()


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_an_unreachable_registry_is_listed_not_failed(tmp_path):
    versions = _versions(tmp_path, STALE, STALE)
    before = versions.read_text()
    host = f"127.0.0.1:{_closed_port()}"
    # the option's environment form, LPX_REGISTRY_OVERRIDE
    overrides = {"LPX_REGISTRY_OVERRIDE": f"docker.io=http://{host} nvcr.io=http://{host}"}
    started = time.monotonic()
    result = _run("--versions", versions, "--write", env=overrides)
    assert time.monotonic() - started < 10
    assert result.returncode == 0, result.stdout + result.stderr
    refused = f"not checked: {host} unreachable ([Errno 111] Connection refused)"
    assert result.stdout.splitlines() == [
        f"engine:v2: {refused}",
        f"nvcr.io/nvidia/pytorch:26.09-py3: {refused}",
        "0 ok, 0 changed, 2 not checked (unchecked pins stand as recorded in "
        "docs/engine-versions.md)",
    ]
    assert versions.read_text() == before


def test_a_registry_that_never_answers_times_out(tmp_path):
    versions = _versions(tmp_path, STALE, STALE)
    with socket.socket() as silent:  # accepts connections (the kernel's backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        result = _run("--versions", versions, "--timeout", "0.5", *_overrides(url))
        elapsed = time.monotonic() - started
    assert result.returncode == 0
    assert elapsed < 5  # both images asked at once: one timeout, not one per image
    host = url.removeprefix("http://")
    assert result.stdout.splitlines()[:2] == [
        f"engine:v2: not checked: {host} timed out after 0.5 s",
        f"nvcr.io/nvidia/pytorch:26.09-py3: not checked: {host} timed out after 0.5 s",
    ]


def test_broken_json_exits_2_naming_the_file(tmp_path):
    versions = tmp_path / "engine-versions.json"
    versions.write_text('{"include": [\n')
    result = _run("--versions", versions)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith(f"error: {versions}: not valid JSON (line 2, column 1: ")
    assert "git checkout" in result.stderr


def test_a_reference_without_a_tag_exits_2_naming_the_row(tmp_path):
    versions = _versions(tmp_path, STALE, STALE)
    document = json.loads(versions.read_text())
    document["include"][1]["train_base"] = f"nvcr.io/nvidia/pytorch@{STALE}"
    versions.write_text(json.dumps(document))
    result = _run("--versions", versions)
    assert result.returncode == 2
    assert f"{versions}, row 2 (previous), train_base: " in result.stderr
    assert "names no tag" in result.stderr

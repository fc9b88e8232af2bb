"""Capture through a running `lpx serve`'s /capture endpoint (`logprob-server:url=URL`).

The server runs the HF capture adapter on the weights it serves, in its dtype, and streams
each boundary's rows as NDJSON; this session reads them line by line and hands each to the
sink as it arrives. The session states the server's weight version and fingerprint in its
layout, and refuses an answer computed with other weights than the first one.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pipeline.engines.answered import describe_answer, describe_unreachable
from pipeline.engines.base import knobs_from_dict
from pipeline.engines.http_json import json_request
from pipeline.errors import BadInput


@dataclass(frozen=True)
class ServerCaptureKnobs:
    url: str = ""
    timeout_s: float = 600.0
    retries: int = 2


def open_session(model_dir: Path, knobs: dict, device: str = "cpu", spec: str = "logprob-server"):
    settings = knobs_from_dict(ServerCaptureKnobs, knobs, "logprob-server capture")
    if not settings.url.startswith(("http://", "https://")) or "," in settings.url:
        raise BadInput(
            f"{spec}: name one server, e.g. logprob-server:url=http://127.0.0.1:8400 "
            "(an `lpx serve` of the same model)."
        )
    return ServerCapture(settings, name=spec)


class ServerCapture:
    can_replace = True

    def __init__(self, settings: ServerCaptureKnobs, name: str):
        self.settings = settings
        self.url = settings.url.rstrip("/")
        self.name = name
        info = json_request(
            "GET", self.url + "/capture", None, settings.timeout_s, settings.retries
        )
        try:
            self.dtype = str(info["dtype"])
            self.reference_dtype = str(info["reference_dtype"])
            self._boundaries = [str(b) for b in info["boundaries"]]
            self.fingerprint = str(info["weights_fingerprint"])
            layout = dict(info.get("layout") or {})
        except (KeyError, TypeError) as error:
            raise BadInput(
                f"{self.url}/capture: unexpected answer (no {error}); is it an lpx serve?"
            ) from None
        self.layout = {
            **layout,
            "engine": "logprob-server",
            "url": self.url,
            "weight_version": str(info.get("weight_version")),
            "weights_fingerprint": self.fingerprint,
        }

    @property
    def boundaries(self) -> list[str]:
        return list(self._boundaries)

    def capture(self, token_ids, precision: str, sink, replace: dict | None = None) -> None:
        from pipeline.localize.wire import decode_rows, encode_rows

        body = {"token_ids": [int(t) for t in token_ids], "precision": precision}
        if replace:
            body["replace"] = {name: encode_rows(rows) for name, rows in replace.items()}
        where = self.url + "/capture"
        request = urllib.request.Request(
            where,
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.settings.timeout_s) as response:
                header = json.loads(response.readline())
                self._check_weights(header)
                for raw in response:
                    item = json.loads(raw)
                    if "boundary" in item:
                        sink(item["boundary"], decode_rows(item))
                    elif "error" in item:
                        raise BadInput(f"{where}: {item['error']}")
                    elif item.get("done"):
                        return
                raise BadInput(f"{where}: the answer ended before its last boundary.")
        except urllib.error.HTTPError as error:
            said = describe_answer(error.code, error.headers.get("Content-Type"), error.read())
            raise BadInput(f"{where}: {said}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
            said = describe_unreachable(error)
            raise BadInput(f"{where}: {said} (timeout {self.settings.timeout_s:g} s)") from None
        except (http.client.HTTPException, json.JSONDecodeError, KeyError, ValueError) as error:
            raise BadInput(f"{where}: unreadable answer ({error}); is it an lpx serve?") from None

    def close(self) -> None:
        pass

    def _check_weights(self, header: dict) -> None:
        fingerprint = header.get("weights_fingerprint")
        if fingerprint != self.fingerprint:
            raise BadInput(
                f"{self.url} now serves other weights ({header.get('weight_version')}, "
                f"{str(fingerprint)[:19]}...) than when this localisation began "
                f"({self.layout['weight_version']}); pause weight updates (POST /pause) and rerun."
            )

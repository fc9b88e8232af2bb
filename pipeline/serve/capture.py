"""`/capture`: the served model's activations at every boundary, for `lpx localize`.

Built on the HF capture adapter (`pipeline.localize.adapters.hf`) in the server's process, on
the model directory of the weights in service and in the server's dtype. Its models load on
the first capture, beside the scoring model, so a server that never captures pays nothing.
The answer streams as NDJSON, one line per boundary as soon as the forward computes it:

    {"weight_version": ..., "weights_fingerprint": ..., "dtype": ..., "precision": ..., ...}
    {"boundary": "embed", "dtype": "float32", "shape": [T, F], "data": BASE64}
    ...
    {"done": true, "boundaries": N}        (or {"error": "..."} if the forward failed)

`data` is the row-major little-endian bytes of the array, base64 encoded.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

from pipeline.localize.wire import encode_rows


def line(value: dict) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode() + b"\n"


class CaptureService:
    """One HF capture session for the weights in service (rebuilt when they change); one
    capture at a time, since the adapter's hooks serve one forward at a time."""

    def __init__(self, slot):
        self.slot = slot
        self._lock = threading.Lock()
        self._session = None
        self._model_dir: str | None = None

    def session(self, model_dir: str | None = None):
        """The capture session for `model_dir` (default: the weights in service)."""
        from pipeline.localize.adapters.hf import CaptureKnobs, HFCapture

        model_dir = model_dir or self.slot.version.model_dir
        if self._session is None or self._model_dir != model_dir:
            settings = self.slot.settings
            if self._session is not None:
                self._session.close()
            self._session = HFCapture(
                Path(model_dir),
                CaptureKnobs(dtype=settings.dtype),
                getattr(settings, "device", "cpu"),
                name="lpx serve",
            )
            self._model_dir = model_dir
        return self._session

    def describe(self) -> dict:
        """What GET /capture answers: the boundaries, row widths and precisions."""
        with self._lock:
            session = self.session()
            return {
                "engine": "hf",
                "dtype": session.dtype,
                "reference_dtype": session.reference_dtype,
                "boundaries": session.boundaries,
                "widths": boundary_widths(_config(session), session.boundaries),
                "layout": {**session.layout, "served_by": self.slot.engine},
                **_version(self.slot),
            }

    def widths(self) -> dict[str, int]:
        with self._lock:
            session = self.session()
            return boundary_widths(_config(session), session.boundaries)

    async def stream(self, token_ids: list[int], precision: str, replace: dict):
        """NDJSON lines of one capture, each boundary as soon as the forward emits it."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        finished = object()
        version = self.slot.version

        def sink(name, rows):
            loop.call_soon_threadsafe(
                queue.put_nowait, line({"boundary": name, **encode_rows(rows)})
            )

        def work() -> int:
            with self._lock:
                session = self.session(version.model_dir)
                session.capture(token_ids, precision, sink, replace or None)
                return len(session.boundaries)

        yield line(
            {
                "weight_version": version.weight_version,
                "weights_fingerprint": version.weights_fingerprint,
                "dtype": self.slot.settings.dtype,
                "precision": precision,
                "tokens": len(token_ids),
            }
        )
        future = loop.run_in_executor(None, work)
        future.add_done_callback(lambda _: queue.put_nowait(finished))
        sent = 0
        while (item := await queue.get()) is not finished:
            sent += 1
            yield item
        failure = future.exception()
        if failure is not None:
            yield line({"error": f"capture failed after {sent} boundaries: {failure}"})
        else:
            yield line({"done": True, "boundaries": sent})


def boundary_widths(config: dict, names: list[str]) -> dict[str, int]:
    """Each boundary's row width in the HF layout, from the model's config."""
    from pipeline.localize.boundaries import kind_of

    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    top_k = int(config.get("num_experts_per_tok") or 0)
    by_kind = {
        "q": heads * head_dim,
        "k": kv_heads * head_dim,
        "v": kv_heads * head_dim,
        "logits": int(config["vocab_size"]),
        "router_logits": experts,
        "experts": top_k,
    }
    return {name: by_kind.get(kind_of(name), hidden) for name in names}


def _config(session) -> dict:
    return json.loads((Path(session.model_dir) / "config.json").read_text())


def _version(slot) -> dict:
    return {
        "weight_version": slot.version.weight_version,
        "weights_fingerprint": slot.version.weights_fingerprint,
    }

"""What identifies a case, a series, an engine build and a testbed, read from a report.

Pure functions of report.json's metadata (``Metadata``, pipeline/contracts/report.py). A
series key = case + engine pair by name + testbed and deliberately leaves out engine
versions, images and drivers: those are the engine builds, and a change in them is a point
on the series, not a new series.
"""

from __future__ import annotations

import hashlib

import orjson

from pipeline.contracts.manifest import StageImage
from pipeline.contracts.report import Metadata, Side

# The package that carries each engine's own version in metadata.engine.versions.
ENGINE_VERSION_KEYS = {"hf": "transformers", "fsdp": "torch", "http": "server"}
# Sampling fields that vary night to night without changing what is compared.
SAMPLING_NOT_IN_CASE = ("seed",)


def digest(value) -> str:
    """sha256 of a JSON value with sorted keys: the same description gives the same key."""
    text = orjson.dumps(value, default=str, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    return hashlib.sha256(text).hexdigest()


def engine_name(side: Side) -> str:
    return str((side.get("engine") or {}).get("name") or "unknown")


def engine_version(side: Side) -> str:
    engine = side.get("engine") or {}
    versions = engine.get("versions") or {}
    name = engine_name(side)
    return str(versions.get(name) or versions.get(ENGINE_VERSION_KEYS.get(name, "")) or "unknown")


def build_description(side: Side, image: StageImage | None = None) -> dict:
    """One side's engine build: version, image (when containerised) and the stack under it."""
    versions = (side.get("engine") or {}).get("versions") or {}
    image = image or {}
    return {
        "engine": engine_name(side),
        "version": engine_version(side),
        "image_ref": image.get("ref"),
        "image_digest": image.get("digest"),
        "torch": _version(versions.get("torch")),
        "cuda": _version(versions.get("cuda")),
        "driver": _version(versions.get("driver")),
        "versions": {str(k): str(v) for k, v in versions.items()},
    }


def _version(value) -> str | None:
    return None if value is None else str(value)


def describe_case(metadata: Metadata, label: str | None = None) -> dict:
    """Model, prompt set, channel, dtypes, knobs and parallel layout of one comparison.

    With a ``label`` (a plan's name for the comparison) the knobs are recorded but left out
    of the key, so a knob that an engine upgrade reads back differently stays on the series
    and shows up in the attribution instead of starting a new series.
    """
    fixture, replay = metadata.get("fixture") or {}, metadata.get("replay") or {}
    model = fixture.get("model") or {}
    sampling = {
        k: v for k, v in (fixture.get("sampling") or {}).items() if k not in SAMPLING_NOT_IN_CASE
    }
    layout = replay.get("layout") or {}
    return {
        "label": label,
        "model": str(model.get("path") or model.get("architecture") or "unknown"),
        "weights_fingerprint": str(model.get("weights_fingerprint") or "unknown"),
        "tokenizer_fingerprint": model.get("tokenizer_fingerprint"),
        "prompt_set": str(fixture.get("prompt_set_fingerprint") or "unknown"),
        "channel": str(fixture.get("channel") or "rollout"),
        "rollout_dtype": str(fixture.get("dtype") or "unknown"),
        "replay_dtype": str(replay.get("dtype") or "unknown"),
        "knobs": {
            "rollout": fixture.get("knobs") or {},
            "replay": replay.get("knobs") or {},
            "sampling": sampling,
        },
        "layout": layout,
    }


def case_key(case: dict) -> str:
    keyed = {k: v for k, v in case.items() if k not in ("model",)}
    if case.get("label"):
        keyed = {k: v for k, v in keyed.items() if k != "knobs"}
    return digest(keyed)


def testbed_key(testbed: dict) -> str:
    """The hardware class: a named testbed, else the GPU model and count, else the CPU model."""
    if testbed.get("name"):
        return digest({"name": testbed["name"]})
    if testbed.get("gpu_count"):
        return digest({"gpu": testbed.get("gpu_model"), "count": testbed["gpu_count"]})
    return digest({"cpu": testbed.get("cpu_model")})


def testbed_name(testbed: dict) -> str:
    if testbed.get("name"):
        return str(testbed["name"])
    if testbed.get("gpu_count"):
        return f"{testbed['gpu_count']}x {testbed.get('gpu_model') or 'GPU'}"
    return f"cpu: {testbed.get('cpu_model') or 'unknown'}"


def series_key(case_key_: str, rollout_engine: str, replay_engine: str, testbed_key_: str) -> str:
    return digest([case_key_, rollout_engine, replay_engine, testbed_key_])


def series_label(case: dict, rollout_engine: str, replay_engine: str, testbed: str) -> str:
    """What a person reads: 'hf float32 vs hf bfloat16 · tiny-llama · cpu: ...'."""
    layout = case.get("layout") or {}
    where = []
    if (layout.get("tensor_parallel_size") or 1) > 1:
        where.append(f"TP{layout['tensor_parallel_size']}")
    if (layout.get("world_size") or 1) > 1:
        where.append(f"x{layout['world_size']}")
    name = case.get("label") or case["model"].rstrip("/").split("/")[-1]
    pair = f"{rollout_engine} {case['rollout_dtype']} vs {replay_engine} {case['replay_dtype']}" + (
        f" {' '.join(where)}" if where else ""
    )
    return f"{pair} · {name} · {testbed}"

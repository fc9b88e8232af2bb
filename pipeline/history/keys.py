"""What identifies a case, a series, an engine build and a testbed, read from a report.

Pure functions of report.json's metadata (``Metadata``, pipeline/contracts/report.py). A
series key = case + engine pair by name + testbed and deliberately leaves out engine
versions, images and drivers: those are the engine builds, and a change in them is a point
on the series, not a new series. Nor does anything that differs from run to run of the same
case split it: seeds, run and request ids, output paths, timestamps (``run_specific``).
What a case key holds, and why: docs/history.md, "What a series is".
"""

from __future__ import annotations

import hashlib
import re

import orjson

from pipeline.contracts.manifest import StageImage
from pipeline.contracts.report import Metadata, Side

# The package that carries each engine's own version in metadata.engine.versions.
ENGINE_VERSION_KEYS = {"hf": "transformers", "fsdp": "torch", "http": "server"}
# What else an engine's numbers depend on, beside its own release, as
# metadata.engine.versions names it: the runtime, and the modelling code where the engine
# takes it from transformers (FSDP, DeepSpeed and Megatron's conversion build the model
# with it), so a transformers upgrade under FSDP is an upgrade of the FSDP build.
ENGINE_STACKS = {
    "hf": ("torch",),
    "fsdp": ("transformers",),  # its own version string is "FSDP2 (torch X)"
    "deepspeed": ("torch", "transformers"),
    "megatron": ("torch", "transformers"),
    "vllm": ("torch",),
    "sglang": ("torch",),
}
# Knobs that differ from run to run of one case: a seed, an id of the run or a request, where
# the outputs go, when, and where the engine was reached (a server's URL, host and port, a
# process id: a nightly on whichever runner is free gets another each night; the server's
# build is recorded apart). Matched on the last part of a knob's name, lower case.
RUN_SPECIFIC_NAMES = frozenset(
    {"seed", "run_id", "run_name", "request_id", "trajectory_id", "job_id", "uuid",
     "out", "output", "outputs", "log", "timestamp", "date", "time", "started", "ended",
     "url", "host", "hostname", "port", "pid", "node", "address", "endpoint",
     "master_addr", "master_port", "dist_init_addr", "cuda_visible_devices"}
)  # fmt: skip
RUN_SPECIFIC_SUFFIXES = ("seed", "_dir", "_path", "_file", "_at", "_timestamp", "_uuid",
                         "_url", "_host", "_hostname", "_port", "_addr", "_address",
                         "_endpoint", "_pid")  # fmt: skip
RUN_SPECIFIC_PREFIXES = ("seed_", "output_", "out_")
# A value that is a timestamp, a UUID, a network address (scheme://...) or a path in a
# temporary directory is run-specific whatever the knob is called.
_RUN_SPECIFIC_VALUE = re.compile(
    r"^(\d{4}-\d{2}-\d{2}[T _]\d{2}:\d{2}"
    r"|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
    r"|(https?|tcp|grpc|wss?|zmq|ipc|unix)://"
    r"|/(tmp|var/tmp|dev/shm)/)",
    re.IGNORECASE,
)

_DEVICE_INDEX = re.compile(r"^(cuda|xpu|npu|mps|hpu):\d+$", re.IGNORECASE)


def digest(value) -> str:
    """sha256 of a JSON value with sorted keys: the same description gives the same key."""
    text = orjson.dumps(value, default=str, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    return hashlib.sha256(text).hexdigest()


def engine_name(side: Side) -> str:
    return str((side.get("engine") or {}).get("name") or "unknown")


def engine_version(side: Side) -> str:
    """The engine's build as the matrix and attribution name it: its own release, then the
    stack under it that changes its numbers (``ENGINE_STACKS``): "0.32.0, torch 2.9.0"."""
    engine = side.get("engine") or {}
    return stack_version(engine_name(side), engine.get("versions") or {})


def release_key(engine: str, versions: dict) -> str | None:
    """Which of ``versions`` is the engine's own release: its name, or the package that
    carries it (``ENGINE_VERSION_KEYS``), spelled as a dump from another tool may spell it
    ("megatron-core", "megatron_core", "SGLang")."""
    spelled = {_plain(name): name for name in versions}
    for name in (engine, ENGINE_VERSION_KEYS.get(engine, ""), f"{engine}core"):
        key = spelled.get(_plain(name))
        if name and key is not None and versions[key]:
            return key
    return None


def _plain(name) -> str:
    return re.sub(r"[-_. ]", "", str(name).lower())


def stack_version(engine: str, versions: dict) -> str:
    own = release_key(engine, versions)
    parts = [str(versions[own]) if own else "unknown"]
    for package in ENGINE_STACKS.get(engine, ()):
        if versions.get(package) and package != own:
            parts.append(f"{package} {versions[package]}")
    return ", ".join(parts)


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


BUILD_SEGMENT_FIELDS = ("engine", "version", "image_ref", "image_digest", "cuda", "driver")


def segment_of(rollout_build: dict, replay_build: dict) -> str:
    """Both sides' builds as detection's baseline segments tell them apart: the engines'
    releases with their stacks, images, CUDA and driver; not lpx, Python or the other
    packages a build lists (they do not change an engine's numbers)."""
    return digest(
        [
            [build.get(name) for name in BUILD_SEGMENT_FIELDS]
            for build in (rollout_build, replay_build)
        ]
    )[:16]


def run_specific(name: str, value, run_dir: str | None = None) -> bool:
    """Whether a knob differs from run to run of one case (``RUN_SPECIFIC_*``), or is a path
    inside the run's own directory (an output)."""
    last = str(name).rsplit(".", 1)[-1].lower()
    if (
        last in RUN_SPECIFIC_NAMES
        or last.endswith(RUN_SPECIFIC_SUFFIXES)
        or last.startswith(RUN_SPECIFIC_PREFIXES)
    ):
        return True
    if isinstance(value, str):
        if _RUN_SPECIFIC_VALUE.match(value.strip()):
            return True
        if run_dir and value.startswith(run_dir.rstrip("/") + "/"):
            return True
    return False


def case_knobs(knobs: dict, run_dir: str | None = None) -> dict:
    """``knobs`` without what is run-specific, at any depth (nested dicts kept as dicts), and
    a device without its index ("cuda:3" is "cuda": which GPU of a node a nightly got is not
    part of the case, as the layout already records it)."""
    kept = {}
    for name, value in knobs.items():
        if run_specific(name, value, run_dir):
            continue
        if isinstance(value, dict):
            kept[name] = case_knobs(value, run_dir)
        elif isinstance(value, str) and _DEVICE_INDEX.match(value):
            kept[name] = value.split(":", 1)[0].lower()
        else:
            kept[name] = value
    return kept


def describe_case(metadata: Metadata, label: str | None = None, run_dir: str | None = None) -> dict:
    """Model, prompt set, channel, dtypes, knobs and parallel layout of one comparison.

    Knobs that differ from run to run (``run_specific``: seeds, ids, outputs under
    ``run_dir``, timestamps) are left out. With a ``label`` (a plan's name for the
    comparison) the knobs are recorded but left out of the key, so a knob that an engine
    upgrade reads back differently stays on the series and shows up in the attribution
    instead of starting a new series.
    """
    fixture, replay = metadata.get("fixture") or {}, metadata.get("replay") or {}
    model = fixture.get("model") or {}
    sampling = case_knobs(fixture.get("sampling") or {}, run_dir)
    layout = case_knobs(replay.get("layout") or {}, run_dir)
    return {
        "label": label,
        "model": str(model.get("path") or model.get("architecture") or "unknown"),
        "weights_fingerprint": str(model.get("weights_fingerprint") or "unknown"),
        "tokenizer_fingerprint": model.get("tokenizer_fingerprint"),
        "prompt_set": str(fixture.get("prompt_set_fingerprint") or "unknown"),
        "channel": str(fixture.get("channel") or "rollout"),
        "rollout_dtype": str(fixture.get("dtype") or "unknown"),
        "replay_dtype": str(replay.get("dtype") or "unknown"),
        # reduced-precision numerics: an FP8 rollout is another case than a bf16 one
        "rollout_numerics": _numerics(fixture),
        "replay_numerics": _numerics(replay),
        # a multi-turn agent loop: its turns and mode are another workload than one turn
        "agent_loop": _agent_loop(fixture),
        "knobs": {
            "rollout": case_knobs(fixture.get("knobs") or {}, run_dir),
            "replay": case_knobs(replay.get("knobs") or {}, run_dir),
            "sampling": sampling,
        },
        "layout": layout,
    }


def _numerics(side: Side) -> str | None:
    recorded = side.get("numerics") or {}
    text = recorded.get("text") if isinstance(recorded, dict) else None
    return str(text) if text else None


def _agent_loop(side: Side) -> str | None:
    """A fixture's agent loop in words (its turns, mode, thinking or the preset it was
    ingested with); None for one completion per prompt."""
    loop = side.get("agent_loop")
    if not isinstance(loop, dict):
        return None
    if loop.get("mode") == "ingested":
        return f"ingested ({loop.get('preset', 'unknown')})"
    think = ", thinking" if loop.get("think") else ""
    # the chat template renders the loop's opening, tool and user turns (and, in messages
    # mode, every context): another template is another workload
    template = (side.get("model") or {}).get("chat_template_fingerprint")
    template = (
        f", template {template.removeprefix('sha256:')[:12]}"
        if template and template != "none" else ""
    )  # fmt: skip
    mode = loop.get("mode")
    # a messages loop that the engine's own chat path rendered is another workload than one
    # lpx rendered (a loop recorded before the renderer was has no rendered_by)
    if mode == "messages" and not str(loop.get("rendered_by") or "lpx").startswith("lpx"):
        mode = "messages through the engine's chat path"
    return f"{loop.get('turns')} turns, {mode}{think}{template}"


# keyed only where present (a side's numerics, an agent loop): every case recorded before
# keeps its key
KEYED_WHERE_PRESENT = ("rollout_numerics", "replay_numerics", "agent_loop")


def case_key(case: dict) -> str:
    """The digest of a case (``describe_case``) less its model path (the weights' and the
    tokenizer's fingerprints stand for the model) and, for a labelled case, its knobs. The
    run-specific knobs are dropped here too, so a case stored before they were is keyed as
    a new one is (the history migration re-keys with this)."""
    keyed = {
        k: v for k, v in case.items() if k != "model" and not (k in KEYED_WHERE_PRESENT and not v)
    }
    keyed["knobs"] = case_knobs(keyed.get("knobs") or {})
    keyed["layout"] = case_knobs(keyed.get("layout") or {})
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


def numerics_label(text: str | None) -> str:
    """``fp8-block + kv fp8_e4m3`` for a side's numerics text ("" for none)."""
    if not text:
        return ""
    from pipeline.contracts.numerics import parse_numerics

    return parse_numerics(text).label


def series_label(case: dict, rollout_engine: str, replay_engine: str, testbed: str) -> str:
    """What a person reads: 'hf float32 vs hf bfloat16 · tiny-llama · cpu: ...'."""
    layout = case.get("layout") or {}
    where = []
    if (layout.get("tensor_parallel_size") or 1) > 1:
        where.append(f"TP{layout['tensor_parallel_size']}")
    if (layout.get("world_size") or 1) > 1:
        where.append(f"x{layout['world_size']}")
    name = case.get("label") or case["model"].rstrip("/").split("/")[-1]
    rollout = " ".join(
        filter(None, [case["rollout_dtype"], numerics_label(case.get("rollout_numerics"))])
    )
    replay = " ".join(
        filter(None, [case["replay_dtype"], numerics_label(case.get("replay_numerics"))])
    )
    pair = f"{rollout_engine} {rollout} vs {replay_engine} {replay}" + (
        f" {' '.join(where)}" if where else ""
    )
    return f"{pair} · {name} · {testbed}"

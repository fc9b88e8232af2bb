"""The capture adapters' registry: a SPEC parsed, and the adapter it names opened (lpx's own
through `pipeline.plugins`' built-in table, third parties' through the entry-point group
`lpx.capture_engines`)."""

from __future__ import annotations

from pipeline import plugins
from pipeline.errors import BadInput, EngineNotInstalled

GROUP = plugins.CAPTURE
# Engines that lpx knows but cannot capture from, and what it would take.
REFUSED = {
    "http": "an HTTP-only rollout engine returns logprobs, not activations; run its model in "
    "a capture adapter (hf, vllm, sglang) or serve it with `lpx serve`, whose /capture "
    "endpoint the logprob-server adapter reads",
}


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """("hf", {"dtype": "bf16"}) for "hf:dtype=bf16"; BadInput naming the part that is wrong."""
    engine, _, rest = spec.strip().partition(":")
    if not engine:
        raise BadInput(f"engine spec {spec!r}: name an engine, e.g. hf:dtype=bf16.")
    knobs, given = {}, {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or not key:
            raise BadInput(f"engine spec {spec!r}: {part!r} is not knob=value.")
        if key in knobs:  # the later one would silently win; which one was meant is not ours
            raise BadInput(
                f"engine spec {spec!r}: {given[key]!r} and {part!r} both set {key}; give it once."
            )
        knobs[key], given[key] = value.strip(), part
    return engine, knobs


def engine_names() -> list[str]:
    return plugins.names(GROUP)


def open_side(spec: str, model_dir, device: str = "cpu"):
    engine, knobs = parse_spec(spec)
    if engine in REFUSED:
        raise BadInput(f"cannot capture activations from {engine!r}: {REFUSED[engine]}.")
    try:
        open_session = plugins.load(GROUP, engine)
    except ImportError as error:
        raise EngineNotInstalled(
            f"the {engine!r} capture adapter cannot be imported ({error}); install the engine."
        ) from None
    if open_session is None:
        raise BadInput(
            f"no capture adapter for engine {engine!r}; known: {', '.join(engine_names())}."
        )
    return open_session(model_dir, knobs, device=device, spec=spec)

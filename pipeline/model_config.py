"""The model as an engine read it: the keys of a model config that change a logprob, in one
form whatever wrote them (a config.json, transformers 4 or 5, vLLM's resolved hf_config,
SGLang's file with its override arguments), and what differs between two such records.

Engines read these keys differently in ways that produced real mismatches (vLLM's RoPE op at
long lengths, YaRN's attention factor dropped, a sliding window off by one, Qwen's
`max_window_layers` read two ways), while the weights were right. Each side records the
config it computed with (`metadata.model.config`), so compare can name a difference on file
before it re-scores anything. Pure, but for the file fingerprints (`config_files`)."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

CONFIG_FILES = ("config.json", "generation_config.json")
# RoPE scaling's fields (YaRN, LongRoPE, Llama 3, dynamic NTK, partial rotary, M-RoPE)
ROPE_FIELDS = (
    "rope_type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "low_freq_factor",
    "high_freq_factor",
    "truncate",
    "partial_rotary_factor",
    "mrope_section",
    "short_factor",
    "long_factor",
)
# A recorded key and the config fields it is read from, first found first
READ_FROM = {
    "num_hidden_layers": ("num_hidden_layers",),
    "max_position_embeddings": ("max_position_embeddings",),
    "rms_norm_eps": ("rms_norm_eps", "layer_norm_eps", "norm_eps", "layer_norm_epsilon"),
    "head_dim": ("head_dim",),
    "num_attention_heads": ("num_attention_heads",),
    "num_key_value_heads": ("num_key_value_heads",),
    "attn_logit_softcapping": ("attn_logit_softcapping",),
    "final_logit_softcapping": ("final_logit_softcapping",),
    "tie_word_embeddings": ("tie_word_embeddings",),
    "quantization_config": ("quantization_config",),
}
# Recorded but not judged: a loaded model's config carries the dtype it was loaded in, which
# is the side's own dtype (judged as precision), not a reading of the model
NOT_COMPARED = ("torch_dtype",)
REL_TOLERANCE = 1e-9  # floats written by two JSON writers (1e-06 and 1e-6)


def numerics_config(config, file_config: dict | None = None) -> dict:
    """The logprob-relevant keys of ``config`` (a dict, or a transformers/vLLM config object
    with ``to_dict``), normalized: ``rope`` (type, theta and every scaling field set),
    ``sliding_window`` (None where no layer windows), ``windowed_layers`` (the layers that
    do), eps, head sizes, soft-caps, the tied head, quantization_config, and the file's
    ``torch_dtype`` (from ``file_config`` where the object holds the loaded dtype)."""
    raw = _as_dict(config)
    out: dict = {"rope": _rope(raw)}
    layers = raw.get("num_hidden_layers")
    window, windowed = _windows(raw, layers)
    out["sliding_window"] = window
    out["windowed_layers"] = _ranges(windowed)
    for key, fields in READ_FROM.items():
        value = next((raw[f] for f in fields if raw.get(f) is not None), None)
        out[key] = _plain(value)
    if out["head_dim"] is None and raw.get("hidden_size") and raw.get("num_attention_heads"):
        out["head_dim"] = int(raw["hidden_size"]) // int(raw["num_attention_heads"])
    if out["tie_word_embeddings"] is None:
        out["tie_word_embeddings"] = True  # transformers' PretrainedConfig default
    declared = file_config if file_config is not None else raw
    dtype = declared.get("torch_dtype") or declared.get("dtype")
    out["torch_dtype"] = str(dtype).removeprefix("torch.") if dtype else None
    return out


def config_files(model_dir) -> dict:
    """sha256 of each config file a model directory has (config.json, generation_config.json)."""
    found = {}
    for name in CONFIG_FILES:
        path = Path(model_dir) / name
        if path.is_file():
            found[name] = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def read_config_file(model_dir) -> dict:
    """config.json as a dict ({} where it is missing or not a JSON object)."""
    try:
        loaded = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def with_overrides(config: dict, overrides: dict) -> dict:
    """A config dict with an engine's override arguments applied as engines apply them (vLLM's
    ``hf_overrides``, SGLang's ``--json-model-override-args``): nested dicts merged, the rest
    replaced."""
    merged = dict(config)
    for key, value in (overrides or {}).items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = with_overrides(merged[key], value)
        else:
            merged[key] = value
    return merged


def config_differences(rollout: dict | None, replay: dict | None) -> list[dict]:
    """[{"key", "rollout", "replay"}] for each key both records hold and read differently
    (``rope.theta``-style keys for RoPE's fields); [] where either side recorded none."""
    if not isinstance(rollout, dict) or not isinstance(replay, dict):
        return []
    differ = []
    for key in sorted(set(rollout) & set(replay)):
        if key in NOT_COMPARED:
            continue
        a, b = rollout[key], replay[key]
        if key == "rope" and isinstance(a, dict) and isinstance(b, dict):
            differ += [
                {"key": f"rope.{field}", "rollout": a.get(field), "replay": b.get(field)}
                for field in sorted(set(a) | set(b))
                if not _same(a.get(field), b.get(field))
            ]
        elif not _same(a, b):
            differ.append({"key": key, "rollout": a, "replay": b})
    return differ


def described(differences: list[dict]) -> str:
    """'rope.rope_theta 10000 (rollout) against 500000 (replay); ...'."""
    return "; ".join(
        f"{d['key']} {_shown(d['rollout'])} (rollout) against {_shown(d['replay'])} (replay)"
        for d in differences
    )


def _rope(raw: dict) -> dict:
    # transformers 5 writes rope_parameters; 4 wrote rope_theta beside rope_scaling (whose
    # type was once "type"); vLLM's resolved hf_config is whichever its transformers has
    rope = {}
    for source in (raw.get("rope_scaling"), raw.get("rope_parameters")):
        if isinstance(source, dict):
            rope.update({k: v for k, v in source.items() if v is not None})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.pop("type", None)
    if raw.get("rope_theta") is not None and "rope_theta" not in rope:
        rope["rope_theta"] = raw["rope_theta"]
    if raw.get("partial_rotary_factor") is not None and "partial_rotary_factor" not in rope:
        rope["partial_rotary_factor"] = raw["partial_rotary_factor"]
    rope.setdefault("rope_type", "default")
    return {k: _plain(rope[k]) for k in ROPE_FIELDS if k in rope}


def _windows(raw: dict, layers) -> tuple[int | None, list[int]]:
    """The window size and the layers it applies to, as transformers builds them: explicit
    ``layer_types``; else Qwen2/3's rule (a window where ``use_sliding_window``, on layers at
    or past ``max_window_layers``); else every layer (Mistral)."""
    window = raw.get("sliding_window")
    if raw.get("use_sliding_window") is False or not window:
        return None, []
    n = int(layers or 0)
    types = raw.get("layer_types")
    if isinstance(types, list) and types:
        windowed = [i for i, t in enumerate(types) if "sliding" in str(t)]
    elif "use_sliding_window" in raw:
        start = raw.get("max_window_layers")
        windowed = list(range(int(start) if start is not None else 0, n))
    else:
        windowed = list(range(n))
    return (int(window) if windowed else None), windowed


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' ('' for none): short, and equal where the sets are."""
    parts, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            parts.append(str(start) if start == layer else f"{start}-{layer}")
            start = None
    return ",".join(parts)


def _as_dict(config) -> dict:
    if isinstance(config, dict):
        return config
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    return dict(vars(config))


def _plain(value):
    """JSON-plain: tuples as lists, nested dicts kept, objects as their dicts."""
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    to_dict = getattr(value, "to_dict", None)
    return _plain(to_dict()) if callable(to_dict) else str(value)


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(float(a), float(b), rel_tol=REL_TOLERANCE, abs_tol=0.0)
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _shown(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return json.dumps(value) if isinstance(value, dict | list) else str(value)

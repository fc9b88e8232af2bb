"""Model-config misreads: one side computed with the same weights under a config read another
way, the kind of bug of vLLM's RoPE op at long lengths, of YaRN's attention factor dropped,
of a sliding window off by one, of Qwen's `max_window_layers` read two ways.

Two ways in:
- a `model_config` finding (the sides recorded different configs,
  compare/config_evidence.py): the recorded reading of the side that differs from the
  reference model's own is re-scored as it is;
- drift nothing else reproduced: each key engines are known to misread is searched over
  its values (`readings`), the nearest re-scored on one sequence each, and the best judged.
  The search gives up after its first pass where no reading comes CLOSER nearer the side
  than the model's own config (no misread of one key is at work).

Windows are searched around the position drift starts at (a window of W parts from the
model's at position W): compare's onset where it found one, else where the searched
sequence's drift rises; a window reading that comes nearer the side at all is refined (its
layers, and every size near it) before the search is judged. RoPE's theta over the values
checkpoints use and x/÷ 2, 4 and 10 of the model's, then refined by golden section on log
theta and snapped to two significant digits where that fits as well. Each edit is exact
(verify/config_edit.py: fp32 re-scores of a window or a theta that an engine read so match
its logprobs to 1e-6)."""

from __future__ import annotations

import numpy as np

from pipeline.contracts.causes import Cause
from pipeline.contracts.report import Finding
from pipeline.verify.config_edit import EDITABLE, own_reading, reading
from pipeline.verify.hypothesis import Candidate, Family
from pipeline.verify.search import golden_section, mean_abs

KIND = "config_misread"
CLOSER = 1.5  # a reading must come this much nearer the side than the model's own config
THETAS = (1e4, 5e4, 1e5, 5e5, 1e6, 5e6, 1e7)  # the RoPE bases checkpoints ship
THETA_FACTORS = (0.1, 0.25, 0.5, 2.0, 4.0, 10.0)
THETA_STEPS = 14  # golden-section steps on log theta around the best of the grid
EPSILONS = (1e-8, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2)  # what configs ship, and defaults
SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}  # Gemma 2's
SCALINGS = (2.0, 4.0)  # RoPE scaling factors tried on a model that has none
WINDOWS = 6  # powers of two tried as a window where compare found no onset
MAX_WINDOW_STEPS = 16  # sizes re-scored either side of the window's size found
SNAP = 1.02  # a two-digit theta is kept where it leaves at most this much more gap


class ModelConfig(Family):
    name = "model_config"
    causes = (Cause.MODEL_CONFIG,)
    kinds = (KIND,)

    def hypotheses(self, ref, finding: Finding) -> list[Candidate]:
        """The recorded readings of the keys the sides differ in, each side's that differs
        from the reference model's own; a search where none can be re-scored."""
        differences = finding.details.get("differences") or []
        own = own_reading(ref.model)
        out = []
        for side in ("rollout", "replay"):
            edits = _recorded_edits(differences, side, own)
            if edits:
                out.append(_candidate(ref, edits, {"from": f"the {side}'s recorded config"}))
        return out or self.alternatives(ref, finding)

    def alternatives(self, ref, finding: Finding) -> list[Candidate]:
        onset = finding.details.get("position_onset")
        return [_candidate(ref, {}, {"search": True, **({"onset": onset} if onset else {})})]

    def search(self, ref, candidate, rows, observed, clean, side) -> Candidate:
        if not candidate.params.get("search"):
            return candidate
        row, seen = rows[0], observed[0]
        own = own_reading(ref.model)
        longest = len(ref.fixture.prompt_of(row)) + len(ref.fixture.completion_of(row))

        def gap(edits: dict) -> float:
            try:
                return mean_abs([seen], _rescored(ref, edits, [row]))
            except (ValueError, KeyError, TypeError):
                return float("inf")

        before = mean_abs([seen], [clean[0]])
        onset = candidate.params.get("onset")
        start = None if onset else _drift_start(ref, rows, observed, clean, side)
        tried = {_label(e): (e, gap(e)) for e in readings(own, candidate.params, longest, start)}
        window = _refined_window(tried, own, before, gap, layers_searched=bool(onset or start))
        if window is not None:
            tried[_label(window[0])] = window
        best_label = min(tried, key=lambda k: tried[k][1], default=None)
        if best_label is None or tried[best_label][1] * CLOSER > before:
            nearest = {k: round(v[1], 6) for k, v in sorted(tried.items(), key=lambda i: i[1][1])}
            return _candidate(
                ref, {}, {"searched": len(tried), "nearest": dict(list(nearest.items())[:3])}
            )
        edits, best_gap = tried[best_label]
        if "rope" in edits and set(edits["rope"]) == set(own["rope"]):
            edits, best_gap = _refined_theta(edits, best_gap, gap)
        return _candidate(
            ref, edits, {"searched": len(tried), "key": _keys(edits), "value": _values(edits)}
        )

    def commit(self, ref, candidate: Candidate, rows: list[int]):
        return _rescored(ref, candidate.params.get("edits") or {}, rows)

    def words(self, outcome, how: str) -> tuple[str, str]:
        from pipeline.contracts.causes import Severity

        params = outcome.candidate.params
        edits = params.get("edits") or {}
        if not edits:
            return how, Severity.FAULT
        return (
            f"the {outcome.side} side computed as if the model config read "
            f"{_values(edits)}: re-scored with that reading, its logprobs match to mean |d| "
            f"{outcome.after:.3g} (floor {outcome.floor:.3g}; the drift was "
            f"{outcome.before:.3g}); check how that engine reads "
            f"{_keys(edits)} ({', '.join(_where(k) for k in edits)})",
            Severity.FAULT,
        )

    def tried_words(self, tried: dict) -> str | None:
        params = tried["params"]
        if "nearest" not in params:
            return None
        return (
            f"model config: {params['searched']} misreadings re-scored (RoPE theta and scaling, "
            f"windows, eps, soft-caps, a tied head), none nearer the side than the model's own "
            f"config (nearest: {params['nearest']})"
        )


def readings(own: dict, params: dict, longest: int, start: int | None = None) -> list[dict]:
    """Each single-key misreading engines commit, as edits to the model's own reading.
    ``start``: where the searched sequence's drift rises, a window's edge where compare
    found no onset."""
    rope = own.get("rope") or {}
    theta = float(rope.get("rope_theta") or 10000.0)
    thetas = {t for t in THETAS} | {theta * f for f in THETA_FACTORS}
    out = [{"rope": {**rope, "rope_theta": t}} for t in sorted(thetas) if not _close(t, theta)]
    kind = rope.get("rope_type", "default")
    if kind != "default":
        out.append({"rope": {"rope_type": "default", "rope_theta": theta}})  # scaling dropped
        if kind == "yarn":
            out.append({"rope": {**rope, "attention_factor": 1.0}})  # vLLM's get_rope bug
    else:
        longest_table = int(own.get("max_position_embeddings") or longest)
        for factor in SCALINGS:
            out.append({"rope": {"rope_type": "linear", "rope_theta": theta, "factor": factor}})
            # YaRN's original length: the config's table, or that table / factor (a config
            # whose max_position_embeddings already counts the scaling)
            for original in dict.fromkeys((longest_table, int(longest_table // factor))):
                out.append({"rope": {"rope_type": "yarn", "rope_theta": theta, "factor": factor,
                                     "original_max_position_embeddings": original}})  # fmt: skip
    out += _windows(own, params.get("onset"), longest, start)
    eps = own.get("rms_norm_eps")
    out += [{"rms_norm_eps": e} for e in EPSILONS if eps is not None and not _close(e, eps)]
    for key, value in SOFTCAPS.items():
        out.append({key: None if own.get(key) else value})
    if not own.get("tie_word_embeddings"):
        out.append({"tie_word_embeddings": True})
    return out


def _windows(own: dict, onset, longest: int, start: int | None = None) -> list[dict]:
    window, layers = own.get("sliding_window"), own.get("windowed_layers") or ""
    every = f"0-{_layer_count(own) - 1}" if _layer_count(own) else layers
    if window:
        sizes = {window - 1, window + 1}
        out = [{"sliding_window": w, "windowed_layers": layers} for w in sorted(sizes)]
        out.append({"sliding_window": None, "windowed_layers": ""})
        if layers != every:
            out.append({"sliding_window": window, "windowed_layers": every})
        return out
    out = []
    edge = onset or start
    if edge and int(edge) > 1:
        # a window of W parts from the model's at position W: that size, on every layer or
        # on the layers a window rule read one way or the other gives (the size refined
        # after, `_refined_window`)
        out = [
            {"sliding_window": int(edge), "windowed_layers": layers}
            for layers in (every, *_cuts(_layer_count(own)))
        ]
    if onset:
        return out
    sizes = {2**k for k in range(4, 20) if 2**k < longest}
    sizes = set(sorted(sizes)[-WINDOWS:])
    return out + [{"sliding_window": w, "windowed_layers": every} for w in sorted(sizes) if w > 1]


def _drift_start(ref, rows: list[int], observed, clean, side: str) -> int | None:
    """Where the observed side's drift from the clean reference rises over the searched
    sequences, pooled by absolute position (`compare.onset.drift_start`): the edge a window
    would have. Pooled, as a window's edge is at one position in every sequence: on the
    tiny Qwen3 with a window of 24 on its second layer, one sequence alone put it anywhere
    from 24 to 54, all eight pooled at 27 (fp32 replay) and 30 (bf16); a rise's split lies
    inside the ramp, after its edge, which `_window_size` then scans."""
    from pipeline.compare.calibrated import side_precision
    from pipeline.compare.onset import drift_start

    meta = ref.fixture.metadata if side == "rollout" else ref.replay.metadata
    indices = ref.observed(rows)[2]
    floors = ref.token_floors((side_precision(meta), "float32"), clean, indices)
    where = [i + len(ref.fixture.prompt_of(r)) - 1 for r, i in zip(rows, indices, strict=True)]
    z = np.abs(np.concatenate(observed) - np.concatenate(clean)) / np.maximum(
        np.concatenate(floors), 1e-12
    )
    return drift_start(np.concatenate(where), np.nan_to_num(z, nan=0.0, posinf=0.0))


def _refined_window(tried: dict, own: dict, before: float, gap, layers_searched: bool):
    """The nearest window reading refined, where it is the nearest reading of all and comes
    nearer the side than the model's own config: on which layers (max_window_layers read
    either way), unless the readings held those already, and its size to the token.
    Refined before the search is judged: a window of the wrong size or on other layers
    lies well off the side (a Qwen3 window of 24 on its second layer, searched at 32: 1.4x
    nearer, short of CLOSER), and the gap is not unimodal in the size (that window's gap
    at 20..33 had local minima at 28 and 32), so every size within MAX_WINDOW_STEPS is
    re-scored. None otherwise: where another key's reading is nearer, a window is not what
    the side computed with, and the search costs its readings only."""
    if own.get("sliding_window") or not tried:
        return None
    edits, best_gap = min(tried.values(), key=lambda v: v[1])
    if not edits.get("sliding_window") or not best_gap < before:
        return None
    if not layers_searched:
        for layers in _cuts(_layer_count(own)):
            edit = {**edits, "windowed_layers": layers}
            edit_gap = tried[_label(edit)][1] if _label(edit) in tried else gap(edit)
            if edit_gap < best_gap:
                edits, best_gap = edit, edit_gap
    return _window_size(edits, best_gap, gap)


def _window_size(edits: dict, best_gap: float, gap) -> tuple[dict, float]:
    """The window's size to the token: every size within MAX_WINDOW_STEPS of the size found
    (an onset seen under noise lies a few tokens past the edge, or the powers of two a few
    either side of it; a window off by one is the size +- 1), the nearest kept. Not a walk
    that stops where the gap rises: it is not unimodal in the size."""
    size = int(edits["sliding_window"])
    for trial_size in range(max(2, size - MAX_WINDOW_STEPS), size + MAX_WINDOW_STEPS + 1):
        if trial_size == size:
            continue
        trial = {**edits, "sliding_window": trial_size}
        trial_gap = gap(trial)
        if trial_gap < best_gap:
            edits, best_gap = trial, trial_gap
    return edits, best_gap


def _cuts(layers: int) -> list[str]:
    """Windowed layer sets that a window's layer rule read one way or another gives: the
    layers from k on, or before k, at a few k (every k for a model of up to 8 layers)."""
    points = range(1, layers) if layers <= 8 else sorted({layers // 4, layers // 2,
                                                          3 * layers // 4, 1, layers - 1})  # fmt: skip
    out = []
    for k in points:
        out += [f"{k}-{layers - 1}" if k < layers - 1 else str(k), f"0-{k - 1}" if k > 1 else "0"]
    return out


def _layer_count(own: dict) -> int:
    return int(own.get("num_hidden_layers") or 0)


def _refined_theta(edits: dict, best_gap: float, gap) -> tuple[dict, float]:
    """Theta refined by golden section on log theta within x/÷ 2 of the grid's best, then
    snapped to two significant digits where that fits as well."""
    rope = edits["rope"]
    center = np.log(float(rope["rope_theta"]))

    def at(log_theta: float) -> float:
        return gap({"rope": {**rope, "rope_theta": float(np.exp(log_theta))}})

    log_found = golden_section(at, center - np.log(2.0), center + np.log(2.0), THETA_STEPS)
    found = float(np.exp(log_found))
    found_gap = gap({"rope": {**rope, "rope_theta": found}})
    if found_gap >= best_gap:
        found, found_gap = float(rope["rope_theta"]), best_gap
    snapped = float(f"{found:.2g}")
    snapped_gap = gap({"rope": {**rope, "rope_theta": snapped}})
    if snapped_gap <= SNAP * found_gap:
        found, found_gap = snapped, snapped_gap
    return {"rope": {**rope, "rope_theta": found}}, found_gap


def _recorded_edits(differences: list[dict], side: str, own: dict) -> dict:
    """The edits that make the reference read as ``side`` recorded, for the keys the sides
    differ in and that side reads otherwise than the reference model does."""
    edits: dict = {}
    for difference in differences:
        key, value = difference["key"], difference[side]
        if key.startswith("rope."):
            field = key.split(".", 1)[1]
            if (own.get("rope") or {}).get(field) != value:
                rope = edits.setdefault("rope", dict(own.get("rope") or {}))
                if value is None:
                    rope.pop(field, None)
                else:
                    rope[field] = value
        elif key in EDITABLE and own.get(key) != value:
            edits[key] = value
    if ("sliding_window" in edits) != ("windowed_layers" in edits):
        for key in ("sliding_window", "windowed_layers"):
            edits.setdefault(key, own.get(key))
    return edits


def _rescored(ref, edits: dict, rows: list[int]) -> list[np.ndarray]:
    from pipeline.faults import rescore

    with reading(ref.model, edits):
        values = rescore(ref.model, ref.pairs(rows), "clean", ref.base)
    return ref.compared(values, rows)


def _candidate(ref, edits: dict, params: dict) -> Candidate:
    return Candidate(Cause.MODEL_CONFIG, KIND, ref.base, {**params, "edits": edits})


def _label(edits: dict) -> str:
    return _values(edits)


def _keys(edits: dict) -> str:
    return ", ".join(sorted(edits))


def _values(edits: dict) -> str:
    parts = []
    for key, value in sorted(edits.items()):
        if key == "rope" and isinstance(value, dict):
            parts.append(
                ", ".join(f"rope.{k}={_short(v)}" for k, v in value.items() if k != "rope_type")
                + f" ({value.get('rope_type', 'default')})"
            )
        else:
            parts.append(f"{key}={_short(value)}")
    return "; ".join(parts)


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "none" if value is None or value == "" else str(value)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(abs(a), abs(b))


def _where(key: str) -> str:
    return {
        "rope": "its rotary embedding and RoPE scaling",
        "sliding_window": "its attention's window",
        "windowed_layers": "which layers it gives the window (layer_types, max_window_layers)",
        "rms_norm_eps": "its norms' eps",
        "attn_logit_softcapping": "its attention soft-cap",
        "final_logit_softcapping": "its final-logit soft-cap",
        "tie_word_embeddings": "whether it ties the head to the embeddings",
    }.get(key, key)

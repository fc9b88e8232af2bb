"""`lpx calibrate`: measure a model's precision noise floor on the fixture's own tokens.

The reference engine (HF) re-scores a sample of the fixture's sequences in every precision a
comparison may meet (fp32, each side's declared dtype, TF32 on CUDA), each in two
micro-batch sizes (batch variance: other padding, other reduction shapes) and by
teacher-forced decoding with a KV cache (how a rollout engine computed them). Two correct
scorings of the same tokens differ by this much: for every pair of precisions the |d|
samples are fitted per surprisal and position bucket (`floor.py`) and written to
calibration.json, keyed by the model's weights, the engine, the layout and the hardware.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from pipeline import devices
from pipeline.compare.calibrated import CALIBRATION_FILE, CALIBRATION_FORMAT, TF32, pair_key
from pipeline.compare.floor import fit_floor
from pipeline.fixture.table import TokenTable

__all__ = ["CALIBRATION_FILE", "calibrate", "calibration_key", "precisions_for"]
DEFAULT_SEQUENCES = 32
MICRO_BATCHES = (8, 3)


def sample_rows(fixture: TokenTable, sequences: int) -> list[int]:
    """Up to ``sequences`` rows spread evenly over the fixture (same every time)."""
    total = fixture.num_sequences
    if sequences >= total:
        return list(range(total))
    return sorted({int(i) for i in np.linspace(0, total - 1, sequences).round()})


def calibrate(
    fixture: TokenTable,
    model_dir: Path,
    dtypes: list[str],
    sequences: int = DEFAULT_SEQUENCES,
    device: str = "auto",
    say=lambda line: None,
) -> dict:
    """The calibration of ``model_dir`` on ``fixture``'s tokens for ``dtypes`` (fp32 is
    always measured: it is the reference every floor is bucketed by)."""
    from pipeline.engines.hf_common import load_model, model_metadata
    from pipeline.engines.hf_decode import decode_logprobs
    from pipeline.engines.hf_replay import ReplayKnobs, score_batches

    device = devices.resolve_device(device)
    rows = sample_rows(fixture, sequences)
    pairs = [(fixture.prompt_of(r), fixture.completion_of(r)) for r in rows]
    active = np.concatenate([_mask(fixture, r) for r in rows])
    positions = np.concatenate([np.arange(len(c)) for _, c in pairs])[active]
    lengths = np.array([int(_mask(fixture, r).sum()) for r in rows])
    precisions = precisions_for(dtypes, device)
    scored: dict[tuple[str, str], np.ndarray] = {}
    timing = {}
    for name in precisions:
        dtype = "float32" if name == TF32 else name
        started = time.perf_counter()
        model = load_model(model_dir, dtype, device=device)
        devices.set_tf32(device, name == TF32)
        settings = ReplayKnobs(dtype=dtype, device=device)
        for size in MICRO_BATCHES:
            batches = [pairs[i : i + size] for i in range(0, len(pairs), size)]
            sized = replace(settings, micro_batch_size=size)
            values = score_batches(model, batches, sized, progress=False)
            scored[name, f"prefill{size}"] = np.concatenate([s.completion for s in values])[active]
        decoded = decode_logprobs(model, pairs, MICRO_BATCHES[0])
        scored[name, "decode"] = np.concatenate(decoded)[active]
        timing[name] = round(time.perf_counter() - started, 2)
        say(f"calibrate: {name} scored {len(pairs)} sequences three ways in {timing[name]:.1f} s")
        del model
        devices.release_memory(device)
    devices.set_tf32(device, False)
    reference = scored["float32", f"prefill{MICRO_BATCHES[0]}"].astype(np.float64)
    floors = {}
    for a, b in itertools.combinations_with_replacement(precisions, 2):
        samples = _pair_samples(scored, a, b)
        floor = fit_floor(
            np.concatenate(samples),
            np.tile(-reference, len(samples)),
            np.tile(positions, len(samples)),
        )
        floor["sequence_mean_abs_max"] = float(
            max(_sequence_means(s, lengths).max() for s in samples)
        )
        floor["variants"] = len(samples)
        floors[pair_key(a, b)] = floor
    return {
        "lpx_calibration": CALIBRATION_FORMAT,
        "key": calibration_key(model_metadata(model_dir), device),
        "created_at": datetime.now(UTC).replace(tzinfo=None).isoformat(timespec="seconds"),
        "sequences": len(rows),
        "tokens": int(active.sum()),
        "micro_batches": list(MICRO_BATCHES),
        "precisions": precisions,
        "timing_s": timing,
        "pairs": floors,
    }


def precisions_for(dtypes: list[str], device: str) -> list[str]:
    """What a calibration measures: fp32 (the reference), the given dtypes, TF32 on CUDA."""
    return sorted({"float32", *dtypes} | ({TF32} if devices.is_cuda(device) else set()))


def calibration_key(model: dict, device: str) -> dict:
    """What a calibration is valid for: the same weights, scored by the same engine and
    layout on the same kind of hardware."""
    import torch
    import transformers

    hardware = devices.hardware(device)
    return {
        "model_fingerprint": model.get("weights_fingerprint"),
        "model_path": model.get("path"),
        "engine": "hf",
        "layout": {"attn_implementation": "sdpa", "device": devices.device_kind(device)},
        "hardware": hardware.get("name"),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def _pair_samples(scored: dict, a: str, b: str) -> list[np.ndarray]:
    """|d| between correct scorings as a rollout meets a replay: in one precision,
    decoding against prefill in each micro-batch size; across two, each side's decode and
    prefill against the other's prefill. Not prefill against prefill in one precision:
    two batchings often agree to the bit (on a CPU always), and pooling those zeros with
    decoding halved the floor a rollout is judged by (16x1024 bf16: a clean run failed)."""
    m1, m2 = (f"prefill{size}" for size in MICRO_BATCHES)

    def gap(x, y):
        return np.abs(scored[x].astype(np.float64) - scored[y].astype(np.float64))

    if a == b:
        return [gap((a, "decode"), (a, m1)), gap((a, "decode"), (a, m2))]
    return [
        gap((a, m1), (b, m2)),
        gap((a, "decode"), (b, m1)),
        gap((b, "decode"), (a, m1)),
    ]


def _sequence_means(abs_diff: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    sums = np.add.reduceat(abs_diff, offsets[:-1][lengths > 0]) if len(abs_diff) else np.zeros(0)
    return sums / np.maximum(lengths[lengths > 0], 1)


def _mask(fixture: TokenTable, row: int) -> np.ndarray:
    return np.asarray(fixture.completion_mask[fixture.completion_slice(row)], dtype=bool)

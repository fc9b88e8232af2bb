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
from pipeline.compare.calibrated import (
    CALIBRATION_FILE,
    CALIBRATION_FORMAT,
    TAU_MARGIN,
    TF32,
    pair_key,
)
from pipeline.compare.floor import bucket_of, expect, fit_floor
from pipeline.compare.noise_test import design_of
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
    rows: list[int] | None = None,
    keyed: bool = True,
) -> dict:
    """The calibration of ``model_dir`` on ``fixture``'s tokens for ``dtypes`` (fp32 is
    always measured: it is the reference every floor is bucketed by). ``rows``: exactly these
    fixture rows instead of ``sequences`` spread over it (verification re-scores the
    sequences a precision claim is about); ``keyed=False`` leaves out the key, whose weights
    fingerprint reads every weight file (verification already checked them)."""
    from pipeline.engines.hf_common import model_metadata

    device = devices.resolve_device(device)
    rows = sample_rows(fixture, sequences) if rows is None else list(rows)
    pairs = [(fixture.prompt_of(r), fixture.completion_of(r)) for r in rows]
    masks = [_mask(fixture, r) for r in rows]
    active = np.concatenate(masks) if masks else np.zeros(0, dtype=bool)
    positions = np.concatenate([np.arange(len(c)) for _, c in pairs])[active]
    lengths = np.array([int(m.sum()) for m in masks], dtype=np.int64)
    precisions = precisions_for(dtypes, device)
    scored, timing = score_ways(model_dir, pairs, precisions, device, say)
    scored = {key: values[active] for key, values in scored.items()}
    reference = scored["float32", f"prefill{MICRO_BATCHES[0]}"].astype(np.float64)
    floors = {}
    for a, b in itertools.combinations_with_replacement(precisions, 2):
        samples = _pair_samples(scored, a, b, -reference, positions)
        floors[pair_key(a, b)] = fit_pair(samples, -reference, positions, lengths)
    return {
        "lpx_calibration": CALIBRATION_FORMAT,
        "key": calibration_key(model_metadata(model_dir), device) if keyed else {},
        "created_at": datetime.now(UTC).replace(tzinfo=None).isoformat(timespec="seconds"),
        "sequences": len(rows),
        "tokens": int(active.sum()),
        "micro_batches": list(MICRO_BATCHES),
        "precisions": precisions,
        "timing_s": timing,
        "pairs": floors,
    }


def score_ways(model_dir: Path, pairs: list, precisions: list[str], device: str, say):
    """Each pair's completion logprobs in every precision, four correct ways: prefill in
    micro-batches of 8 and of 3, with eager attention instead of SDPA, and teacher-forced
    decoding with a KV cache. Keyed (precision, way); timing per precision in seconds."""
    from pipeline.engines.hf_common import load_model
    from pipeline.engines.hf_decode import decode_logprobs
    from pipeline.engines.hf_replay import ReplayKnobs, score_batches

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
            scored[name, f"prefill{size}"] = np.concatenate([s.completion for s in values])
        scored[name, "decode"] = np.concatenate(decode_logprobs(model, pairs, MICRO_BATCHES[0]))
        # another attention kernel on the same weights: what a different engine's kernels move
        model.set_attn_implementation("eager")
        eager = replace(settings, attn_implementation="eager")
        batches = [pairs[i : i + MICRO_BATCHES[0]] for i in range(0, len(pairs), MICRO_BATCHES[0])]
        values = score_batches(model, batches, eager, progress=False)
        scored[name, "eager"] = np.concatenate([s.completion for s in values])
        del model
        devices.release_memory(device)
        if name == "float32":
            # fp32's own ground truth: what two fp32 engines' reduction orders scatter about
            scored["float64", "prefill1"] = score_exactly(model_dir, pairs, device)
        timing[name] = round(time.perf_counter() - started, 2)
        say(f"calibrate: {name} scored {len(pairs)} sequences four ways in {timing[name]:.1f} s")
    devices.set_tf32(device, False)
    return scored, timing


def score_exactly(model_dir: Path, pairs: list, device: str) -> np.ndarray:
    """Completion logprobs computed in fp64 throughout, one sequence at a time (eager
    attention, an fp64 log-softmax): the reference fp32 implementations scatter about."""
    import torch

    from pipeline.engines.hf_common import load_model, model_device

    model = load_model(model_dir, "float64", attn_implementation="eager", device=device)
    out = []
    with torch.no_grad():
        for prompt, completion in pairs:
            ids = np.concatenate([prompt, completion]).astype(np.int64)
            inputs = torch.from_numpy(ids)[None].to(model_device(model))
            hidden = model.base_model(input_ids=inputs).last_hidden_state[0]
            rows = hidden[len(prompt) - 1 : len(ids) - 1]
            logprobs = model.get_output_embeddings()(rows).log_softmax(-1)
            targets = torch.from_numpy(np.asarray(completion, dtype=np.int64)).to(rows.device)
            out.append(logprobs.gather(-1, targets[:, None])[:, 0].cpu().numpy())
    del model
    devices.release_memory(device)
    return np.concatenate(out) if out else np.zeros(0)


def fit_pair(variants: dict[str, np.ndarray], surprisal, positions, lengths) -> dict:
    """One pair's floor from its variants (label -> |d| per token, all on the same tokens).

    Correct implementations differ by different amounts (another attention kernel moves more
    than another batching). The floor is fitted on the wider half of the variants; the
    narrow ones (decoding against prefill in one precision shares most of its kernels) have
    another shape, most tokens equal and a few apart, which scaled up would fatten the tails.
    An engine under test has kernels of its own, and may lie as far beyond the widest variant
    as the wide variants lie apart among themselves (measured: Megatron-core bf16 2.5 % above
    HF's widest, vLLM-CPU fp32 1.25x; docs/compare.md): each wide variant is scaled to the
    widest mean times that ``allowance`` (widest over narrowest of the wide half). ``spread``
    says how far the widest lies above the mean of all. The design
    (`noise_test.design_of`) and how often a token passes its tau are measured on the same
    scaled samples."""
    means = {
        label: float(values.mean()) if len(values) else 0.0 for label, values in variants.items()
    }
    widest = max(means.values(), default=0.0)
    wide = sorted(means, key=means.get, reverse=True)[: (len(means) + 1) // 2]
    narrowest = min(means[label] for label in wide) if wide else 0.0
    allowance = widest / narrowest if narrowest > 0 else 1.0
    level = widest * allowance
    scaled = [
        variants[label] * (level / means[label]) if means[label] > 0 else variants[label]
        for label in wide
    ]
    count = len(scaled)
    pooled = np.concatenate(scaled)
    floor = fit_floor(pooled, np.tile(surprisal, count), np.tile(positions, count))
    plain_mean = float(np.mean(list(means.values()))) if means else 0.0
    floor["spread"] = widest / plain_mean if plain_mean > 0 else 1.0
    floor["allowance"] = allowance
    floor["variant_means"] = means
    floor["variants"] = len(means)
    floor["fitted_on"] = wide
    expected = expect(floor, surprisal, positions)
    designs = [design_of(v, expected["mean"], expected["q99"], lengths) for v in scaled]
    floor["design"] = {key: float(np.mean([d[key] for d in designs])) for key in designs[0]} | {
        "sequences": int(len(lengths))
    }
    tau = TAU_MARGIN * np.maximum(expected["q999"], 1e-12)
    floor["tau_exceedance"] = {
        "count": int(sum(np.count_nonzero(v > tau) for v in scaled)),
        "samples": int(len(pooled)),
    }
    floor["sequence_mean_abs_max"] = float(max(_sequence_means(v, lengths).max() for v in scaled))
    return floor


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
        "format": CALIBRATION_FORMAT,  # a stored calibration of another format is not reused
        "model_fingerprint": model.get("weights_fingerprint"),
        "model_path": model.get("path"),
        "engine": "hf",
        "layout": {"attn_implementation": "sdpa", "device": devices.device_kind(device)},
        "hardware": hardware.get("name"),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def _pair_samples(scored: dict, a: str, b: str, surprisal, positions) -> dict[str, np.ndarray]:
    """|d| between correct scorings as a rollout meets a replay, by label.

    Across two precisions: each side's decode, eager and prefill against the other's
    prefill. In one precision: decoding against prefill in each batching, and eager against
    SDPA attention; not prefill against prefill, which often agree to the bit (on a CPU
    always) and would pull the floor under what a rollout engine's decoding gives. In one
    low precision (bf16, fp16, TF32), also each side against fp32: two engines there share
    the rounded weights and round activations alike, and measured engine pairs (vLLM-CPU,
    Megatron-core, HF eager and SDPA) differ by up to what one of them differs from fp32,
    3x more than HF's own decoding and prefill do. In fp32 nothing is shared but the
    weights, which are exact: two engines' reduction orders err independently, so the pair's
    noise is the difference of two independent errors against fp64 (docs/compare.md, the
    precision gate)."""
    m1, m2 = (f"prefill{size}" for size in MICRO_BATCHES)

    def gap(x, y):
        return np.abs(scored[x].astype(np.float64) - scored[y].astype(np.float64))

    if a != b:
        return {
            f"{a}:{m1} vs {b}:{m2}": gap((a, m1), (b, m2)),
            f"{a}:decode vs {b}:{m1}": gap((a, "decode"), (b, m1)),
            f"{b}:decode vs {a}:{m1}": gap((b, "decode"), (a, m1)),
            f"{a}:eager vs {b}:{m1}": gap((a, "eager"), (b, m1)),
            f"{b}:eager vs {a}:{m1}": gap((b, "eager"), (a, m1)),
        }
    samples = {
        f"{a}:decode vs {a}:{m1}": gap((a, "decode"), (a, m1)),
        f"{a}:decode vs {a}:{m2}": gap((a, "decode"), (a, m2)),
        f"{a}:eager vs {a}:{m1}": gap((a, "eager"), (a, m1)),
    }
    exact = ("float64", "prefill1")
    if a == "float32" and exact in scored:
        samples["float32:decode vs float64"] = gap((a, "decode"), exact)
        samples["float32:eager vs float64"] = gap((a, "eager"), exact)
        decode_error = scored[a, "decode"].astype(np.float64) - scored[exact]
        eager_error = scored[a, "eager"].astype(np.float64) - scored[exact]
        samples["float32 engines erring independently"] = np.abs(
            decode_error - _shuffled_within_buckets(eager_error, surprisal, positions)
        )
    elif ("float32", m1) in scored:
        samples[f"{a}:decode vs float32"] = gap((a, "decode"), ("float32", m1))
        samples[f"{a}:eager vs float32"] = gap((a, "eager"), ("float32", m1))
    return samples


def _shuffled_within_buckets(values: np.ndarray, surprisal, positions) -> np.ndarray:
    """``values`` permuted among the tokens of each surprisal and position bucket (a fixed
    seed): another token's error of the same kind, independent of this token's own."""
    rows, columns = bucket_of(surprisal, positions)
    cell = rows * 1000 + columns
    out = np.empty_like(values)
    rng = np.random.default_rng(0)
    for key in np.unique(cell):
        members = np.flatnonzero(cell == key)
        out[members] = values[rng.permutation(members)]
    return out


def _sequence_means(abs_diff: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    sums = np.add.reduceat(abs_diff, offsets[:-1][lengths > 0]) if len(abs_diff) else np.zeros(0)
    return sums / np.maximum(lengths[lengths > 0], 1)


def _mask(fixture: TokenTable, row: int) -> np.ndarray:
    return np.asarray(fixture.completion_mask[fixture.completion_slice(row)], dtype=bool)

"""`lpx calibrate`: measure a model's precision noise floor on the fixture's own tokens.

The reference engine (HF) re-scores a sample of the fixture's sequences in every precision a
comparison may meet (fp32, each side's declared dtype and reduced-precision numerics, emulated
exactly by pipeline/numerics, TF32 on CUDA) three correct ways:
prefill in micro-batches of 8 with SDPA attention, prefill in micro-batches of 3 with eager
attention (another kernel and another batching at once), and teacher-forced decoding with a
KV cache of a sample of those sequences, all of them in one batch (how a rollout engine
computed them). Two correct scorings of the same tokens differ by this much: for every pair
of precisions the |d| samples are fitted per surprisal and position bucket (`floor.py`) and
written to calibration.json, keyed by the model's weights, the engine, the layout and the
hardware.

Cost: decoding is a forward per token, bound by reading the weights, so a batch of 16 costs
little more than one of 8 (1.35x in fp32 at 16 x 1024 on 2 CPU cores); it is still the
largest part (there, 2.5x an fp32 prefill of the 32 sequences and 4x a bf16 one). A window of each sequence
decoded after a prefilled prefix would cost one forward, and was measured: its decode gap is
0.74x the whole decode's on the same tokens in fp32 at 16 x 1024 (the prefix's keys and
values, computed by decoding in a rollout, carry part of the gap), so it is not used.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from pipeline import devices
from pipeline.calibrate.signed_null import drawing_temperature, seen_drawn, signed_null
from pipeline.compare.calibrated import (
    CALIBRATION_FILE,
    CALIBRATION_FORMAT,
    TAU_MARGIN,
    TF32,
    pair_key,
)
from pipeline.compare.floor import bucket_of, expect, fit_floor
from pipeline.compare.precision_gate import design_of
from pipeline.compare.signed import prompt_clusters
from pipeline.contracts.numerics import canonical_precision, split_precision
from pipeline.fixture.table import TokenTable

__all__ = ["CALIBRATION_FILE", "calibrate", "calibration_key", "precisions_for"]
DEFAULT_SEQUENCES = 32
MICRO_BATCHES = (8, 3)  # the SDPA prefill's and the eager prefill's
DECODE_SEQUENCES = 16  # decoded in one batch: as cheap as 8, where 32 cost 1.3x (16 x 1024)
# Tokens drawn at each calibrated position for the sign statistics' null (compare/signed.py):
# scored at these ids in every precision's prefills, they cost a gather, not a forward.
DRAWS = 4


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
    from pipeline.engines.metadata import model_metadata

    device = devices.resolve_device(device)
    rows = sample_rows(fixture, sequences) if rows is None else list(rows)
    pairs = [(fixture.prompt_of(r), fixture.completion_of(r)) for r in rows]
    masks = [_mask(fixture, r) for r in rows]
    active = np.concatenate(masks) if masks else np.zeros(0, dtype=bool)
    positions = np.concatenate([np.arange(len(c)) for _, c in pairs])[active]
    lengths = np.array([int(m.sum()) for m in masks], dtype=np.int64)
    precisions = precisions_for(dtypes, device)
    temperature = drawing_temperature(fixture.metadata.get("sampling"))
    scored, timing = score_ways(model_dir, pairs, precisions, device, say, temperature)
    scored = {key: values[active] for key, values in scored.items()}
    reference = scored["float32", "prefill"].astype(np.float64)
    sequence_of = prompt_clusters([prompt for prompt, _ in pairs], lengths)
    seen = None
    if ("float64", "draws") in scored:  # which drawn tokens occurred earlier in their context
        drawn = np.split(scored["float64", "draws"], np.cumsum(lengths)[:-1])
        seen = np.concatenate(
            [
                seen_drawn(fixture, row, ids, _mask(fixture, row))
                for row, ids in zip(rows, drawn, strict=True)
            ]
        )
    floors = {}
    for a, b in itertools.combinations_with_replacement(precisions, 2):
        samples = _pair_samples(scored, a, b, -reference, positions)
        floors[pair_key(a, b)] = fit_pair(samples, -reference, positions, lengths)
        if temperature:
            floors[pair_key(a, b)]["signed"] = signed_null(
                scored, a, b, positions, sequence_of, temperature, seen
            )
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


def same_precision_floor(
    fixture: TokenTable,
    rows: list[int],
    model_dir: Path,
    precision: str,
    surprisal: np.ndarray,
    device: str = "auto",
) -> tuple[dict, np.ndarray]:
    """How far correct scorings of the rows' compared tokens in one ``precision`` lie apart
    (its decode, eager and SDPA prefill against each other, as `calibrate` pairs a
    precision with itself; no fp32 run: ``surprisal``, one per compared token, buckets
    them), and that precision's SDPA prefill of those tokens. Verification judges a
    reproduction in that precision by it."""
    device = devices.resolve_device(device)
    pairs = [(fixture.prompt_of(r), fixture.completion_of(r)) for r in rows]
    masks = [_mask(fixture, r) for r in rows]
    active = np.concatenate(masks) if masks else np.zeros(0, dtype=bool)
    positions = np.concatenate([np.arange(len(c)) for _, c in pairs])[active]
    lengths = np.array([int(m.sum()) for m in masks], dtype=np.int64)
    scored, _ = score_ways(Path(model_dir), pairs, [precision], device, say=lambda line: None)
    scored = {key: values[active] for key, values in scored.items()}
    samples = _pair_samples(scored, precision, precision, surprisal, positions)
    floor = fit_pair(samples, surprisal, positions, lengths)
    return floor, scored[precision, "prefill"].astype(np.float64)


def score_ways(
    model_dir: Path, pairs: list, precisions: list[str], device: str, say, temperature=0.0
):
    """Each pair's completion logprobs in every precision, three correct ways: ``prefill``
    (SDPA, micro-batches of 8), ``eager`` (eager attention, micro-batches of 3) and
    ``decode`` (teacher-forced decoding of `decode_rows`, NaN on the other sequences' tokens).
    fp32 also gets its fp64 ground truth. With a ``temperature`` (the rollout's, > 0), DRAWS
    tokens are drawn at each position from the fp64 distribution at that temperature
    (``("float64", "draws")``, their ids; ``("float64", "exact@draws")``, their fp64
    logprobs), and both prefills score them too (``(name, "prefill@draws")``,
    ``(name, "eager@draws")``; [tokens, DRAWS] each). Keyed (precision, way); timing per
    precision in seconds."""
    from pipeline.engines.hf.decode import decode_logprobs
    from pipeline.engines.hf.model import load_model
    from pipeline.engines.hf.replay import ReplayKnobs
    from pipeline.numerics.emulate import set_attention

    scored: dict[tuple[str, str], np.ndarray] = {}
    timing = {}
    decoded = decode_rows(len(pairs))
    lengths = [len(c) for _, c in pairs]
    # fp32's own ground truth: what two fp32 engines' reduction orders scatter about; first,
    # for the tokens it draws are scored in every precision
    started = time.perf_counter()
    drawn = None
    if "float32" in precisions or temperature > 0:
        exact, drawn, drawn_exact = score_exactly(model_dir, pairs, device, temperature)
        scored["float64", "exact"] = exact
    if drawn is not None:
        scored["float64", "draws"] = np.concatenate(drawn)
        scored["float64", "exact@draws"] = drawn_exact
    exact_s = time.perf_counter() - started
    for name in precisions:
        dtype, tf32, numerics = split_precision(name)
        started = time.perf_counter()
        model = load_model(model_dir, dtype, device=device, numerics=numerics)
        devices.set_tf32(device, tf32)
        settings = ReplayKnobs(dtype=dtype, device=device)
        prefill, eager = MICRO_BATCHES
        _prefill(scored, (name, "prefill"), model, pairs, settings, prefill, drawn)
        chosen = [pairs[i] for i in decoded]
        if drawn is None:
            values = decode_logprobs(model, chosen, max(len(chosen), 1))
        else:
            values, at_draws = decode_logprobs(
                model, chosen, max(len(chosen), 1), draws=[drawn[i] for i in decoded]
            )
            scored[name, "decode@draws"] = _spread(at_draws, decoded, lengths, DRAWS)
        scored[name, "decode"] = _spread(values, decoded, lengths)
        # another attention kernel and another batching on the same weights: what a different
        # engine's kernels and batch shapes move
        set_attention(model, "eager")
        settings = replace(settings, attn_implementation="eager", micro_batch_size=eager)
        _prefill(scored, (name, "eager"), model, pairs, settings, eager, drawn)
        del model
        devices.release_memory(device)
        elapsed = time.perf_counter() - started + (exact_s if name == "float32" else 0.0)
        timing[name] = round(elapsed, 2)
        say(
            f"calibrate: {name} scored {len(pairs)} sequences by prefill and eager attention, "
            f"{len(decoded)} by decoding, in {timing[name]:.1f} s"
        )
    devices.set_tf32(device, False)
    return scored, timing


def _prefill(scored: dict, key: tuple, model, pairs, settings, size: int, drawn) -> None:
    """One prefill way's completion logprobs into ``scored[key]``, in micro-batches of
    ``size``; with ``drawn``, also the drawn tokens' (``(name, "way@draws")``)."""
    from pipeline.engines.hf.replay import score_batches

    values = score_batches(
        model,
        _batched(pairs, size),
        settings,
        progress=False,
        top_ids=None if drawn is None else _batched(drawn, size),
    )
    scored[key] = np.concatenate([s.completion for s in values])
    if drawn is not None:
        scored[key[0], f"{key[1]}@draws"] = np.concatenate([s.top_logprob for s in values])


def decode_rows(count: int) -> list[int]:
    """Which of ``count`` sampled sequences are decoded: up to DECODE_SEQUENCES, evenly spread."""
    if count <= DECODE_SEQUENCES:
        return list(range(count))
    return sorted({int(i) for i in np.linspace(0, count - 1, DECODE_SEQUENCES).round()})


def score_exactly(model_dir: Path, pairs: list, device: str, temperature: float = 0.0):
    """Completion logprobs computed in fp64 throughout, one sequence at a time (eager
    attention, an fp64 log-softmax): the reference fp32 implementations scatter about. With a
    ``temperature`` > 0, also DRAWS tokens drawn at each completion position from that
    distribution at that temperature (seeded: the same draws every time), per pair
    [completion, DRAWS], and their fp64 logprobs (untempered) [tokens, DRAWS]; else None,
    None."""
    import torch

    from pipeline.engines.hf.model import load_model, model_device

    model = load_model(model_dir, "float64", attn_implementation="eager", device=device)
    generator = torch.Generator().manual_seed(0)
    out, drawn, drawn_exact = [], [], []
    with torch.no_grad():
        for prompt, completion in pairs:
            ids = np.concatenate([prompt, completion]).astype(np.int64)
            inputs = torch.from_numpy(ids)[None].to(model_device(model))
            hidden = model.base_model(input_ids=inputs).last_hidden_state[0]
            rows = hidden[len(prompt) - 1 : len(ids) - 1]
            logprobs = model.get_output_embeddings()(rows).log_softmax(-1)
            targets = torch.from_numpy(np.asarray(completion, dtype=np.int64)).to(rows.device)
            out.append(logprobs.gather(-1, targets[:, None])[:, 0].cpu().numpy())
            if temperature > 0 and len(completion):
                probs = (logprobs / temperature).softmax(-1).cpu()
                ids_drawn = torch.multinomial(probs, DRAWS, replacement=True, generator=generator)
                drawn.append(ids_drawn.numpy().astype(np.int64))
                drawn_exact.append(logprobs.cpu().gather(-1, ids_drawn).numpy())
            elif temperature > 0:
                drawn.append(np.zeros((0, DRAWS), dtype=np.int64))
    del model
    devices.release_memory(device)
    exact = np.concatenate(out) if out else np.zeros(0)
    if temperature <= 0:
        return exact, None, None
    empty = np.zeros((0, DRAWS))
    return exact, drawn, np.concatenate(drawn_exact) if drawn_exact else empty


def _batched(pairs: list, size: int) -> list[list]:
    return [pairs[i : i + size] for i in range(0, len(pairs), size)]


def _spread(values: list[np.ndarray], rows: list[int], lengths: list[int], k: int = 0):
    """The chosen rows' completion values in place among all rows' tokens, NaN elsewhere
    (``k`` > 0: each token's k values)."""
    out = [np.full((n, k) if k else n, np.nan, dtype=np.float32) for n in lengths]
    for row, row_values in zip(rows, values, strict=True):
        out[row] = np.asarray(row_values, dtype=np.float32)
    return np.concatenate(out) if out else np.zeros((0, k) if k else 0, dtype=np.float32)


def fit_pair(variants: dict[str, np.ndarray], surprisal, positions, lengths) -> dict:
    """One pair's floor from its variants (label -> |d| per token, NaN where a variant was
    not measured: the decoded variants cover a sample of the sequences).

    Correct implementations differ by different amounts (another attention kernel moves more
    than another batching). The floor is fitted on the wider half of the variants; the
    narrow ones (decoding against prefill in one precision shares most of its kernels) have
    another shape, most tokens equal and a few apart, which scaled up would fatten the tails.
    An engine under test has kernels of its own, and may lie as far beyond the widest variant
    as the wide variants lie apart among themselves (measured: Megatron-core bf16 2.5 % above
    HF's widest, vLLM-CPU fp32 1.25x; docs/compare.md): each wide variant is scaled to the
    widest mean times that ``allowance`` (widest over narrowest of the wide half). ``spread``
    says how far the widest lies above the mean of all. The design
    (`precision_gate.design_of`) and how often a token passes its tau are measured on the same
    scaled samples."""
    surprisal = np.asarray(surprisal, dtype=np.float64)
    positions = np.asarray(positions)
    lengths = np.asarray(lengths, dtype=np.int64)
    measured = {label: np.isfinite(values) for label, values in variants.items()}
    means = {
        label: float(values[measured[label]].mean()) if measured[label].any() else 0.0
        for label, values in variants.items()
    }
    widest = max(means.values(), default=0.0)
    wide = sorted(means, key=means.get, reverse=True)[: (len(means) + 1) // 2]
    narrowest = min(means[label] for label in wide) if wide else 0.0
    allowance = widest / narrowest if narrowest > 0 else 1.0
    level = widest * allowance
    scaled = {
        label: variants[label][measured[label]] * (level / means[label] if means[label] > 0 else 1)
        for label in wide
    }
    pooled = np.concatenate(list(scaled.values()))
    floor = fit_floor(
        pooled,
        np.concatenate([surprisal[measured[label]] for label in wide]),
        np.concatenate([positions[measured[label]] for label in wide]),
    )
    plain_mean = float(np.mean(list(means.values()))) if means else 0.0
    floor["spread"] = widest / plain_mean if plain_mean > 0 else 1.0
    floor["allowance"] = allowance
    floor["variant_means"] = means
    floor["variants"] = len(means)
    floor["fitted_on"] = wide
    expected = expect(floor, surprisal, positions)
    tau = TAU_MARGIN * np.maximum(expected["q999"], 1e-12)
    designs, exceeding, sequence_means = [], 0, []
    for label, values in scaled.items():
        keep = measured[label]
        own_lengths = _measured_lengths(keep, lengths)
        designs.append(
            design_of(values, expected["mean"][keep], expected["q99"][keep], own_lengths)
        )
        exceeding += int(np.count_nonzero(values > tau[keep]))
        sequence_means.append(_sequence_means(values, own_lengths).max(initial=0.0))
    # a variant measured on fewer tokens weighs less in the design it shares
    weights = np.array([len(values) for values in scaled.values()], dtype=np.float64)
    floor["design"] = {
        key: float(np.average([d[key] for d in designs], weights=weights)) for key in designs[0]
    } | {"sequences": int(len(lengths))}
    floor["tau_exceedance"] = {"count": exceeding, "samples": int(len(pooled))}
    floor["sequence_mean_abs_max"] = float(max(sequence_means))
    return floor


def _measured_lengths(measured: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per sequence, how many of its tokens a variant measured (only sequences it measured)."""
    sequence_of = np.repeat(np.arange(len(lengths)), lengths)
    counts = np.bincount(sequence_of[measured], minlength=len(lengths))
    return counts[counts > 0].astype(np.int64)


def precisions_for(dtypes: list[str], device: str) -> list[str]:
    """What a calibration measures: fp32 (the reference), the given precisions (dtypes, and
    dtypes with reduced-precision numerics: ``bfloat16+fp8_e4m3:w=tensor,a=tensor``), TF32
    on CUDA."""
    named = {canonical_precision(d) for d in dtypes}
    return sorted({"float32", *named} | ({TF32} if devices.is_cuda(device) else set()))


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
    """|d| between correct scorings as a rollout meets a replay, by label (NaN on tokens a
    scoring did not measure: decoding covers a sample of the sequences).

    Across two precisions: the two prefills, and each side's decode and eager prefill against
    the other's prefill. In one precision: decoding against each prefill, and eager against
    SDPA prefill; not prefill against prefill in one batching, which often agree to the bit
    (on a CPU always) and would pull the floor under what a rollout engine's decoding gives.
    In one low precision (bf16, fp16, TF32), also each side against fp32: two engines there
    share the rounded weights and round activations alike, and measured engine pairs
    (vLLM-CPU, Megatron-core, HF eager and SDPA) differ by up to what one of them differs
    from fp32, 3x more than HF's own decoding and prefill do. In fp32 nothing is shared but
    the weights, which are exact: two engines' reduction orders err independently, so the
    pair's noise is the difference of two independent errors against fp64 (docs/compare.md,
    the precision gate)."""

    def gap(x, y):
        return np.abs(scored[x].astype(np.float64) - scored[y].astype(np.float64))

    if a != b:
        return {
            f"{a}:prefill vs {b}:prefill": gap((a, "prefill"), (b, "prefill")),
            f"{a}:decode vs {b}:prefill": gap((a, "decode"), (b, "prefill")),
            f"{b}:decode vs {a}:prefill": gap((b, "decode"), (a, "prefill")),
            f"{a}:eager vs {b}:prefill": gap((a, "eager"), (b, "prefill")),
            f"{b}:eager vs {a}:prefill": gap((b, "eager"), (a, "prefill")),
        }
    samples = {
        f"{a}:decode vs {a}:prefill": gap((a, "decode"), (a, "prefill")),
        f"{a}:decode vs {a}:eager": gap((a, "decode"), (a, "eager")),
        f"{a}:eager vs {a}:prefill": gap((a, "eager"), (a, "prefill")),
    }
    exact = ("float64", "exact")
    if a == "float32" and exact in scored:
        samples["float32:decode vs float64"] = gap((a, "decode"), exact)
        samples["float32:eager vs float64"] = gap((a, "eager"), exact)
        decode_error = scored[a, "decode"].astype(np.float64) - scored[exact]
        eager_error = scored[a, "eager"].astype(np.float64) - scored[exact]
        samples["float32 engines erring independently"] = np.abs(
            decode_error - _shuffled_within_buckets(eager_error, surprisal, positions)
        )
    elif ("float32", "prefill") in scored and not split_precision(a)[2]:
        # (not for reduced-precision numerics: their gap to fp32 is what they add, not what
        # two engines computing them alike differ by; their own variants quantize their own
        # activations, and so carry the rounding flips another engine's kernels give)
        samples[f"{a}:decode vs float32"] = gap((a, "decode"), ("float32", "prefill"))
        samples[f"{a}:eager vs float32"] = gap((a, "eager"), ("float32", "prefill"))
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

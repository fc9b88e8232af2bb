r"""The fuzz suite's profiles, the contract every command keeps, and the input generators.

Profiles (env LPX_FUZZ): `fast` (default) is derandomized, so the README test command runs
the same examples on every machine; `long` draws many more, fresh each run:

    LPX_FUZZ=long .venv/bin/python -m pytest tests/cli/test_fuzz.py tests/serve/test_serve_fuzz.py \
        tests/cli/test_interrupts.py

No example database is kept: tests never write into the checkout.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
from click.testing import CliRunner
from hypothesis import HealthCheck, currently_in_test_context, event, settings
from hypothesis import strategies as st

from pipeline.cli import cli
from pipeline.fixture.table import table_from_sequences

PROFILE = os.environ.get("LPX_FUZZ", "fast")
_common = dict(
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile("fast", max_examples=25, derandomize=True, **_common)
settings.register_profile("long", max_examples=400, **_common)
settings.load_profile(PROFILE)
# Kills per command and signal in tests/cli/test_interrupts.py.
KILLS = {"fast": 1, "long": 12}[PROFILE]

VOCAB = 32
ALLOWED_EXIT_CODES = (0, 1, 2)


# -- the contract --------------------------------------------------------------------------


def files_under(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in Path(root).rglob("*")
        if p.is_file()
    }


def run_under_contract(root: Path, args: list, outputs: list[Path], expect: str = "any"):
    """Run `lpx ARGS` in-process and check the contract of issue 8.

    - the exit code is 0, 1 or 2, and no exception escapes (a TypeError deep in a library
      would otherwise end as the catch-all "an engine or library failed");
    - exit 2 prints one `Error:` line and no traceback;
    - nothing is written under ``root`` except at ``outputs``;
    - ``expect="bad"``: exit 2, and no output says pass; ``expect="good"``: exit 0 or 1.
    """
    root = Path(root)
    allowed = [Path(o).resolve() for o in outputs]

    def outside(files):
        return {
            name: stat
            for name, stat in files.items()
            if not any(
                (root / name).resolve() == o or o in (root / name).resolve().parents
                for o in allowed
            )
        }

    before = outside(files_under(root))
    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    code, output = result.exit_code, result.output
    if currently_in_test_context():
        event(f"{args[0]}: exit {code}")
    assert code in ALLOWED_EXIT_CODES, (code, output)
    assert "Traceback" not in output, output
    if code == 2:
        errors = [line for line in output.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1, output
        assert "an engine or library failed" not in output, output
    assert outside(files_under(root)) == before, "a file changed outside the given outputs"
    if expect == "bad":
        assert code == 2, f"bad input was judged (exit {code}):\n{output}"
        assert "PASS" not in output
    elif expect == "good":
        assert code in (0, 1), output
    return result


# -- fixtures and replays ------------------------------------------------------------------

# Sequence ids that try to break markdown, HTML and terminals.
HOSTILE_IDS = st.text(
    alphabet=st.sampled_from(list("ab01-_#|*<>&`\n\r\t\x1b[]()! ") + ["\u202e", "\x00"]),
    min_size=1,
    max_size=8,
)


@st.composite
def token_tables(draw, scored: bool = False):
    """A valid fixture as per-sequence lists (0 to 4 sequences, masked tokens included);
    ``scored``: at least one active token, so a comparison has something to judge."""
    n = draw(st.sampled_from([1, 2, 3] if scored else [0, 1, 2, 2, 3, 4]))
    ids = draw(st.lists(HOSTILE_IDS, min_size=n, max_size=n, unique=True))
    prompts = [draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4)) for _ in ids]
    completions = [draw(st.lists(st.integers(0, VOCAB - 1), max_size=6)) for _ in ids]
    # (an empty completion is valid: a sequence that stopped at once)
    if scored and not completions[0]:
        completions[0] = [draw(st.integers(0, VOCAB - 1))]
    masks = [[draw(st.integers(0, 4)) > 0 for _ in c] for c in completions]
    if scored:
        masks[0][0] = True
    logprob = st.floats(-20.0, 0.0, allow_nan=False)
    rollout = [[draw(logprob) for _ in c] for c in completions]
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    return dict(
        sequence_ids=ids,
        prompts=prompts,
        completions=completions,
        masks=masks,
        rollout=rollout,
        metadata={"dtype": dtype, "model": {"vocab_size": VOCAB}},
    )


def build_pair(spec: dict, drift: float, seed: int):
    """(fixture, replay) tables; the replay's logprobs move by up to ``drift`` nats."""
    rng = np.random.default_rng(seed)
    fixture = table_from_sequences(
        "fixture",
        spec["sequence_ids"],
        spec["prompts"],
        spec["completions"],
        {"rollout": spec["rollout"]},
        masks=spec["masks"],
        metadata=spec["metadata"],
    )
    moved = fixture.channels["rollout"] + rng.uniform(-drift, drift, fixture.num_completion_tokens)
    replay = table_from_sequences(
        "replay",
        spec["sequence_ids"],
        spec["prompts"],
        spec["completions"],
        {"replay": [[0.0] * len(c) for c in spec["completions"]]},
        masks=spec["masks"],
        metadata=spec["metadata"],
    )
    replay.channels["replay"] = np.minimum(moved, 0.0).astype(np.float32)
    return fixture, replay


def active_count(spec: dict) -> int:
    return sum(sum(bool(m) for m in mask) for mask in spec["masks"])


# -- JSON values for dumps and policies ----------------------------------------------------

JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


def dumps_line(value) -> str:
    """One JSONL line; NaN and infinities as Python's json writes them (as dumps do)."""
    return json.dumps(value, allow_nan=True)


def finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# -- calibrations --------------------------------------------------------------------------


def synthetic_calibration(
    seed: int = 0,
    precisions: tuple[str, ...] = ("bfloat16", "float32"),
    sequences: int = 6,
    length: int = 24,
    fingerprint: str | None = None,
    level: float = 0.01,
) -> dict:
    """A calibration.json as `lpx calibrate` writes it, fitted by its own fit_pair on seeded
    synthetic |d| samples (half-normal, three variants per pair) instead of re-scorings."""
    from pipeline.calibrate.run import fit_pair
    from pipeline.compare.calibrated import CALIBRATION_FORMAT, pair_key

    rng = np.random.default_rng(seed)
    tokens = sequences * length
    surprisal = rng.exponential(1.0, tokens)
    positions = np.tile(np.arange(length), sequences)
    lengths = np.full(sequences, length, dtype=np.int64)
    pairs = {}
    for i, a in enumerate(precisions):
        for b in precisions[i:]:
            scale = level if "float32" not in (a, b) or a != b else level * 1e-4
            variants = {
                f"variant {k}": np.abs(rng.normal(0.0, scale * (1 + k / 2), tokens))
                for k in range(3)
            }
            pairs[pair_key(a, b)] = fit_pair(variants, surprisal, positions, lengths)
    return {
        "lpx_calibration": CALIBRATION_FORMAT,
        "key": {
            "format": CALIBRATION_FORMAT,
            "model_fingerprint": fingerprint,
            "model_path": "/models/tiny",
            "engine": "hf",
            "layout": {"attn_implementation": "sdpa", "device": "cpu"},
            "hardware": "cpu",
            "versions": {"torch": "2", "transformers": "5"},
        },
        "created_at": "2026-03-01T03:00:00",
        "sequences": sequences,
        "tokens": tokens,
        "micro_batches": [8, 3],
        "precisions": sorted(precisions),
        "timing_s": {p: 0.5 for p in precisions},
        "pairs": pairs,
    }


def model_with_other_weights(model_dir: Path, out: Path, scale: float = 1.01) -> Path:
    """A copy of ``model_dir`` whose first layer's MLP down-projection is scaled: a stale
    checkpoint of the same architecture and tokenizer, with another weights fingerprint."""
    import shutil

    import torch

    from pipeline.engines.hf.model import load_model

    out = Path(out)
    shutil.copytree(model_dir, out)
    for weights in out.glob("*.safetensors"):
        weights.unlink()
    model = load_model(Path(model_dir))
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(scale)
    model.save_pretrained(out)
    return out


# Numbers no calibration holds where |d| or a moment goes (m3 may be negative: not listed).
NOT_A_MAGNITUDE = [math.nan, math.inf, -math.inf, -1e-3, "0.1", True, None, [], {}]
NOT_A_COUNT = [0, -1, 1.5, "3", True, None, 2**64]
MAGNITUDES = ("mean", "max", "q50", "q90", "q99", "q999", "var", "mean_sq", "var_sq")
CELL_KEYS = (*MAGNITUDES, "n", "m3", "mean_expm1", "var_expm1", "sketch")
FLOOR_KEYS = ("tokens", "all", "cells", "surprisal_edges", "position_edges", "spread",
              "variant_means", "variants", "fitted_on", "design", "tau_exceedance",
              "sequence_mean_abs_max")  # fmt: skip
TOP_KEYS = ("lpx_calibration", "key", "created_at", "sequences", "tokens", "micro_batches",
            "precisions", "pairs")  # fmt: skip
CALIBRATION_DAMAGE = (
    "magnitude", "count", "order", "sketch", "edges", "missing", "marker", "pair_key",
    "design", "tau", "bytes",
)  # fmt: skip


@st.composite
def calibration_files(draw, precisions=None):
    """(JSON text of a calibration, what was done to it): a real-shaped calibration of
    seeded synthetic noise, left valid ("none"), given unknown fields ("extra", still valid),
    or damaged in one way a reader must refuse (CALIBRATION_DAMAGE)."""
    import copy as _copy

    chosen = precisions or tuple(
        sorted(
            draw(st.sets(st.sampled_from(["bfloat16", "float16", "float32+tf32"]), max_size=2))
            | {"float32"}
        )
    )
    calibration = synthetic_calibration(
        seed=draw(st.integers(0, 2**16)),
        precisions=chosen,
        sequences=draw(st.integers(1, 5)),
        length=draw(st.integers(1, 48)),
        level=draw(st.sampled_from([1e-7, 1e-3, 0.05, 2.0])),
    )
    action = draw(st.sampled_from(["none", "extra"] + list(CALIBRATION_DAMAGE)))
    pair_name = draw(st.sampled_from(sorted(calibration["pairs"])))
    floor = calibration["pairs"][pair_name]
    cell_name = draw(st.sampled_from(["all", *sorted(floor["cells"])]))
    cell = floor["all"] if cell_name == "all" else floor["cells"][cell_name]
    if action == "extra":
        target = draw(st.sampled_from([calibration, floor, cell, calibration["key"]]))
        target[draw(st.sampled_from(["newer", "bootstrap", "z"]))] = draw(JSON_VALUES)
        calibration["timing_s"] = draw(st.sampled_from([calibration["timing_s"], {}]))
    elif action == "magnitude":
        where = draw(st.sampled_from([cell, floor, floor["design"]]))
        key = draw(
            st.sampled_from(
                MAGNITUDES
                if where is cell
                else ("spread", "sequence_mean_abs_max")
                if where is floor
                else ("icc", "icc_tail", "mean_length", "design_effect")
            )
        )
        where[key] = draw(st.sampled_from(NOT_A_MAGNITUDE))
    elif action == "count":
        where, key = draw(
            st.sampled_from(
                [(cell, "n"), (floor, "tokens"), (floor, "variants"), (calibration, "tokens"),
                 (calibration, "sequences"), (floor["design"], "sequences")]
            )
        )  # fmt: skip
        where[key] = draw(st.sampled_from(NOT_A_COUNT))
    elif action == "order":
        key = draw(st.sampled_from(["q50", "q90", "q99", "q999", "mean"]))
        cell[key] = cell["max"] * 2 + 1.0  # past max, and so past every level above it
    elif action == "sketch":
        # empty, past max, or decreasing
        cell["sketch"] = draw(
            st.sampled_from([[], [cell["max"] * 2 + 1.0], [1.0, 0.0] + cell["sketch"]])
        )
    elif action == "edges":
        edges = floor[draw(st.sampled_from(["surprisal_edges", "position_edges"]))]
        edges.insert(1, edges[0])  # an edge twice: bins must increase strictly
    elif action == "missing":
        where, keys = draw(
            st.sampled_from([(cell, CELL_KEYS), (floor, FLOOR_KEYS), (calibration, TOP_KEYS)])
        )
        where.pop(draw(st.sampled_from(keys)))
    elif action == "marker":
        calibration["lpx_calibration"] = draw(st.sampled_from([1, 3, "2", True, None, 2.0]))
    elif action == "pair_key":
        a, _, b = pair_name.partition("|")
        moved = _copy.deepcopy(floor)
        renamed = draw(st.sampled_from([f"{b}|{a}", "x", f"{a}|float64", f"{a}|{b}|{a}"]))
        if renamed == f"{b}|{a}" and a == b:
            renamed = "x"
        calibration["pairs"][renamed] = moved
    elif action == "design":
        floor["design"][draw(st.sampled_from(["icc", "icc_tail"]))] = draw(
            st.sampled_from([1.5, -0.1, math.nan])
        )
    elif action == "tau":
        over = floor["tau_exceedance"]
        over["count"] = over["samples"] + draw(st.integers(1, 3))
    text = dumps_line(calibration)
    if action == "bytes":
        text = draw(st.sampled_from([text[: len(text) // 2], "", "\x00\x01", "NaN", "[]"]))
    return GeneratedFile(text, action)


class GeneratedFile(tuple):
    """(text, action) of a generated file, shown briefly: a calibration's text is some 50 kB
    (print_blob reproduces a failing one exactly)."""

    def __new__(cls, text: str, action: str):
        return super().__new__(cls, (text, action))

    def __repr__(self) -> str:
        return f"GeneratedFile({self[0][:80]!r}..., {self[1]!r})"

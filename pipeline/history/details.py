"""What a run page shows for one comparison, distilled from its report.json at record time
(the run directory may be gone when the report is rendered): worst tokens with their
decoded text, the diagnosis and its evidence, the per-position drift map, and everything
needed to reproduce the comparison.

Reports written before report.json carried ``drift_map`` and ``context_ids`` get them from
the tokens.parquet beside them, when it is there.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from pipeline.compare.drift_map import drift_map
from pipeline.compare.onset import onset_words
from pipeline.contracts.report import ModelInfo, Report, Side, WorstToken
from pipeline.contracts.sequences import sequence_count, sequence_rows
from pipeline.fingerprint import tokenizer_fingerprint

SEQUENCE_ROWS = 200  # per-sequence metric rows kept, worst first
CONTEXT_TOKENS = 6  # tokens of left context decoded with each worst token
_TOKENIZER_LOCK = threading.Lock()


def comparison_details(
    report: Report, tokens_path: Path | None, tokenizers: dict, report_path: Path | None = None
) -> dict:
    """The run page's view of one comparison, as the JSON the comparison row stores (the
    report's own parts, as it wrote them, under the page's names). The per-sequence rows
    come from the sequences.parquet beside ``report_path``, or inline from an older report;
    the findings are stored as report.json has them (a count and a sample of their
    sequences, or an older report's whole lists)."""
    meta = report.metadata
    fixture, replay = meta["fixture"], meta["replay"]
    heatmap = report.drift_map
    worst = report.worst or []
    tokens = None
    if heatmap is None or not _has_context(worst):  # an older report: read its token table
        tokens = read_tokens(tokens_path)
        if heatmap is None and tokens is not None:
            heatmap = _drift_map_from_tokens(tokens, report.policy.get("tau"))
    tokenizer = _tokenizer(fixture.get("model") or {}, tokenizers)
    sequences = sequence_rows(report, report_path, worst=SEQUENCE_ROWS)
    return {
        "worst": [_decoded(row, tokens, tokenizer) for row in worst],
        "diagnosis": report.diagnosis or [],
        # whether compare re-scored the findings, or why not: the run page says so beside them
        "verification": report.verification or {},
        "policy": report.policy,
        "sequences": sequences,
        "sequence_count": sequence_count(report),
        "heatmap": heatmap,
        "by_region": {
            name: _scalars(values)
            for name, values in (report.metrics.get("by_region") or {}).items()
            if name != "completion" and isinstance(values, dict)
        },
        "routing": report.routing,
        # what an IS correction would do (compare/correction.py), and the numerics each side
        # declares: an FP8 rollout's run page says so beside its verdict
        "correction": correction_rows(report.correction),
        "numerics": {
            role: (side.get("numerics") or {}).get("label")
            for role, side in (("rollout", fixture), ("replay", replay))
            if (side.get("numerics") or {}).get("label")
        },
        # where drift starts at one position in many sequences (compare/onset.py)
        "onset": onset_words(report.onset) if getattr(report, "onset", None) else None,
        "kl_input_drift": _scalars(report.metrics.get("kl_input_drift") or {}),
        # multi-turn trajectories: drift per model-turn index, and the share token-exact
        "by_turn": report.metrics.get("by_turn") or [],
        "token_exact_rate": report.metrics.get("token_exact_rate"),
        "decoded": tokenizer is not None,
        "reproduce": {
            "command_line": meta.get("command_line", ""),
            "fixture": _side(fixture),
            "replay": _side(replay),
        },
    }


CORRECTION_COLUMNS = ("rollout_is_mean", "rollout_is_std", "rollout_is_min", "rollout_is_max",
                      "rollout_is_eff_sample_size")  # fmt: skip
VIEW_NAMES = {"token_tis": "token TIS", "sequence_is": "sequence IS", "icepop": "IcePop"}


def correction_rows(correction: dict | None) -> dict | None:
    """The run page's correction table: per view (token TIS at its cap, sequence IS, IcePop's
    band, each rejection mode) verl's IS statistics and the fractions of tokens and sequences
    it truncated or masked; None for a report before the view existed."""
    if not correction:
        return None
    views = correction.get("views") or {}
    settings = correction.get("settings") or {}
    rows = []
    for name, label in VIEW_NAMES.items():
        view = views.get(name) or {}
        if not view:
            continue
        acted = "masked" if "masked_tokens_fraction" in view else "truncated"
        rows.append({
            "view": label,
            **{column: view.get(column) for column in CORRECTION_COLUMNS},
            "acted": acted,
            "tokens": view.get(f"{acted}_tokens_fraction"),
            "sequences": view.get(f"{acted}_sequences_fraction"),
        })  # fmt: skip
    rejection = [
        {
            "mode": mode,
            **{k: view.get(k) for k in ("threshold", "masked_fraction", "seq_masked_fraction")},
        }  # fmt: skip
        for mode, view in (views.get("rejection") or {}).items()
    ]
    return {
        "settings": settings,
        "views": rows,
        "rejection": rejection,
        "probs_diff": correction.get("probs_diff") or {},
    }


def _side(side: Side) -> dict:
    model = side.get("model") or {}
    engine = side.get("engine") or {}
    return {
        "path": side.get("path"),
        "engine": engine.get("name"),
        "versions": engine.get("versions") or {},
        "dtype": side.get("dtype"),
        "knobs": side.get("knobs") or {},
        "sampling": side.get("sampling") or {},
        "layout": side.get("layout") or {},
        "logprob_channels": side.get("logprob_channels") or {},
        "model_path": model.get("path"),
        "weights_fingerprint": model.get("weights_fingerprint"),
        "tokenizer_fingerprint": model.get("tokenizer_fingerprint"),
        "prompt_set_fingerprint": side.get("prompt_set_fingerprint"),
        "injected_faults": side.get("injected_faults"),
        "weights": side.get("weights"),
    }


def read_tokens(path: Path | None, extra: tuple[str, ...] = ()) -> dict | None:
    """tokens.parquet as numpy columns (and the ``extra`` ones by their names), or None when
    missing or unreadable (a run page then shows token ids without context and no heatmap;
    the metrics are still recorded)."""
    if path is None:
        return None
    try:
        import pyarrow.parquet as pq

        table = pq.read_table(
            path, columns=["sequence_id", "position", "region", "token_id", "diff", *extra]
        )
    except Exception:  # noqa: BLE001 - a damaged side file must not block recording the run
        return None
    names, sequence_index = _categories(table.column("sequence_id").combine_chunks())
    regions, region_index = _categories(table.column("region").combine_chunks())
    return {
        "names": names,
        "sequence": sequence_index,
        "position": table.column("position").to_numpy(),
        "completion": regions[region_index] == "completion",
        "token_id": table.column("token_id").to_numpy(),
        "diff": table.column("diff").to_numpy(),
        **{name: table.column(name).to_numpy() for name in extra},
    }


def _categories(column) -> tuple[np.ndarray, np.ndarray]:
    """(distinct values, index of each row's value) of a string or dictionary column."""
    if hasattr(column, "dictionary"):
        values = np.asarray(column.dictionary.to_pylist(), dtype=object)
        return values, column.indices.to_numpy(zero_copy_only=False)
    return np.unique(np.asarray(column.to_pylist(), dtype=object), return_inverse=True)


def _tokenizer(model: ModelInfo, cache: dict):
    """The fixture's tokenizer when its files are still there and match the fingerprint."""
    path = model.get("path")
    if not path:
        return None
    with _TOKENIZER_LOCK:  # record reads pairs in threads: load each tokenizer once
        return _load_tokenizer(path, model, cache)


def _load_tokenizer(path: str, model: ModelInfo, cache: dict):
    if path not in cache:
        cache[path] = None
        tokenizer_file = Path(path) / "tokenizer.json"
        if tokenizer_file.is_file() and (
            not model.get("tokenizer_fingerprint")
            or tokenizer_fingerprint(Path(path)) == model["tokenizer_fingerprint"]
        ):
            try:
                from tokenizers import Tokenizer

                cache[path] = Tokenizer.from_file(str(tokenizer_file))
            except Exception:  # noqa: BLE001 - undecodable: ids are shown instead
                cache[path] = None
    return cache[path]


def _decoded(row: WorstToken, tokens: dict | None, tokenizer) -> dict:
    row = dict(row)
    if tokenizer is None:
        return row
    token_id = row.get("token_id")
    if isinstance(token_id, int):
        row["text"] = tokenizer.decode([token_id], skip_special_tokens=False)
    if isinstance(row.get("context_ids"), list):
        ids = [i for i in row["context_ids"] if isinstance(i, int)]
        row["context"] = tokenizer.decode(ids, skip_special_tokens=False)
    elif tokens is not None and isinstance(row.get("position"), int):
        names = list(tokens["names"])
        if row.get("sequence_id") in names:
            index = names.index(row["sequence_id"])
            in_region = tokens["completion"] == (row.get("region", "completion") == "completion")
            mask = (tokens["sequence"] == index) & in_region
            positions, ids = tokens["position"][mask], tokens["token_id"][mask]
            before = ids[
                (positions < row["position"]) & (positions >= row["position"] - CONTEXT_TOKENS)
            ]
            row["context"] = tokenizer.decode([int(i) for i in before], skip_special_tokens=False)
    return row


def _drift_map_from_tokens(tokens: dict, tau) -> dict | None:
    mask = tokens["completion"]
    return drift_map(
        tokens["names"],
        tokens["sequence"][mask],
        tokens["position"][mask],
        tokens["diff"][mask],
        tau,
    )


def _has_context(worst: list[WorstToken]) -> bool:
    return not worst or all(isinstance(row, dict) and "context_ids" in row for row in worst)


def _scalars(values: dict) -> dict:
    return {
        k: v
        for k, v in values.items()
        if isinstance(v, (int, float, str)) and not isinstance(v, bool)
    }

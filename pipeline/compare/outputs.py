"""Write a comparison's outputs: report.json, the token-level drift table and summary.md."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pipeline.compare.onset import onset_words
from pipeline.compare.run import Comparison
from pipeline.compare.sequence_table import write_sequence_table
from pipeline.compare.signed import STATISTICS as SIGN_STATISTICS
from pipeline.contracts.files import REPORT, SEQUENCES, SUMMARY, TOKENS
from pipeline.contracts.metrics import SUMMARY_METRICS
from pipeline.contracts.report import Finding, Report
from pipeline.paths import LOCK, output_lock, replacing, write_text_atomic
from pipeline.text import for_markdown as _md


def write_outputs(comparison: Comparison, out_dir: Path) -> dict[str, Path]:
    """The four outputs as a unit (sequences.parquet holds the per-sequence rows and each
    finding's whole list, report.json a count and a sample): an earlier report.json is removed first and the new one
    is written last, so an interrupted or failed write leaves the previous complete outputs
    (if it stopped before starting) or no report at all, never an old verdict beside new
    tokens. Each file is written to a temp name and renamed; temps never outlive a crash of
    Python (an interrupt included). Two writers into one directory: the second fails."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "report": out_dir / REPORT,
        "tokens": out_dir / TOKENS,
        "sequences": out_dir / SEQUENCES,
        "summary": out_dir / SUMMARY,
    }
    with output_lock(out_dir):
        # Both verdict-bearing files go first: an interrupted write never leaves an old
        # verdict beside new tokens.
        paths["report"].unlink(missing_ok=True)
        paths["summary"].unlink(missing_ok=True)
        _write_tokens(comparison, paths["tokens"])
        report = comparison.report
        if comparison.sequences is not None:
            table, findings = write_sequence_table(
                comparison.sequences, report.diagnosis or [], paths["sequences"]
            )
            report = report.model_copy(update={"sequence_table": table, "diagnosis": findings})
        else:  # rows inline (a report built by hand): no table of another comparison beside it
            paths["sequences"].unlink(missing_ok=True)
        write_text_atomic(paths["summary"], render_summary(comparison.report))
        # The report goes last: its presence means the comparison finished.
        write_text_atomic(paths["report"], report_json(report))
    return paths


def retract_verdicts(out_dir: Path) -> None:
    """Remove the verdicts an earlier compare left in ``out_dir`` (and in a matrix's pair
    directories), before this one reads its inputs: a rerun that fails on bad input or is
    interrupted must not leave the old PASS to be recorded as if it were this run's. The
    token tables stay, so `lpx record` sees a compare that did not finish (an error run)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return
    folders = [out_dir] + [p.parent for p in out_dir.glob(f"*/{TOKENS}")]
    for folder in folders:
        if (folder / TOKENS).is_file() or (folder / LOCK).is_file():  # written by compare
            for name in (REPORT, SUMMARY):
                (folder / name).unlink(missing_ok=True)


def render_summary(report: Report) -> str:
    policy, metrics = report.policy, report.metrics
    fixture, replay = report.metadata["fixture"], report.metadata["replay"]
    lines = [
        f"# lpx compare: {report.verdict.upper()}",
        "",
        f"- rollout: {_md(engine_label(fixture))} ({_md(fixture['path'])}, channel "
        f"{_md(fixture['channel'])})",
        f"- replay: {_md(engine_label(replay))} ({_md(replay['path'])})",
        f"- policy: {policy['source']}, profile `{policy['profile']}`, tau {policy['tau']:g}",
        f"- sign: {report.sign_convention}",
        f"- noise floor: {_calibration_line(report.calibration or {})}",
    ]
    if report.precision_gate:
        lines.append(f"- precision gate: {_gate_line(report.precision_gate)}")
    verification = report.verification or {}
    if verification:
        lines.append(f"- verification: {_verification_line(verification)}")
    if policy.get("exact"):
        lines.append(f"- exact mode (--exact): {bitwise_line(metrics)}")
    defaults = (report.model_extra or {}).get("generation_defaults")
    if defaults:
        lines.append(f"- generation defaults: {_md(defaults['note'])}")
    if report.onset:
        lines.append(f"- onset: {_md(onset_words(report.onset))}")
    lines += ["", "| metric | value | limit |", "|---|---|---|"]
    # the usual metrics, then any other the policy limits (e.g. NeMo-RL's gates)
    limited = [name for name in policy["limits"] if name not in SUMMARY_METRICS]
    for name in (*SUMMARY_METRICS, *limited):
        if name in metrics:
            limit = policy["limits"].get(name)
            lines.append(
                f"| {name} | {_fmt(metrics[name])} | {'' if limit is None else _fmt(limit)} |"
            )
    by_version = metrics.get("by_weight_version") or {}
    if len(by_version) > 1 or (replay.get("weights_store") and by_version):
        lines += [
            "",
            "## Drift per weight version",
            "",
            "| version | sequences | tokens | max abs diff | mean abs diff | k3 |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {_md(name)} | {row['sequences']} | {row['tokens']} | "
            f"{_fmt(row.get('max_abs_diff'))} | {_fmt(row.get('mean_abs_diff'))} | "
            f"{_fmt(row.get('k3'))} |"
            for name, row in by_version.items()
        ]
    lines += correction_lines(report.correction)
    if policy.get("not_measured"):
        lines += [
            "",
            f"Not measured here, so not judged: {', '.join(policy['not_measured'])} "
            "(top1_flip_rate needs top-k alternatives on both sides, the topk_kl metrics "
            "logprobs at the same k >= 2 ids on both sides).",
        ]
    if policy["violations"]:
        lines += ["", "## Violations", ""]
        lines += [
            f"- {v['metric']} = {_fmt(v['value'])} "
            f"{'under its lower bound' if v.get('bound') == 'lower' else '>'} {_fmt(v['limit'])}"
            + (f" ({v['source']})" if v.get("source") else "")
            for v in policy["violations"]
        ]
    lines += _routing_lines(report.routing)
    lines += ["", "## Diagnosis", ""]
    if not report.diagnosis:
        lines.append("- no drift above tau; nothing to explain")
    for finding in report.diagnosis:
        lines.append(
            f"- **{_md(finding.cause)}** ({_md(finding.severity)}, "
            f"{_md(finding.status)}{_residuals(finding)}): {_md(finding.evidence)}"
        )
    lines += [
        "",
        "## Worst tokens",
        "",
        "| sequence | position | region | token | rollout | train | abs diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report.worst[:10]:
        lines.append(
            f"| {_md(row['sequence_id'])} | {row['position']} | {row['region']} | {row['token_id']} | "
            f"{row['logprob_rollout']:.6g} | {row['logprob_train']:.6g} | {row['abs_diff']:.3g} |"
        )
    return "\n".join(lines) + "\n"


def _routing_lines(routing: dict | None) -> list[str]:
    """The MoE routing agreement: flips overall and on the worst layer, and any side whose
    recorded routing is incomplete."""
    if not routing:
        return []
    worst = max(routing["layers"], key=lambda layer: layer["flip_rate"])
    lines = [
        "",
        "## Routing",
        "",
        f"- {routing['tokens_with_flip']:,} of {routing['tokens']:,} tokens routed to other "
        f"experts ({routing['flip_rate']:.2%}); most on layer {worst['layer']} "
        f"({worst['flip_rate']:.2%})",
    ]
    for side, missing in (routing.get("unrecorded") or {}).items():
        if missing:
            first = missing["first"]
            lines.append(
                f"- the {side}'s routing is incomplete: {missing['rows']:,} of {missing['of']:,} "
                f"positions hold no top-k choice (first: sequence {_md(first['sequence_id'])}, "
                f"position {first['position']}), as an engine returns for prefix-cached or "
                "chunked-prefill tokens"
            )
    return lines


def bitwise_line(metrics: dict) -> str:
    """'bitwise equal: 99.99 % (3 mismatches of 41,000 tokens)'; never 100.00 % with a
    mismatch."""
    mismatches = metrics["bitwise_mismatches"]
    percent = round(metrics["bitwise_equal_fraction"] * 100, 2)
    if mismatches:
        percent = min(percent, 99.99)
    return (
        f"bitwise equal: {percent:.2f} % ({mismatches:,} mismatch{'es' if mismatches != 1 else ''} "
        f"of {metrics['tokens']:,} tokens)"
    )


def _write_tokens(comparison: Comparison, path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    aligned, tables = comparison.aligned, []
    regions = [("completion", aligned.completion)] + (
        [("prompt", aligned.prompt)] if aligned.prompt else []
    )
    ids = np.asarray(aligned.sequence_ids, dtype=object)
    for name, region in regions:
        lengths = np.diff(region.offsets)
        diff = region.train.astype(np.float64) - region.rollout.astype(np.float64)
        tables.append(
            pa.table(
                {
                    "sequence_id": pa.DictionaryArray.from_arrays(
                        np.repeat(np.arange(len(ids), dtype=np.int32), lengths),
                        pa.array(ids, pa.string()),
                    ),
                    "position": region.positions.astype(np.int32),
                    "region": pa.DictionaryArray.from_arrays(
                        np.zeros(len(diff), dtype=np.int8), pa.array([name])
                    ),
                    "token_id": region.token_ids,
                    "logprob_rollout": region.rollout,
                    "logprob_train": region.train,
                    "diff": diff,
                    "over_tau": np.abs(diff) > comparison.tau,
                }
            )
        )
    with replacing(path) as tmp:
        # Dictionaries only where values repeat; zstd's fast level (the logprobs barely
        # compress further at higher levels, for twice the time on a million tokens).
        pq.write_table(
            pa.concat_tables(tables),
            tmp,
            compression="zstd",
            compression_level=1,
            use_dictionary=["sequence_id", "region"],
        )


def engine_label(side: dict) -> str:
    """``vllm 0.32.0 bfloat16 fp8-block + kv fp8_e4m3``: a side's engine, release, dtype and
    the reduced-precision numerics it declares."""
    engine = side.get("engine") or {}
    versions = engine.get("versions") or {}
    name = engine.get("name", "?")
    version = versions.get(name) or (versions.get("transformers") if name == "hf" else "")
    numerics = (side.get("numerics") or {}).get("label", "")
    return " ".join(part for part in (name, version, side.get("dtype", ""), numerics) if part)


def correction_lines(correction: dict | None) -> list[str]:
    """summary.md's correction section: what token TIS, sequence IS, IcePop and the
    rejection modes would do (verl's rollout_corr names, compare/correction.py)."""
    if not correction:
        return []
    settings, views = correction["settings"], correction["views"]
    probs = correction["probs_diff"]["rollout_probs_diff_mean"]
    faq = (
        "normal"
        if probs < 0.005
        else "an inference-precision problem"
        if probs > 0.01
        else "between"
    )
    lines = [
        "",
        "## Correction",
        "",
        f"What an importance-sampling correction would do (verl's definitions; the policy "
        f"gates rollout_is={settings['rollout_is']}, threshold "
        f"{settings['rollout_is_threshold']}). training/rollout_probs_diff_mean "
        f"{_fmt(probs)}: {faq} by verl's FAQ (normal below 0.005, a precision problem above "
        "0.01).",
        "",
        "| view | IS mean | IS std | IS min | IS max | ESS | tokens | sequences |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, label in (("token_tis", "token TIS"), ("sequence_is", "sequence IS"),
                        ("icepop", "IcePop")):  # fmt: skip
        view = views[name]
        acted = "masked" if "masked_tokens_fraction" in view else "truncated"
        lines.append(
            f"| {label} | {_fmt(view['rollout_is_mean'])} | {_fmt(view['rollout_is_std'])} | "
            f"{_fmt(view['rollout_is_min'])} | {_fmt(view['rollout_is_max'])} | "
            f"{_fmt(view['rollout_is_eff_sample_size'])} | "
            f"{100 * view[f'{acted}_tokens_fraction']:.2f} % {acted} | "
            f"{100 * view[f'{acted}_sequences_fraction']:.2f} % {acted} |"
        )
    masked = [
        f"{mode} ({view['threshold']}) {100 * view['masked_fraction']:.1f} % of tokens, "
        f"{100 * view['seq_masked_fraction']:.1f} % of sequences"
        for mode, view in views["rejection"].items()
        if view["masked_fraction"] > 0
    ]
    lines += ["", "Rejection (rollout_rs) would mask: " + ("; ".join(masked) or "nothing") + "."]
    return lines


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def report_json(report: Report) -> str:
    """report.json's text: the model's fields through orjson, with NaN and inf as strings.
    Per-sequence rows held inline (a report of the older layout, read back) are JSON-safe
    as read, so only the rest is walked."""
    import orjson

    fields = report.as_dict()
    safe = {k: (v if k == "sequences" else _json_safe(v)) for k, v in fields.items()}
    text = orjson.dumps(safe, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode()
    return text + "\n"


def _json_safe(value):
    """JSON has no NaN/inf: write them as strings a reader can still recognise."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (np.floating, float)):
        value = float(value)
        return value if math.isfinite(value) else str(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


def _calibration_line(note: dict) -> str:
    if note.get("used"):
        return (
            f"calibrated ({_md(note.get('pair'))} from {_md(note.get('source') or 'the history')}, "
            f"made {_md(note.get('created_at'))}): the precision gate, limits and tau from this "
            "model's measured floor"
        )
    reason = note.get("reason") or "no calibration"
    return f"not calibrated ({_md(reason)}); judged by the profile's constants"


def _gate_line(gate: dict) -> str:
    """`PASS at 1,536 tokens (false-alarm rate 0.001): mean |d| 0.0041 (noise 0.0044, at
    most 0.0059), ...`: each test's observed value against what noise gives."""
    tests = "; ".join(
        f"{t['name']} {_fmt(t['observed'])} (noise {_fmt(t['expected'])}, "
        + (
            f"within +/- {_fmt(abs(t['critical'] - t['expected']))}"  # two-sided: the sign tests
            if t["name"] in SIGN_STATISTICS
            else f"at most {_fmt(t['critical'])}"
        )
        + f"{'' if t['passed'] else ', FAILED'})"
        for t in gate["tests"]
    )
    verdict = "PASS" if gate["passed"] else "FAIL"
    return f"{verdict} at {gate['tokens']} tokens (false-alarm rate {gate['alpha']:g}): {tests}"


def _verification_line(note: dict) -> str:
    if note.get("ran"):
        line = f"findings re-scored with {_md(note.get('model'))} ({_md(note.get('source'))})"
        if note.get("out_of_budget"):
            kinds = sorted({t["kind"] for t in note.get("not_tried") or []})
            line += (
                f"; the budget ({note['budget_s']:g} s, --verify-budget) ran out: "
                f"{len(note['not_tried'])} hypotheses not tried ({_md(', '.join(kinds))}); "
                "the findings they would have tested stay as the signatures said"
            )
        return line
    return f"not run ({_md(note.get('reason'))}); unverified findings stay plausible"


def _residuals(finding: Finding) -> str:
    """`, mean |d| 0.21 -> 0.004 (floor 0.003)` for a finding that re-scored."""
    before, after, floor = finding.residual_before, finding.residual_after, finding.floor
    if before is None:
        return ""
    text = f", mean |d| {before:.3g}"
    if after is not None:
        text += f" -> {after:.3g}"
    return text + (f" (floor {floor:.3g})" if floor is not None else "")

"""A finding is shown with its status everywhere outside the report too: the claim helper's
wording, `lpx history` (text and JSON) and `lpx gate`, on SQLite and PostgreSQL. The report's
pages are checked in Chromium (tests/history/test_report_browser.py)."""

import json

import pytest

from pipeline.history.claims import claim_of, failing_claims, summary
from pipeline.history.gate import OpenAlert, decide
from pipeline.report.pages import finding_rows
from support.helpers import run_lpx
from support.synthetic_runs import CLAIMED_FINDINGS, STALE_WEIGHTS_GUESS, claimed_history
from tests.history.test_history import record

VERIFIED, PLAUSIBLE, RULED_OUT, UNEXPLAINED = CLAIMED_FINDINGS
HF_DIAGNOSIS = "temperature (verified), top_k (plausible), token_shift (ruled out), unexplained"


@pytest.mark.parametrize(
    ("finding", "status", "label", "severity", "headline"),
    [
        (VERIFIED, "verified", "verified", "fault", "temperature, verified by re-scoring"),
        (PLAUSIBLE, "plausible", "plausible", "fault", "plausible, not reproduced: top_k"),
        (RULED_OUT, "ruled_out", "ruled out", "info", "ruled out by re-scoring: token_shift"),
        (
            UNEXPLAINED,
            "unexplained",
            "unexplained",
            "fault",
            "unexplained: no re-scored cause reproduces this drift",
        ),
        # an older report: no status, never re-scored
        (
            STALE_WEIGHTS_GUESS,
            "plausible",
            "plausible",
            "fault",
            "plausible, not reproduced: stale_weights",
        ),
        # a status this lpx does not know proves nothing
        (
            {"cause": "temperature", "status": "likely", "severity": "fault"},
            "plausible",
            "plausible",
            "fault",
            "plausible, not reproduced: temperature",
        ),
        # ruled out is never a fault, whatever severity was stored
        (
            {**RULED_OUT, "severity": "fault"},
            "ruled_out",
            "ruled out",
            "info",
            "ruled out by re-scoring: token_shift",
        ),
        # compare's own unexplained drift, before any re-scoring
        (
            {"cause": "unexplained", "status": "plausible", "severity": "fault"},
            "unexplained",
            "unexplained",
            "fault",
            "unexplained: no known cause's signature fits this drift",
        ),
        # kept plausible after re-scoring reproduced none of what it tried
        (
            {**STALE_WEIGHTS_GUESS, "status": "plausible", "details": {"ruled_out": [{}]}},
            "plausible",
            "plausible",
            "fault",
            "plausible, not reproduced by re-scoring: stale_weights",
        ),
    ],
)
def test_a_finding_becomes_a_claim_worded_as_sure_as_it_is(
    finding, status, label, severity, headline
):
    claim = claim_of(finding)
    assert (claim.status, claim.label, claim.severity, claim.headline) == (
        status,
        label,
        severity,
        headline,
    )
    assert claim.as_dict() == {
        "cause": finding["cause"],
        "status": status,
        "severity": severity,
        "claim": headline,
    }


def test_only_unsettled_claims_say_how_to_settle_them():
    assert claim_of(VERIFIED).next_step == claim_of(RULED_OUT).next_step == ""
    guess = claim_of(PLAUSIBLE)
    assert "--no-verify" in guess.next_step and "lpx diagnose FIXTURE REPLAY --model DIR" in (
        guess.next_step
    )
    assert guess.meaning.startswith("Plausible: the drift's signatures fit this cause")
    assert guess.meaning.endswith(guess.next_step)
    # weights cannot be re-created from logprobs: only a weight store verifies them
    assert "--weights-store STORE" in claim_of(STALE_WEIGHTS_GUESS).next_step
    assert claim_of(UNEXPLAINED).next_step == "Inspect the worst tokens and the drift heatmap."


def test_the_policys_failing_causes_carry_their_statuses():
    findings = [*CLAIMED_FINDINGS, {**PLAUSIBLE, "status": "verified"}]
    assert failing_claims(["temperature", "top_k", "unexplained"], findings) == [
        "temperature (verified)",
        "top_k (plausible)",
        "top_k (verified)",  # held twice, with two statuses: both are said
        "unexplained",
    ]
    # a cause the diagnosis does not hold, or holds only as ruled out, is shown as held
    assert failing_claims(["prompt_mismatch", "token_shift"], findings) == [
        "prompt_mismatch (plausible)",
        "token_shift (ruled out)",
    ]
    assert summary([claim_of(f).as_dict() for f in CLAIMED_FINDINGS]) == HF_DIAGNOSIS


def test_the_gate_names_each_failing_alerts_findings_with_their_status():
    claims = tuple(claim_of(f).as_dict() for f in CLAIMED_FINDINGS)
    alerts = [
        OpenAlert(4, "policy_violation", "vllm vs hf", "policy", "policy: verdict fail", claims),
        OpenAlert(5, "suspicious", "vllm vs hf", "k3", "history: k3 ...", claims),
    ]
    decision = decide("fail", [], alerts, ("policy",))
    assert decision.exit_code == 1
    assert decision.reasons == [
        "alert 4 policy_violation: vllm vs hf: policy: verdict fail",
        f"  diagnosis: {HF_DIAGNOSIS}",
    ]


@pytest.fixture
def claimed_db(history_url, tmp_path) -> str:
    record(history_url, *claimed_history(tmp_path))
    return history_url


def _series_ids(db: str) -> dict[str, int]:
    rows = json.loads(run_lpx("history", "series", "--json", "--db", db).output)
    return {row["replay_engine"]: row["id"] for row in rows}


def test_lpx_history_prints_each_finding_with_its_status(claimed_db):
    ids = _series_ids(claimed_db)
    points = run_lpx("history", "series", ids["hf"], "--db", claimed_db)
    lines = points.output.splitlines()
    assert points.exit_code == 0 and len(lines) == 4
    assert lines[-1].startswith("run     3") and lines[-1].endswith(f"  diagnosis: {HF_DIAGNOSIS}")
    assert "diagnosis" not in lines[1] + lines[2]  # the passing nights found nothing

    listed = run_lpx("history", "series", "--db", claimed_db).output.splitlines()
    fsdp = next(line for line in listed if "fsdp" in line)
    assert fsdp.endswith("  diagnosis: stale_weights (plausible)")

    alerts = run_lpx("history", "alerts", "--db", claimed_db).output.splitlines()
    assert len(alerts) == 3
    hf = next(line for line in alerts if f"series {ids['hf']} " in line)
    assert "findings: temperature (verified), top_k (plausible), unexplained" in hf  # the rule
    assert hf.endswith(f"  diagnosis: {HF_DIAGNOSIS}")


def test_lpx_history_json_gives_each_finding_its_status_and_claim(claimed_db):
    ids = _series_ids(claimed_db)
    series = json.loads(run_lpx("history", "series", "--json", "--db", claimed_db).output)
    fsdp = next(row for row in series if row["id"] == ids["fsdp"])
    assert fsdp["latest_findings"] == [
        {
            "cause": "stale_weights",
            "status": "plausible",
            "severity": "fault",
            "claim": "plausible, not reproduced: stale_weights",
        }
    ]
    points = json.loads(
        run_lpx("history", "series", ids["hf"], "--json", "--db", claimed_db).output
    )
    assert [p["findings"] for p in points[:2]] == [[], []]
    assert [(f["cause"], f["status"], f["severity"]) for f in points[2]["findings"]] == [
        ("temperature", "verified", "fault"),
        ("top_k", "plausible", "fault"),
        ("token_shift", "ruled_out", "info"),
        ("unexplained", "unexplained", "fault"),
    ]
    alerts = json.loads(run_lpx("history", "alerts", "--json", "--db", claimed_db).output)
    by_series = {a["series_id"]: a for a in alerts}
    assert [f["status"] for f in by_series[ids["hf"]]["first_bad"]["findings"]] == [
        "verified",
        "plausible",
        "ruled_out",
        "unexplained",
    ]
    assert by_series[ids["fsdp"]]["rule"] == (
        "policy: max_abs_diff 0.5 > 0.1; findings: stale_weights (plausible)"
    )


def test_lpx_gate_prints_the_findings_of_what_failed_it_with_their_status(claimed_db):
    ids = _series_ids(claimed_db)
    gate = run_lpx("gate", "--db", claimed_db)
    assert gate.exit_code == 1
    lines = gate.output.splitlines()
    assert len(lines) == 5 and lines[-1].startswith("gate: FAIL run 3")
    hf = next(i for i, line in enumerate(lines) if "vs hf" in line)
    assert lines[hf].endswith(
        "policy: max_abs_diff 0.5 > 0.1; findings: temperature (verified), top_k (plausible), "
        "unexplained"
    )
    assert lines[hf + 1] == f"  diagnosis: {HF_DIAGNOSIS}"
    fsdp = next(i for i, line in enumerate(lines) if "vs fsdp" in line)
    assert lines[fsdp + 1] == "  diagnosis: stale_weights (plausible)"
    # re-judging the series (an annotation) words the rule the same way
    annotated = run_lpx(
        "annotate", ids["fsdp"], "--change", "2", "--reason", "new runner", "--db", claimed_db
    )
    assert annotated.exit_code == 0, annotated.output
    alerts = json.loads(run_lpx("history", "alerts", "--json", "--db", claimed_db).output)
    rule = next(a["rule"] for a in alerts if a["series_id"] == ids["fsdp"])
    assert rule == "policy: max_abs_diff 0.5 > 0.1; findings: stale_weights (plausible)"


def test_run_page_rows_say_where_a_finding_starts_and_survive_odd_fields():
    rows = finding_rows([STALE_WEIGHTS_GUESS, UNEXPLAINED])
    assert rows[0]["where"] == "sequences 7-1 · from position 0 of 7-1"
    assert rows[0]["residuals"] == ""  # never re-scored
    assert rows[1]["where"] == (
        "sequences 0-0, 1-0, 2-0, 3-0, 4-0, 5-0, 6-0, 7-0, 8-0, 9-0, 10-0, 11-0 and 28 more"
    )  # and no position: unexplained drift has none
    assert rows[1]["residuals"] == "re-scored: mean |d| 0.05 -> 0.05 (floor 0.003)"
    # report.json's schema checks a finding's cause only
    odd = {"cause": "top_k", "sequences": 5, "first_position": [1], "evidence": None}
    (row,) = finding_rows([odd, "not a finding"])
    assert (row["where"], row["evidence"], row["claim"].status) == ("", "", "plausible")

"""pipeline/belonging.py: a fixture and the model, calibration or report it is combined with
(issue 28). Model directories here hold stand-in weight files: the checks only fingerprint
them, and a real model's fingerprint is the same function over bigger files."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.belonging import check_calibration, check_model, check_report, model_weights
from pipeline.contracts.calibration import Calibration, Key
from pipeline.contracts.report import Report
from pipeline.errors import BadInput
from pipeline.fingerprint import prompt_set_fingerprint, weights_fingerprint
from pipeline.fixture.table import table_from_sequences


def _model(root: Path, name: str, content: bytes) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(content)
    return folder


def _fixture(weights: str | None, prompts=((1, 2), (3,)), completions=((4, 5), (6, 7, 8))):
    model = {"path": "/models/rolled", **({"weights_fingerprint": weights} if weights else {})}
    return table_from_sequences(
        "fixture",
        ["s0", "s1"],
        [list(p) for p in prompts],
        [list(c) for c in completions],
        {"rollout": [[-0.5] * len(c) for c in completions]},
        metadata={"model": model, "dtype": "float32"},
    )


def test_the_fixtures_own_model_passes_and_another_is_refused_naming_both(tmp_path):
    same = _model(tmp_path, "same", b"weights v1")
    other = _model(tmp_path, "other", b"weights v2")
    fixture = _fixture(weights_fingerprint(same))
    assert check_model(fixture.metadata, "run/fixture.parquet", same, allow=False) is None
    with pytest.raises(BadInput) as refused:
        check_model(fixture.metadata, "run/fixture.parquet", other, allow=False)
    message = refused.value.format_message()
    assert message.startswith(f"--model {other}: its weights ({weights_fingerprint(other)[:19]}")
    assert weights_fingerprint(same)[:19] in message and "run/fixture.parquet" in message
    assert "(/models/rolled)" in message and "--allow-model-mismatch" in message
    assert "\n" not in message
    allowed = check_model(fixture.metadata, "f", other, allow=True, option="--model-b")
    assert allowed == {
        "fixture_weights": weights_fingerprint(same),
        "model_weights": weights_fingerprint(other),
        "model": str(other),
        "allowed": True,
    }


def test_the_model_a_fixture_records_is_refused_once_it_holds_other_weights(tmp_path):
    model = _model(tmp_path, "m", b"retrained since")
    fixture = _fixture("sha256:" + "a" * 64)
    fixture.metadata["model"]["path"] = str(model)
    with pytest.raises(BadInput) as refused:
        check_model(fixture.metadata, "f.parquet", model, False, "the fixture's model")
    assert refused.value.format_message() == (
        f"f.parquet records model {model}, which now holds weights "
        f"{weights_fingerprint(model)[:19]}..., not the sha256:aaaaaaaaaaaa... it was rolled out "
        "with; pass --model DIR with those weights, or --allow-model-mismatch to re-score with "
        "these on purpose (a stale checkpoint)."
    )


def test_a_fixture_that_records_no_weights_cannot_be_checked_and_is_taken(tmp_path):
    model = _model(tmp_path, "m", b"w")
    for weights in (None, "none"):
        assert check_model(_fixture(weights).metadata, "f", model, allow=False) is None
    assert check_model({"model": "not a mapping"}, "f", model, allow=False) is None


def test_a_model_is_fingerprinted_once_while_its_files_stay_as_they_are(tmp_path, monkeypatch):
    model = _model(tmp_path, "m", b"first")
    first = model_weights(model)
    calls = []
    monkeypatch.setattr(
        "pipeline.belonging.weights_fingerprint", lambda d: calls.append(d) or "sha256:x"
    )
    assert model_weights(model) == first and calls == []
    (model / "model.safetensors").write_bytes(b"second, longer")  # another size: rehashed
    assert model_weights(model) == "sha256:x" and len(calls) == 1


def _calibration(fingerprint):
    """A calibration.json's model with only its key (all check_calibration reads)."""
    return Calibration.model_construct(key=Key(model_fingerprint=fingerprint))


def test_a_calibration_of_other_weights_is_refused_unless_allowed():
    fixture = _fixture("sha256:" + "a" * 64)
    ours, theirs = _calibration("sha256:" + "a" * 64), _calibration("sha256:" + "b" * 64)
    assert check_calibration(fixture.metadata, "f.parquet", ours, "c.json", False) is None
    with pytest.raises(BadInput) as refused:
        check_calibration(fixture.metadata, "f.parquet", theirs, "c.json", False)
    assert refused.value.format_message() == (
        "c.json: a calibration of weights sha256:bbbbbbbbbbbb..., but f.parquet was rolled out "
        "with sha256:aaaaaaaaaaaa...; calibrate this model (lpx calibrate f.parquet), or pass "
        "--allow-calibration-mismatch to judge with it on purpose."
    )
    assert check_calibration(fixture.metadata, "f.parquet", theirs, "c.json", True) == {
        "fixture_weights": "sha256:" + "a" * 64,
        "calibration_weights": "sha256:" + "b" * 64,
        "calibration": "c.json",
        "allowed": True,
    }
    # nothing recorded on either side: nothing to compare
    assert check_calibration(fixture.metadata, "f", _calibration(None), "c", False) is None
    assert check_calibration({}, "f", theirs, "c", False) is None


def _held(report: dict) -> Report:
    """A report.json's model as a reader holds it (only the fields check_report reads)."""
    return Report.model_construct(**{"metadata": {"fixture": {}, "replay": {}}, **report})


def _report(fixture, **changes) -> Report:
    report = {
        "verdict": "fail",
        "sequences": [{"sequence_id": "s1", "max_abs_diff": 0.3}],
        "worst": [{"sequence_id": "s1", "position": 2, "token_id": 8, "region": "completion"}],
        "metadata": {
            "fixture": {
                "path": "night/fixture.parquet",
                "prompt_set_fingerprint": prompt_set_fingerprint(fixture),
                "model": fixture.metadata["model"],
            }
        },
    }
    report.update(changes)
    return _held(report)


def test_the_prompt_set_fingerprint_is_the_one_compare_records():
    """One function (pipeline/fingerprint.py) for compare and this check; its digest is frozen:
    history keys hold it, so a change would split every series in two."""
    from pipeline.compare import run

    fixture = _fixture(None)
    assert run.prompt_set_fingerprint is prompt_set_fingerprint
    assert prompt_set_fingerprint(fixture) == (
        "sha256:0f07b480bbdfac7b59b8677acd20723be285642d13f0ba7f7b0053a23e5c29a7"
    )
    assert prompt_set_fingerprint(_fixture(None, prompts=((1, 2), (4,)))) != (
        prompt_set_fingerprint(fixture)
    )


def test_a_report_of_this_fixture_chooses_its_sequences():
    fixture = _fixture("sha256:" + "a" * 64)
    assert check_report(fixture, "f", _report(fixture), "r.json", False) is None
    # an older report with none of the fields compared: nothing says it is another's
    assert check_report(fixture, "f", _held({"verdict": "fail"}), "r.json", False) is None


@pytest.mark.parametrize(
    "other, reason",
    [
        (
            _fixture("sha256:" + "b" * 64),
            "its rollout weights are sha256:bbbbbbbbbbbb..., the fixture's sha256:aaaaaaaaaaaa...",
        ),
        (_fixture("sha256:" + "a" * 64, prompts=((1, 2), (9,))), "its prompt set is sha256:"),
    ],
)
def test_a_report_of_another_fixture_is_refused_naming_both(other, reason):
    fixture = _fixture("sha256:" + "a" * 64)
    with pytest.raises(BadInput) as refused:
        check_report(fixture, "run/fixture.parquet", _report(other), "old/report.json", False)
    message = refused.value.format_message()
    assert message.startswith(
        "--report old/report.json: a comparison of night/fixture.parquet, not of "
        "run/fixture.parquet ("
    )
    assert reason in message and message.endswith(
        "pass this fixture's report.json, or --allow-report-mismatch to pick sequences by it on "
        "purpose."
    )
    allowed = check_report(fixture, "run/fixture.parquet", _report(other), "old/report.json", True)
    assert allowed["allowed"] is True and reason in allowed["reason"]


@pytest.mark.parametrize(
    "position, token, reason",
    [
        (2, 9, "its worst token of sequence 's1' at completion position 2 is token 9, the "
         "fixture's is 8"),
        (3, 8, "its worst token of sequence 's1' is at completion position 3, past the "
         "fixture's 3 completion tokens"),
    ],
)  # fmt: skip
def test_a_report_of_the_same_prompts_with_other_completions_is_refused(position, token, reason):
    """Two rollouts of one prompt set share their ids and prompts: the tokens tell them apart."""
    fixture = _fixture(None)
    report = _report(fixture, worst=[{"sequence_id": "s1", "position": position,
                                      "token_id": token, "region": "completion"}])  # fmt: skip
    with pytest.raises(BadInput) as refused:
        check_report(fixture, "f", report, "r.json", False)
    assert f"({reason});" in refused.value.format_message()


def test_a_report_naming_sequences_the_fixture_lacks_is_refused():
    fixture = _fixture(None)
    report = _held({"sequences": [{"sequence_id": "elsewhere"}, {"sequence_id": 7}]})
    with pytest.raises(BadInput, match=r"its sequences 'elsewhere', '7' are not in the fixture"):
        check_report(fixture, "f", report, "r.json", False)

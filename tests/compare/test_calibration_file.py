"""calibration.json's schema (pipeline/compare/calibration_file.py, issue 28): what
`lpx calibrate` writes is read back as it is; a damaged file is one line naming the file and
the first wrong field, never numbers that judge a comparison."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest

from pipeline.compare.calibrated import token_tau
from pipeline.compare.calibration_file import (
    as_calibration,
    load_calibration,
    read_calibration,
    validate_calibration,
)
from pipeline.errors import BadInput
from support.fuzzing import synthetic_calibration

PAIR = "bfloat16|float32"


def _with(change):
    calibration = synthetic_calibration()
    change(calibration)
    return calibration


def _cell(calibration, name="all"):
    floor = calibration["pairs"][PAIR]
    return floor["all"] if name == "all" else floor["cells"][name]


def test_what_calibrate_writes_is_read_back_unchanged_with_unknown_fields_kept(tmp_path):
    calibration = synthetic_calibration()
    calibration["pairs"][PAIR]["a_newer_statistic"] = {"kept": [1, 2]}
    calibration["newer"] = True
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(calibration))
    assert read_calibration(path) == json.loads(json.dumps(calibration))


def test_the_mean_of_equal_samples_may_lie_an_ulp_over_their_max():
    # np.mean([0.1] * 3) is 0.10000000000000002: rounding, not damage
    calibration = _with(lambda c: _cell(c).update(mean=0.1 + 2**-56, max=0.1))
    for key in ("q50", "q90", "q99", "q999"):
        _cell(calibration)[key] = 0.05
    _cell(calibration)["sketch"] = [0.05] * 4
    assert validate_calibration(calibration, "c.json") is calibration


DAMAGE = [
    (lambda c: _cell(c).update(q99=math.nan), "`pairs.bfloat16|float32.all.q99`: Input should "
     "be a finite number (got nan)"),
    (lambda c: _cell(c).update(mean=-0.01), "`pairs.bfloat16|float32.all.mean`: Input should "
     "be greater than or equal to 0 (got -0.01)"),
    (lambda c: _cell(c).update(q50=1.0), "`pairs.bfloat16|float32.all`: q50 (1) must not "
     "exceed q90"),
    (lambda c: _cell(c).update(max=0.0), "must not exceed max (0)"),
    (lambda c: _cell(c)["sketch"].reverse(), "`pairs.bfloat16|float32.all`: sketch[1]"),
    (lambda c: _cell(c)["sketch"].append(5.0), "sketch ends at 5, past max"),
    (lambda c: _cell(c).update(n=0), "`pairs.bfloat16|float32.all.n`: Input should be greater "
     "than or equal to 1 (got 0)"),
    (lambda c: _cell(c).update(n="96"), "all.n`: Input should be a valid integer (got '96')"),
    (lambda c: _cell(c).update(var=True), "all.var`: Input should be a valid number (got True)"),
    (lambda c: _cell(c).pop("q999"), "`pairs.bfloat16|float32.all.q999`: Field required"),
    (lambda c: _cell(c).update(n=7), "all.n (7) must equal tokens (288)"),
    (lambda c: c["pairs"][PAIR]["surprisal_edges"].reverse(), "surprisal_edges must increase"),
    (lambda c: c["pairs"][PAIR]["cells"].update({"9,0": _cell(c)}), "cell '9,0' is not a bucket"),
    (lambda c: c["pairs"][PAIR]["design"].update(icc=1.5), "design.icc`: Input should be less "
     "than or equal to 1 (got 1.5)"),
    (lambda c: c["pairs"][PAIR]["tau_exceedance"].update(count=10**6), "count (1000000) "
     "exceeds samples (288)"),
    (lambda c: c["pairs"][PAIR].pop("design"), "`pairs.bfloat16|float32.design`: Field required"),
    (lambda c: c["pairs"].update({"float32|bfloat16": c["pairs"].pop(PAIR)}), "`pairs."
     "float32|bfloat16`: must name its precisions in order, bfloat16|float32"),
    (lambda c: c["pairs"].update({"float16|float32": c["pairs"][PAIR]}), "`pairs."
     "float16|float32`: not two of the precisions measured (bfloat16, float32)"),
    (lambda c: c["pairs"].update({"x": c["pairs"][PAIR]}), "`pairs.x.[key]`: String should "
     "match pattern"),
    (lambda c: c.update(pairs={}), "`pairs`: Dictionary should have at least 1 item"),
    (lambda c: c.update(precisions=["float64"]), "`precisions[0]`: unknown dtype 'float64'"),
    (lambda c: c.update(precisions=["bfloat16+fp9"]), "`precisions[0]`: unknown quantization 'fp9'"),
    (lambda c: c["key"].update(model_fingerprint=7), "`key.model_fingerprint`: Input should be "
     "a valid string (got 7)"),
    (lambda c: c.pop("key"), "`key`: Field required"),
]  # fmt: skip


@pytest.mark.parametrize("damage, problem", DAMAGE, ids=[p[:40] for _, p in DAMAGE])
def test_a_damaged_calibration_is_refused_naming_the_file_and_the_field(tmp_path, damage, problem):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(_with(damage)))
    with pytest.raises(BadInput) as refused:
        read_calibration(path)
    message = refused.value.format_message()
    assert message.startswith(f"{path}: not a calibration lpx can judge with: `")
    assert problem in message, message
    assert message.endswith("; rerun `lpx calibrate`.") and "\n" not in message


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"lpx_calibration": 1, "pairs": {}}', ": a calibration of format 1, made before the "
         "precision gate (it lacks the noise's design and variant levels); rerun `lpx calibrate`."),
        ('{"lpx_calibration": 3}', ": lpx_calibration 3 is not a format this lpx reads (2); rerun "
         "`lpx calibrate` with this lpx."),
        ('{"lpx_calibration": "2"}', ": lpx_calibration '2' is not a format this lpx reads"),
        ('{"lpx_calibration": true}', ": lpx_calibration True is not a format this lpx reads"),
        ('{"verdict": "pass"}', ": not an lpx calibration (no `lpx_calibration: 2`); rerun "
         "`lpx calibrate`."),
        ("[1, 2]", ": not an lpx calibration"),
        ('{"lpx_calibration": 2, "pairs": ', ": not a readable calibration (Expecting value: "
         "line 1 column 33 (char 32)); rerun `lpx calibrate`."),
    ],
)  # fmt: skip
def test_a_file_that_is_no_calibration_of_this_format_is_refused(tmp_path, text, message):
    path = tmp_path / "c.json"
    path.write_text(text)
    for reader in (read_calibration, load_calibration):  # the dict as read, or its model
        with pytest.raises(BadInput) as refused:
            reader(path)
        assert refused.value.format_message().startswith(f"{path}{message}")


def test_an_unreadable_calibration_names_the_file(tmp_path):
    (tmp_path / "bytes.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(BadInput, match=r"bytes.json: not a readable calibration \("):
        read_calibration(tmp_path / "bytes.json")
    with pytest.raises(BadInput, match=r"missing.json: cannot read the calibration \(No such"):
        read_calibration(tmp_path / "missing.json")


def test_a_hostile_key_is_shown_on_one_visible_line(tmp_path):
    calibration = synthetic_calibration()
    calibration["pairs"]["a\nb\x1b[2J|c"] = copy.deepcopy(calibration["pairs"][PAIR])
    with pytest.raises(BadInput) as refused:
        validate_calibration(calibration, "c.json")
    message = refused.value.format_message()
    assert "\n" not in message and "\x1b" not in message and "\\x1b[2J" in message


def test_a_calibration_given_as_a_dict_is_checked_as_the_file_is_and_judges_alike():
    """Bench scripts give compare_tables, verify_report and token_tau the dict json.loads
    read: it is checked into the model once, naming where it came from."""
    calibration = synthetic_calibration()
    model = as_calibration(calibration, "bench")
    assert as_calibration(model) is model and as_calibration(None) is None
    logprobs, positions = -np.linspace(0.001, 6.0, 40), np.arange(40)
    tau = token_tau(calibration, PAIR, logprobs, positions)
    assert np.array_equal(tau, token_tau(model, PAIR, logprobs, positions))
    assert tau.min() > 0 and tau.max() > tau.min()  # bucketed: not one constant
    damaged = _with(lambda c: _cell(c).update(n=0))
    with pytest.raises(BadInput) as refused:
        as_calibration(damaged, "bench")
    assert refused.value.format_message().startswith(
        "bench: not a calibration lpx can judge with: `pairs.bfloat16|float32.all.n`"
    )
    with pytest.raises(BadInput, match="^the calibration given: not an lpx calibration"):
        as_calibration({"pairs": {}})

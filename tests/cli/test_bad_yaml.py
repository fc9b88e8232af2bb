"""YAML that does not parse, in every YAML file lpx reads (a bisect's --builds, a plan, a
policy): one Error line naming the file and the line, exit 2, never PyYAML's four lines
(the shape plans and policies always had: "FILE line N: not valid YAML (PROBLEM).")."""

import pytest
import yaml

from pipeline.errors import BadInput
from pipeline.yaml_text import parse_yaml, yaml_error_line
from support.helpers import run_lpx

PLAN = (
    "version: 1\nname: p\nmodel: tiny\nrollout: {engine: hf}\n"
    "replays: [{name: hf-fp32, engine: hf}]\n"
)
# an unclosed flow list whose third line breaks it: what the builds file did
BROKEN_BUILDS = "- pip:transformers==5.18.0\n- [pip:transformers==5.19.0\n  bad: : x\n"


def _error_lines(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.strip()]


@pytest.mark.parametrize(
    "text, said",
    [
        (BROKEN_BUILDS, "b.yaml line 3: not valid YAML (expected ',' or ']', but got ':'; "
         "while parsing a flow sequence from line 2)."),
        ("a: 1\n b: 2\n", "b.yaml line 2: not valid YAML (mapping values are not allowed here)."),
        ("- a\n\t- b\n", "b.yaml line 2: not valid YAML (found character '\\t' that cannot "
         "start any token; while scanning for the next token)."),
        ("a: *nope\n", "b.yaml line 1: not valid YAML (found undefined alias 'nope')."),
        ("ok: 1\nbell: \x07\n", "b.yaml line 2: not valid YAML ('\\x07' is not allowed in YAML: "
         "special characters are not allowed)."),
    ],
)  # fmt: skip
def test_a_yaml_error_is_one_line_naming_file_line_and_problem(text, said):
    with pytest.raises(yaml.YAMLError) as caught:
        yaml.safe_load(text)
    assert len(str(caught.value).splitlines()) >= 2  # what the user saw before
    assert yaml_error_line("b.yaml", caught.value, text) == said
    with pytest.raises(BadInput) as refused:
        parse_yaml(text, "b.yaml")
    assert refused.value.format_message() == said


def test_valid_yaml_reads_as_yaml():
    assert parse_yaml("- pip:a==1\n- {image: x:1}\n", "b.yaml") == ["pip:a==1", {"image": "x:1"}]


def test_bisect_with_a_broken_builds_file_is_one_error_line(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    builds = tmp_path / "builds.yaml"
    builds.write_text(BROKEN_BUILDS)
    result = run_lpx(
        "bisect", plan, "--pair", "hf-fp32", "--good", "transformers==5.18.0",
        "--bad", "transformers==5.19.0", "--builds", builds, "--out", tmp_path / "out",
    )  # fmt: skip
    assert result.exit_code == 2
    assert _error_lines(result) == [
        f"Error: --builds {builds} line 3: not valid YAML (expected ',' or ']', but got ':'; "
        "while parsing a flow sequence from line 2)."
    ]
    assert not (tmp_path / "out").exists()


def test_bisect_with_a_builds_file_that_is_not_utf8_is_one_error_line(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    builds = tmp_path / "builds.yaml"
    builds.write_bytes(b"- pip:transformers==5.18.0\n- pip:\xff\xfe\n")
    result = run_lpx(
        "bisect", plan, "--pair", "hf-fp32", "--good", "transformers==5.18.0",
        "--bad", "transformers==5.19.0", "--builds", builds, "--out", tmp_path / "out",
    )  # fmt: skip
    assert result.exit_code == 2
    assert _error_lines(result) == [
        f"Error: --builds {builds}: not UTF-8 text; save it as UTF-8 YAML."
    ]


def test_a_broken_plan_is_one_error_line(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN + "replays: [{name: a\n")
    result = run_lpx("run", plan, "--out", tmp_path / "run")
    assert result.exit_code == 2
    (line,) = _error_lines(result)
    assert line.startswith(f"Error: {plan} line 7: not valid YAML (")
    assert "while parsing a flow mapping from line 6" in line
    assert not (tmp_path / "run").exists()


def test_a_broken_policy_is_one_error_line(tmp_path):
    from pipeline.compare.policy import load_policy

    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\nprofiles:\n  bfloat16: {tau: 0.1\n")
    with pytest.raises(BadInput) as refused:
        load_policy(policy)
    said = refused.value.format_message()
    assert "\n" not in said
    assert said.startswith(f"{policy} line 4: not valid YAML (")
    assert "while parsing a flow mapping from line 3" in said

"""A threshold policy is validated strictly: a typo or a nonsense threshold is exit 2 with
the key named, never a policy that quietly passes drift."""

import pytest

from support.helpers import run_lpx

GOOD = "version: 1\nprofiles:\n  bfloat16:\n    tau: 0.1\n    limits: {max_abs_diff: 1.0}\n"
BROKEN = {
    "typo key": (
        "version: 1\nprofiles:\n  bfloat16:\n    tau: 0.1\n    limts: {max_abs_diff: 1.0}\n",
        "profiles.bfloat16.limts: unknown key",
    ),
    "typo top key": (GOOD + "fail_on_finding: [token_shift]\n", "fail_on_finding: unknown key"),
    "typo cause": (GOOD + "fail_on_findings: [token_shfit]\n", "'token_shfit' is not one of"),
    "unknown metric": (GOOD.replace("max_abs_diff", "max_abs_dif"), "'max_abs_dif' is not one of"),
    "nan": (GOOD.replace("1.0}", ".nan}"), "finite number"),
    "inf": (GOOD.replace("1.0}", ".inf}"), "finite number"),
    "negative": (GOOD.replace("1.0}", "-1.0}"), "greater than or equal to 0"),
    "boolean": (GOOD.replace("1.0}", "true}"), "a number, not true/false"),
    "zero tau": (GOOD.replace("tau: 0.1", "tau: 0"), "profiles.bfloat16.tau"),
    "no profiles": ("version: 1\nprofiles: {}\n", "profiles"),
    "version": (GOOD.replace("version: 1", "version: 2"), "version"),
    # found by the fuzz suite's long profile: pydantic's Literal[1] took true (== 1)
    "version true": (GOOD.replace("version: 1", "version: true"), "the integer 1, not True"),
}


def test_a_limit_the_inputs_cannot_measure_is_listed_not_an_error(run_dir, tmp_path):
    """Found by the fuzz suite: a top1_flip_rate limit on files without top-k alternatives
    was exit 2 "unknown metric" (a metric the policy schema itself lists)."""
    import json

    from pipeline.fixture.io import read_table, write_table

    replay = read_table(run_dir / "replay-bfloat16.parquet")
    replay.top_ids = replay.top_logprobs = None
    write_table(replay, tmp_path / "replay-no-topk.parquet")
    policy = tmp_path / "p.yaml"
    policy.write_text(GOOD.replace("max_abs_diff: 1.0", "top1_flip_rate: 0.0"))
    result = run_lpx(
        "compare",
        run_dir / "fixture.parquet",
        tmp_path / "replay-no-topk.parquet",
        "--policy",
        policy,
        "--out",
        tmp_path / "out",
    )
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["policy"]["not_measured"] == ["top1_flip_rate"]
    assert "Not measured here, so not judged: top1\\_flip\\_rate" not in result.output
    assert "Not measured here, so not judged: top1_flip_rate" in result.output


def compare_with(policy, run_dir, tmp_path, *more):
    return run_lpx(
        "compare",
        run_dir / "fixture.parquet",
        run_dir / "replay-bfloat16.parquet",
        "--policy",
        policy,
        "--out",
        tmp_path / "out",
        *more,
    )


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_policy_is_refused_with_the_key_named(case, run_dir, tmp_path):
    text, expected = BROKEN[case]
    policy = tmp_path / "policy.yaml"
    policy.write_text(text)
    result = compare_with(policy, run_dir, tmp_path)
    assert result.exit_code == 2, result.output
    assert str(policy) in result.output and expected in result.output, result.output
    assert "docs/policy.md" in result.output and not (tmp_path / "out").exists()


def test_a_non_utf8_policy_is_one_line(run_dir, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_bytes(b"version: 1\nprofiles: \xff\xfe\n")
    result = compare_with(policy, run_dir, tmp_path)
    assert result.exit_code == 2 and "not UTF-8" in result.output


def test_numbers_written_the_yaml_1_1_way_still_work(run_dir, tmp_path):
    policy = tmp_path / "policy.yaml"  # PyYAML reads 1e-4 (no dot) as a string
    policy.write_text(GOOD.replace("tau: 0.1", "tau: 1e-1"))
    result = compare_with(policy, run_dir, tmp_path, "--quiet")
    assert result.exit_code == 0, result.output

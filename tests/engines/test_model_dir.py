"""A missing, incomplete or corrupt model directory is one clear line, before any engine
loads it (issue 8: these ended as `TypeError ... (an engine or library failed)`)."""

import json
import shutil

import pytest

from support.helpers import run_lpx


def _edit_config(model, **changes):
    config = json.loads((model / "config.json").read_text())
    config.update(changes)
    (model / "config.json").write_text(json.dumps(config))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


BROKEN = {
    "no_directory": (lambda m: shutil.rmtree(m), "no such model directory"),
    "no_config": (lambda m: (m / "config.json").unlink(), "no config.json"),
    "config_not_json": (lambda m: (m / "config.json").write_text("{oops"), "not valid JSON"),
    "config_a_list": (lambda m: (m / "config.json").write_text("[1]"), "not a JSON object"),
    "vocab_a_string": (lambda m: _edit_config(m, vocab_size="512"), "vocab_size '512'"),
    "no_model_type": (lambda m: _edit_config(m, model_type=None), "no model_type"),
    "no_weights": (lambda m: (m / "model.safetensors").unlink(), "no weight files"),
    "truncated_weights": (lambda m: _truncate(m / "model.safetensors"), "truncated or corrupt"),
    "garbage_weights": (
        lambda m: (m / "model.safetensors").write_bytes(b"\xff" * 64),
        "not a readable safetensors file",
    ),
    "weights_of_another_shape": (
        lambda m: _edit_config(m, hidden_size=64, head_dim=16),
        "transformers cannot load this model",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_replay_with_a_broken_model_dir_names_it(case, run_dir, tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    breaks, expected = BROKEN[case]
    breaks(model)
    out = tmp_path / "replay.parquet"
    result = run_lpx("replay", run_dir / "fixture.parquet", "--model", model, "--out", out)
    assert result.exit_code == 2, result.output
    assert str(model) in result.output and expected in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert not out.exists()


def test_text_prompts_need_a_tokenizer(tiny_model, tmp_path):
    """A checkpoint without tokenizer files (e.g. only a sentencepiece model elsewhere)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "tokenizer.json").unlink()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    out = tmp_path / "f.parquet"
    result = run_lpx("rollout", "--model", model, "--prompts", prompts, "--out", out)
    assert result.exit_code == 2, result.output
    assert "no tokenizer" in result.output and "token ids" in result.output
    assert not out.exists()


def test_a_corrupt_tokenizer_is_named(tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "tokenizer.json").write_text('{"model": 3}')
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    result = run_lpx("rollout", "--model", model, "--prompts", prompts, "--out", tmp_path / "f")
    assert result.exit_code == 2, result.output
    assert "cannot load its tokenizer" in result.output and str(model) in result.output

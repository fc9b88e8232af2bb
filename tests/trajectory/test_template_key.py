"""The chat template's fingerprint: the same templates in either of transformers' layouts, and
an agent loop's series keyed by it while a one-completion series keeps its key."""

from __future__ import annotations

import json

from pipeline.fingerprint import chat_template_fingerprint, tokenizer_fingerprint
from pipeline.history.keys import case_key, describe_case

TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"


def _write(folder, template=TEMPLATE, layout="jinja"):
    folder.mkdir(parents=True, exist_ok=True)
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if layout == "config":  # transformers 4's layout: the template inside tokenizer_config.json
        config["chat_template"] = template
    else:
        (folder / "chat_template.jinja").write_text(template)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text("{}")
    return folder


def test_the_same_template_in_either_layout_has_one_fingerprint(tmp_path):
    new = chat_template_fingerprint(_write(tmp_path / "new"))
    old = chat_template_fingerprint(_write(tmp_path / "old", layout="config"))
    assert new == old and new.startswith("sha256:")
    changed = chat_template_fingerprint(_write(tmp_path / "changed", TEMPLATE + "\n"))
    assert changed != new
    # a named template beside the default one is part of it
    extra = _write(tmp_path / "extra") / "additional_chat_templates"
    extra.mkdir()
    (extra / "tool_use.jinja").write_text("{{ tools }}")
    assert chat_template_fingerprint(tmp_path / "extra") != new
    assert chat_template_fingerprint(tmp_path / "nothing") == "none"


def test_the_tokenizer_fingerprint_does_not_move_with_the_jinja_template(tmp_path):
    """How ids score does not depend on the template: series of one completion keep their
    tokenizer key when a model gains or changes chat_template.jinja."""
    one = tokenizer_fingerprint(_write(tmp_path / "a"))
    assert one == tokenizer_fingerprint(_write(tmp_path / "b", TEMPLATE + "changed"))


def _metadata(template: str, agent_loop: dict | None):
    fixture = {
        "model": {"path": "m", "weights_fingerprint": "sha256:w", "tokenizer_fingerprint": "t",
                  "chat_template_fingerprint": template},
        "prompt_set_fingerprint": "p", "dtype": "float32",
    }  # fmt: skip
    if agent_loop:
        fixture["agent_loop"] = agent_loop
    return {"fixture": fixture, "replay": {"dtype": "float32"}}


def test_an_agent_loop_series_is_keyed_by_its_template_and_one_completion_is_not():
    loop = {"turns": 4, "mode": "messages", "think": True}
    a = describe_case(_metadata("sha256:" + "a" * 64, loop))
    b = describe_case(_metadata("sha256:" + "b" * 64, loop))
    assert a["agent_loop"] == "4 turns, messages, thinking, template aaaaaaaaaaaa"
    assert case_key(a) != case_key(b)
    # one completion per prompt: the template renders nothing the engine scores
    single_a = describe_case(_metadata("sha256:" + "a" * 64, None))
    single_b = describe_case(_metadata("sha256:" + "b" * 64, None))
    assert single_a["agent_loop"] is None and case_key(single_a) == case_key(single_b)
    # a fixture recorded before the template was fingerprinted keeps its key
    before = _metadata("none", loop)
    del before["fixture"]["model"]["chat_template_fingerprint"]
    assert describe_case(before)["agent_loop"] == "4 turns, messages, thinking"

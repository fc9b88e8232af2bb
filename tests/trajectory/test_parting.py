"""Token-exactness on the tiny model's real tokenizer and chat template: each class of parting
committed the way an agent loop commits it (re-tokenizing decoded text, re-rendering messages
through the template, rebuilding the trainer's sequence turn by turn), named with its turn and
position, and clean token-in-token-out trajectories token-exact."""

from __future__ import annotations

import pytest

from pipeline.errors import BadInput
from pipeline.trajectory.parting import exact_model_positions, token_partings
from pipeline.trajectory.shape import make_trajectory
from pipeline.trajectory.template import GENERATION_PROMPT, append_only, encode, render

SYSTEM = "You are a careful calculator."
QUESTIONS = ["What is two and two?", "And then three more?"]
ANSWERS = [
    "<think>\nadd the two\n</think>\n\nI will use the tool.",
    "The tool says four.",
    "<think>\nfour and three\n</think>\n\nIt is seven.",
    "Seven is the answer.",
]
TOOL = ["4", "7"]


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def conversation() -> list[dict]:
    """system, user, assistant, tool, assistant, user, assistant, tool, assistant."""
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTIONS[0]},
        {"role": "assistant", "content": ANSWERS[0]},
        {"role": "tool", "content": TOOL[0]},
        {"role": "assistant", "content": ANSWERS[1]},
        {"role": "user", "content": QUESTIONS[1]},
        {"role": "assistant", "content": ANSWERS[2]},
        {"role": "tool", "content": TOOL[1]},
        {"role": "assistant", "content": ANSWERS[3]},
    ]


def tito_turns(tok, messages, split_model_words=False) -> list[dict]:
    """The turns a token-in-token-out loop records: each model turn's generated ids (its text,
    `<|im_end|>` and the eos), the template's tokens between turns carried by the turn after."""
    turns, pending = [], ""
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            ids = encode(tok, m["content"] + "<|im_end|>") + [tok.eos_token_id]
            turns.append({"role": "assistant", "ids": ids, "logprobs": [-0.5] * len(ids)})
            pending = "\n"
            continue
        text = render(tok, [m])
        if (
            m["role"] != "system"
            and k + 1 < len(messages)
            and messages[k + 1]["role"] == "assistant"
        ):
            text += GENERATION_PROMPT
        turns.append({"role": m["role"], "ids": encode(tok, pending + text)})
        pending = ""
    return turns


def test_the_template_strips_earlier_thinking_and_the_check_names_where(tok):
    messages = conversation()
    whole = render(tok, messages)
    assert "add the two" not in whole and "four and three" in whole  # Qwen3's rule
    broken = append_only(tok, messages)
    # message 5 is the second user message: from it on, turn 2's <think> is left out
    assert broken is not None and broken.turn == 5 and broken.kind == "text"
    assert "<think>" in broken.before and "<think>" not in broken.after
    # without thinking, the template only ever appends
    plain = [dict(m, content=m["content"].split("</think>")[-1].lstrip()) for m in messages]
    assert append_only(tok, plain) is None


def test_token_in_token_out_trajectories_are_token_exact(tok):
    turns = tito_turns(tok, conversation())
    trajectory = make_trajectory("t0", turns)
    assert token_partings(trajectory, tok) == []
    model = [t for t in turns if t["role"] == "assistant"]
    assert len(exact_model_positions(trajectory)) == sum(len(t["ids"]) for t in model)


def _flat(turns) -> tuple[list[int], list[int]]:
    ids = [i for t in turns for i in t["ids"]]
    mask = [int(t["role"] == "assistant") for t in turns for _ in t["ids"]]
    return ids, mask


def _model_turn_indices(turns) -> list[int]:
    return [k for k, t in enumerate(turns) if t["role"] == "assistant"]


def commit_bpe_remerge(tok, turns, k):
    """The engine sampled a word in two pieces; the trainer decodes the turn's text and
    re-tokenizes it: one piece."""
    text = tok.decode(turns[k]["ids"][:-1])
    # a word of the turn that two pieces spell otherwise than the tokenizer does
    word, cut = next(
        (w, p) for w in text.split()[1:] for p in range(1, len(w))
        if encode(tok, " " + w[:p]) + encode(tok, w[p:]) != encode(tok, " " + w)
    )  # fmt: skip
    at = text.index(" " + word)
    pieces = encode(tok, text[:at]) + encode(tok, " " + word[:cut]) + encode(tok, word[cut:])
    pieces += encode(tok, text[at + len(word) + 1 :]) + [tok.eos_token_id]
    assert tok.decode(pieces) == tok.decode(turns[k]["ids"]) and pieces != turns[k]["ids"]
    engine = [dict(t) for t in turns]
    engine[k] = dict(turns[k], ids=pieces, logprobs=[-0.5] * len(pieces))
    ids, mask = _flat(engine)
    # the trainer re-tokenizes the model turn's decoded text
    retok = encode(tok, tok.decode(pieces[:-1])) + [tok.eos_token_id]
    flat = _flat(engine[:k])[0] + retok + _flat(engine[k + 1 :])[0]
    mask = _flat(engine[:k])[1] + [1] * len(retok) + _flat(engine[k + 1 :])[1]
    return engine, flat, mask, "bpe_remerge"


def commit_separator_lost(tok, turns, k):
    """verl's tool loop: the trainer tokenizes the tool turn without the `\\n` the template
    puts after the assistant's eos."""
    j = k + 1
    flat_turns = [dict(t) for t in turns]
    text = tok.decode(turns[j]["ids"])
    assert text.startswith("\n")
    flat_turns[j] = dict(turns[j], ids=encode(tok, text[1:]))
    flat, mask = _flat(flat_turns)
    return turns, flat, mask, "separator_lost"


def commit_special_token_lost(tok, turns, k):
    """The trainer rebuilds the model turn from text decoded with skip_special_tokens."""
    flat_turns = [dict(t) for t in turns]
    text = tok.decode(turns[k]["ids"], skip_special_tokens=True)
    flat_turns[k] = dict(turns[k], ids=encode(tok, text))
    flat, mask = _flat(flat_turns)
    return turns, flat, mask, "special_token_lost"


def commit_leading_space(tok, turns, k):
    """The trainer tokenizes the model turn on its own with a prefix space (as a
    SentencePiece tokenizer adds `▁` to a turn tokenized alone)."""
    flat_turns = [dict(t) for t in turns]
    text = tok.decode(turns[k]["ids"][:-1])
    flat_turns[k] = dict(turns[k], ids=encode(tok, " " + text) + [tok.eos_token_id])
    flat, mask = _flat(flat_turns)
    return turns, flat, mask, "leading_space"


def commit_system_prompt_dropped(tok, turns, k):
    """The trainer's sequence sliced from the first user turn (verl#7592)."""
    flat, mask = _flat(turns[1:])
    return turns, flat, mask, "system_prompt_dropped"


def commit_mask_off_by_one(tok, turns, k):
    flat, mask = _flat(turns)
    start = sum(len(t["ids"]) for t in turns[:k])
    end = start + len(turns[k]["ids"])
    shift = 1 if end < len(flat) else -1  # the last turn's mask slips back, others forward
    mask[start:end] = [0] * (end - start)
    mask[start + shift : end + shift] = [1] * (end - start)
    return turns, flat, mask, "mask_off_by_one"


def commit_tool_tokens_in_loss(tok, turns, k):
    flat, mask = _flat(turns)
    j = k + 1 if k + 1 < len(turns) and turns[k + 1]["role"] == "tool" else k - 1
    assert turns[j]["role"] == "tool"
    start = sum(len(t["ids"]) for t in turns[:j])
    mask[start : start + len(turns[j]["ids"])] = [1] * len(turns[j]["ids"])
    return turns, flat, mask, "tool_tokens_in_loss"


def commit_model_tokens_masked(tok, turns, k):
    flat, mask = _flat(turns)
    start = sum(len(t["ids"]) for t in turns[:k])
    mask[start + 2 : start + 5] = [0, 0, 0]
    return turns, flat, mask, "model_tokens_masked"


COMMITS = {
    "bpe_remerge": (commit_bpe_remerge, None),
    "separator_lost": (commit_separator_lost, None),
    "special_token_lost": (commit_special_token_lost, None),
    "leading_space": (commit_leading_space, None),
    "system_prompt_dropped": (commit_system_prompt_dropped, 0),
    "mask_off_by_one": (commit_mask_off_by_one, None),
    "tool_tokens_in_loss": (commit_tool_tokens_in_loss, None),
    "model_tokens_masked": (commit_model_tokens_masked, None),
}


@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("cause", sorted(COMMITS))
def test_each_class_committed_by_an_agent_loop_is_named_at_its_turn(tok, cause, where):
    commit, _ = COMMITS[cause]
    turns = tito_turns(tok, conversation())
    model_turns = _model_turn_indices(turns)
    k = model_turns[0] if where == "first" else model_turns[-1]
    if cause in ("separator_lost", "tool_tokens_in_loss") and where == "last":
        k = model_turns[-2]  # the last model turn has no tool turn after it
    engine, flat, mask, _ = commit(tok, turns, k)
    trajectory = make_trajectory("t3", engine, flat, mask)
    partings = token_partings(trajectory, tok)
    assert partings, cause
    first = partings[0]
    assert first.cause == cause, [str(p) for p in partings]
    assert first.status == "verified", str(first)
    expected_turn = model_turns[0] if cause == "system_prompt_dropped" else k
    if cause == "separator_lost":
        expected_turn = next(m for m in model_turns if m > k)  # the next turn's context parts
    if cause == "tool_tokens_in_loss":
        expected_turn = k + 1  # the tool turn whose tokens the loss scores
    assert first.turn == expected_turn, str(first)
    # never more than the one class committed
    assert {p.cause for p in partings} == {cause}, [str(p) for p in partings]


def test_thinking_stripped_by_a_messages_mode_loop_is_named_at_the_turn_after_the_user(tok):
    """Messages mode: each model turn's context is the conversation re-rendered through the
    template, which leaves out turn 2's <think> once the second user message is in; the
    trainer scores the turns end to end, thinking kept."""
    messages = conversation()
    turns = tito_turns(tok, messages)
    flat, mask = _flat(turns)
    model_messages = [i for i, x in enumerate(messages) if x["role"] == "assistant"]
    model_turns = [t for t in turns if t["role"] == "assistant"]
    for message_index, turn in zip(model_messages, model_turns, strict=True):
        prompt = render(tok, messages[:message_index], add_generation_prompt=True)
        turn["context_ids"] = encode(tok, prompt)
    partings = token_partings(make_trajectory("t4", turns, flat, mask), tok)
    assert [p.cause for p in partings] == ["thinking_stripped"], [str(p) for p in partings]
    found = partings[0]
    # the third model turn (after the second user message) is the first to see the history
    # without turn 2's thinking; the fourth sees the same parting
    assert found.turn == _model_turn_indices(turns)[2]
    assert found.turns == _model_turn_indices(turns)[2:]
    assert "add the two" in found.trainer_text and "<think>" not in found.engine_text


def test_a_few_faulty_trajectories_among_many_are_the_only_ones_named(tok):
    clean = [make_trajectory(f"c{i}", tito_turns(tok, conversation())) for i in range(12)]
    turns = tito_turns(tok, conversation())
    k = _model_turn_indices(turns)[1]
    faulty = [
        make_trajectory("f0", *commit_special_token_lost(tok, turns, k)[:3]),
        make_trajectory("f1", *commit_separator_lost(tok, turns, k)[:3]),
    ]
    named = {t.id: [p.cause for p in token_partings(t, tok)] for t in clean + faulty}
    assert {i: c for i, c in named.items() if c} == {
        "f0": ["special_token_lost"],
        "f1": ["separator_lost"],
    }


@pytest.mark.parametrize(
    "turns, flat, mask, message",
    [
        ([{"role": "tool", "ids": [3], "logprobs": [-1.0]}], None, None, "logprobs on a tool turn"),
        ([{"role": "assistant", "ids": [3, 4], "logprobs": [-1.0]}], None, None,
         "1 logprobs for 2 tokens"),
        ([{"role": "assistant", "ids": [3], "logprobs": [-1.0]}], [3, 4], [1, 2], "holds 2"),
        ([{"role": "assistant", "ids": [3], "logprobs": [-1.0]}], [3, 4], [1], "1 values for 2"),
        ([{"role": "robot", "ids": [3]}], None, None, "role 'robot'"),
        ([{"role": "user", "ids": [3]}], None, None, "no model (assistant) turn"),
    ],
)  # fmt: skip
def test_bad_trajectories_are_one_line_naming_the_trajectory_and_turn(turns, flat, mask, message):
    with pytest.raises(BadInput) as raised:
        make_trajectory("tr7", turns, flat, mask, source="dump.jsonl:3")
    text = str(raised.value)
    assert message in text and "dump.jsonl:3: trajectory 'tr7'" in text and "\n" not in text


def test_lpx_check_template_names_where_a_template_stops_appending(tiny_model, tmp_path):
    import json

    from support.helpers import run_lpx

    done = run_lpx("check-template", tiny_model)
    assert done.exit_code == 1
    assert "not append-only at message 5" in done.output and "<think>" in done.output
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps([dict(m, content=m["content"].split("</think>")[-1].strip())
                                 for m in conversation()]))  # fmt: skip
    done = run_lpx("check-template", tiny_model, "--conversation", plain)
    assert done.exit_code == 0 and "append-only over 9 messages" in done.output
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"role": "system", "content": "x"}, {"role": "robot"}]))
    done = run_lpx("check-template", tiny_model, "--conversation", bad)
    assert done.exit_code == 2
    assert f"{bad}: message 1 needs a role" in done.output and "Traceback" not in done.output

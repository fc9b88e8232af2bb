"""Token-exactness: where each model turn's engine context parts from the trainer's sequence,
which class of parting it is, and whether the model's own tokenizer reproduces it.

For model turn k the engine saw ``context_k`` and generated ``ids_k``; token-in-token-out
holds when ``context_k + ids_k`` is a prefix of the trainer's ``flat_ids`` and the loss mask is
1 exactly on ``ids_k``. Where it does not, the two sides' differing windows (difflib on ids)
are decoded and the class is read from how the texts differ:

- ``bpe_remerge``: the same text, other ids (decoded text re-tokenized across a boundary);
- ``special_token_lost`` / ``special_token_added``: the ids differ by special tokens only;
- ``thinking_stripped``: one side has a ``<think>`` block the other lacks;
- ``system_prompt_dropped`` / ``system_prompt_truncated``: the system turn is missing, or cut;
- ``leading_space``: one side starts a turn's text with a space the other lacks;
- ``separator_lost`` / ``separator_added``: only whitespace differs (a newline at a role
  boundary);
- ``tokens_differ``: none of these (the texts differ).

Then the mask: ``mask_off_by_one`` (a model turn's 1s shifted by one token),
``tool_tokens_in_loss``, ``model_tokens_masked``.

A class is ``verified`` when re-tokenizing reproduces it: the trainer's window is exactly the
model tokenizer's encoding of its own text, and that text is the engine's changed the class's
way. Otherwise ``plausible``. Pure functions of the trajectory and a tokenizer.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import asdict, dataclass, field

from pipeline.trajectory.shape import Trajectory

THINK = re.compile(r"<think>.*?</think>\s*", re.S)
WINDOW_CONTEXT = 24  # characters of equal text shown on each side of a parting
MASK_CLASSES = ("mask_off_by_one", "tool_tokens_in_loss", "model_tokens_masked")


@dataclass
class Parting:
    trajectory: str
    turn: int  # the first model turn whose context shows it
    position: int  # token position in the trainer's sequence
    cause: str
    status: str  # verified | plausible
    engine_text: str = ""
    trainer_text: str = ""
    engine_ids: list[int] = field(default_factory=list)
    trainer_ids: list[int] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)  # every model turn it reaches
    evidence: str = ""

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return (
            f"{self.trajectory}: {self.cause} ({self.status}) at model turn {self.turn}, token "
            f"{self.position}: engine {self.engine_text!r}, trainer {self.trainer_text!r}"
        )


def engine_sequence(trajectory: Trajectory, k: int) -> tuple[tuple[int, ...], int]:
    """What turn k's engine saw and made, and where its own tokens start: its recorded
    context, or (none recorded) the turns before it end to end, as token-in-token-out sends."""
    turn = trajectory.turns[k]
    context = turn.context_ids
    if context is None:
        context = tuple(i for t in trajectory.turns[:k] for i in t.ids)
    return tuple(context) + turn.ids, len(context)


def _first_difference(engine: tuple[int, ...], flat: tuple[int, ...]):
    """The first differing (engine window, trainer window) as index ranges, or None."""
    if flat[: len(engine)] == engine:
        return None  # the common case, token-exact: no alignment needed
    start = next(i for i in range(min(len(engine), len(flat)) + 1)
                 if i == len(engine) or i == len(flat) or engine[i] != flat[i])  # fmt: skip
    # align from where they part, in a window that grows until the sides meet again inside it
    width = 256
    while True:
        e_end = min(len(engine), start + width)
        f_end = min(len(flat), e_end + 64)
        matcher = difflib.SequenceMatcher(None, engine[start:e_end], flat[start:f_end],
                                          autojunk=False)  # fmt: skip
        opcodes = [op for op in matcher.get_opcodes() if op[0] != "equal"]
        tag, i1, i2, j1, j2 = opcodes[0] if opcodes else ("equal", 0, 0, 0, 0)
        whole = e_end == len(engine)
        if whole or (opcodes and start + i2 < e_end and start + j2 < f_end):
            break
        width *= 4
    if not opcodes or (tag == "insert" and start + i1 == len(engine)):
        return None  # the trainer's sequence only goes on: a prefix, token-exact
    return start + i1, start + i2, start + j1, start + j2


def _decode(tokenizer, ids, skip_special: bool = False) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special)


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _classify(trajectory, tokenizer, engine, flat, window, engine_start) -> tuple[str, str, bool]:
    """(cause, evidence, reproduced) for one differing window."""
    i1, i2, j1, j2 = window
    e_ids, t_ids = list(engine[i1:i2]), list(flat[j1:j2])
    e_text, t_text = _decode(tokenizer, e_ids), _decode(tokenizer, t_ids)
    specials = set(tokenizer.all_special_ids)
    # one side's ids are what re-tokenizing the other's text gives (in some equal context)
    retokenized = _retokenizes(tokenizer, engine, flat, window)
    # the equal tokens just before the window, decoded with it: a marker such as <think>
    # whose first piece both sides share is read whole
    lead = _decode(tokenizer, engine[max(0, i1 - 3) : i1])

    first = trajectory.turns[0]
    if first.role == "system" and i1 < len(first.ids) and i2 - i1 > j2 - j1:
        if j2 == j1 and i2 - i1 == len(first.ids):  # the whole turn's length, deleted
            return "system_prompt_dropped", "the trainer's sequence has no system turn", True
        if not t_text or e_text.startswith(t_text):
            return "system_prompt_truncated", "the system turn is cut short", retokenized
    if e_ids and t_ids and e_text == t_text:
        return "bpe_remerge", "the same text in other ids (re-tokenized)", retokenized
    if [i for i in e_ids if i not in specials] == [i for i in t_ids if i not in specials]:
        lost = len([i for i in e_ids if i in specials]) > len([i for i in t_ids if i in specials])
        cause = "special_token_lost" if lost else "special_token_added"
        named = sorted({tokenizer.convert_ids_to_tokens(i) for i in (e_ids if lost else t_ids)
                        if i in specials})  # fmt: skip
        return (
            cause,
            f"{', '.join(named)} only on the {'engine' if lost else 'trainer'}'s side",
            True,
        )
    e_lead, t_lead = lead + e_text, lead + t_text
    if "<think>" in e_lead and THINK.sub("", e_lead).strip() == THINK.sub("", t_lead).strip():
        return "thinking_stripped", "a <think> block only the engine saw", retokenized
    if "<think>" in t_lead and THINK.sub("", t_lead).strip() == THINK.sub("", e_lead).strip():
        return "thinking_stripped", "a <think> block only the trainer scores", retokenized
    if e_text.split() == t_text.split():
        at_turn_start = i1 == engine_start or _at_span_start(trajectory, j1)
        if at_turn_start and (t_text == " " + e_text or e_text == " " + t_text
                              or t_text.lstrip(" ") == e_text.lstrip(" ")):  # fmt: skip
            side = "trainer" if t_text.startswith(" ") else "engine"
            return "leading_space", f"a leading space only on the {side}'s side", retokenized
        e_space, t_space = _whitespace(e_text), _whitespace(t_text)
        cause = "separator_lost" if len(e_space) > len(t_space) else "separator_added"
        return cause, f"whitespace {e_space!r} (engine) against {t_space!r} (trainer)", retokenized
    return "tokens_differ", "the texts differ", False


def _classify_window(trajectory, tokenizer, engine, flat, window, start):
    """Classify; where the window runs to the end of what the engine made, the trainer's
    sequence goes on past it (the next turns), so the shortest trainer window that a class
    explains is the parting, the rest is continuation."""
    i1, i2, j1, j2 = window
    tried = [window]
    if i2 == len(engine) and j2 > j1:
        tried = [(i1, i2, j1, j1 + m) for m in range(0, j2 - j1 + 1)]
    first = None
    for candidate in tried:
        cause, evidence, reproduced = _classify(
            trajectory, tokenizer, engine, flat, candidate, start
        )
        if cause != "tokens_differ":
            return cause, evidence, reproduced, candidate
        first = first or (cause, evidence, reproduced, candidate)
    return first


def _whitespace(text: str) -> str:
    return "".join(c for c in text if c.isspace())


def _at_span_start(trajectory: Trajectory, position: int) -> bool:
    return any(start == position for start, _ in trajectory.spans())


def _retokenizes(tokenizer, engine, flat, window) -> bool:
    """Whether one side's window, widened by up to 3 equal tokens each side, is the
    tokenizer's own encoding of its text while the other's is not: that side is re-tokenized
    text (the trainer's, or a messages-mode engine context's)."""
    i1, i2, j1, j2 = window
    for pad in range(0, 4):
        e_ids = list(engine[max(0, i1 - pad) : min(len(engine), i2 + pad)])
        t_ids = list(flat[max(0, j1 - pad) : min(len(flat), j2 + pad)])
        e_own = bool(e_ids) and _encode(tokenizer, _decode(tokenizer, e_ids)) == e_ids
        t_own = bool(t_ids) and _encode(tokenizer, _decode(tokenizer, t_ids)) == t_ids
        if e_own != t_own or (e_own and t_own and e_ids != t_ids):
            return True
    return False


def _shown(tokenizer, ids, lo: int, hi: int) -> str:
    text = _decode(tokenizer, ids[lo:hi])
    return text if len(text) <= 2 * WINDOW_CONTEXT + 40 else text[:80] + "..."


def token_partings(trajectory: Trajectory, tokenizer) -> list[Parting]:
    """Every distinct place where a model turn's engine context parts from the trainer's
    sequence, first model turn first; then the loss mask's faults. Empty: token-exact."""
    flat = trajectory.flat_ids
    found: dict[tuple[int, str], Parting] = {}
    exact_through = None  # the model turns whose context and tokens are a prefix of flat
    for k in trajectory.model_turns():
        engine, start = engine_sequence(trajectory, k)
        window = _first_difference(engine, flat)
        if window is None:
            if len(engine) > len(flat):
                window = (len(flat), len(engine), len(flat), len(flat))
            else:
                exact_through = k if exact_through is None or exact_through < k else exact_through
                continue
        cause, evidence, reproduced, window = _classify_window(
            trajectory, tokenizer, engine, flat, window, start
        )
        i1, i2, j1, j2 = window
        # a parting in the turn's own tokens is that turn's; one in its context is first
        # shown by this turn (the earliest model turn whose context reaches it)
        key = (j1, cause)
        if key in found:
            found[key].turns.append(k)
            continue
        found[key] = Parting(
            trajectory.id, k, j1, cause, "verified" if reproduced else "plausible",
            engine_text=_shown(tokenizer, engine, i1, i2),
            trainer_text=_shown(tokenizer, flat, j1, j2),
            engine_ids=list(engine[i1:i2]), trainer_ids=list(flat[j1:j2]),
            turns=[k], evidence=evidence,
        )  # fmt: skip
    partings = sorted(found.values(), key=lambda p: (p.turn, p.position))
    return partings + mask_faults(trajectory, tokenizer)


def model_spans(trajectory: Trajectory) -> list[tuple[int, int, int]]:
    """(model turn, start, end) of each model turn's tokens in the trainer's sequence, for
    the turns whose engine context and tokens are a prefix of it."""
    out = []
    for k in trajectory.model_turns():
        engine, start = engine_sequence(trajectory, k)
        if trajectory.flat_ids[: len(engine)] == engine:
            out.append((k, start, len(engine)))
    return out


def mask_faults(trajectory: Trajectory, tokenizer) -> list[Parting]:
    """The loss mask against the model turns' own positions, where the ids are exact."""
    mask, flat = trajectory.loss_mask, trajectory.flat_ids
    spans = model_spans(trajectory)
    if not spans:
        return []
    checked_to = max(end for _, _, end in spans)
    expected = [0] * checked_to
    for _, start, end in spans:
        expected[start:end] = [1] * (end - start)
    faults: list[Parting] = []
    for k, start, end in spans:
        ones = [i for i in range(start - 1, min(end + 1, len(mask))) if i >= 0 and mask[i]]
        for shift in (1, -1):
            if ones == list(range(start + shift, end + shift)):
                faults.append(Parting(
                    trajectory.id, k, min(start, start + shift), "mask_off_by_one", "verified",
                    engine_text=_shown(tokenizer, flat, start, end),
                    trainer_text=_shown(tokenizer, flat, start + shift, end + shift),
                    turns=[k], evidence=f"the mask's 1s sit {shift:+d} token from the turn's tokens",
                ))  # fmt: skip
                break
    shifted = {f.turn for f in faults}
    spans_of = {k: (start, end) for k, start, end in spans}
    turn_spans = trajectory.spans() if flat[: len(trajectory.concatenated())] == \
        trajectory.concatenated() else []  # fmt: skip
    for i in range(checked_to):
        if mask[i] == expected[i] or any(
            k in shifted and spans_of[k][0] - 1 <= i <= spans_of[k][1] for k in spans_of
        ):
            continue
        k = next((k for k, (s, e) in spans_of.items() if s <= i < e), None)
        if expected[i] == 1:
            cause, evidence = "model_tokens_masked", "a model token the loss does not score"
        else:
            role = next((trajectory.turns[t].role for t, (s, e) in enumerate(turn_spans)
                         if s <= i < e), "template")  # fmt: skip
            cause = "tool_tokens_in_loss" if role == "tool" else f"{role}_tokens_in_loss"
            evidence = f"a {role} token the loss scores"
            k = next((t for t, (s, e) in enumerate(turn_spans) if s <= i < e), None)
            k = k if k is not None else next((m for m, s, _ in spans if s > i), spans[-1][0])
        if faults and faults[-1].cause == cause and faults[-1].turns[-1] == k and \
                faults[-1].evidence == evidence:  # fmt: skip
            continue  # one finding per run of the same fault
        faults.append(Parting(trajectory.id, k, i, cause, "verified",
                              trainer_text=_shown(tokenizer, flat, i, i + 1), turns=[k],
                              evidence=evidence))  # fmt: skip
    return faults


def exact_model_positions(trajectory: Trajectory) -> list[int]:
    """Positions in the trainer's sequence of model tokens whose whole context is exact and
    that the mask scores: the tokens compare may judge against precision."""
    mask = trajectory.loss_mask
    return [i for _, start, end in model_spans(trajectory) for i in range(start, end) if mask[i]]

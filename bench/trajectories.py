"""What lpx adds on multi-turn trajectories (issue 60): the token-exactness check and the
per-turn metrics, as a ratio to one HF replay of the same tokens.

16 trajectories x 8 model turns x 256 tokens, tool turns between them (the offline
environment's answers, rendered through the tiny model's chat template), token-in-token-out.
The model tokens are drawn at random from the vocabulary (the cost does not depend on where
they came from). Two cases: every trajectory token-exact (the check aligns each of the 128
model turns' contexts and finds nothing), and every context from turn 3 on re-rendered without
the first turns' thinking (each parting found, decoded, classed and re-tokenized). Timed:
one fp32 HF replay; `token_check`; `compare_tables` with and without the trajectories (the
difference is what compare adds: the check, the mask, `by_turn`).

    .venv/bin/python bench/trajectories.py                         # tiny and 16x1024
    .venv/bin/python bench/trajectories.py --scales tiny --turns 4 --tokens 64
"""

from __future__ import annotations

import argparse
import copy
import time

import _bootstrap  # noqa: F401
import models
import numpy as np

from pipeline.compare.run import compare_tables
from pipeline.engines.hf.replay import HFScoringEngine
from pipeline.fixture.table import table_from_sequences
from pipeline.trajectory.agent_loop import (
    THINK_OPEN,
    describe,
    environment_turn_ids,
    load_tokenizer,
    opening_ids,
)
from pipeline.trajectory.environment import ToolEnvironment
from pipeline.trajectory.fixture import token_check, tokenizer_for

SCALES = {"tiny": models.tiny, "16x1024": lambda: models.random_llama(16, 1024, 0.05)}


def build(model_dir, trajectories: int, turns: int, tokens: int, stripped: bool, seed: int = 0):
    """A fixture of token-in-token-out trajectories; with ``stripped`` every model turn from
    the third on records a context without the first model turn's thinking."""
    tokenizer = load_tokenizer(model_dir)
    env, rng = ToolEnvironment(seed), np.random.default_rng(seed)
    vocab = len(tokenizer)
    specials = set(tokenizer.all_special_ids)
    ids_out, prompts, completions, masks, logprobs, described = [], [], [], [], [], {}
    for t in range(trajectories):
        messages = env.opening(f"Trajectory {t}: count the boats.")
        turns_made = [
            {"role": m["role"], "ids": ids}
            for m, ids in zip(messages, opening_ids(tokenizer, messages, THINK_OPEN), strict=True)
        ]
        for k in range(turns):
            ids = [int(i) for i in rng.integers(3, vocab, tokens) if int(i) not in specials]
            context = [i for turn in turns_made for i in turn["ids"]]
            if stripped and k >= 2:  # the first model turn's tokens left out of the history
                first = turns_made[2]["ids"]
                at = len(turns_made[0]["ids"]) + len(turns_made[1]["ids"])
                context = context[:at] + context[at + len(first) :]
            values = (-rng.exponential(1.0, len(ids))).tolist()
            turns_made.append({"role": "assistant", "ids": ids, "logprobs": values,
                               "context_ids": context})  # fmt: skip
            if k + 1 < turns:
                reply = env.respond(t, k, "")
                ids = environment_turn_ids(tokenizer, reply, THINK_OPEN)
                turns_made.append({"role": reply["role"], "ids": ids})
        flat = [i for turn in turns_made for i in turn["ids"]]
        prompt_len = len(turns_made[0]["ids"]) + len(turns_made[1]["ids"])
        ids_out.append(f"{t}-0")
        prompts.append(flat[:prompt_len])
        completion, mask, values = [], [], []
        for turn in turns_made[2:]:
            completion += turn["ids"]
            model = turn["role"] == "assistant"
            mask += [model] * len(turn["ids"])
            values += turn["logprobs"] if model else [np.nan] * len(turn["ids"])
        completions.append(completion)
        masks.append(mask)
        logprobs.append(values)
        described[f"{t}-0"] = describe(turns_made, flat)
    from pipeline.engines.metadata import model_metadata

    metadata = {"engine": {"name": "bench", "role": "rollout", "versions": {}},
                "dtype": "float32", "model": model_metadata(model_dir),
                "position_id_rule": "arange", "trajectories": described}  # fmt: skip
    return table_from_sequences("fixture", ids_out, prompts, completions, {"rollout": logprobs},
                                masks=masks, metadata=metadata)  # fmt: skip


def timed(call):
    started = time.perf_counter()
    out = call()
    return out, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scales", default="tiny,16x1024")
    parser.add_argument("--trajectories", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256, help="model tokens per turn")
    args = parser.parse_args()
    print("| scale | case | tokens | model tokens | replay s | token check s | compare adds s "
          "| check / replay | compare adds / replay | partings |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for scale in args.scales.split(","):
        model_dir = SCALES[scale]()
        for case, stripped in (("token-exact", False), ("thinking stripped", True)):
            table = build(model_dir, args.trajectories, args.turns, args.tokens, stripped)
            print(row(scale, case, table, model_dir))


def row(scale: str, case: str, table, model_dir) -> str:
    replay, replay_s = timed(
        lambda: HFScoringEngine().score(table, model_dir, {"dtype": "float32"})
    )
    tokenizer = tokenizer_for(table, model_dir)
    (partings, _), check_s = timed(lambda: token_check(table, tokenizer))
    plain = copy.copy(table)
    plain.metadata = {k: v for k, v in table.metadata.items() if k != "trajectories"}
    _, without_s = timed(lambda: compare_tables(plain, replay, "f", "r"))
    _, with_s = timed(lambda: compare_tables(table, replay, "f", "r"))
    adds = max(0.0, with_s - without_s)
    total = int(table.num_completion_tokens + len(table.prompt_ids))
    return (f"| {scale} | {case} | {total:,} | {int(table.completion_mask.sum()):,} | "
            f"{replay_s:.2f} | {check_s:.2f} | {adds:.2f} | {check_s / replay_s:.3f} | "
            f"{adds / replay_s:.3f} | {len(partings)} |")  # fmt: skip


if __name__ == "__main__":
    main()

"""Where `compare_tables` spends its time on 1 M tokens, view by view and metric by metric
(issue 63): a cProfile of the in-process compare, each of lpx's compare functions with its
own and cumulative seconds, and the correction view's parts timed alone.

    .venv/bin/python bench/compare_profile.py [--repeats 3] [--seed 0]

Two data shapes of 1,000,000 drifting tokens each, the numbers bench/rlkernel.py draws
(rollout = -|N(0, 2)|, train = min(rollout + N(0, 0.05), 0)): RL-Kernel #107's 20,000
sequences x 50 tokens, and 1,000 sequences x 1,000 tokens (long agent rollouts). Prints, per
shape, the median compare_tables time, the share of each function of pipeline/compare/ that
takes 1 % or more of it, and the correction view's parts (the IS views, the eleven rejection
modes over one pass of their statistics, the off-policy diagnostics, probs_diff).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import _bootstrap  # noqa: F401
import numpy as np

SHAPES = ((20_000, 50), (1_000, 1_000))
PROMPT_LEN = 4


def make_tables(n_seq: int, length: int, seed: int):
    from pipeline.fixture.table import table_from_sequences

    rng = np.random.default_rng(seed)
    rollout = -np.abs(rng.normal(0.0, 2.0, (n_seq, length)))
    train = np.minimum(rollout + rng.normal(0.0, 0.05, (n_seq, length)), 0.0)
    ids = [f"seq-{i:05d}" for i in range(n_seq)]
    prompts = list(rng.integers(3, 501, (n_seq, PROMPT_LEN), dtype=np.int32))
    completions = list(rng.integers(3, 501, (n_seq, length), dtype=np.int32))

    def table(kind, channel, values):
        return table_from_sequences(
            kind, ids, prompts, completions, {channel: list(values.astype(np.float32))},
            metadata={"dtype": "float32"},
        )  # fmt: skip

    return table("fixture", "rollout", rollout), table("replay", "replay", train)


def timed(function, repeats: int) -> float:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def correction_parts(train, rollout, offsets, repeats: int) -> dict[str, float]:
    from pipeline.compare import correction as c

    d, lengths = c._log_ratios(train, rollout, offsets)
    settings = c.CorrectionSettings()
    thresholds = {**c.RS_DEFAULT_THRESHOLDS, **c.rs_thresholds(settings)}

    def rejection():
        statistics_ = c.RejectionStatistics.of(d, lengths)
        for mode in c.RS_MODES:
            statistics_.view(mode, thresholds[mode])
        statistics_.summary(c.rs_thresholds(settings))

    return {
        "correction_view (all of it)": timed(
            lambda: c.correction_view(train, rollout, offsets, settings), repeats
        ),
        "  four IS views (configured, token TIS, sequence IS, IcePop)": timed(
            lambda: [
                c.is_view(d, lengths, *args)
                for args in (
                    ("token", "2.0"),
                    ("token", "2.0"),
                    ("sequence", "2.0"),
                    ("token", c.ICEPOP_BAND),
                )
            ],
            repeats,
        ),  # fmt: skip
        "  eleven rejection modes, one pass": timed(rejection, repeats),
        "  off-policy diagnostics": timed(
            lambda: c.off_policy(d, train, rollout, lengths), repeats
        ),
        "  probs_diff": timed(lambda: c.probs_diff(train, rollout), repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from pipeline.compare.align import align
    from pipeline.compare.run import compare_tables

    for n_seq, length in SHAPES:
        fixture, replay = make_tables(n_seq, length, args.seed)
        print(f"\n{n_seq:,} sequences x {length:,} tokens")

        def run(fixture=fixture, replay=replay):
            return compare_tables(fixture, replay, "fixture.parquet", "replay.parquet")

        run()  # warm: first-call imports
        total = timed(run, args.repeats)
        print(f"  compare_tables: {total:.3f} s (median of {args.repeats})")
        profile = cProfile.Profile()
        profile.enable()
        run()
        profile.disable()
        stats = pstats.Stats(profile)
        profiled = max(row[3] for row in stats.stats.values())  # the outermost call's cumtime
        rows = []
        for (path, _line, name), (_, _, own, cumulative, _) in stats.stats.items():
            if "pipeline/compare/" in path and cumulative >= 0.01 * profiled:
                module = path.split("pipeline/", 1)[1].removesuffix(".py").replace("/", ".")
                rows.append((cumulative, own, f"{module}.{name}"))
        print(f"  {'cumulative':>10} {'own':>7}  share  function (profiled run {profiled:.3f} s)")
        for cumulative, own, name in sorted(rows, reverse=True):
            share = cumulative / profiled
            print(f"  {cumulative:10.3f} {own:7.3f}  {share:5.0%}  {name}")
        aligned = align(fixture, replay, "rollout", "fixture.parquet", "replay.parquet")
        completion = aligned.completion
        parts = correction_parts(
            completion.train, completion.rollout, completion.offsets, args.repeats
        )
        print("  the correction view's parts, timed alone:")
        for name, seconds in parts.items():
            print(f"    {seconds:7.3f} s  {seconds / total:5.1%} of compare_tables  {name}")


if __name__ == "__main__":
    main()

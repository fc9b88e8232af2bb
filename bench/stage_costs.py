"""What each stage lpx adds costs, in two checkouts, on the same fixtures, in one sitting (issue 42).

Per scale (the tiny model; random llamas 16 x 1024 and 32 x 512) one HF fp32 rollout of 16
sequences x 48 tokens (prompts of 12-35 tokens, so a batch pads), its HF bf16 replay, and three faults committed in that replay by the
model in bf16 (`lpx inject --dtype bf16`): an extra BOS on every sequence, padding attended and
position ids shifted from token 8, each on three sequences. Made once with this checkout and
cached under ~/.cache/lpx/bench-stages. Then, for each checkout in turn (stage by stage, so
both meet the machine in the same state), the whole `lpx` commands are timed:

- `lpx calibrate FIXTURE --dtype bf16 --sequences 16`;
- `lpx compare FIXTURE REPLAY --calibration ...` on the clean replay and on each fault, in
  the documented flow (findings verified by re-scoring with the fixture's model), with the
  verdict and the causes and statuses it ends with;
- the same compare with `--no-verify`: what a bisect probe runs now. A probe of the older
  checkout ran the verified compare, so its cost there is the row above.

Once, for both: `lpx compare` of 1 M drifting tokens (bench/run.py's synthetic pair, sequences
of 512 tokens on average) and `lpx record` / `lpx report` of a year of nightly history
(bench/history.py's year: 365 nights x 50 series).

    .venv/bin/python bench/stage_costs.py --before /tmp/before42          # ~1 hour on 2 cores
    .venv/bin/python bench/stage_costs.py --before /tmp/before42 --scales tiny
    .venv/bin/python bench/stage_costs.py --scales 16x1024 --sequences 32 --tokens 96 --no-once

Without `--before` only this checkout is timed. `--sequences` and `--tokens` size the fixture
(16 x 48 by default; issue 42's own figures were taken on 32 x 96).

`--before DIR` is another checkout of lpx (`git worktree add /tmp/before42 37d6642`, the main
that issue 42 was filed against); it runs with this checkout's virtual environment, its own
`pipeline/` first on the path.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import _bootstrap
import models
import numpy as np
from _commands import lpx_environment, run_lpx

AFTER = _bootstrap.ROOT  # this checkout: the "after" of a before and after

CACHE = Path.home() / ".cache" / "lpx" / "bench-stages"
SCALES = {
    "tiny": models.tiny,
    "16x1024": lambda: models.random_llama(16, 1024, 0.05),
    "32x512": lambda: models.random_llama(32, 512, 0.05),
}
DEFAULT_SIZE = (16, 48)  # the fixture's sequences and completion tokens
SIZE = dict(zip(("sequences", "tokens"), DEFAULT_SIZE, strict=True))  # set by the command line
PROMPT_TOKENS = 24
FAULTS = {  # kind: (sequences faulted, first position)
    "bos_extra": ("all", 0),
    "pad_attended": (3, 0),
    "position_ids": (3, 8),
}


def lpx(checkout: Path, *args, cwd: Path) -> tuple[float, int, str]:
    """One whole `lpx` command of ``checkout``: seconds, exit code, the output's tail."""
    seconds, done = run_lpx(*args, checkout=checkout, cwd=cwd)
    if done.returncode not in (0, 1):
        print(done.stdout[-2000:], done.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{checkout}: lpx {' '.join(map(str, args[:2]))} exited {done.returncode}")
    return seconds, done.returncode, (done.stdout + done.stderr)[-400:]


# Packages the wheel maps from top-level folders (pyproject's package-dir); the venv's
# editable finder maps them to *this* checkout's folders whatever PYTHONPATH says.
MAPPED = {"db": "db", "templates": "templates"}


def own_mapped_packages(checkout: Path) -> None:
    """Give another checkout's pipeline/ its own db/ and templates/ (links inside it), so its
    migrations and pages are its own, not this checkout's."""
    for package, folder in MAPPED.items():
        link = checkout / "pipeline" / package
        if not link.exists():
            link.symlink_to(Path("..") / folder)


def imported_from(checkout: Path) -> list[Path]:
    """Where `lpx()` imports pipeline/ and its mapped packages from."""
    env = lpx_environment(checkout)
    names = ["pipeline", *(f"pipeline.{p}" for p in MAPPED)]
    command = [
        sys.executable, "-c",
        f"import importlib; [print(importlib.import_module(n).__file__) for n in {names!r}]",
    ]  # fmt: skip
    done = subprocess.run(command, cwd="/", env=env, capture_output=True, text=True, check=True)
    return [Path(line).parent.resolve() for line in done.stdout.split()]


def fixtures(scale: str) -> dict:
    """The scale's model, fixture, clean replay and faulted replays (made once, cached)."""
    from pipeline.engines.base import SamplingParams
    from pipeline.engines.hf.rollout import HFRolloutEngine
    from pipeline.fixture.io import read_table, write_table

    model_dir = SCALES[scale]()
    sequences, tokens = SIZE["sequences"], SIZE["tokens"]
    root = CACHE / (
        scale if (sequences, tokens) == DEFAULT_SIZE else f"{scale}-{sequences}x{tokens}"
    )
    root.mkdir(parents=True, exist_ok=True)
    fixture = root / "fixture.parquet"
    if not fixture.is_file():
        rng = np.random.default_rng(0)
        lengths = rng.integers(PROMPT_TOKENS // 2, PROMPT_TOKENS * 3 // 2, sequences)
        prompts = [list(map(int, rng.integers(3, 250, n))) for n in lengths]
        params = SamplingParams(max_tokens=tokens, samples_per_prompt=1, seed=0, ignore_eos=True)
        table = HFRolloutEngine().rollout(model_dir, prompts, params, {"device": "cpu"})
        write_table(table, fixture)
    replay = root / "replay-bf16.parquet"
    if not replay.is_file():
        lpx(AFTER, "replay", fixture, "--dtype", "bf16", "--device", "cpu", "--out", replay,
            cwd=root)  # fmt: skip
    ids = read_table(fixture).sequence_ids
    faulted = {}
    for kind, (count, onset) in FAULTS.items():
        path = root / f"replay-{kind}.parquet"
        if not path.is_file():
            chosen = ["all"] if count == "all" else [ids[i] for i in (1, 7, 12)[:count]]
            sequences = [a for s in chosen for a in ("--sequence", s)]
            lpx(AFTER, "inject", replay, "--kind", kind, *sequences, "--from-position", onset,
                "--dtype", "bf16", "--device", "cpu", "--out", path, cwd=root)  # fmt: skip
        faulted[kind] = path
    return {"model": model_dir, "fixture": fixture, "replay": replay, "faults": faulted}


def answer(report_dir: Path) -> str:
    """The verdict, and each finding's cause and status, as the report ends."""
    report = json.loads((report_dir / "report.json").read_text())
    causes = sorted(f"{f['cause']}:{f.get('status')}" for f in report.get("diagnosis") or [])
    return f"{report.get('verdict')} {','.join(causes) or '-'}"


def stage_rows(scale: str, checkouts: dict[str, Path], work: Path) -> list[dict]:
    made = fixtures(scale)
    rows = []
    for name in checkouts:
        (work / scale / name).mkdir(parents=True, exist_ok=True)
    calibration = {}
    for name, checkout in checkouts.items():
        out = work / scale / name / "calibration.json"
        seconds, _, _ = lpx(checkout, "calibrate", made["fixture"], "--dtype", "bf16",
                            "--sequences", SIZE["sequences"], "--device", "cpu", "--out", out,
                            cwd=work)  # fmt: skip
        calibration[name] = out
        rows.append({"scale": scale, "stage": "calibrate bf16", "checkout": name, "s": seconds})
        print(f"{scale:8s} {name:7s} calibrate bf16          {seconds:7.1f} s", flush=True)
    replays = {"clean": made["replay"], **made["faults"]}
    for case, replay in replays.items():
        for verify in (True, False):
            stage = f"compare {case}" + ("" if verify else " --no-verify")
            for name, checkout in checkouts.items():
                out = work / scale / name / f"{case}-{'verified' if verify else 'probe'}"
                extra = [] if verify else ["--no-verify"]
                seconds, code, _ = lpx(checkout, "compare", made["fixture"], replay,
                                       "--calibration", calibration[name], "--device", "cpu",
                                       "--out", out, *extra, cwd=work)  # fmt: skip
                said = answer(out)
                rows.append({"scale": scale, "stage": stage, "checkout": name, "s": seconds,
                             "exit": code, "answer": said})  # fmt: skip
                print(f"{scale:8s} {name:7s} {stage:32s} {seconds:7.1f} s  {said}", flush=True)
    return rows


def once_rows(checkouts: dict[str, Path], work: Path) -> list[dict]:
    """`lpx compare` of 1 M drifting tokens and a year's record and report, per checkout."""
    import history as history_bench
    from run import synthetic_pair

    from pipeline.fixture.io import write_table

    pair = CACHE / "compare-1m"
    if not (pair / "replay.parquet").is_file():
        pair.mkdir(parents=True, exist_ok=True)
        fixture, replay = synthetic_pair(1_000_000, 512, drifting=True)
        write_table(fixture, pair / "fixture.parquet")
        write_table(replay, pair / "replay.parquet")
    year = CACHE / "year"
    if not year.is_dir():
        history_bench.make_year(year, 365, 50)
    runs = sorted(p for p in year.iterdir() if p.is_dir())
    rows = []
    for name, checkout in checkouts.items():
        seconds, _, _ = lpx(checkout, "compare", pair / "fixture.parquet", pair / "replay.parquet",
                            "--out", work / f"compare-1m-{name}", cwd=work)  # fmt: skip
        rows.append({"scale": "-", "stage": "compare 1 M drifting tokens", "checkout": name,
                     "s": seconds})  # fmt: skip
        print(f"{'-':8s} {name:7s} compare 1 M tokens      {seconds:7.1f} s", flush=True)
    for name, checkout in checkouts.items():
        db = work / f"year-{name}.db"
        seconds, _, _ = lpx(checkout, "record", *runs, "--db", db, cwd=work)
        rows.append({"scale": "-", "stage": "record a year", "checkout": name, "s": seconds})
        print(f"{'-':8s} {name:7s} record a year           {seconds:7.1f} s", flush=True)
        seconds, _, _ = lpx(checkout, "report", "--db", db, "--out", work / f"site-{name}",
                            cwd=work)  # fmt: skip
        rows.append({"scale": "-", "stage": "report a year", "checkout": name, "s": seconds})
        print(f"{'-':8s} {name:7s} report a year           {seconds:7.1f} s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="the older checkout (none: this one alone)")
    parser.add_argument("--sequences", type=int, default=DEFAULT_SIZE[0], help="fixture rows")
    parser.add_argument("--tokens", type=int, default=DEFAULT_SIZE[1], help="completion tokens")
    parser.add_argument("--scales", default="tiny,16x1024,32x512")
    parser.add_argument("--no-once", action="store_true", help="skip compare 1 M and the year")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    options = parser.parse_args()
    SIZE.update(sequences=options.sequences, tokens=options.tokens)
    checkouts = {"before": options.before.resolve()} if options.before else {}
    checkouts["after"] = AFTER
    if options.before:
        own_mapped_packages(checkouts["before"])
    for checkout in checkouts.values():
        wanted = [checkout / "pipeline", *(checkout / f for f in MAPPED.values())]
        found = imported_from(checkout)
        if found != [p.resolve() for p in wanted]:
            raise SystemExit(f"{checkout}: `lpx` would import {found}, not {wanted}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="lpx-stages-") as tmp:
        work = Path(tmp)
        if not options.no_once:
            rows += once_rows(checkouts, work)
        for scale in options.scales.split(","):
            rows += stage_rows(scale, checkouts, work)
            if options.json:
                options.json.write_text(json.dumps(rows, indent=1))
    if options.json:
        options.json.write_text(json.dumps(rows, indent=1))
    print_table(rows, compared="before" in checkouts)


def print_table(rows: list[dict], compared: bool) -> None:
    keyed = {(r["scale"], r["stage"], r["checkout"]): r for r in rows}
    if compared:
        print("\n| scale | stage | before | after | ratio | answers (before / after) |")
        print("|---|---|---|---|---|---|")
    else:
        print("\n| scale | stage | seconds | answer |")
        print("|---|---|---|---|")
    for scale, stage in dict.fromkeys((r["scale"], r["stage"]) for r in rows):
        after = keyed[scale, stage, "after"]
        if not compared:
            print(f"| {scale} | {stage} | {after['s']:.1f} s | {after.get('answer', '')} |")
            continue
        before = keyed[scale, stage, "before"]
        same = before.get("answer") == after.get("answer")
        answers = (
            "" if "answer" not in before
            else after["answer"] if same else f"{before['answer']} / {after['answer']}"
        )  # fmt: skip
        print(f"| {scale} | {stage} | {before['s']:.1f} s | {after['s']:.1f} s | "
              f"{before['s'] / after['s']:.1f}x | {answers} |")  # fmt: skip


if __name__ == "__main__":
    main()

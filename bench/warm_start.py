"""What starting local stages and CPU ranks warm saves (pipeline/warm_start.py,
pipeline/engines/warm_ranks.py): each case run whole, as a user runs it, once with
LPX_WARM_START=1 and once with 0, printing wall and CPU seconds (every process the command
started, waited for) and their ratio, warm over cold.

- `lpx run` of a plan: an HF fp32 rollout (16 sequences x 24 tokens of the bundled prompts),
  HF fp32 and bf16 replays, an FSDP2 replay on 2 ranks, the compare; record and report.
- `lpx replay --engine E --nproc 2` of that rollout, for fsdp, deepspeed and megatron (TP=2):
  ranks forked warm against torchrun's.

On the tiny model and a random llama 16 x 1024 (`--scales tiny` for one).

    .venv/bin/python bench/warm_start.py             # ~5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
from pathlib import Path

import _bootstrap  # noqa: F401
import models
import yaml
from _commands import run_lpx

SCALES = {"tiny": models.tiny, "16x1024": lambda: models.random_llama(16, 1024, 0.05)}
REPLAYS = {"fsdp": [], "deepspeed": [], "megatron": ["--set", "tensor_parallel_size=2"]}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(*args, warm: bool, cwd: Path) -> tuple[float, float]:
    """(wall s, CPU s) of the whole command with warm starts on or off; it must exit 0."""
    before = _children_cpu()
    seconds, done = run_lpx(*args, cwd=cwd, env={"LPX_WARM_START": "1" if warm else "0"})
    if done.returncode != 0:
        raise SystemExit(f"lpx {' '.join(map(str, args))}: exit {done.returncode}\n{done.stderr}")
    return seconds, _children_cpu() - before


def plan(model: Path, folder: Path) -> Path:
    path = folder / "plan.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "version": 1,
                "name": "warm-start-bench",
                "model": str(model),
                "prompts": "bundled",
                "sampling": {
                    "max_tokens": 24,
                    "temperature": 1.0,
                    "seed": 0,
                    "samples_per_prompt": 2,
                },  # fmt: skip
                "rollout": {"engine": "hf", "dtype": "fp32"},
                "replays": [
                    {"name": "hf-fp32", "engine": "hf", "dtype": "fp32"},
                    {"name": "hf-bf16", "engine": "hf", "dtype": "bf16"},
                    {"name": "fsdp", "engine": "fsdp", "dtype": "fp32", "nproc": 2},
                ],
                "history": {"db": str(folder / "lpx.db"), "report": str(folder / "site")},
            }
        )
    )
    return path


def row(name: str, cold: tuple[float, float], warm: tuple[float, float]) -> None:
    print(
        f"  {name:<28} cold {cold[0]:6.1f} s wall {cold[1]:6.1f} s CPU | warm {warm[0]:6.1f} s "
        f"wall {warm[1]:6.1f} s CPU | warm/cold wall {warm[0] / cold[0]:.2f}, "
        f"CPU {warm[1] / cold[1]:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scales", nargs="+", choices=list(SCALES), default=list(SCALES))
    args = parser.parse_args()
    for scale in args.scales:
        model = SCALES[scale]()
        folder = Path(tempfile.mkdtemp(prefix=f"lpx-bench-warm-{scale}-"))
        try:
            print(f"{scale} ({model}):")
            runs = {}
            for warm in (False, True):  # cold first: the page cache then favours neither
                out = folder / f"run-{'warm' if warm else 'cold'}"
                runs[warm] = timed("run", plan(model, folder), "--out", out, warm=warm, cwd=folder)
            row("lpx run (5 stages)", runs[False], runs[True])
            fixture = folder / "run-cold" / "fixture.parquet"
            for engine, knobs in REPLAYS.items():
                cases = {}
                for warm in (False, True):
                    out = folder / f"{engine}-{warm}.parquet"
                    cases[warm] = timed(
                        "replay", fixture, "--engine", engine, "--nproc", 2, *knobs,
                        "--model", model, "--out", out, warm=warm, cwd=folder,
                    )  # fmt: skip
                row(f"lpx replay {engine} 2 ranks", cases[False], cases[True])
        finally:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()

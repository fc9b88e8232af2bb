"""Weight store benchmark (issue 12): publish time and stored bytes of full, delta and
delta+compress versions of a random llama, and pull time through each store's chain.

Version 1 is the model; each later version takes a small SGD-like step (t + 1e-4 * randn)
on a share of the previous version's tensors (by count, at least one): 1 %, then 10 %, then
all of them (a full fine-tuning step, what most RL trainers publish).

    .venv/bin/python bench/weights.py                       # ~1 minute
    .venv/bin/python bench/weights.py --hidden 1024 --layers 16
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import _bootstrap  # noqa: F401
import models
import numpy as np
from _commands import run_lpx

from pipeline.weights.store import publish, pull

STEPS = (("1 %", 0.01), ("10 %", 0.10), ("all", 1.0))
MODES = {"full": {}, "delta": {"delta": True}, "delta+compress": {"compress": True}}
SCALING_TOLERANCE = 0.1  # a delta within 10 % of the changed tensors' bytes scales with them


def stepped(previous: Path, out: Path, share: float, seed: int) -> tuple[Path, int, int]:
    """A copy of ``previous`` with ``share`` of its tensors (at least one, chosen at random)
    moved by 1e-4 * randn. Returns the directory, tensors changed and their bytes."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(previous, out, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(previous / "model.safetensors")
    names = sorted(tensors)
    count = max(1, round(share * len(names)))
    rng = np.random.default_rng(seed)
    chosen = [names[i] for i in rng.choice(len(names), size=count, replace=False)]
    generator = torch.Generator().manual_seed(seed)
    for name in chosen:
        step = torch.randn(tensors[name].shape, generator=generator)
        tensors[name] = tensors[name] + 1e-4 * step
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out, count, sum(tensors[name].nbytes for name in chosen)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="lpx-bench-weights-") as temp:
        root = Path(temp)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        first = models.multi_head_llama(root / "v1", args.layers, args.hidden, args.vocab, None)
        versions = [first]
        changes = [
            (len(_tensor_names(versions[0])), (versions[0] / "model.safetensors").stat().st_size)
        ]
        for number, (_, share) in enumerate(STEPS, start=2):
            model, count, nbytes = stepped(versions[-1], root / f"v{number}", share, number)
            versions.append(model)
            changes.append((count, nbytes))
        total_tensors, model_bytes = changes[0]
        print(
            f"model: llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
            f"{total_tensors} tensors, {model_bytes / 2**20:.1f} MiB fp32"
        )

        results = {}  # (mode, version) -> (publish s, stored bytes, pull s)
        for mode, options in MODES.items():
            store = root / f"store-{mode}"
            for number, model in enumerate(versions, start=1):
                started = time.perf_counter()
                manifest = publish(model, store, **(options if number > 1 else {}))
                published_in = time.perf_counter() - started
                started = time.perf_counter()
                pull(store, str(number), into=root / f"pulled-{mode}-{number}")
                pulled_in = time.perf_counter() - started
                shutil.rmtree(root / f"pulled-{mode}-{number}")
                results[mode, number] = (published_in, manifest["stored_bytes"], pulled_in)

        print()
        print(
            f"{'version':<18} {'mode':<15} {'publish s':>9} {'stored MiB':>11} "
            f"{'/ full':>7} {'/ changed':>9} {'pull s':>7}"
        )
        for number in range(1, len(versions) + 1):
            label = "1 (the model)" if number == 1 else f"{number} ({STEPS[number - 2][0]} step)"
            count, changed = changes[number - 1]
            for mode in MODES:
                published_in, stored, pulled_in = results[mode, number]
                full = results["full", number][1]
                print(
                    f"{label:<18} {mode:<15} {published_in:>9.2f} {stored / 2**20:>11.2f} "
                    f"{stored / full:>7.3f} {stored / changed:>9.3f} {pulled_in:>7.2f}"
                )
            print(f"{'':<18} {count} tensors changed, {changed / 2**20:.2f} MiB")

        print()
        scaling = []
        for number in (2, 3):
            stored = results["delta", number][1]
            changed = changes[number - 1][1]
            scaling.append(abs(stored / changed - 1) <= SCALING_TOLERANCE)
            print(
                f"{STEPS[number - 2][0]} step: delta / full bytes "
                f"{stored / results['full', number][1]:.4f}, delta+compress / full "
                f"{results['delta+compress', number][1] / results['full', number][1]:.4f}, "
                f"delta / changed tensors' bytes {stored / changed:.3f}"
            )
        everything = results["delta+compress", 4][1] / results["full", 4][1]
        print(f"all-tensor step: delta+compress / full bytes {everything:.3f}")
        print(
            "delta bytes scale with what changed: "
            + ("yes" if all(scaling) else "NO")
            + f" (within {SCALING_TOLERANCE:.0%} of the changed tensors' bytes at 1 % and 10 %)"
        )
        print()
        commands(root, versions[:2])
    return 0


def commands(root: Path, versions: list[Path]) -> None:
    """The whole user-facing commands (Python start included): lpx weights publish (full,
    then a 1 % delta), pull, ls, and a pull of a tampered version, which must exit 2."""
    store = root / "store-cli"

    def timed(*args) -> tuple[float, int]:
        seconds, done = run_lpx("weights", *args)
        return seconds, done.returncode

    steps = [
        ("publish (full)", ("publish", versions[0], "--to", store)),
        ("publish --delta (1 % step)", ("publish", versions[1], "--to", store, "--delta")),
        ("pull latest (through the chain)", ("pull", store, "--into", root / "cli-pull")),
        ("ls", ("ls", store)),
    ]
    for label, args in steps:
        seconds, code = timed(*args)
        print(f"lpx weights {label}: {seconds:.2f} s, exit {code}")
    tensors = store / "versions" / "1" / "tensors.safetensors"
    with open(tensors, "r+b") as damaged:  # one byte of a tensor flipped, past the header
        damaged.seek(tensors.stat().st_size // 2)
        byte = damaged.read(1)
        damaged.seek(-1, 1)
        damaged.write(bytes([byte[0] ^ 0xFF]))
    seconds, code = timed("pull", store, "--version", "2", "--into", root / "cli-bad")
    print(f"lpx weights pull of a tampered version: {seconds:.2f} s, exit {code} (want 2)")


def _tensor_names(model_dir: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", framework="pt") as weights:
        return list(weights.keys())


if __name__ == "__main__":
    sys.exit(main())

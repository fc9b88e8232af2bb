"""Faults seeded into a real engine release, as patches a pip build applies (tests, bench).

Real releases of one engine rarely differ in logprobs on the tiny model, so a bisect's
"first bad build" would be unknown. A patch against the release's own source, made from the
wheel, makes it known. The fault is a real class of engine bug: the RMSNorm of the Gemma
convention, ``(1 + weight) * x``, applied to a Llama checkpoint whose norm is ``weight * x``:
in transformers' Llama model, or in SGLang's RMSNorm (its torch path, which a CPU runs and
every model family SGLang serves uses).

The flaky variant fires on some runs and not others, decided once per process from a
repeating pattern and a counter file (LPX_SEEDED_FLAKE_COUNTER), so a test knows exactly
which of the build's runs fail: a build that fails 30 % of its runs, the way a racy kernel
does, without a random test.
"""

from __future__ import annotations

import difflib
import zipfile
from pathlib import Path

from pipeline.errors import BadInput

LLAMA = "transformers/models/llama/modeling_llama.py"
NORM_LINE = "        return self.weight * hidden_states.to(input_dtype)\n"
GEMMA_NORM = "        return (1.0 + self.weight) * hidden_states.to(input_dtype)\n"
FLAKY_NORM = (
    "        if _LPX_SEEDED_FIRES:\n"
    "            return (1.0 + self.weight) * hidden_states.to(input_dtype)\n"
    "        return self.weight * hidden_states.to(input_dtype)\n"
)
# 3 of every 10 runs fail; the first two fail, so the build looks bad until it is re-run
FLAKY_PATTERN = "1100001000"
FLAKY_HEADER = '''
def _lpx_seeded_fires() -> bool:
    """lpx's seeded flaky fault: this process's turn in the pattern (one count a process)."""
    import os

    counter = os.environ.get("LPX_SEEDED_FLAKE_COUNTER")
    if not counter:
        return False
    try:
        with open(counter) as handle:
            count = int(handle.read() or 0)
    except FileNotFoundError:
        count = 0
    with open(counter, "w") as handle:
        handle.write(str(count + 1))
    return "{pattern}"[count % {length}] == "1"


_LPX_SEEDED_FIRES = _lpx_seeded_fires()
'''


SGLANG_NORM = "sglang/srt/layers/layernorm.py"
SGLANG_NORM_LINE = "            x = (x * self.weight).to(orig_dtype)\n"
SGLANG_GEMMA_NORM = "            x = (x * (1.0 + self.weight)).to(orig_dtype)\n"


def norm_patch(wheel: Path, out: Path, flaky: bool = False) -> Path:
    """A unified diff (``patch -p1`` in site-packages) that seeds the Gemma-norm fault into
    the release in ``wheel``: transformers' Llama model, or SGLang's RMSNorm."""
    if Path(wheel).name.startswith("sglang-"):
        if flaky:
            raise BadInput("the flaky fault is seeded into transformers wheels only.")
        return _patch(wheel, out, SGLANG_NORM, SGLANG_NORM_LINE, SGLANG_GEMMA_NORM)
    with zipfile.ZipFile(wheel) as archive:
        try:
            original = archive.read(LLAMA).decode("utf-8")
        except KeyError:
            raise BadInput(
                f"{wheel}: no {LLAMA} in it; seed the fault into a transformers wheel."
            ) from None
    if original.count(NORM_LINE) != 1:
        raise BadInput(
            f"{wheel}: its LlamaRMSNorm does not end as lpx expects; cannot seed the fault."
        )
    if flaky:
        header = FLAKY_HEADER.format(pattern=FLAKY_PATTERN, length=len(FLAKY_PATTERN))
        changed = original.replace(NORM_LINE, FLAKY_NORM)
        at = changed.rfind("\n\n", 0, changed.index("class LlamaRMSNorm"))  # above its decorators
        changed = changed[:at] + "\n" + header + changed[at:]
    else:
        changed = original.replace(NORM_LINE, GEMMA_NORM)
    return _write_diff(original, changed, LLAMA, out)


def _patch(wheel: Path, out: Path, member: str, line: str, replacement: str) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        try:
            original = archive.read(member).decode("utf-8")
        except KeyError:
            raise BadInput(f"{wheel}: no {member} in it; cannot seed the fault.") from None
    if original.count(line) != 1:
        raise BadInput(f"{wheel}: {member} does not read as lpx expects; cannot seed the fault.")
    return _write_diff(original, original.replace(line, replacement), member, out)


def _write_diff(original: str, changed: str, member: str, out: Path) -> Path:
    diff = difflib.unified_diff(
        original.splitlines(keepends=True),
        changed.splitlines(keepends=True),
        f"a/{member}",
        f"b/{member}",
    )
    out.write_text("".join(diff), encoding="utf-8")
    return out


def flaky_failures(runs: int) -> int:
    """How many of a flaky build's first ``runs`` runs fail."""
    return sum(FLAKY_PATTERN[i % len(FLAKY_PATTERN)] == "1" for i in range(runs))

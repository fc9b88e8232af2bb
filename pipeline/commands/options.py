"""Options shared by several commands."""

from __future__ import annotations

import math
import os
from pathlib import Path

import click

from pipeline import plugins
from pipeline.errors import BadInput
from pipeline.names import DTYPE_SPELLINGS
from pipeline.paths import written_by_lpx


def knob_options(function):
    """`--set key=value` (repeatable): engine-specific knobs, passed through to the adapter."""
    return click.option(
        "--set",
        "knob_pairs",
        multiple=True,
        metavar="KNOB=VALUE",
        help="A knob of the --engine, repeatable (e.g. --set dtype=bf16); `lpx engines` "
        "lists each engine's knobs and defaults.",
    )(function)


class EngineChoice(click.Choice):
    """The engines of a plug-in group: the built-ins and every registered plug-in. Read from
    the plug-in table when shown or checked, never at import, and naming them imports no
    engine."""

    def __init__(self, group: str):
        # click.Choice.__init__ would store a fixed tuple; these choices are read each time
        self.group = group
        self.case_sensitive = True

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(plugins.names(self.group))


def model_and_prompts_options(function):
    """--model and --prompts, as every command that rolls out takes them."""
    function = click.option(
        "--prompts",
        "prompts_path",
        required=True,
        type=click.Path(dir_okay=False, path_type=Path),
        help="Text lines, or JSONL with `prompt_ids` or `text` per line.",
    )(function)
    return click.option(
        "--model",
        "model_dir",
        required=True,
        type=click.Path(file_okay=False, path_type=Path),
        help="A local Hugging Face model directory (`lpx make-model DIR` builds a tiny one).",
    )(function)


def engine_option(group: str, default: str, help_text: str):
    """`--engine NAME`, one of ``group``'s engines."""
    return click.option(
        "--engine",
        type=EngineChoice(group),
        default=default,
        show_default=True,
        help=f"{help_text} `lpx engines` lists each with its knobs.",
    )


def dtype_option(help_text: str = "Precision the model computes in.", default: str = "fp32"):
    """`--dtype`, a dtype or its short name (fp32, bf16, fp16, half), spelled as
    pipeline.names.canonical_dtype takes it."""
    return click.option(
        "--dtype",
        type=click.Choice(DTYPE_SPELLINGS),
        default=default,
        show_default=True,
        help=help_text,
    )


def device_option(function):
    """`--device auto|cpu|cuda|cuda:N` (env LPX_<COMMAND>_DEVICE): where the model runs."""

    def check(_ctx, _param, value):
        from pipeline.devices import parse_device

        return parse_device(value)

    return click.option(
        "--device",
        default="auto",
        show_default=True,
        metavar="auto|cpu|cuda|cuda:N",
        callback=check,
        help="Where the model runs: auto = CUDA when a GPU is visible, else the CPU. "
        "Distributed engines run one rank per GPU (CUDA_VISIBLE_DEVICES picks which).",
    )(function)


def device_knobs(engine, name: str, device: str) -> dict:
    """{"device": ...} for an engine that lpx places (hf and the distributed engines); an
    engine that picks its own device (vLLM by its build, a server by where it runs) takes
    only auto."""
    if getattr(engine, "takes_device", False):
        return {"device": device}
    if device != "auto":
        raise BadInput(
            f"--device {device}: engine {name!r} runs where its own build or server runs; "
            "--device places hf, fsdp, deepspeed and megatron. Leave it at auto."
        )
    return {}


def parse_knobs(
    pairs: tuple[str, ...], option: str = "--set", example: str = "padding_side=left"
) -> dict[str, str]:
    """KEY=VALUE pairs of a repeatable ``option`` as a dict. A key given twice is refused,
    naming both values: the later one would silently win, and which one the user meant is
    theirs to say."""
    knobs: dict[str, str] = {}
    given: dict[str, str] = {}  # each key's pair as typed, to name both in a refusal
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise BadInput(f"{option} {pair!r}: expected KEY=VALUE, e.g. {option} {example}.")
        if key in knobs:
            raise BadInput(
                f"{option} {given[key]!r} and {option} {pair!r}: {key!r} is given twice; give "
                "it once."
            )
        knobs[key], given[key] = value, pair
    return knobs


def runner_option(help_text: str):
    """`--runner local|docker`: where each stage runs (orchestrator/runners.py)."""
    return click.option(
        "--runner",
        type=click.Choice(["local", "docker"]),
        default="local",
        show_default=True,
        help=help_text,
    )


def db_option(command: str):
    """`--db URL|PATH`, also from LPX_<COMMAND>_DB or LPX_DB (the history every command shares)."""
    variable = f"LPX_{command.upper().replace('-', '_')}_DB"
    return click.option(
        "--db",
        envvar=[variable, "LPX_DB"],
        metavar="URL|PATH",
        help="History database: a SQLite path or a SQLAlchemy URL such as "
        "postgresql+psycopg://user@host/lpx [env LPX_DB; default runs/lpx.db].",
    )


class FiniteFloat(click.FloatRange):
    """A float in a range that is also finite: click's FloatRange lets NaN through (every
    comparison with NaN is false) and inf through an open upper end."""

    name = "finite float"

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


class RankCount(click.ParamType):
    """--nproc: a count of ranks, or `auto` (one per visible GPU, else 1)."""

    name = "N|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        return click.IntRange(min=1).convert(value, param, ctx)


COUNT = click.IntRange(min=1)  # tokens, samples, ranks, batch sizes: at least one
RANKS = RankCount()
NON_NEGATIVE = click.IntRange(min=0)
TEMPERATURE = FiniteFloat(min=0.0)  # 0 = greedy
TOP_P = FiniteFloat(min=0.0, max=1.0, min_open=True)
REPLAY_TEMPERATURE = FiniteFloat(min=0.0, min_open=True)  # logits are divided by it


class OutputPath(click.Path):
    """Where a command writes: never empty (an empty --out would mean the current directory),
    and, when it exists, of the right kind. click.Path's own check only looks for regular
    files, so a FIFO or a device such as /dev/null would pass it and a rename over it would
    replace the node itself."""

    def __init__(self, directory: bool):
        super().__init__(file_okay=not directory, dir_okay=directory, path_type=Path)
        self.directory = directory

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            self.fail("an empty path; name the output.", param, ctx)
        path = super().convert(value, param, ctx)
        if os.path.lexists(path):
            right_kind = os.path.isdir(path) if self.directory else os.path.isfile(path)
            if not right_kind:
                wanted = "a directory" if self.directory else "a regular file"
                self.fail(f"{str(path)!r} exists and is not {wanted}.", param, ctx)
            if not self.directory and not written_by_lpx(path):
                self.fail(
                    f"{str(path)!r} exists and is not an lpx file; lpx replaces only files it "
                    "wrote. Choose another path, or move that file away first.",
                    param,
                    ctx,
                )
        return path


OUTPUT_FILE = OutputPath(directory=False)
OUTPUT_DIR = OutputPath(directory=True)

"""The `lpx` command line: one module per command under pipeline/commands/."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

import click

from pipeline import __version__
from pipeline.commands.ack import ack
from pipeline.commands.annotate import annotate
from pipeline.commands.bisect import bisect
from pipeline.commands.calibrate import calibrate
from pipeline.commands.check_template import check_template
from pipeline.commands.compare import compare, diagnose
from pipeline.commands.engines import engines
from pipeline.commands.fixture import fixture
from pipeline.commands.gate import gate
from pipeline.commands.history import history
from pipeline.commands.ingest import ingest
from pipeline.commands.inject import inject
from pipeline.commands.localize import localize
from pipeline.commands.make_model import make_model
from pipeline.commands.record import record
from pipeline.commands.replay import replay
from pipeline.commands.report import report
from pipeline.commands.rollout import rollout
from pipeline.commands.run import run
from pipeline.commands.serve import serve
from pipeline.commands.smoke import smoke
from pipeline.commands.sweep import sweep
from pipeline.commands.weights import weights
from pipeline.errors import EXIT_BAD_INPUT, BadInput, Interrupted
from pipeline.paths import is_disk_full
from pipeline.signals import RESEND_AFTER_S, after_imports


class LpxGroup(click.Group):
    """Turns a file-system error anywhere under a command (a parent that is a file, no
    permission, a full disk) into one line naming the path, exit 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except OSError as error:
            if error.filename is None:
                raise
            where = f"{error.filename}" + (f" -> {error.filename2}" if error.filename2 else "")
            advice = (
                "free space on its volume (or choose an --out elsewhere) and run again"
                if is_disk_full(error)
                else "check the path and its parent directories (an output's parent must be a "
                "directory you can write)"
            )
            raise BadInput(f"{where}: {error.strerror or error}; {advice}.") from None


@click.group(
    cls=LpxGroup,
    context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "LPX"},
)
@click.version_option(__version__, prog_name="lpx")
def cli() -> None:
    """lpx: do your rollout and training engines assign the same logprobs to the same tokens?

    Stages read and write files: rollout -> fixture -> replay -> compare -> report.
    Every option can also come from an environment variable LPX_<COMMAND>_<OPTION>.
    Exit codes: 0 pass, 1 threshold violated, 2 bad input or infrastructure error.

    \b
    Example (the whole pipeline on CPU with a tiny model built offline):
      lpx make-model models/tiny
      lpx rollout --model models/tiny --prompts prompts.txt --out run/fixture.parquet
      lpx replay run/fixture.parquet --dtype bf16 --out run/replay.parquet
      lpx compare run/fixture.parquet run/replay.parquet --out run/compare
    or just:  lpx smoke --out run/smoke

    \b
    History (nightly): lpx record RUN_DIR; lpx report --out site; lpx gate --fail-on regression
    """


COMMANDS = (
    run,
    make_model,
    rollout,
    replay,
    calibrate,
    compare,
    diagnose,
    localize,
    sweep,
    bisect,
    fixture,
    ingest,
    check_template,
    inject,
    smoke,
    record,
    report,
    history,
    gate,
    ack,
    annotate,
    serve,
    weights,
    engines,
)
for command in COMMANDS:
    cli.add_command(command)


def name_environment_variables(command: click.Command, prefix: str = "LPX") -> None:
    """LPX_<COMMAND>_<OPTION> for every option, from the option's long name. Click's
    auto_envvar_prefix would use the parameter's Python name instead (--policy ->
    LPX_COMPARE_POLICY_PATH), which is not what the docs promise."""
    for param in command.params:
        if isinstance(param, click.Option) and param.envvar is None and not param.hidden:
            longs = [o for o in param.opts if o.startswith("--")]
            if longs:
                param.envvar = f"{prefix}_{longs[0][2:].upper().replace('-', '_')}"
    for name, sub in getattr(command, "commands", {}).items():
        name_environment_variables(sub, f"{prefix}_{name.upper().replace('-', '_')}")


name_environment_variables(cli)


def _interrupt(signum, _frame) -> None:
    _silence_logged_interruptions()
    raise Interrupted(signum)


def _deliver_unraisable_interruptions(unraisable) -> None:
    """An interrupt raised inside a finalizer (a ``__del__``, a weakref callback) cannot
    propagate: Python would print it as "Exception ignored" with a traceback and go on running,
    the Ctrl-C lost. It is sent again a moment later, from a thread (a signal sent from here
    would run its handler inside this hook), to be raised where it can be."""
    if isinstance(unraisable.exc_value, Interrupted):
        resend = threading.Timer(
            RESEND_AFTER_S, os.kill, (os.getpid(), unraisable.exc_value.signum)
        )
        resend.daemon = True
        resend.start()
        return
    sys.__unraisablehook__(unraisable)


def _is_not_an_interruption(record: logging.LogRecord) -> bool:
    return not (record.exc_info and isinstance(record.exc_info[1], Interrupted))


def _silence_logged_interruptions() -> None:
    """A library that catches BaseException to log and re-raise (SQLAlchemy's pool, closing a
    connection the interrupt landed in) would print our interrupt as an error with its
    traceback on the way out. The interrupt is ours and main() reports it in one line, so from
    now on every handler drops a record that carries it: Python's last-resort handler (used
    when nothing is configured) and the handlers of every logger that has some."""
    handlers = {logging.lastResort, *logging.getLogger().handlers}
    for logger in list(logging.Logger.manager.loggerDict.values()):
        handlers.update(getattr(logger, "handlers", ()))
    for handler in handlers:
        if handler is not None and _is_not_an_interruption not in handler.filters:
            handler.addFilter(_is_not_an_interruption)


def main() -> None:
    sys.unraisablehook = _deliver_unraisable_interruptions
    signal.signal(signal.SIGINT, after_imports(_interrupt))
    signal.signal(signal.SIGTERM, after_imports(_interrupt))
    try:
        cli(prog_name="lpx")
    except Interrupted as interrupted:
        click.echo(f"Interrupted ({signal.Signals(interrupted.signum).name}).", err=True)
        sys.exit(interrupted.exit_code)
    except Exception as error:  # an engine or library failed underneath: one line, exit 2
        if os.environ.get("LPX_DEBUG"):
            raise
        message = (str(error).strip().splitlines() or [""])[0]
        click.echo(
            f"Error: {type(error).__name__}: {message} (an engine or library failed; "
            "rerun with LPX_DEBUG=1 for the traceback)",
            err=True,
        )
        sys.exit(EXIT_BAD_INPUT)

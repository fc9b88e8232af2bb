"""The `lpx` process entry: signal handlers before anything else is imported.

Importing the command line (click, numpy, the commands) takes a while; a Ctrl-C or SIGTERM
in that window would otherwise print a KeyboardInterrupt traceback. Nothing is written yet
then, so the early handler simply exits 128 + signal. pipeline.cli.main installs the handler
that unwinds a running command.

Both handlers wait until no import is under way (pipeline.signals says why).
"""

from __future__ import annotations

import signal
import sys

from pipeline.signals import after_imports


def _exit_before_start(signum, _frame) -> None:
    sys.stderr.write(f"Interrupted ({signal.Signals(signum).name}).\n")
    raise SystemExit(128 + signum)


def main() -> None:
    signal.signal(signal.SIGINT, after_imports(_exit_before_start))
    signal.signal(signal.SIGTERM, after_imports(_exit_before_start))
    from pipeline.cli import main as run_cli

    run_cli()

"""User-facing errors: one line that says what is wrong, where, and what to do; exit code 2."""

from __future__ import annotations

import click

EXIT_PASS = 0
EXIT_REGRESSION = 1
EXIT_BAD_INPUT = 2


class BadInput(click.ClickException):
    """Bad input, config or infrastructure: printed without a traceback, exit code 2."""

    exit_code = EXIT_BAD_INPUT

    def format_message(self) -> str:
        return self.message


class EngineNotInstalled(BadInput):
    """An engine adapter whose Python packages are missing."""


class DeviceOutOfMemory(BadInput):
    """The GPU ran out of memory; the message names where and what to lower."""


class Interrupted(BaseException):
    """SIGINT/SIGTERM: not an Exception, so no handler mistakes it for a failure to record,
    and click does not turn it into "Aborted!" with exit 1 (1 means "regression")."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # what shells report: 130 for Ctrl-C, 143 for SIGTERM

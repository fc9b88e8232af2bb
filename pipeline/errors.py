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

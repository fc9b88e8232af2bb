"""Why a launcher refused to start, in the one sentence of its output that says so.

A server or engine that refuses its arguments prints its whole usage text (SGLang's is 480
lines) before the sentence that matters ("error: argument --attention-backend: invalid
choice: 'nonsense'"); the tail of its log is then mostly usage. The sentence is the last
of argparse's ``PROG: error: ...`` lines and Python's exception lines (``ValueError: ...``, a
traceback's last), else the last line of the output that is neither usage text nor a warning.
"""

from __future__ import annotations

import re

MAX_CHARS = 600  # argparse's "choose from" lists what to write instead: keep most of it

ARGPARSE_ERROR = re.compile(r"^(?:\S[^:]*: )?error: (.+)$")
EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit): .+$")
USAGE_START = re.compile(r"^usage: ", re.I)
WARNING = re.compile(r"(^|\W)(\w*Warning|WARNING|warnings\.warn)\b")


def launch_failure_reason(output: str) -> str:
    """The sentence of a failed launch's ``output`` that says why (see the module's
    docstring); "" when it printed nothing."""
    lines = [line.rstrip() for line in output.splitlines()]
    for line in reversed(lines):
        found = ARGPARSE_ERROR.match(line.strip())
        if found:
            return _short(f"error: {found.group(1)}")
        if EXCEPTION_LINE.match(line.strip()):
            return _short(line.strip())
    said = [line.strip() for line in _outside_usage(lines) if line.strip()]
    plain = [line for line in said if not WARNING.search(line) and not _lpx_own(line)]
    anything = [line.strip() for line in lines if line.strip()][:1]  # usage alone: its head
    return _short((plain or said or anything or [""])[-1])


def _outside_usage(lines: list[str]) -> list[str]:
    """The lines that are not a usage block: ``usage:`` and the lines indented or bracketed
    under it, up to the first line that starts at the margin with a word."""
    kept, in_usage = [], False
    for line in lines:
        if USAGE_START.match(line):
            in_usage = True
            continue
        if in_usage and (not line.strip() or line[:1].isspace() or line.lstrip()[:1] in "[-"):
            continue
        in_usage = False
        kept.append(line)
    return kept


def _lpx_own(line: str) -> bool:
    """The command line and notes lpx writes at the head of a server's log."""
    return line.startswith(("$ ", "# lpx:"))


def _short(text: str) -> str:
    return text if len(text) <= MAX_CHARS else text[: MAX_CHARS - 3] + "..."

"""Strings from fixtures, dumps and configs made inert for the medium they are shown in.

A sequence id, engine name or knob value comes from a file lpx did not write. Shown raw, it
can move the cursor or recolour a terminal (ESC sequences), reverse the text that follows it
(U+202E), start a markdown heading or close an HTML tag. HTML is escaped by Jinja's
autoescape; these two cover the terminal and markdown.
"""

from __future__ import annotations

import unicodedata

MARKDOWN_SPECIALS = str.maketrans({c: "\\" + c for c in "\\`*_[]|<>#"})


def for_terminal(value) -> str:
    """One line with every control and format character written as a visible escape."""
    return "".join(_visible(c) for c in str(value))


def for_markdown(value) -> str:
    """Inert inline markdown: one line (it can never start a heading or a list), control
    characters visible, and the characters that act mid-line escaped (emphasis, code, links,
    table cells, HTML tags)."""
    return for_terminal(str(value).translate(MARKDOWN_SPECIALS))


def _visible(char: str) -> str:
    if unicodedata.category(char) not in ("Cc", "Cf", "Zl", "Zp"):
        return char
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"

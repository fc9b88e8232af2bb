"""Print, one per line, the `uv pip install` flags that make uv install what pip would here.

scripts/setup installs with uv when it can (a fresh 2-core machine: ~25 s against pip's ~100 s)
and must resolve exactly as pip does on this machine. uv reads none of pip's configuration, so
this reads it (`pip config list`: pip.conf files and PIP_* variables, a variable over a file)
and says it uv's way: the index, extra indexes, find-links and constraint files. pip's
resolution picks the best version over all indexes at once; uv's default takes the first index
that has a package, so the strategy is set to pip's. A TLS certificate bundle pip was told to
trust is printed as `SSL_CERT_FILE=...`, for the caller to export (uv reads it from there).

Usage: .venv/bin/python scripts/uv_flags.py   (run by scripts/setup)
"""

from __future__ import annotations

import ast
import subprocess
import sys

# pip's setting -> uv's flag, for the settings that change what gets installed.
LIST_FLAGS = {
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}


def pip_settings(listing: str) -> dict[str, str]:
    """pip's effective settings from `pip config list`: `section.key='value'` lines; a PIP_*
    variable (section `:env:`) overrides a file's value of the same key."""
    settings: dict[str, str] = {}
    from_env: dict[str, str] = {}
    for line in listing.splitlines():
        name, sep, quoted = line.partition("=")
        if not sep or "." not in name:
            continue
        section, key = name.rsplit(".", 1)
        if section not in {"global", "install", ":env:"}:
            continue
        (from_env if section == ":env:" else settings)[key] = ast.literal_eval(quoted)
    return settings | from_env


def uv_flags(settings: dict[str, str]) -> list[str]:
    flags = ["--index-strategy", "unsafe-best-match"]
    if settings.get("index-url"):
        flags += ["--index-url", settings["index-url"]]
    if settings.get("no-index", "").lower() in {"1", "true", "yes", "on"}:
        flags.append("--no-index")
    for key, flag in LIST_FLAGS.items():
        for value in settings.get(key, "").split():
            flags += [flag, value]
    return flags


def main() -> None:
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    settings = pip_settings(listing)
    if settings.get("cert"):
        print(f"SSL_CERT_FILE={settings['cert']}")
    print("\n".join(uv_flags(settings)))


if __name__ == "__main__":
    main()

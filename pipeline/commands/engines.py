from __future__ import annotations

import json
import shutil
import textwrap

import click


@click.command(short_help="List the engines: roles, install extra, knobs and defaults.")
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
def engines(as_json: bool) -> None:
    """List every engine lpx can run, built-in or plug-in: what it does (rollout, scoring,
    capture), what installs it and whether that is installed, and its knobs (--set) with
    their defaults. Read without starting any engine.

    \b
    Example:
      lpx engines
      lpx engines --json | jq '.[] | select(.name == "vllm") | .knobs.rollout'
    """
    from pipeline.engines.catalog import catalog

    entries = catalog()
    if as_json:
        click.echo(json.dumps([entry.as_dict() for entry in entries], indent=2, default=str))
        return
    width = min(shutil.get_terminal_size().columns, 100)
    for entry in entries:
        click.echo(f"{entry.name}: {', '.join(entry.roles)}; {_installed(entry)}")
        if entry.note:
            click.echo(
                textwrap.fill(entry.note, width, initial_indent="  ", subsequent_indent="  ")
            )
        for roles, knobs in _knob_lines(entry.knobs):
            label = f"  {roles} knobs: "
            listed = " ".join(f"{knob.name}={_shown(knob.default)}" for knob in knobs or ())
            unknown = "unknown until it imports" if entry.installed is False else None
            text = listed or unknown or "none declared (the adapter has no `knobs` dataclass)"
            click.echo(textwrap.fill(text, width, initial_indent=label,
                                     subsequent_indent=" " * len(label)))  # fmt: skip
    click.echo(
        "\nSet a knob with --set NAME=VALUE (none: the engine's own default); docs/engines.md "
        "says what each one does."
    )


def _installed(entry) -> str:
    said = {True: "installed", False: "not installed", None: "set up apart"}[entry.installed]
    return f"installs with {entry.installs_with}, {said}"


def _knob_lines(knobs: dict) -> list[tuple[str, object]]:
    """(roles, knobs), one line for roles that share the same knobs (vllm's one dataclass)."""
    lines: list[tuple[str, object]] = []
    for role, declared in knobs.items():
        for index, (roles, shared) in enumerate(lines):
            if shared == declared:
                lines[index] = (f"{roles}, {role}", shared)
                break
        else:
            lines.append((role, declared))
    return lines


def _shown(value) -> str:
    """A default as --set takes it: true/false, none, '' for an empty string."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "none"
    if value == "":
        return "''"
    return str(value)

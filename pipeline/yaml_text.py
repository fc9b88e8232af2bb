"""YAML as lpx reads it: a file that is not valid YAML is one line naming the file and line."""

from __future__ import annotations

import yaml

from pipeline.errors import BadInput


def parse_yaml(text: str, source: str, loader: type = yaml.SafeLoader):
    """The data of YAML ``text`` read from ``source`` (a path, or words such as "default
    policy"); BadInput with `yaml_error_line` when it is not valid YAML."""
    try:
        return yaml.load(text, Loader=loader)
    except yaml.YAMLError as error:
        raise BadInput(yaml_error_line(source, error, text)) from None


def yaml_error_line(source: str, error: yaml.YAMLError, text: str = "") -> str:
    """``SOURCE line N: not valid YAML (PROBLEM; CONTEXT from line M).``

    PyYAML's own message spans four lines (context, its mark, problem, its mark), each mark
    naming the stream again; a user wants the file, the line and what is wrong there. The
    shape is the one plans and policies have always had."""
    if isinstance(error, yaml.reader.ReaderError):
        # a byte or character YAML does not allow: the reader knows only its offset
        line = text.count("\n", 0, error.position) + 1 if text else None
        character = error.character  # a code point read from text, a byte from bytes
        what = repr(chr(character)) if isinstance(character, int) else f"byte {character!r}"
        return _line(source, line, f"{what} is not allowed in YAML: {error.reason}")
    problem = getattr(error, "problem", None)
    if problem is None:
        return _line(source, None, " ".join(str(error).split()))
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    context = getattr(error, "context", None)
    context_mark = getattr(error, "context_mark", None)
    said = str(problem)
    if context:
        since = f" from line {context_mark.line + 1}" if context_mark is not None else ""
        said += f"; {context}{since}"
    return _line(source, None if mark is None else mark.line + 1, said)


def _line(source: str, line: int | None, said: str) -> str:
    where = "" if line is None else f" line {line}"
    return f"{source}{where}: not valid YAML ({said})."

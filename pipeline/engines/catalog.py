"""What each engine is, read without running it: its roles, the extra that installs it, and
its knobs with their defaults (what `lpx engines` prints)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from importlib import metadata

from pipeline import plugins
from pipeline.names import EXTRA_FOR_ENGINE, ROLE_OF_GROUP, SETUP_FOR_ENGINE

# The roles whose adapters declare knobs (a class with `knobs`); a capture adapter is a
# function, and its spec's knobs are documented in docs/localize.md.
KNOB_GROUPS = (plugins.ROLLOUT, plugins.SCORING)


@dataclass(frozen=True)
class Knob:
    name: str
    type: str  # the field's annotation, as written (`int | None`)
    default: object


@dataclass(frozen=True)
class EngineEntry:
    name: str
    roles: tuple[str, ...]  # rollout, scoring, capture
    installs_with: str  # "lpx", "the extra X", or the distribution of a plug-in
    installed: bool | None  # None: cannot be told here (SETUP_FOR_ENGINE says how to set it up)
    note: str  # why not installed and what to do, or how the engine is set up; "" when nothing
    # role -> its knobs; None where the adapter declares none or cannot be imported
    knobs: dict[str, tuple[Knob, ...] | None]

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def catalog() -> list[EngineEntry]:
    """Every engine of every plug-in group, built-ins and plug-ins, by name."""
    roles: dict[str, list[str]] = {}
    for group, role in ROLE_OF_GROUP.items():
        for name in plugins.names(group):
            roles.setdefault(name, []).append(role)
    return [_entry(name, tuple(engine_roles)) for name, engine_roles in sorted(roles.items())]


def knobs_of(adapter) -> tuple[Knob, ...] | None:
    """The knobs an adapter class declares in its `knobs` dataclass; None when it has none."""
    declared = getattr(adapter, "knobs", None)
    if not dataclasses.is_dataclass(declared):
        return None
    return tuple(
        Knob(field.name, str(field.type), _default(field)) for field in dataclasses.fields(declared)
    )


def missing_requirements(extra: str) -> list[str] | None:
    """The distributions lpx's ``extra`` requires that are not installed ([] when all are);
    None when lpx itself is not installed, so its extras cannot be read."""
    from packaging.requirements import Requirement

    try:
        required = metadata.requires("lpx") or []
    except metadata.PackageNotFoundError:
        return None
    missing = []
    for line in required:
        requirement = Requirement(line)
        if requirement.marker is None or not requirement.marker.evaluate({"extra": extra}):
            continue
        try:
            metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            missing.append(requirement.name)
    return missing


def _entry(name: str, roles: tuple[str, ...]) -> EngineEntry:
    knobs: dict[str, tuple[Knob, ...] | None] = {}
    failed = ""
    for group in KNOB_GROUPS:
        role = ROLE_OF_GROUP[group]
        if role not in roles:
            continue
        try:
            knobs[role] = knobs_of(plugins.load(group, name))
        except ImportError as error:  # a plug-in whose module needs what is not installed
            knobs[role], failed = None, f"its adapter cannot be imported ({error})"
    plugin = _plugin_distribution(name)
    if plugin is not None:
        return EngineEntry(name, roles, plugin, not failed, failed, knobs)
    extra = EXTRA_FOR_ENGINE.get(name)
    if extra is None:
        return EngineEntry(name, roles, "lpx", not failed, failed, knobs)
    if name in SETUP_FOR_ENGINE:
        return EngineEntry(name, roles, f"the extra {extra}", None, SETUP_FOR_ENGINE[name], knobs)
    missing = missing_requirements(extra)
    if missing is None:
        note = "lpx is not installed as a package, so its extras cannot be checked"
        return EngineEntry(name, roles, f"the extra {extra}", None, note, knobs)
    note = f"pip install -e '.[{extra}]' (missing: {', '.join(missing)})" if missing else ""
    return EngineEntry(name, roles, f"the extra {extra}", not missing, note, knobs)


def _plugin_distribution(name: str) -> str | None:
    """The distribution that registers ``name`` in any group, for an engine that is not (or
    not only) lpx's own; None for a built-in."""
    for group in ROLE_OF_GROUP:
        if plugins.target(group, name) != plugins.BUILTIN[group].get(name):
            for entry in metadata.entry_points(group=group, name=name):
                if entry.dist is not None and entry.dist.metadata["Name"] != "lpx":
                    return f"the plug-in {entry.dist.metadata['Name']}"
    return None


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None

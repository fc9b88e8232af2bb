"""Attribution: what changed between a series' last good point and its first bad one.

Pure: each point is described by ``point_description`` (both sides' engine builds, knobs,
testbed host, lpx version) and ``changes`` lists the differences, engine versions first,
so a regression reads "replay vllm: vllm 0.31.0 -> 0.32.0" rather than "something moved".
"""

from __future__ import annotations

from pipeline.history.keys import ENGINE_STACKS, ENGINE_VERSION_KEYS, release_key

BUILD_FIELDS = ("version", "image_digest", "image_ref", "torch", "cuda", "driver")


def point_description(
    rollout_build: dict, replay_build: dict, knobs: dict, host: str | None, lpx: str
) -> dict:
    return {
        "rollout": rollout_build,
        "replay": replay_build,
        "knobs": knobs,
        "host": host,
        "lpx": lpx,
    }


def changes(before: dict, after: dict) -> list[dict]:
    """Every difference, most telling first: engine versions, the stack under them, the
    other packages, knobs, then the host and lpx itself."""
    found = []
    for side in ("rollout", "replay"):
        old, new = before.get(side) or {}, after.get(side) or {}
        engine = new.get("engine") or old.get("engine") or side
        for name in BUILD_FIELDS:
            if old.get(name) != new.get(name):
                label = "version" if name == "version" else name
                found.append(_change(side, engine, label, old.get(name), new.get(name)))
        old_versions, new_versions = old.get("versions") or {}, new.get("versions") or {}
        own = {release_key(engine, new_versions), release_key(engine, old_versions), engine,
               ENGINE_VERSION_KEYS.get(engine), *ENGINE_STACKS.get(engine, ())}  # fmt: skip
        for package in sorted(set(old_versions) | set(new_versions)):
            if package in ("torch", "lpx", "cuda", "driver") or package in own:
                continue  # listed above in the build's version (its stack), torch, cuda or driver
            if old_versions.get(package) != new_versions.get(package):
                found.append(
                    _change(
                        side, engine, package, old_versions.get(package), new_versions.get(package)
                    )
                )
    old_knobs, new_knobs = _flatten(before.get("knobs") or {}), _flatten(after.get("knobs") or {})
    for name in sorted(set(old_knobs) | set(new_knobs)):
        if old_knobs.get(name) != new_knobs.get(name):
            found.append(_change("knobs", "", name, old_knobs.get(name), new_knobs.get(name)))
    for name in ("host", "lpx"):
        if before.get(name) != after.get(name):
            found.append(_change(name, "", name, before.get(name), after.get(name)))
    return _unique(found)


def summary(found: list[dict]) -> str:
    """One line for tables: the engine changes, or what else changed, or 'no change'."""
    if not found:
        return "no engine build, knob or host changed"
    engines = [c for c in found if c["field"] == "version"]
    shown = engines or found[:3]
    text = "; ".join(_format(c) for c in shown)
    rest = len(found) - len(shown)
    return text + (f" (+{rest} more)" if rest > 0 else "")


def _change(side: str, engine: str, field: str, before, after) -> dict:
    return {"side": side, "engine": engine, "field": field, "before": before, "after": after}


def _format(change: dict) -> str:
    where = f"{change['side']} {change['engine']}".strip()
    if change["field"] == "version":
        before, after, shared = stack_difference(change["before"], change["after"])
        text = f"{where}: {change['engine']} {before} -> {after}"
        return text + (f" ({shared})" if shared else "")
    before, after = (_shown(change[end]) for end in ("before", "after"))
    return f"{where}: {change['field']} {before} -> {after}"


def _shown(value) -> str:
    """A value as a change lists it: '-' where there was none (False and 0 are values)."""
    return "-" if value is None or value == "" else str(value)


def stack_difference(before, after) -> tuple[str, str, str]:
    """A build's version is its release and its stack ("0.32.0, torch 2.9.0"): the parts
    that differ on each side, and the parts both share (said once)."""
    old, new = str(before or "-").split(", "), str(after or "-").split(", ")
    shared = [part for part in old if part in new]
    return (
        ", ".join(p for p in old if p not in shared) or "-",
        ", ".join(p for p in new if p not in shared) or "-",
        ", ".join(shared),
    )


def _flatten(values: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _unique(found: list[dict]) -> list[dict]:
    seen, result = set(), []
    for change in found:
        marker = (change["side"], change["field"], str(change["before"]), str(change["after"]))
        if marker not in seen:
            seen.add(marker)
            result.append(change)
    return result

"""Engines by name: the adapter a plug-in group registers, imported only when asked for, with
advice (which extra to install) when its imports fail."""

from __future__ import annotations

from pipeline import plugins
from pipeline.errors import BadInput, EngineNotInstalled
from pipeline.names import EXTRA_FOR_ENGINE, ROLLOUT_GROUP, SCORING_GROUP, engine_names


def rollout_engine(name: str):
    return _load(ROLLOUT_GROUP, name)()


def scoring_engine(name: str):
    return _load(SCORING_GROUP, name)()


def _load(group: str, name: str):
    try:
        adapter = plugins.load(group, name)
    except ImportError as error:
        extra = EXTRA_FOR_ENGINE.get(name, name)
        raise EngineNotInstalled(
            f"engine {name!r} is not installed ({error}); install it with "
            f"`pip install -e '.[{extra}]'`."
        ) from None
    if adapter is None:
        known = ", ".join(engine_names(group)) or "none"
        raise BadInput(f"unknown engine {name!r} for {group.split('.')[-1]}; known: {known}.")
    return adapter

"""Engine plugins: rollout engines make fixtures, scoring engines replay them teacher-forced.

Adapters are found through the entry-point groups ``lpx.rollout_engines`` and
``lpx.scoring_engines`` and imported only when used, so lpx runs with whichever engines
are installed. A team can ship its own adapter by registering it in those groups.
"""

from __future__ import annotations

from pipeline import plugins
from pipeline.errors import BadInput, EngineNotInstalled
from pipeline.names import EXTRA_FOR_ENGINE, ROLLOUT_GROUP, SCORING_GROUP, engine_names

__all__ = ["engine_names", "rollout_engine", "scoring_engine"]


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

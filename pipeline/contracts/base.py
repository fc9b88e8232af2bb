"""What every contract shares: strict types (no "0.1" for 0.1, no true for 1), and fields lpx
does not know kept as written (a newer lpx may write more)."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ConfigDict

OPEN = ConfigDict(extra="allow", strict=True)


class Open(BaseModel):
    model_config = OPEN


Model = TypeVar("Model", bound=BaseModel)


def held_as_written(model: type[Model], validated: dict) -> Model:
    """``validated`` (a file's JSON that ``model`` has just accepted) held as ``model``, every
    value as the file wrote it (validation may coerce; a reader passing the model on must not
    change what is stored); unknown fields are kept as extras."""
    return model.model_construct(**validated)

"""What every contract shares: strict types (no "0.1" for 0.1, no true for 1), and fields lpx
does not know kept as written (a newer lpx may write more)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

OPEN = ConfigDict(extra="allow", strict=True)


class Open(BaseModel):
    model_config = OPEN

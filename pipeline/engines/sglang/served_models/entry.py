"""The ``EntryClass`` of each SGLang model module named in LPX_SGLANG_MODEL_MODULES (comma
separated): the classes SGLang's own scan would register from those modules, the same
objects."""

from __future__ import annotations

import importlib
import os

EntryClass: list = []
# set by engines/sglang/launch.py (MODULES_VARIABLE) before SGLang imports this
for _name in filter(None, os.environ.get("LPX_SGLANG_MODEL_MODULES", "").split(",")):
    _entry = importlib.import_module(_name).EntryClass
    EntryClass += _entry if isinstance(_entry, list) else [_entry]

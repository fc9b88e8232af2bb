"""Signal handlers that wait while the process is inside an import.

A native extension's module init can call back into Python (triton's nanobind builds its
enums through enum.py while torch imports it); an exception a handler raises there cannot
cross the C++ frames, and the process aborts with SIGABRT and a core instead of exiting 130.
The signal is re-sent every 50 ms until the import has finished (importing torch takes a few
seconds; after a minute the handler runs anyway). Kept to the standard library: pipeline.entry
installs these before anything else is imported.
"""

from __future__ import annotations

import os
import threading
import time

RESEND_AFTER_S = 0.05
# An import that hangs must not make the process deaf: past this, the handler runs anyway.
DEFER_AT_MOST_S = 60.0


def _inside_an_import(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def after_imports(handler):
    """``handler``, run only once no import is under way: a signal that arrives during one is
    sent again a little later."""

    first_deferred: dict[int, float] = {}

    def guarded(signum, frame) -> None:
        waited = time.monotonic() - first_deferred.setdefault(signum, time.monotonic())
        if _inside_an_import(frame) and waited < DEFER_AT_MOST_S:
            resend = threading.Timer(RESEND_AFTER_S, os.kill, (os.getpid(), signum))
            resend.daemon = True
            resend.start()
            return
        first_deferred.pop(signum, None)
        handler(signum, frame)

    return guarded

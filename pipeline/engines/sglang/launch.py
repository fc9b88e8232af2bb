"""Start SGLang's server in its environment, past what stops it on a CPU host.

Run as ``python -m pipeline.engines.sglang.launch SGLANG-SERVER-ARGS...`` by the interpreter
that has SGLang (engines/sglang_server.py does). Everything here runs at import, because
SGLang starts its scheduler and detokenizer with multiprocessing's spawn: each child
imports this module again (as ``__mp_main__``) before it imports SGLang.

1. torchvision, which SGLang imports whatever the model, must be let import beside the CPU
   torch (pipeline/torchvision_guard.py; ``import pipeline`` installs it, and it is applied
   here at once).
2. ``SGLANG_USE_CPU_ENGINE=1`` selects SGLang's CPU engine, which needs sgl-kernel's CPU build;
   none exists for this machine, so lpx runs SGLang's plain torch path and unsets it.
3. ``--enable-return-routed-experts`` allocates its host buffer with ``pin_memory=True`` and
   page-locks it through CUDA's ``cudaHostRegister`` (torch's cudart binding), which
   asserts "Torch not compiled with CUDA enabled" on a CPU torch. Where no CUDA device exists there is nothing
   to page-lock for, so the registration is skipped; the buffer, and what the routers write
   into it, are SGLang's own. Nothing here changes a number SGLang computes.
"""

from __future__ import annotations

import importlib.util
import os
import runpy

from pipeline.devices import visible_gpus
from pipeline.torchvision_guard import let_torchvision_import


def let_routing_capture_run_without_cuda() -> bool:
    """Skip page-locking host buffers where torch has no CUDA (3. above); True if skipped."""
    if visible_gpus() or importlib.util.find_spec("sglang") is None:
        return False
    try:
        from sglang.srt.mem_cache.pool_host import common
    except ImportError:  # a release without it: nothing to skip
        return False
    if not hasattr(common, "_cuda_host_register"):
        return False
    common._cuda_host_register = _nothing_to_page_lock
    return True


def _nothing_to_page_lock(buffer, registration_granularity_bytes=None) -> None:
    return None


os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
TORCHVISION = let_torchvision_import()
PAGE_LOCK_SKIPPED = let_routing_capture_run_without_cuda()

if __name__ == "__main__":
    # Not alter_sys: __main__ stays this module, so the spawned children import it first.
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)

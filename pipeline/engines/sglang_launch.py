"""Start SGLang's server in its environment, past the two things that stop it on a CPU host.

Run as ``python -m pipeline.engines.sglang_launch SGLANG-SERVER-ARGS...`` by the interpreter
that has SGLang (engines/sglang_server.py does). Everything here runs at import, because
SGLang starts its scheduler and detokenizer with multiprocessing's spawn: each child
imports this module again (as ``__mp_main__``) before it imports SGLang.

1. SGLang imports torchvision whatever the model (sglang/srt/configs reaches
   torchvision.transforms), and torchvision's ``_meta_registrations`` registers fake kernels
   for ``torchvision::nms`` and ``torchvision::qnms`` without checking that its compiled ops
   loaded. The only torchvision wheels for torch 2.13 are CUDA builds whose ``_C`` cannot
   load beside the CPU torch, so ``import torchvision`` fails with "operator torchvision::nms
   does not exist", and SGLang with it. Where the ops do not load, the two operators are
   declared here (schema only, no kernel): the registrations then succeed, and anything
   that calls them still fails loudly. Where ``_C`` loads (a matching build, a GPU image),
   nothing is declared.
2. ``SGLANG_USE_CPU_ENGINE=1`` selects SGLang's CPU engine, which needs sgl-kernel's CPU build;
   none exists for this machine, so lpx runs SGLang's plain torch path and unsets it.
3. ``--enable-return-routed-experts`` allocates its host buffer with ``pin_memory=True`` and
   page-locks it through ``torch.cuda.cudart().cudaHostRegister``, which asserts "Torch not
   compiled with CUDA enabled" on a CPU torch. Where no CUDA device exists there is nothing
   to page-lock for, so the registration is skipped; the buffer, and what the routers write
   into it, are SGLang's own. Nothing here changes a number SGLang computes.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import runpy

# (schema, operator) SGLang's import of torchvision needs declared
TORCHVISION_OPERATORS = {
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


def let_torchvision_import() -> str:
    """ "loaded" when torchvision's compiled ops load, "declared" when the operators its
    import registers had to be declared here, "absent" without torchvision."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return "absent"
    import torch

    if all(_declared(torch, name) for name in TORCHVISION_OPERATORS):
        return "loaded"
    folder = list(spec.submodule_search_locations)[0]
    for library in glob.glob(os.path.join(folder, "_C*.so")):
        try:
            torch.ops.load_library(library)
            return "loaded"
        except (OSError, RuntimeError):
            pass
    for name, schema in TORCHVISION_OPERATORS.items():
        if not _declared(torch, name):
            torch.library.define(f"torchvision::{name}", schema)
    return "declared"


def _declared(torch, name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
    except RuntimeError:
        return False
    return True


def let_routing_capture_run_without_cuda() -> bool:
    """Skip page-locking host buffers where torch has no CUDA (3. above); True if skipped."""
    import torch

    if torch.cuda.is_available() or importlib.util.find_spec("sglang") is None:
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

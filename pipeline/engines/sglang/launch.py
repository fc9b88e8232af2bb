"""Start SGLang's server in its environment, past what stops it on a CPU host.

Run as ``python -m pipeline.engines.sglang.launch SGLANG-SERVER-ARGS...`` by the interpreter
that has SGLang (engines/sglang/server.py does). Everything here runs at import: where
SGLang starts its scheduler and detokenizer with multiprocessing's spawn (on a GPU host),
each child imports this module again (as ``__mp_main__``) before it imports SGLang.

1. torchvision, which SGLang imports whatever the model, must be let import beside the CPU
   torch (pipeline/torchvision_guard.py; ``import pipeline`` installs it, and it is applied
   here at once).
2. ``SGLANG_USE_CPU_ENGINE=1`` selects SGLang's CPU engine, which needs sgl-kernel's CPU build;
   none exists for this machine, so lpx runs SGLang's plain torch path and unsets it.
3. Where no CUDA device exists, SGLang's children are forked, not spawned. SGLang asks for
   spawn so that no child inherits an initialised CUDA context; without CUDA there is none,
   and a spawned child spends its first ~12 CPU-seconds importing SGLang again (the
   scheduler and the detokenizer each: a start measured 41 CPU-s spawned, 19 forked, on two
   cores). The child runs the same code on the same inputs: its numbers are the spawned
   child's (measured: 16 sampled completions of 64 tokens, every token and logprob equal
   bit for bit; tests/engines/test_engines_sglang.py holds them to HF fp32).
4. ``--enable-return-routed-experts`` allocates its host buffer with ``pin_memory=True`` and
   page-locks it through CUDA's ``cudaHostRegister`` (torch's cudart binding), which
   asserts "Torch not compiled with CUDA enabled" on a CPU torch. Where no CUDA device
   exists there is nothing to page-lock for, so the registration is skipped, in the
   launcher just before its children are forked; the buffer, and what the routers write
   into it, are SGLang's own.
5. SGLang imports every one of its ~250 model modules at start to find the model's class
   (2.7 of a forked start's 19 CPU-s; 16 without). lpx names the modules that define the
   model's architectures (a text search of SGLang's models folder) as SGLang's external
   model package (engines/sglang/served_models): SGLang takes the class from there, the
   same class object, and scans everything as before where it is not found.

Nothing here changes a number SGLang computes.

SGLang is imported by SGLang's own ``launch_server``, not here: a server argument it refuses
is refused after its argument parser's imports alone (8 CPU-s, not the whole server's 12).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import runpy
import sys
from pathlib import Path

from pipeline.devices import visible_gpus
from pipeline.torchvision_guard import let_torchvision_import


def fork_children_where_no_cuda() -> bool:
    """Where no CUDA device exists, have SGLang fork its children (3. above) and skip
    page-locking (4.) as it asks for its start method; True where it will."""
    if visible_gpus():
        return False
    import multiprocessing

    set_start_method = multiprocessing.set_start_method

    def fork_instead_of_spawn(method, force=False):
        if method == "spawn":
            let_routing_capture_run_without_cuda()
            method = "fork"
        set_start_method(method, force=force)

    multiprocessing.set_start_method = fork_instead_of_spawn
    return True


def let_routing_capture_run_without_cuda() -> bool:
    """Skip page-locking host buffers (4. above); True if skipped."""
    if importlib.util.find_spec("sglang") is None:
        return False
    try:
        from sglang.srt.mem_cache.pool_host import common
    except ImportError:  # a release without it: nothing to skip
        return False
    if not hasattr(common, "_cuda_host_register"):
        return False
    common._cuda_host_register = _nothing_to_page_lock
    return True


# the modules served_models/entry.py takes EntryClass from, comma separated
MODULES_VARIABLE = "LPX_SGLANG_MODEL_MODULES"


def register_only_the_served_models(server_args: list[str]) -> list[str]:
    """Name the SGLang model modules that define the served model's architectures as
    SGLang's external model package (5. above); the modules named, none where the model's
    config or SGLang's models folder is not found (SGLang then scans as it does)."""
    if os.environ.get("SGLANG_EXTERNAL_MODEL_PACKAGE"):
        return []  # the user's own
    architectures = _architectures(server_args)
    spec = importlib.util.find_spec("sglang")
    if not architectures or spec is None or not spec.submodule_search_locations:
        return []
    folder = Path(list(spec.submodule_search_locations)[0]) / "srt" / "models"
    defines = re.compile(rf"^class ({'|'.join(map(re.escape, architectures))})\(", re.MULTILINE)
    modules = [
        f"sglang.srt.models.{path.stem}"
        for path in sorted(folder.glob("*.py"))
        if defines.search(path.read_text(encoding="utf-8", errors="replace"))
    ]
    if modules:
        os.environ[MODULES_VARIABLE] = ",".join(modules)
        os.environ["SGLANG_EXTERNAL_MODEL_PACKAGE"] = "pipeline.engines.sglang.served_models"
    return modules


def _architectures(server_args: list[str]) -> list[str]:
    """The architectures of the model at --model-path, as --json-model-override-args leaves
    them; [] where they cannot be read here (a hub id: SGLang resolves it)."""
    given = _argument(server_args, "--model-path") or _argument(server_args, "--model")
    try:
        config = json.loads((Path(given) / "config.json").read_text(encoding="utf-8"))
        overrides = json.loads(_argument(server_args, "--json-model-override-args") or "{}")
    except (OSError, TypeError, ValueError):
        return []
    if not isinstance(config, dict) or not isinstance(overrides, dict):
        return []
    found = overrides.get("architectures", config.get("architectures"))
    if not isinstance(found, list):
        return []
    return [name for name in found if isinstance(name, str) and name.isidentifier()]


def _argument(server_args: list[str], flag: str) -> str | None:
    for index, part in enumerate(server_args):
        if part == flag and index + 1 < len(server_args):
            return server_args[index + 1]
        if part.startswith(flag + "="):
            return part[len(flag) + 1 :]
    return None


def _nothing_to_page_lock(buffer, registration_granularity_bytes=None) -> None:
    return None


os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
TORCHVISION = let_torchvision_import()
CHILDREN_FORKED = fork_children_where_no_cuda()

if __name__ == "__main__":
    register_only_the_served_models(sys.argv[1:])
    # Not alter_sys: __main__ stays this module, so the spawned children import it first.
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)

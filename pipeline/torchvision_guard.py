"""Let torchvision import beside a CPU torch whose build its compiled ops do not fit.

SGLang imports torchvision whatever the model (sglang/srt/configs reaches
torchvision.transforms), and transformers imports it whenever it is installed. The only
torchvision wheels for torch 2.13 are CUDA builds whose ``_C`` cannot load beside the CPU
torch, and torchvision's ``_meta_registrations`` then registers fake kernels for
``torchvision::nms`` and ``torchvision::qnms`` without checking that its ops loaded: ``import
torchvision`` fails with "operator torchvision::nms does not exist", and transformers and
SGLang fail with it. So wherever SGLang's environment is (its own layered venv, an image with
SGLang beside lpx), every process, lpx's own and SGLang's, would fail.

`install()` (run by ``import pipeline``, cheap: it imports nothing) puts a finder first on
``sys.meta_path`` that, the first time torchvision is imported, tries its compiled ops and,
where they do not load, declares the two operators (schema only, no kernel): the
registrations then succeed, and anything that calls the operators still fails loudly. Where
``_C`` loads (a matching build, a GPU image), nothing is declared. Nothing here runs in an
environment without torchvision.
"""

from __future__ import annotations

import glob
import importlib.abc
import importlib.util
import os
import sys

# the operators torchvision's import registers fake kernels for, with their schemas
OPERATORS = {
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

    if all(_declared(torch, name) for name in OPERATORS):
        return "loaded"
    folder = list(spec.submodule_search_locations)[0]
    for library in glob.glob(os.path.join(folder, "_C*.so")):
        try:
            torch.ops.load_library(library)
            return "loaded"
        except (OSError, RuntimeError):
            pass
    for name, schema in OPERATORS.items():
        if not _declared(torch, name):
            torch.library.define(f"torchvision::{name}", schema)
    return "declared"


def install() -> None:
    """Run `let_torchvision_import` just before torchvision is first imported."""
    if "torchvision" in sys.modules or any(isinstance(f, _Guard) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Guard())


class _Guard(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)  # once, and never for its own find_spec below
        let_torchvision_import()
        return None  # the usual finders load it


def _declared(torch, name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
    except RuntimeError:
        return False
    return True

"""The forward hooks lpx's SGLang capture adapter registers inside SGLang's scheduler.

SGLang (0.5.23's ``--forward-hooks``, sglang/srt/model_executor/hook_manager.py) imports this
module in its scheduler process after the model loads, calls ``tap(config)`` once per hook spec
and registers the returned function as a forward hook on every module the spec's patterns
match. Keep this module small and free of lpx's other modules: only the standard library,
numpy and torch (what SGLang's process already has).

Each hook writes its module's rows of one forward to one file in ``config["dir"]``:
``{forward:06d}.{boundary}.npy`` ([rows, features], float32, or int64 expert ids). The
embedding hook opens a forward (it runs first in every forward); the logits processor's hook
closes it by writing ``{forward:06d}.positions.npy`` (the token positions the forward ran,
so a chunked prefill is reassembled) last. A hook never raises into SGLang: a failure is
written to ``{forward:06d}.error.txt`` and the reader reports it.

``config``: ``dir``; ``kind`` (embed, input_norm, qkv, attn_out, mlp_in, router_logits,
experts, mlp_out, final_norm, logits); ``layers``: the layer index of the n-th module the
spec's pattern matches in one forward (modules run in layer order); ``top_k`` for experts.
"""

from __future__ import annotations

import os
import traceback

import numpy as np

# the forward in flight, and how many modules of each spec have run in it
_STATE = {"forward": 0, "seen": {}}


def tap(config: dict):
    """The forward hook for one spec (see the module docstring)."""
    directory = str(config["dir"])
    kind = str(config["kind"])
    layers = [int(i) for i in config.get("layers") or []]
    top_k = int(config.get("top_k") or 0)
    handler = _HANDLERS[kind]

    def hook(module, args, output):
        try:
            if kind == "embed":
                _STATE["forward"] += 1
                _STATE["seen"] = {}
            layer = None
            if layers:
                count = _STATE["seen"].get(kind, 0)
                _STATE["seen"][kind] = count + 1
                if count >= len(layers):
                    raise RuntimeError(f"{kind}: more modules ran than the {len(layers)} hooked")
                layer = layers[count]
                own = getattr(module, "layer_id", None)
                if isinstance(own, int) and own != layer:
                    raise RuntimeError(f"{kind}: module of layer {own} ran as layer {layer}")
            prefix = "" if layer is None else f"layers.{layer}."
            for name, rows in handler(module, args, output, top_k):
                _write(directory, f"{prefix}{name}", rows)
        except Exception:  # noqa: BLE001  (never into SGLang's scheduler: the reader reports it)
            _error(directory, kind, traceback.format_exc())
        return None

    return hook


def _write(directory: str, name: str, rows) -> None:
    path = os.path.join(directory, f"{_STATE['forward']:06d}.{name}.npy")
    partial = path + ".part"
    with open(partial, "wb") as out:
        np.save(out, _numpy(rows))
    os.replace(partial, path)


def _error(directory: str, kind: str, text: str) -> None:
    path = os.path.join(directory, f"{_STATE['forward']:06d}.error.txt")
    try:
        with open(path, "a", encoding="utf-8") as out:
            out.write(f"[{kind}] {text}\n")
    except OSError:
        pass


def _numpy(tensor) -> np.ndarray:
    """[N, ...] -> [N, F] numpy: floats as float32, ids as int64, copied off the device."""
    import torch

    tensor = tensor.detach()
    if tensor.dtype.is_floating_point:
        tensor = tensor.to(torch.float32)
    else:
        tensor = tensor.to(torch.int64)
    return tensor.reshape(tensor.shape[0], -1).cpu().numpy()


def _tensor(output):
    """A module's output tensor: the normed half of a fused norm's (normed, residual), the
    output of a linear's (output, bias)."""
    value = output[0] if isinstance(output, (tuple, list)) else output
    if not hasattr(value, "detach"):
        raise TypeError(f"output is a {type(value).__name__}, not a tensor")
    return value


def _output(name: str):
    def handle(module, args, output, top_k):
        yield name, _tensor(output)

    return handle


def _qkv(module, args, output, top_k):
    """RadixAttention(q, k, v, forward_batch): q and k after rotary, v as projected."""
    for name, tensor in zip(("q", "k", "v"), args[:3], strict=True):
        yield name, tensor.reshape(tensor.shape[0], -1)


def _experts(module, args, output, top_k):
    """The expert ids SGLang's TopK chose (its own routing, not a recomputation), sorted."""
    import torch

    ids = getattr(output, "topk_ids", None)
    if ids is None:
        raise TypeError(
            f"TopK returned {type(output).__name__}, which carries no topk_ids: this MoE "
            "runner routes inside its kernel"
        )
    if top_k:
        ids = ids[:, :top_k]
    yield "experts", torch.sort(ids.to(torch.int64), dim=-1).values


def _logits(module, args, output, top_k):
    """LogitsProcessor(input_ids, hidden_states, lm_head, forward_batch): the logits of every
    position through SGLang's own lm-head path (its `_get_logits`: lm head, logit scale,
    soft-capping), then the forward's positions (written last: the forward is complete)."""
    hidden, lm_head, batch = args[1], args[2], args[3]
    from sglang.srt.layers.logits_processor import LogitsMetadata

    metadata = (
        batch if isinstance(batch, LogitsMetadata) else LogitsMetadata.from_forward_batch(batch)
    )
    yield "logits", module._get_logits(hidden, lm_head, metadata, use_logits_buffer=False)
    yield "positions", batch.positions


_HANDLERS = {
    "embed": _output("embed"),
    "input_norm": _output("input_norm"),
    "qkv": _qkv,
    "attn_out": _output("attn_out"),
    "mlp_in": _output("mlp_in"),
    "router_logits": _output("router_logits"),
    "experts": _experts,
    "mlp_out": _output("mlp_out"),
    "final_norm": _output("final_norm"),
    "logits": _logits,
}

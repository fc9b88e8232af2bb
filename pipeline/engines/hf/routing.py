"""The experts an HF MoE model's routers choose, read from the routers themselves, and
router replay (R3): each router made to choose the rollout's experts.

Hooks sit on each MoE layer's router module (``layers.N.mlp.gate``: transformers' TopKRouter,
which returns logits, gate weights and expert ids). They work the same inside FSDP and
DeepSpeed wrappers, which keep the module tree.
"""

from __future__ import annotations

import re

import numpy as np

from pipeline.routing import ROUTING_DTYPE

_ROUTER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")
_TAP = "_lpx_router_tap"


class RouterTap:
    """Hooks on every router of one model. For each forward, `begin` says where each
    sequence sits in the batch (and optionally which experts to force); `finish` returns
    each sequence's routing [length - 1, MoE layers, k], expert ids sorted."""

    def __init__(self, routers: list[tuple[int, object]]):
        self.layers = [layer for layer, _ in routers]
        self.top_k = int(routers[0][1].top_k)
        self.num_experts = int(routers[0][1].num_experts)
        self._seen: dict[int, object] = {}
        self._forced = None
        self._layout = None
        for slot, (_, module) in enumerate(routers):
            module.register_forward_hook(self._hook(slot))

    def begin(self, width: int, starts, lengths, forced: list | None = None) -> None:
        """``starts``: (row, column) of each sequence in a batch of rows x ``width``;
        ``forced``: per sequence [length - 1, layers, k] expert ids to route to, or None."""
        import torch

        self._layout = (width, list(starts), list(lengths))
        self._seen = {}
        self._forced = None
        if forced is not None:
            rows = max(row for row, _ in starts) + 1
            ids = torch.full((rows * width, len(self.layers), self.top_k), -1, dtype=torch.long)
            for (row, column), length, chosen in zip(starts, lengths, forced, strict=True):
                if chosen.shape != (length - 1, len(self.layers), self.top_k):
                    raise ValueError(
                        f"forced routing of shape {chosen.shape} for a sequence of {length} "
                        f"tokens, {len(self.layers)} MoE layers, top-{self.top_k}"
                    )
                flat = row * width + column
                ids[flat : flat + length - 1] = torch.from_numpy(chosen.astype(np.int64))
            self._forced = ids

    def begin_decode(self) -> None:
        """Record every forward of a KV-cache decode: a left-padded prefill, then one
        position per row per step (`finish_decode` stitches them per sequence)."""
        self._layout = "decode"
        self._forced = None
        self._seen = {slot: [] for slot in range(len(self.layers))}

    def finish_decode(self, prompt_lengths, completion_lengths) -> list[np.ndarray]:
        """Per row: its prompt's positions from the prefill, then the decode steps that fed
        its completion tokens back (every one but the last)."""
        rows = len(prompt_lengths)
        calls = [
            [c.reshape(rows, -1, self.top_k) for c in self._seen[slot]]
            for slot in range(len(self.layers))
        ]
        self._layout = None
        out = []
        for i, (prompt, completion) in enumerate(
            zip(prompt_lengths, completion_lengths, strict=True)
        ):
            per_layer = []
            for layer_calls in calls:
                prefill = layer_calls[0][i, layer_calls[0].shape[1] - prompt :]
                steps = [call[i] for call in layer_calls[1:completion]]
                per_layer.append(np.concatenate([prefill, *steps]))
            out.append(np.sort(np.stack(per_layer, axis=1), axis=-1).astype(ROUTING_DTYPE))
        return out

    def finish(self) -> list[np.ndarray]:
        width, starts, lengths = self._layout
        missing = [layer for slot, layer in enumerate(self.layers) if slot not in self._seen]
        if missing:
            raise RuntimeError(f"the routers of MoE layers {missing} did not run in this forward")
        stacked = np.stack([self._seen[slot] for slot in range(len(self.layers))], axis=1)
        stacked = np.sort(stacked, axis=-1).astype(ROUTING_DTYPE)
        out = []
        for (row, column), length in zip(starts, lengths, strict=True):
            flat = row * width + column
            out.append(stacked[flat : flat + length - 1])
        self._layout = self._forced = None
        return out

    def _hook(self, slot: int):
        def hook(module, args, output):
            if self._layout is None:  # a forward lpx did not lay out (capture)
                return None
            logits, weights, chosen = output
            if self._layout == "decode":
                self._seen[slot].append(chosen.detach().to("cpu").numpy())
                return None
            if self._forced is not None:
                chosen, weights = self._force(module, logits, chosen, self._forced[:, slot])
                output = (logits, weights, chosen)
            self._seen[slot] = chosen.detach().to("cpu").numpy()
            return output

        return hook

    @staticmethod
    def _force(module, logits, own, forced):
        """The forced experts where given (own elsewhere: padding, the last position), with
        the gate weights this router gives them: its softmax at those experts, renormalised
        when the model's norm_topk_prob says so (as the router does for its own choice)."""
        import torch

        forced = forced.to(own.device)
        given = (forced >= 0).all(dim=-1, keepdim=True)
        chosen = torch.where(given, forced, own.to(torch.long))
        probabilities = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights = probabilities.gather(-1, chosen)
        if getattr(module, "norm_topk_prob", False):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen.to(own.dtype), weights.to(logits.dtype)


def router_tap(model) -> RouterTap | None:
    """The model's tap (installed on first use), or None for a dense model."""
    if hasattr(model, _TAP):
        return getattr(model, _TAP)
    routers = []
    for name, module in model.named_modules():
        match = _ROUTER.search(name)
        if match and hasattr(module, "top_k") and hasattr(module, "num_experts"):
            routers.append((int(match.group(1)), module))
    tap = RouterTap(sorted(routers, key=lambda r: r[0])) if routers else None
    object.__setattr__(model, _TAP, tap)
    return tap

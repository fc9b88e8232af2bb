"""The experts megatron-core's own routers choose, and router replay (R3), through megatron's
RouterReplay (`moe_enable_routing_replay`, set by `megatron.model.moe_settings`).

Each MoE layer's TopKRouter owns a RouterReplay: with the RECORD action it keeps the top-k
it computed ([tokens, k]); with REPLAY_FORWARD it takes the given expert ids instead and
gathers its own scores at them, so the gate weights are megatron's own router
probabilities at the forced experts (a softmax over every expert when
`moe_router_pre_softmax`, i.e. norm_topk_prob False; a softmax over the k forced logits,
i.e. the renormalised probabilities, when norm_topk_prob is True).

Megatron works sequence-first: a batch of B sequences x W positions reaches the router as
[W, B, hidden], so token (row b, position s) is router row s * B + b. Routers run on each
rank's own tokens before any dispatch (TP ranks hold the same tokens, EP ranks their own
micro-batch), so each rank reads its own sequences' routing; nothing is gathered here.
"""

from __future__ import annotations

import numpy as np

from pipeline.errors import BadInput
from pipeline.routing import ROUTING_DTYPE


class MegatronRouters:
    """Record or force the routing of every MoE layer of one GPTModel."""

    def __init__(self, model):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._actions = RouterReplayAction
        self.layers, self.replays = [], []
        for index, layer in enumerate(model.decoder.layers):
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                if router.router_replay is None:
                    raise RuntimeError("the GPTModel was built without moe_enable_routing_replay")
                self.layers.append(index)
                self.replays.append(router.router_replay)
        self.top_k = int(model.config.moe_router_topk) if self.layers else 0
        self.num_experts = int(model.config.num_moe_experts or 0)

    def __bool__(self) -> bool:
        return bool(self.layers)

    def begin(self, forced: dict[int, object] | None = None) -> None:
        """Before a forward: record every router, except the slots in `forced` (slot ->
        [router rows, k] expert ids), which route to those experts."""
        import torch

        forced = forced or {}
        for slot, replay in enumerate(self.replays):
            replay.clear_indices()
            if slot in forced:
                replay.set_target_indices(torch.as_tensor(forced[slot], dtype=torch.long))
                replay.set_router_replay_action(self._actions.REPLAY_FORWARD)
            else:
                replay.set_router_replay_action(self._actions.RECORD)

    def chosen(self, slot: int):
        """The [router rows, k] expert ids slot `slot` routed to in the last forward (the
        forced ones where forced), as a torch tensor."""
        replay = self.replays[slot]
        if replay.router_replay_action == self._actions.REPLAY_FORWARD:
            return replay.target_topk_idx
        if replay.recorded_topk_idx is None:
            raise RuntimeError(f"the router of MoE layer {self.layers[slot]} did not run")
        return replay.recorded_topk_idx

    def finish(self) -> np.ndarray:
        """[router rows, MoE layers, k] expert ids of the last forward, sorted per row; the
        routers are left recording nothing (and holding no tensors)."""
        stacked = np.stack(
            [self.chosen(slot).detach().cpu().numpy() for slot in range(len(self.replays))], axis=1
        )
        self.end()
        return np.sort(stacked, axis=-1).astype(ROUTING_DTYPE)

    def end(self) -> None:
        for replay in self.replays:
            replay.clear_indices()
            replay.clear_router_replay_action()


def batch_targets(
    forced: list[np.ndarray], width: int, layers: int, top_k: int
) -> dict[int, np.ndarray]:
    """Per MoE layer slot, [width * batch, k] router rows for a right-padded batch whose
    sequence b has ``forced[b]`` ([length - 1, layers, k]) for its positions 0 .. length - 2.
    The rows the fixture has none for (each sequence's last position, padding) route to
    experts 0 .. k-1: no scored logprob depends on them (causal attention, per-token MoE)."""
    batch = len(forced)
    rows = np.tile(np.arange(top_k, dtype=np.int64), (width, batch, layers, 1))
    for b, chosen in enumerate(forced):
        chosen = np.asarray(chosen)
        if chosen.ndim != 3 or chosen.shape[1:] != (layers, top_k):
            raise BadInput(
                f"router_replay: the fixture's routed_experts rows are {chosen.shape[1:]} (MoE "
                f"layers, k), and this model has {layers} MoE layers, top-{top_k}; replay with "
                "the model that made the fixture."
            )
        rows[: len(chosen), b] = chosen
    flat = rows.reshape(width * batch, layers, top_k)  # row s * batch + b, as megatron routes
    return {slot: flat[:, slot] for slot in range(layers)}


def sequence_rows(routed: np.ndarray, batch: int, row: int, length: int) -> np.ndarray:
    """Sequence `row`'s [length - 1, layers, k] routing out of a forward's [width * batch,
    layers, k] router rows."""
    return routed[row::batch][: length - 1]

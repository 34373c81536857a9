"""Rollout routing replay (R3) in the megatron learner, through megatron-core's own RouterReplay.

Owns what happens at a megatron MoE router for each micro-batch: with ``algo.routing_replay=r3`` the
router uses the experts the sampler's engine chose for each position (``TrainBatch.routes``, the sample's
recorded routes in the learner's token order) instead of its own top-k, in the forward and therefore in the
backward; with replay off it routes itself. Either way it also records what its own top-k was, so the
step can report how often learner and sampler agree (megarl.algo.metrics router partials).

How it uses megatron-core 0.16.1 (``transformer/moe/router_replay.py``): every ``Router`` built with
``TransformerConfig.moe_enable_routing_replay`` holds a ``RouterReplay``; in ``REPLAY_FORWARD`` its top-k is
the target indices set on it and the routing probabilities are the router's scores gathered at those
indices, so gradients still reach the router weight through the scores. One target per layer is held, so
it is set before every micro-batch's forward (megatron's schedules call ``forward_step`` right before each
micro-batch's forward, on every pipeline stage, for its own layers only). The backward needs no target:
the chosen indices are saved by autograd in the forward. Activation recomputation of whole layers would
re-run the router in the backward, after later micro-batches set their targets: megarl refuses r3 with
``learner.recompute_activations=full`` (megarl/config/load.py) rather than drive ``REPLAY_BACKWARD``.
The replayer installs a subclass per router (not megatron's static all-instances list, which a second
model in the process, the KL reference, would share) that also records the router's own top-k.

Token order: megatron's MoE layer sees hidden states [S, B, H] and routes them flattened s-major, so the
target of micro-batch routes [B, S, L, k] for layer l is ``routes[:, :, l].transpose(0, 1).reshape(-1, k)``.
Under sequence parallelism (an MoE model at learner.tp > 1: megarl.learner.sequence_parallel) a TP rank's MoE
layers see only its positions [start, end) of the (padded) micro-batch, [S/tp, B, H]: its routers get that slice
of the routes, and what they chose themselves is gathered over the TP group back into the whole micro-batch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.learner.sequence_parallel import local_positions


def _replay_class():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class OwnChoiceRouterReplay(RouterReplay):
        """megatron's RouterReplay that also records the router's own top-k while it replays."""

        REPLAYING = (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD)

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            self.record_indices(own.detach())
            if self.router_replay_action in self.REPLAYING:
                return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            return probs, own

    return OwnChoiceRouterReplay, RouterReplay, RouterReplayAction


class RouteReplayer:
    """The routers of one megatron model (this pipeline stage's MoE layers, whose routes are the samples' route
    ``layer_offset + j``: the MoE layers counted, dense ones not), fed before each micro-batch's forward."""

    def __init__(self, gpt, layer_offset: int, replay: bool, seq_group=None):
        replay_cls, base, self._action = _replay_class()
        self.layer_offset, self.replay = layer_offset, replay
        self.seq_group = seq_group  # the TP group under sequence parallelism (None: every rank sees every position)
        self.routers = [layer.mlp.router for layer in gpt.decoder.layers if hasattr(layer.mlp, "router")]
        self.top_k = int(gpt.config.moe_router_topk)
        for router in self.routers:
            if router.router_replay is not None:  # built by megatron: taken out of its process-wide list
                base.global_router_replay_instances.remove(router.router_replay)
            router.router_replay = replay_cls()
            base.global_router_replay_instances.remove(router.router_replay)
        self._shape: tuple[int, int] | None = None

    def _positions(self, width: int) -> slice:
        if self.seq_group is None:
            return slice(0, width)
        return local_positions(width, self.seq_group.size(), self.seq_group.rank())

    def before_forward(self, input_ids: torch.Tensor, routes: torch.Tensor | None) -> None:
        """Set this micro-batch's targets (replay) or let the routers choose (off); under sequence parallelism
        input_ids and routes are the padded micro-batch, of which this rank's routers see their positions."""
        self._shape = tuple(input_ids.shape)
        positions = self._positions(input_ids.shape[1])
        for j, router in enumerate(self.routers):
            replay = router.router_replay
            replay.clear_indices()
            if not self.replay:
                replay.clear_router_replay_action()
                continue
            if routes is None:
                raise RuntimeError("algo.routing_replay=r3: a micro-batch reached the learner without routes")
            layer = routes[:, positions, self.layer_offset + j]  # [B, S (this rank's), k]
            replay.set_target_indices(layer.transpose(0, 1).reshape(-1, layer.shape[-1]).long())
            replay.set_router_replay_action(self._action.REPLAY_FORWARD)

    def own_choice(self) -> torch.Tensor | None:
        """[B, S, L_stage, k] the top-k each of this stage's routers computed itself in the last forward (under
        sequence parallelism gathered from every TP rank's positions: collective over the TP group); None before
        any forward. A stage without MoE layers (a pipeline stage of only DeepSeek-V3's or GLM-4.5's first dense
        layers) made no choice: [B, S, 0, k], which counts no routing decision in the stages' sum."""
        if self._shape is None:
            return None
        b, s = self._shape
        if not self.routers:
            return torch.empty((b, s, 0, self.top_k), dtype=torch.long)
        local = self._positions(s)
        own = torch.stack([r.router_replay.get_recorded_indices().reshape(local.stop - local.start, b, -1)
                           for r in self.routers], dim=2)  # [S (this rank's), B, L_stage, k]
        if self.seq_group is not None:
            parts = [torch.empty_like(own) for _ in range(self.seq_group.size())]
            dist.all_gather(parts, own.contiguous(), group=self.seq_group)
            own = torch.cat(parts)  # the ranks hold consecutive positions
        return own.transpose(0, 1).cpu()

    def clear(self) -> None:
        """Drop the held indices (megatron's REPLAY_BACKWARD list grows with every target set)."""
        for router in self.routers:
            router.router_replay.clear_indices()

"""Rollout routing replay (R3) in the DeepSpeed learner: the recorded routes forced at a transformers MoE router.

Owns what happens at each router of a transformers 5.x MoE model (Mixtral, Qwen3-MoE: ``model.layers[i].mlp.gate``,
``MixtralTopKRouter`` / ``Qwen3MoeTopKRouter``; gpt-oss: ``mlp.router``, ``GptOssTopKRouter``; DeepSeek-V3:
``mlp.gate``, ``DeepseekV3TopkRouter``, and GLM-4.5: ``Glm4MoeTopkRouter``, the same sigmoid scores, in the layers
after their dense first ones) for each
micro-batch.
Such a router returns
``(router_logits, top-k scores, top-k indices)`` and its sparse block sends each token to the indices, weighted by
the scores. A forward hook on the router replaces that output: with ``algo.routing_replay=r3`` the indices are the
ones the sampler's engine recorded (``TrainBatch.routes``) and the scores the router's own softmax gathered at them
(renormalised over the k exactly where the router renormalises its own top-k: Mixtral always, Qwen3-MoE with
``norm_topk_prob``), so the router weight still gets gradients through the scores, as megatron's RouterReplay
does. With replay off the output is untouched. Either way the hook records the router's own top-k, so the step
can report how often learner and sampler agree.

The hook computes from the router's own logits: when the replayed indices equal the router's own the output is
bit-identical to transformers'. The targets stay set from a micro-batch's forward until the next micro-batch's, so
HF gradient checkpointing, which re-runs a layer's forward in the backward, replays the same routes.

Token order: the sparse block flattens hidden states [B, S, H] b-major before the router, so layer l's target of
micro-batch routes [B, S, L, k] is ``routes[:, :, l].reshape(-1, k)``.
"""
from __future__ import annotations

import torch

from megarl.models import moe


def replayed_scores(router_logits: torch.Tensor, indices: torch.Tensor, renormalise: bool,
                    dtype: torch.dtype) -> torch.Tensor:
    """[T, k] routing weights of `indices` [T, k] as transformers' top-k router computes them for its own top-k
    (pure): the fp32 softmax over all experts gathered at the indices, renormalised over the k when the router
    renormalises, in `dtype` (the dtype its own scores come in)."""
    probs = torch.softmax(router_logits.float(), dim=-1).gather(-1, indices)
    if renormalise:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs.to(dtype)


def replayed_sigmoid_scores(router_logits: torch.Tensor, indices: torch.Tensor, renormalise: bool,
                            scaling: float) -> torch.Tensor:
    """[T, k] routing weights of `indices` as DeepSeek-V3's and GLM-4.5's router (DeepseekV3TopkRouter) computes them for its own
    top-k (pure): the sigmoid of the fp32 logits gathered at the indices (the expert bias only chooses, it does
    not weigh), over their sum + 1e-20 when the router renormalises (norm_topk_prob), times
    routed_scaling_factor; fp32, as its own."""
    scores = router_logits.float().sigmoid().gather(-1, indices)
    if renormalise:
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    return scores * scaling


class HFRouteReplayer:
    """The routers of one transformers MoE model, fed before each micro-batch's forward."""

    def __init__(self, model, hf_config: dict, replay: bool):
        self.replay = replay
        # Mixtral's router renormalises its top-k in fp32 and returns fp32 scores; Qwen3-MoE's renormalises only
        # with norm_topk_prob and casts the scores to the logits' dtype.
        # gpt-oss's router softmaxes its top-k logits: the full softmax gathered there, renormalised.
        mixtral, gpt_oss = hf_config["model_type"] == "mixtral", hf_config["model_type"] == "gpt_oss"
        self._renormalise = mixtral or gpt_oss or bool(hf_config.get("norm_topk_prob", False))
        self._cast = not mixtral
        # DeepSeek-V3's and GLM-4.5's router (one computation in transformers: DeepseekV3TopkRouter,
        # Glm4MoeTopkRouter): sigmoid scores, renormalised (norm_topk_prob) and scaled
        self._sigmoid = hf_config["model_type"] in moe.SIGMOID_ROUTED
        self._scaling = float(hf_config.get("routed_scaling_factor") or 1.0)
        # (route l is MoE layer l: decoder layer first_dense_layers + l, after DeepSeek-V3's / GLM-4.5's dense ones)
        first = moe.first_dense_layers(hf_config)
        self.routers = [model.get_submodule(f"model.layers.{first + i}.mlp.{'router' if gpt_oss else 'gate'}")
                        for i in range(moe.num_moe_layers(hf_config))]
        self._targets: list[torch.Tensor | None] = [None] * len(self.routers)
        self._own: list[torch.Tensor | None] = [None] * len(self.routers)
        self._shape: tuple[int, int] | None = None
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def hook(module, args, output):
            logits, scores, own = output
            self._own[layer] = own.detach()
            if not self.replay:
                return None
            target = self._targets[layer]
            if target is None:
                raise RuntimeError("algo.routing_replay=r3: a micro-batch reached the learner without routes")
            if target.shape != own.shape:
                raise RuntimeError(f"algo.routing_replay=r3: layer {layer}'s router saw {tuple(own.shape)} token "
                                   f"routes, the micro-batch's recorded ones are {tuple(target.shape)}")
            target = target.to(own.device)
            if self._sigmoid:
                return logits, replayed_sigmoid_scores(logits, target, self._renormalise, self._scaling), target
            return logits, replayed_scores(logits, target, self._renormalise,
                                           logits.dtype if self._cast else scores.dtype), target
        return hook

    def before_forward(self, input_ids: torch.Tensor, routes: torch.Tensor | None) -> None:
        """Set this micro-batch's targets (replay; `routes` [B, S, L, k]) or let the routers choose (off)."""
        self._shape = tuple(input_ids.shape)
        self._own = [None] * len(self.routers)
        if not self.replay:
            return
        if routes is None:
            raise RuntimeError("algo.routing_replay=r3: a micro-batch reached the learner without routes")
        k = routes.shape[-1]
        self._targets = [routes[:, :, layer].reshape(-1, k).long() for layer in range(len(self.routers))]

    def own_choice(self) -> torch.Tensor:
        """[B, S, L, k] the top-k each router computed itself in the last forward."""
        b, s = self._shape
        return torch.stack([own.reshape(b, s, -1) for own in self._own], dim=2).cpu()

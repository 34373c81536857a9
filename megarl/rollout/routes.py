"""A batch's MoE routes: every sample's recorded routes checked and packed into the learner's [B, S, L, k].

A sample's `routes` (MOE_CONTRACT, megarl.protocols.Sample) are [P, L_moe, top_k] small integers with
P = len(prompt_ids) + len(token_ids) - 1: row i holds the experts the engine's router chose in each MoE layer
when it computed position i (input token i). The batch tensor is aligned with input_ids: entry [b, t] = the
routes of input token [b, t]. A sample's last token and the right padding have no recorded route; they are
filled with experts 0..k-1 (any valid distinct indices would do): the log-prob of token t comes from the
logits at position t-1, which causal attention computes from positions <= t-1 only, so what the last
position and the padding after it are routed to never reaches a trained log-prob (nor its gradient).

Pure functions; the learner's lead calls `pack_routes` while it assembles a batch, so a sample with missing or
malformed routes under routing replay stops the step there, naming its sampler rank.
"""
from __future__ import annotations

import numpy as np
import torch

from megarl.protocols import RouteShape, Sample


def check_routes(sample: Sample, shape: RouteShape) -> np.ndarray:
    """The sample's routes, or ValueError naming the sampler rank, the sample and what is wrong."""
    where = f"sample {sample.group_id!r} from sampler rank {sample.sampler_rank}"
    routes = sample.routes
    if routes is None:
        raise ValueError(f"algo.routing_replay=r3: {where} carries no routes (its engine did not record them); "
                         "the step stops rather than train it unreplayed")
    routes = np.asarray(routes)
    positions = len(sample.prompt_ids) + len(sample.token_ids) - 1
    expected = (positions, shape.layers, shape.top_k)
    if routes.shape != expected:
        raise ValueError(f"{where}: routes of shape {routes.shape}, expected {expected} (prompt + tokens - 1 "
                         f"positions, {shape.layers} MoE layers, top_k {shape.top_k})")
    if not np.issubdtype(routes.dtype, np.integer):
        raise ValueError(f"{where}: routes of dtype {routes.dtype}, expected small integers")
    if routes.size and (routes.min() < 0 or routes.max() >= shape.num_experts):
        raise ValueError(f"{where}: routes name experts outside 0..{shape.num_experts - 1} "
                         f"(min {routes.min()}, max {routes.max()})")
    return routes


def pack_routes(samples: list[Sample], width: int, shape: RouteShape | None, required: bool) -> torch.Tensor | None:
    """[B, width, L, k] routes of the batch's samples (see module docstring), or None when the model is dense,
    or when routes are not required (replay off) and some sample has none (then no agreement metrics)."""
    if shape is None:
        return None
    if not required and any(s.routes is None for s in samples):
        return None
    out = torch.arange(shape.top_k, dtype=shape.dtype).expand(len(samples), width, shape.layers, shape.top_k).clone()
    for i, sample in enumerate(samples):
        routes = check_routes(sample, shape)
        out[i, :routes.shape[0]] = torch.from_numpy(routes.astype(np.int64)).to(shape.dtype)
    return out

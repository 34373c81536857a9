"""Routes over SGLang's return_routed_experts contract: megarl's client asks for and parses them, megarl's
SGLang-compatible server answers them from the built-in engine's records (a real server process)."""
from __future__ import annotations

import base64

import numpy as np
import pytest

from megarl.config.load import load_config
from megarl.protocols import GenerationRequest, RouteShape, SamplingParams
from megarl.sampler.sglang_engine import (
    SUPPORTED_VERSIONS, SGLangEngine, SGLangError, check_routed_experts, generate_body, routes_from_meta,
    server_command)
from megarl.distributed.ranks import Topology
from tests.sampler import hf_logprobs_and_routes, make_tiny_model

CONTEXT = 64
TOPO = Topology(rank=1, world_size=2, num_learners=1, num_samplers=1)
SHAPE = RouteShape(layers=2, top_k=2, num_experts=4)


def config(run_dir, model_dir, *overrides):
    return load_config(None, [f"run.dir={run_dir}", f"model.path={model_dir}", "sampler.engine=sglang",
                              f"sampler.max_seq_len={CONTEXT}", "sampler.max_running=4", *overrides])


def test_r3_asks_for_routes_in_the_body_and_the_launch_and_parses_sglangs_base64_int32():
    req = GenerationRequest("r", [1, 2, 3], SamplingParams(max_new_tokens=4))
    assert "return_routed_experts" not in generate_body(req, CONTEXT)
    assert generate_body(req, CONTEXT, routed_experts=True)["return_routed_experts"] is True
    routes = np.arange(5 * 2 * 2, dtype=np.int32).reshape(5, 2, 2) % 4  # prompt 3 + 3 tokens - 1
    meta = {"routed_experts": base64.b64encode(routes.tobytes()).decode()}
    parsed = routes_from_meta(meta, req, 3, SHAPE)
    assert parsed.dtype == np.uint8
    np.testing.assert_array_equal(parsed, routes)
    with pytest.raises(ValueError, match=r"holds 20 indices, expected 6 positions"):
        routes_from_meta(meta, req, 4, SHAPE)
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        routes_from_meta({}, req, 3, SHAPE)


def test_a_release_without_return_routed_experts_is_refused_for_r3_naming_it():
    for version in SUPPORTED_VERSIONS:
        check_routed_experts(version)
    with pytest.raises(SGLangError, match=r"version '0\.5\.20'.*algo.routing_replay=r3"):
        check_routed_experts("0.5.20")


def test_the_launch_enables_route_capture_only_for_r3(tmp_path):
    off = server_command(config(tmp_path, tmp_path), tmp_path, 1, 0)
    r3 = server_command(config(tmp_path, tmp_path, "algo.routing_replay=r3"), tmp_path, 1, 0)
    assert "--enable-return-routed-experts" not in off and "--enable-return-routed-experts" in r3


def test_routes_through_the_sglang_compatible_server_equal_transformers(tmp_path):
    """Lag 0: the server's routes (and log-probs) of every position are transformers' for the same tokens."""
    model = make_tiny_model(tmp_path / "moe", "mixtral", max_position_embeddings=CONTEXT)
    engine = SGLangEngine.from_config(config(tmp_path / "run", model, "algo.routing_replay=r3"), TOPO, model)
    try:
        for i, prompt in enumerate([[1, 5, 9, 2], [3, 3], [7, 1, 4, 1, 5, 9, 2, 6]]):
            engine.add_request(GenerationRequest(str(i), prompt, SamplingParams(temperature=1.0, max_new_tokens=6)))
        done = {}
        while engine.num_unfinished:
            done.update((c.request_id, c) for c in engine.step())
    finally:
        engine.close()
    for c in done.values():
        logp, routes = hf_logprobs_and_routes(c.prompt_ids + c.token_ids, (model, None))
        n = len(c.prompt_ids)
        assert max(abs(lp - logp[n - 1 + i, t].item()) for i, (lp, t) in enumerate(zip(c.logprobs, c.token_ids))) < 1e-5
        np.testing.assert_array_equal(c.routes, routes[:-1])

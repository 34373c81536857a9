"""DeepSpeedLearner on mixture-of-experts models (one gloo rank, in this process) against transformers: the
published per-expert HF names, and rollout routing replay (R3) through a hook on transformers' own router
(megarl/learner/hf_routing_replay.py), in the training pass and the extra log-prob passes.

The "sampler" is transformers in fp32 (tests/learner/test_moe_learner.py's pattern): its routes are the top-k of its
router logits, its log-probs the behaviour log-probs, so at lag 0 every difference is the learner's doing."""
import pytest
import torch
from safetensors.torch import load_file

from megarl.algo.config import LossConfig
from megarl.config.schema import DeepSpeedConfig, LearnerConfig
from megarl.learner.step import micro_batch_rows
from tests.helpers import LEARNER_TOL, save_tiny_deepseek_v3, save_tiny_glm4_moe, save_tiny_gpt_oss, save_tiny_moe
from tests.learner.conftest import destroy_world
from tests.learner.test_moe_learner import B, S, _batch, _hf_forward, _ids, _perturbed_router_dir


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """World-size-1 gloo default group (the learner ranks) with the LOCAL_RANK DeepSpeed asks a launcher for; no
    megatron (conftest's world tears its state down too)."""
    import os

    import torch.distributed as dist

    saved = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    destroy_world()
    if saved is None:
        del os.environ["LOCAL_RANK"]
    else:
        os.environ["LOCAL_RANK"] = saved


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_moe")
    return {"mixtral": str(save_tiny_moe(root / "mixtral", "mixtral")),
            "qwen3_moe": str(save_tiny_moe(root / "qwen3_moe", "qwen3_moe")),
            "gpt_oss": str(save_tiny_gpt_oss(root / "gpt_oss")),
            "deepseek_v3": str(save_tiny_deepseek_v3(root / "deepseek_v3")),
            "glm4_moe": str(save_tiny_glm4_moe(root / "glm4_moe"))}


def _learner(model_dir, routing_replay="off", zero_stage=1, loss_cfg=None, **cfg):
    from megarl.learner.deepspeed import DeepSpeedLearner

    cfg = LearnerConfig(backend="deepspeed", deepspeed=DeepSpeedConfig(zero_stage=zero_stage), **cfg)
    return DeepSpeedLearner(model_dir, cfg, loss_cfg or LossConfig(), routing_replay=routing_replay)


def _expert_calls(learner):
    """Per MoE layer, the top-k indices every forward handed the fused experts (transformers' own module) of the
    policy and, when there is one, the KL reference model."""
    models = [learner.module] + ([learner.ref_model] if learner.ref_model is not None else [])
    calls = [[] for _ in learner.module.model.layers]
    for model in models:
        for layer, block in enumerate(model.model.layers):
            block.mlp.experts.register_forward_pre_hook(
                lambda mod, args, layer=layer: calls[layer].append(args[1].clone()))
    return calls


@pytest.mark.parametrize("kind,zero_stage", [("mixtral", 1), ("qwen3_moe", 3), ("deepseek_v3", 1),
                                             ("deepseek_v3", 3), ("glm4_moe", 2)])
def test_moe_publishes_and_exports_the_save_pretrained_state(moe_dirs, world, kind, zero_stage, tmp_path):
    """transformers fuses the experts in memory; what samplers receive and what a checkpoint exports is
    save_pretrained's per-expert state, in the order, shapes and dtypes publish_spec announces (ZeRO-3: gathered
    per bucket); DeepSeek-V3's router expert bias (a buffer: no parameter) among it, which the engines' routers
    read; the built-in engine's arena takes exactly those tensors."""
    from megarl.learner.deepspeed import checkpoint_hf_tensors
    from megarl.sampler import hf_model

    learner = _learner(moe_dirs[kind], zero_stage=zero_stage)
    published = {n: t.clone() for n, t in learner.publish_tensors()}
    assert learner.publish_spec() == [(n, tuple(t.shape), t.dtype) for n, t in published.items()]
    learner.save_shards(tmp_path)
    exported = dict(checkpoint_hf_tensors(tmp_path, learner.hf_config))
    saved = load_file(f"{moe_dirs[kind]}/model.safetensors")
    assert set(published) == set(saved) == set(exported)
    for name, tensor in saved.items():
        assert torch.equal(published[name], tensor) and torch.equal(exported[name], tensor), name
    hf_model.choose(learner.hf_config).ModelSpec.from_hf_config(learner.hf_config).check_weights(published)


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe"])
def test_sigmoid_routed_logprobs_match_transformers(moe_dirs, world, kind):
    """DeepSeek-V3 and GLM-4.5 on the DeepSpeed learner: their routers are those of the MoE layers after the dense
    first one (the route replayer's, built for every MoE model), and their log-probs are transformers' own to the
    fp32 bound."""
    from tests.learner.test_moe_learner import _tol

    learner = _learner(moe_dirs[kind])
    ids = _ids()
    ref, _ = _hf_forward(moe_dirs[kind], ids)
    assert (learner.logprobs(ids) - ref).abs().max().item() <= _tol(moe_dirs[kind])


def test_r3_forces_the_recorded_routes_in_every_pass(moe_dirs, world, tmp_path):
    """Same weights: the learner's own routes are the sampler's and the lag-0 log-prob gap is fp32 noise. A
    perturbed learner router: without replay the agreement drops and the gap grows; with r3 every forward of the
    step (the decoupled objective's proximal pass, the KL reference's pass, the training pass, and the recomputed
    forward of HF gradient checkpointing) hands the experts exactly the recorded routes, layer by layer, the
    learner's own router still reports its disagreement, and the router weight still learns."""
    ids = _ids()
    behaviour, routes = _hf_forward(moe_dirs["mixtral"], ids)
    batch = _batch(ids, behaviour, routes)

    same = _learner(moe_dirs["mixtral"], routing_replay="r3", micro_batch_size=3).train_step(batch)
    assert same["router/agreement"] == 1.0 and same["router/token_diff_frac"] == 0.0
    assert same["lag0/logprob_gap_abs"] < LEARNER_TOL

    perturbed = _perturbed_router_dir(moe_dirs["mixtral"], tmp_path / "perturbed")
    off = _learner(perturbed, micro_batch_size=3).train_step(batch)
    assert off["router/agreement"] < 0.9 and off["lag0/logprob_gap_abs"] > 1e-3

    loss_cfg = LossConfig(decoupled=True, kl_coef=0.1)
    # Unpacked rows, so each forward's routes are a run of the batch's rows (packed micro-batches are checked
    # end to end above: `same` packs by default, and its learner routes exactly as the sampler did).
    r3 = _learner(perturbed, routing_replay="r3", micro_batch_size=3, recompute_activations="full", loss_cfg=loss_cfg,
                  pack_sequences=False)
    calls = _expert_calls(r3)
    router = r3.module.model.layers[0].mlp.gate.weight
    before = router.detach().clone()
    m = r3.train_step(batch)
    assert m["router/agreement"] < 0.9  # what its own router would have chosen
    # Every row has the same length, so the rows keep their order and the micro-batches are consecutive runs
    # of at most 3 (megarl.learner.step.micro_batch_rows: 8 equal rows -> 3 runs), in the order of the
    # forwards: the proximal pass, the reference's, then each training forward followed by its recomputation.
    runs = [(int(g[0]), int(g[-1]) + 1) for g in micro_batch_rows(torch.full((B,), S), 3)]
    assert len(runs) == 3 and runs[0][0] == 0 and runs[-1][1] == B
    chunks = [0, 1, 2] + [0, 1, 2] + [0, 0, 1, 1, 2, 2]
    for layer, seen in enumerate(calls):
        assert len(seen) == len(chunks), layer
        for call, chunk in zip(seen, chunks):
            lo, hi = runs[chunk]
            expected = routes[lo:hi, :, layer].reshape(-1, routes.shape[-1]).long()
            assert torch.equal(call, expected), (layer, chunk)
    assert not torch.equal(router.detach(), before)  # (weight_decay 0: moved by its gradient alone)


def test_r3_on_qwen3_moe_unnormalised_routing_is_exact(moe_dirs, world):
    """Qwen3-MoE with norm_topk_prob false (top-k of the softmax, not renormalised, in the logits' dtype): replayed
    scores equal the router's own at the same routes, so the lag-0 gap is fp32 noise."""
    ids = _ids()
    behaviour, routes = _hf_forward(moe_dirs["qwen3_moe"], ids)
    learner = _learner(moe_dirs["qwen3_moe"], routing_replay="r3", micro_batch_size=3)
    assert (learner.logprobs(ids, routes) - behaviour).abs().max() < LEARNER_TOL
    m = learner.train_step(_batch(ids, behaviour, routes))
    assert m["router/agreement"] == 1.0 and m["lag0/logprob_gap_abs"] < LEARNER_TOL


def test_r3_on_gpt_oss_replays_at_its_router(moe_dirs, world, tmp_path):
    """gpt-oss's router (mlp.router: biased logits, top-k, softmax over the k): same weights, its own routes are the
    sampler's and the lag-0 gap is fp32 noise under r3; a perturbed router under r3 hands the experts exactly the
    recorded routes, and its own choice still shows its disagreement."""
    ids = _ids()
    behaviour, routes = _hf_forward(moe_dirs["gpt_oss"], ids)
    same = _learner(moe_dirs["gpt_oss"], routing_replay="r3", micro_batch_size=3)
    assert (same.logprobs(ids, routes) - behaviour).abs().max() < LEARNER_TOL
    m = same.train_step(_batch(ids, behaviour, routes))
    assert m["router/agreement"] == 1.0 and m["lag0/logprob_gap_abs"] < LEARNER_TOL
    r3 = _learner(_perturbed_router_dir(moe_dirs["gpt_oss"], tmp_path / "perturbed"), routing_replay="r3",
                  micro_batch_size=B, pack_sequences=False)
    calls = _expert_calls(r3)
    r3.logprobs(ids, routes)
    for layer, seen in enumerate(calls):
        assert torch.equal(seen[-1], routes[:, :, layer].reshape(-1, routes.shape[-1]).long()), layer
    assert r3.train_step(_batch(ids, behaviour, routes))["router/agreement"] < 0.9


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe"])
def test_r3_replays_at_the_sigmoid_router(moe_dirs, world, tmp_path, kind):
    """DeepSeek-V3's and GLM-4.5's router (sigmoid scores, the expert bias choosing only, group-limited, renormalised
    and scaled by routed_scaling_factor 2.5) under r3: same weights, the replayed weights are its own and the lag-0 gap is fp32
    noise; a perturbed router hands the MoE layers' experts (after the dense first layer) exactly the recorded
    routes, and its own choice still shows its disagreement."""
    from tests.learner.test_moe_learner import _tol

    ids = _ids()
    model_dir = moe_dirs[kind]
    behaviour, routes = _hf_forward(model_dir, ids)
    same = _learner(model_dir, routing_replay="r3", micro_batch_size=3)
    assert (same.logprobs(ids, routes) - behaviour).abs().max() < _tol(model_dir)
    m = same.train_step(_batch(ids, behaviour, routes))
    assert m["router/agreement"] == 1.0 and m["lag0/logprob_gap_abs"] < _tol(model_dir)
    r3 = _learner(_perturbed_router_dir(model_dir, tmp_path / "perturbed"), routing_replay="r3",
                  micro_batch_size=B, pack_sequences=False)
    calls = {}
    for layer, block in enumerate(r3.module.model.layers[1:], start=1):
        block.mlp.experts.register_forward_pre_hook(lambda mod, args, layer=layer: calls.update({layer: args[1]}))
    r3.logprobs(ids, routes)
    assert sorted(calls) == [1, 2]
    for layer, seen in calls.items():
        assert torch.equal(seen, routes[:, :, layer - 1].reshape(-1, routes.shape[-1]).long()), layer
    assert r3.train_step(_batch(ids, behaviour, routes))["router/agreement"] < 0.9


def test_r3_without_routes_stops_the_step(moe_dirs, world):
    ids = _ids()
    behaviour, _ = _hf_forward(moe_dirs["mixtral"], ids)
    learner = _learner(moe_dirs["mixtral"], routing_replay="r3")
    with pytest.raises(RuntimeError, match="without routes"):
        learner.train_step(_batch(ids, behaviour, None))

"""MegatronLearner on mixture-of-experts models (one gloo rank) against transformers: the forward, the published
HF names, and rollout routing replay (R3) through megatron-core's RouterReplay.

The "sampler" here is transformers itself in fp32: its routes are the top-k of its router logits
(``output_router_logits``), its log-probs the behaviour log-probs, so at lag 0 learner and sampler compute the
same function and every difference is the learner's doing."""
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megarl.algo.config import LossConfig
from megarl.models.lora import ATTENTION_TARGETS as ATTENTION
from megarl.protocols import TrainBatch
from tests.helpers import (GLM4_MOE_ROUTER, LEARNER_TOL, fp32_logprob_tol, save_tiny_deepseek_v3, save_tiny_glm4_moe,
                           save_tiny_gpt_oss, save_tiny_gpt_oss_mxfp4, save_tiny_moe)

VOCAB, B, S, PROMPT, TOP_K = 64, 8, 12, 4, 2


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {"mixtral": str(save_tiny_moe(root / "mixtral", "mixtral")),
            "qwen3_moe": str(save_tiny_moe(root / "qwen3_moe", "qwen3_moe")),
            "qwen3_moe_norm_topk": str(save_tiny_moe(root / "qwen3_moe_norm", "qwen3_moe", norm_topk_prob=True)),
            "glm4_moe": str(save_tiny_glm4_moe(root / "glm4_moe")),
            # (two layers, the dense one and an MoE one: one per stage at PP2)
            "glm4_moe_2l": str(save_tiny_glm4_moe(root / "glm4_moe_2l", num_hidden_layers=2)),
            "gpt_oss": str(save_tiny_gpt_oss(root / "gpt_oss")),
            # (its experts as MXFP4 blocks and scales, as the hub's gpt-oss checkpoints: dequantized on load)
            "gpt_oss_mxfp4": str(save_tiny_gpt_oss_mxfp4(root / "gpt_oss_mxfp4")),
            "deepseek_v3": str(save_tiny_deepseek_v3(root / "deepseek_v3")),
            "deepseek_v3_q_full": str(save_tiny_deepseek_v3(root / "deepseek_v3_q_full", q_lora_rank=None)),
            # (two layers, the dense one and an MoE one: one per stage at PP2)
            "deepseek_v3_2l": str(save_tiny_deepseek_v3(root / "deepseek_v3_2l", num_hidden_layers=2))}


def _learner(model_dir, routing_replay="off", loss_cfg=None, **cfg):
    from megarl.config.schema import LearnerConfig
    from megarl.learner.megatron import MegatronLearner

    return MegatronLearner(model_dir, LearnerConfig(**cfg), loss_cfg or LossConfig(), routing_replay=routing_replay)


def _hf_forward(model_dir, ids):
    """(log-probs [B, S] with column 0 = 0, routes [B, S, L, k]) of transformers in fp32, eager attention (a GLM-4.5's
    and a DeepSeek-V3's routes: what its routers chose, recorded from their outputs; the others': the top-k of their
    router logits)."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    chosen = []
    for module in hf.modules():
        if type(module).__name__ in ("Glm4MoeTopkRouter", "DeepseekV3TopkRouter"):
            module.register_forward_hook(lambda m, args, out: chosen.append(out[2].reshape(*ids.shape, -1)))
    with torch.no_grad():
        out = hf(ids, output_router_logits=True)
    lp = torch.log_softmax(out.logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    routes = torch.stack(chosen or [logits.reshape(*ids.shape, -1).topk(TOP_K, dim=-1).indices
                                    for logits in out.router_logits], dim=2)
    return torch.nn.functional.pad(lp, (1, 0)), routes.to(torch.uint8)


def _ids(seed=3):
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "qwen3_moe_norm_topk", "glm4_moe", "gpt_oss", "deepseek_v3",
                                  "deepseek_v3_q_full", "gpt_oss_mxfp4"])
def test_moe_logprobs_match_transformers(moe_dirs, world, kind):
    learner = _learner(moe_dirs[kind], micro_batch_size=3)
    ids = _ids()
    ref, _ = _hf_forward(moe_dirs[kind], ids)
    assert (learner.logprobs(ids) - ref).abs().max().item() <= _tol(moe_dirs[kind])


def test_sdpa_attention_takes_mla_split_head_dims_as_transformers_eager_attention(moe_dirs, world):
    """megarl's core attention under DeepSeek-V3's multi-latent attention: q/k heads of 8 + 4 dims, v heads of 6,
    scaled by transformers' softmax scale (yarn_apply_mscale), give transformers' eager attention (fp32, causal)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as reference

    from megarl.learner.sdpa_attention import SDPAttention

    learner = _learner(moe_dirs["deepseek_v3"])
    core = learner.gpt.decoder.layers[1].self_attention.core_attention
    hf = AutoModelForCausalLM.from_pretrained(moe_dirs["deepseek_v3"], dtype=torch.float32).eval()
    hf_attention = hf.model.layers[1].self_attn
    assert type(core) is SDPAttention and core.softmax_scale == pytest.approx(hf_attention.scaling, rel=1e-12)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(S, 2, 4, 12, generator=gen) for _ in range(2))
    v = torch.randn(S, 2, 4, 6, generator=gen)
    causal = torch.ones(S, S, dtype=torch.bool).triu(1)
    ours = core(q, k, v, causal.view(1, 1, S, S))
    theirs, _ = reference.eager_attention_forward(
        hf_attention, *(t.permute(1, 2, 0, 3) for t in (q, k, v)),
        torch.zeros(S, S).masked_fill(causal, float("-inf")).view(1, 1, S, S), scaling=hf_attention.scaling)
    assert ours.shape == (S, 2, 4 * 6)
    torch.testing.assert_close(ours, theirs.transpose(0, 1).reshape(S, 2, 4 * 6), atol=1e-6, rtol=1e-5)


def _tol(model_dir):
    """The suite's fp32 bound (tests/helpers.fp32_logprob_tol) for the model's own sizes (the GLM-4.5's heads are
    wider than LEARNER_TINY's)."""
    import json

    with open(f"{model_dir}/config.json") as f:
        config = json.load(f)
    return max(LEARNER_TOL, fp32_logprob_tol({**config, "vocab_size": 264}, max_logprob=8.0, max_seq_len=64))


@pytest.mark.parametrize("kind", ["qwen3_moe", "glm4_moe", "gpt_oss", "deepseek_v3"])
def test_moe_publishes_the_per_expert_hf_names(moe_dirs, world, kind):
    """publish_tensors (what samplers receive, and what megarl sft exports) is the save_pretrained state:
    per-expert names, in the order, shapes and dtypes publish_spec announces (GLM-4.5's too: its dense first
    layer, shared expert and the router's e_score_correction_bias, a megatron buffer)."""
    learner = _learner(moe_dirs[kind])
    published = dict(learner.publish_tensors())
    assert learner.publish_spec() == [(n, tuple(t.shape), t.dtype) for n, t in published.items()]
    saved = load_file(f"{moe_dirs[kind]}/model.safetensors")
    assert set(published) == set(saved)
    assert ("model.layers.1.mlp.experts.down_proj" if kind == "gpt_oss"  # (gpt-oss saves its experts fused)
            else "model.layers.1.mlp.experts.3.down_proj.weight") in published
    for name, tensor in saved.items():
        assert torch.equal(published[name], tensor), name


def _batch(ids, behaviour, routes, short_rows=False):
    """Every row trained from PROMPT on: to its end, or (short_rows) to S, S-1 and S-2 in turn, so micro-batches
    of 3 rows have odd widths too."""
    mask = torch.zeros_like(behaviour)
    mask[:, PROMPT:] = 1.0
    if short_rows:
        for r in range(B):
            mask[r, S - r % 3:] = 0.0
    adv = torch.randn(B, 1, generator=torch.Generator().manual_seed(1)).expand(B, S) * mask
    return TrainBatch(input_ids=ids, loss_mask=mask, behaviour_logprobs=behaviour * mask,
                      versions=torch.where(mask > 0, 0, -1), advantages=adv, learner_version=0, routes=routes)


def _perturbed_router_dir(src, dst):
    """The same model with every router weight (and GLM-4.5's expert bias) moved: another learner router, the same
    experts."""
    from safetensors.torch import save_file
    import shutil

    shutil.copytree(src, dst)
    weights = load_file(f"{dst}/model.safetensors")
    g = torch.Generator().manual_seed(7)
    for name, w in weights.items():
        if name.endswith(("block_sparse_moe.gate.weight", "mlp.gate.weight", "mlp.router.weight")):
            weights[name] = w + 2.0 * w.std() * torch.randn(w.shape, generator=g)
        if name.endswith("e_score_correction_bias"):
            weights[name] = w + 2.0 * w.std() * torch.randn(w.shape, generator=g)
    save_file(weights, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "glm4_moe", "gpt_oss", "deepseek_v3"])
def test_r3_replays_the_sampler_routes_exactly(moe_dirs, world, tmp_path, kind):
    """Same weights: the learner's own routes agree with the sampler's (agreement 1.0) and the lag-0 log-prob
    gap is fp32 noise, replay or not. A perturbed learner router: without replay the agreement drops and the gap
    grows; with r3 every expert call is the sampler's route (counted at the experts), the learner's own router
    still reports its disagreement, and the router weight still gets a gradient. GLM-4.5: its sigmoid router with
    expert bias and group limit chooses transformers' routes; its first MoE layer is decoder layer 1 (route 0)."""
    ids = _ids()
    behaviour, routes = _hf_forward(moe_dirs[kind], ids)
    batch = _batch(ids, behaviour, routes)
    sigmoid_routed = kind in ("glm4_moe", "deepseek_v3")
    first_moe, experts_count = (1, GLM4_MOE_ROUTER["n_routed_experts"]) if sigmoid_routed else (0, 4)

    same = _learner(moe_dirs[kind], routing_replay="r3", micro_batch_size=3)
    m = same.train_step(batch)
    assert m["router/agreement"] == 1.0 and m["router/token_diff_frac"] == 0.0
    assert m["lag0/router_agreement"] == 1.0
    assert m["lag0/logprob_gap_abs"] < _tol(moe_dirs[kind])

    perturbed = _perturbed_router_dir(moe_dirs[kind], tmp_path / "perturbed")
    off = _learner(perturbed, micro_batch_size=3).train_step(batch)
    assert off["router/agreement"] < 0.9 and off["router/token_diff_frac"] > 0.3
    assert off["lag0/logprob_gap_abs"] > 1e-3

    r3 = _learner(perturbed, routing_replay="r3", micro_batch_size=3)
    calls = torch.zeros(experts_count, dtype=torch.long)  # tokens each expert of the first MoE layer computed
    experts = r3.gpt.decoder.layers[first_moe].mlp.experts.local_experts
    for e, expert in enumerate(experts):
        expert.register_forward_hook(lambda mod, inp, out, e=e: calls.__setitem__(e, calls[e] + inp[0].shape[0]))
    m = r3.train_step(batch)
    assert m["router/agreement"] < 0.9  # what its own router would have chosen
    # Every position of every row went to the replayed experts (rows are trimmed to their length: all S here).
    assert torch.equal(calls, torch.bincount(routes[:, :, 0].reshape(-1).long(), minlength=experts_count))
    router = r3.gpt.decoder.layers[first_moe].mlp.router.weight
    assert router.main_grad.abs().sum() > 0


def test_r3_without_routes_stops_the_step(moe_dirs, world):
    ids = _ids()
    behaviour, _ = _hf_forward(moe_dirs["mixtral"], ids)
    learner = _learner(moe_dirs["mixtral"], routing_replay="r3")
    with pytest.raises(RuntimeError, match="without routes"):
        learner.train_step(_batch(ids, behaviour, None))


def test_micro_batches_are_padded_to_the_expert_parallel_count():
    """Every EP rank must run the same number of micro-batches (the MoE alltoall pairs them): rows are split
    first, then filler rows that train nothing are added."""
    from megarl.learner.step import pad_micro_batches

    def mb(rows):
        return {"input_ids": torch.arange(rows * 2).reshape(rows, 2), "mask": torch.ones(rows, 2),
                "advantages": torch.ones(rows, 2)}

    split = pad_micro_batches([mb(3), mb(1)], 3)
    assert [m["input_ids"].shape[0] for m in split] == [1, 2, 1]
    assert torch.equal(torch.cat([m["input_ids"] for m in split[:2]]), mb(3)["input_ids"])
    filled = pad_micro_batches([mb(1)], 3)
    assert len(filled) == 3 and all(m["mask"].sum() == 0 and m["advantages"].sum() == 0 for m in filled[1:])
    assert filled[0]["mask"].sum() == 2  # the real row keeps its mask


@pytest.mark.parametrize("kind", ["qwen3_moe", "glm4_moe", "deepseek_v3", "gpt_oss_mxfp4"])
def test_a_checkpoint_of_an_moe_learner_exports_to_a_directory_transformers_loads(moe_dirs, world, tmp_path, kind):
    """megatron saves the experts stacked per layer ([E, ...]); the export unstacks them into per-expert HF names,
    bitwise the tensors the learner publishes, which transformers loads to the trained learner's log-probs.
    GLM-4.5 and DeepSeek-V3 (a dense first layer: megatron's moe_layer_freq list) are saved one key per layer
    (decoder.layers.<i>.<name>), not stacked over layers; DeepSeek-V3's latent attention's projections and norms,
    shared expert and router expert bias come back under transformers' names. A gpt-oss trained from an MXFP4
    checkpoint exports float weights (the trained ones; no quantization_config)."""
    import json

    from megarl.checkpoint import learner_state
    from megarl.checkpoint.export import export_hf

    learner = _learner(moe_dirs[kind])
    ids = _ids()
    behaviour, routes = _hf_forward(moe_dirs[kind], ids)
    learner.train_step(_batch(ids, behaviour, routes))  # weights the HF directory does not have
    learner_state.save(learner, tmp_path / "ckpt", step=1, keep=1, model_dir=moe_dirs[kind])
    exported = export_hf(tmp_path / "ckpt", tmp_path / "hf")
    saved = load_file(exported / "model.safetensors")
    assert "quantization_config" not in json.loads((exported / "config.json").read_text())
    published = dict(learner.publish_tensors())
    assert set(saved) == set(published) and all(torch.equal(saved[n], t) for n, t in published.items())
    ref, _ = _hf_forward(str(exported), ids)
    assert (learner.logprobs(ids) - ref).abs().max().item() <= _tol(moe_dirs[kind])
    assert (ref - behaviour).abs().max().item() > 1e-4  # the trained weights, not the initial ones


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss", "glm4_moe", "deepseek_v3"])
def test_r3_learner_runs_the_engines_routes_across_an_inflight_update(moe_dirs, world, kind):
    """End to end in one process: the built-in engine (its native forward) samples under v0, takes the learner's v1
    in flight and re-prefills (kv_on_update=recompute), recording routes; the batch packs them
    (megarl.rollout.routes) and the r3 learner at v1 sends every position of every MoE layer to exactly the recorded
    experts, its own router agrees with all of them (the engine's routes are the learner's on the same tokens), and
    the log-probs of the lag-0 tokens are the engine's to fp32 noise. gpt-oss: sequences past its sliding window;
    GLM-4.5 and DeepSeek-V3 (multi-latent attention): the sigmoid router with expert bias and group limit, the dense
    first layer recording no routes."""
    from megarl.protocols import GenerationRequest, Sample, SamplingParams
    from megarl.models import moe
    from megarl.rollout.routes import pack_routes
    from megarl.sampler.engine import BuiltinEngine
    from megarl.sampler.model import load_pretrained

    from megarl.sampler import model as native

    learner = _learner(moe_dirs[kind], routing_replay="r3", micro_batch_size=3)
    ids = _ids()
    behaviour, routes = _hf_forward(moe_dirs[kind], ids)
    learner.train_step(_batch(ids, behaviour, routes))  # v1: weights the engine does not have yet

    cfg, weights = load_pretrained(moe_dirs[kind])
    engine = BuiltinEngine(cfg, weights, max_running=4, kv_on_update="recompute")
    assert engine._impl is native
    gen = torch.Generator().manual_seed(4)
    for i in range(4):
        engine.add_request(GenerationRequest(str(i), torch.randint(0, VOCAB, (5,), generator=gen).tolist(),
                                             SamplingParams(temperature=1.0, max_new_tokens=7)))
    done = []
    for _ in range(3):
        done += engine.step()
    engine.stage_weights(dict(learner.publish_tensors()), 1)
    while engine.num_unfinished:
        done += engine.step()
    samples = [Sample(group_id=c.request_id, prompt="", completion="", prompt_ids=c.prompt_ids, token_ids=c.token_ids,
                      logprobs=c.logprobs, versions=c.versions, reward=0.0, finish_reason=c.finish_reason,
                      routes=c.routes) for c in done]
    assert all(0 in s.versions and 1 in s.versions for s in samples)
    width = max(len(s.prompt_ids) + len(s.token_ids) for s in samples)
    batch_ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask, mu, versions = torch.zeros(len(samples), width), torch.zeros(len(samples), width), torch.full(
        (len(samples), width), -1)
    for r, s in enumerate(samples):
        p, n = len(s.prompt_ids), len(s.token_ids)
        batch_ids[r, :p + n] = torch.tensor(s.prompt_ids + s.token_ids)
        mask[r, p:p + n], mu[r, p:p + n], versions[r, p:p + n] = 1.0, torch.tensor(s.logprobs), torch.tensor(s.versions)
    packed = pack_routes(samples, width, moe.route_shape(cfg), required=True)

    moe_layers = [layer for layer in learner.gpt.decoder.layers if hasattr(layer.mlp, "experts")]
    experts = moe.num_experts(cfg)
    calls = torch.zeros(len(moe_layers), experts, dtype=torch.long)  # [MoE layer, expert]: tokens each computed
    hooks = [expert.register_forward_hook(lambda mod, inp, out, l=l, e=e: calls[l].__setitem__(e, calls[l, e] + inp[0].shape[0]))
             for l, layer in enumerate(moe_layers) for e, expert in enumerate(layer.mlp.experts.local_experts)]
    m = learner.train_step(TrainBatch(input_ids=batch_ids, loss_mask=mask, behaviour_logprobs=mu, versions=versions,
                                      advantages=mask, learner_version=1, routes=packed))
    for h in hooks:
        h.remove()
    lengths = (mask * torch.arange(1, width + 1)).amax(dim=1).long()  # each row is computed up to its last token
    used = torch.cat([packed[r, :lengths[r]] for r in range(len(samples))])  # [positions, layers, k]
    assert torch.equal(calls, torch.stack([torch.bincount(used[:, l].reshape(-1).long(), minlength=experts)
                                           for l in range(len(moe_layers))]))
    assert m["router/agreement"] == 1.0 and m["lag0/router_agreement"] == 1.0
    assert m["lag0/token_share"] > 0.3 and m["lag0/logprob_gap_abs"] < _tol(moe_dirs[kind])  # (at v1, in the step)


@pytest.mark.parametrize("kv_on_update", ["keep", "recompute"])
@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe"])
def test_sigmoid_routed_families_sample_on_the_native_engine_from_the_learners_publish(moe_dirs, world, kind,
                                                                                      kv_on_update):
    """DeepSeek-V3 (multi-latent attention) and GLM-4.5 sample on the built-in engine's native forward, whose arena
    takes the learner's per-expert publish, the shared expert and the router's expert bias: the engine samples under
    v0, takes the learner's v1 in flight into its staging buffers (exactly the published names and shapes), and the
    learner's log-probs of every sampled token are the engine's to the fp32 bound, the tokens of either version
    (keep: the v0 cache continued under v1, so only the recompute run checks v1 tokens after the swap against a full
    v1 forward)."""
    from megarl.protocols import GenerationRequest, SamplingParams
    from megarl.sampler import hf_model, model as native
    from megarl.sampler.engine import BuiltinEngine

    model_dir = moe_dirs[kind]
    cfg, weights = native.load_pretrained(model_dir)
    assert hf_model.choose(cfg) is native
    engine = BuiltinEngine(cfg, weights, max_running=4, kv_on_update=kv_on_update)
    learner = _learner(model_dir, micro_batch_size=3)
    ids = _ids()
    behaviour, routes = _hf_forward(model_dir, ids)
    gen = torch.Generator().manual_seed(4)
    for i in range(4):
        engine.add_request(GenerationRequest(str(i), torch.randint(0, VOCAB, (5,), generator=gen).tolist(),
                                             SamplingParams(temperature=1.0, max_new_tokens=7)))
    done = []
    for _ in range(3):
        done += engine.step()
    reference = _learner(model_dir, micro_batch_size=3)  # v0, kept for the tokens sampled before the swap
    learner.train_step(_batch(ids, behaviour, routes))  # v1
    published = dict(learner.publish_tensors())
    views = engine.staging_buffers(1)
    # (the learner publishes exactly the tensors the arena holds; after the swap they are in the forward's layout)
    assert {n: tuple(v.shape) for n, v in views.items()} == {n: tuple(t.shape) for n, t in published.items()}
    for name, tensor in published.items():
        views[name].copy_(tensor)
    engine.stage_weights(views, 1)
    while engine.num_unfinished:
        done += engine.step()
    assert any(1 in c.versions for c in done)
    for c in done:
        row = torch.tensor([c.prompt_ids + c.token_ids])
        n = len(c.prompt_ids)
        for version, model in ((0, reference), (1, learner)):
            if version == 1 and kv_on_update == "keep" and 0 in c.versions:
                continue  # (its v1 tokens attend to v0 keys and values: no single version's forward)
            lp = model.logprobs(row)[0, n:]
            gaps = [abs(lp[i].item() - c.logprobs[i]) for i, v in enumerate(c.versions) if v == version]
            assert max(gaps, default=0.0) <= _tol(model_dir), (c.request_id, version, gaps)


def _expected_expert_tokens(batch, micro_batch_size: int, tp: int) -> dict[tuple[int, int], int]:
    """{(layer, expert): tokens} if every position a one-DP-rank learner computes in a step goes to exactly its
    recorded experts: each micro-batch is its rows up to its longest, its width padded to a multiple of tp under
    sequence parallelism (padded positions: experts 0..k-1)."""
    from megarl.learner import sequence_parallel, step

    micro = step.micro_batches(step.dp_share(batch, 1, 0), micro_batch_size)
    used = torch.cat([sequence_parallel.pad_micro_batch(mb["input_ids"], mb["routes"], tp)[1].flatten(0, 1)
                      for mb in micro])  # [positions, layers, k]
    return {(layer, e): int(n) for layer in range(used.shape[1])
            for e, n in enumerate(torch.bincount(used[:, layer].reshape(-1).long(), minlength=4))}


def _summed(ranks: list[dict], key: str) -> dict:
    out = {}
    for rank in ranks:
        for k, v in rank[key].items():
            out[k] = out.get(k, 0) + v
    return out


# learner.lora on an MoE model (its attention: the experts have no gate/up/down projections of their own to adapt).
# lr 1e-3: this batch's gradients are tiny (loss ~3e-4), and Adam turns their fp32 noise into update noise of
# ~1e-3 lr (one rank with 3- vs 8-row micro-batches: 1.5e-5 apart at lr 1e-2 after two steps).
LORA_MOE = {"micro_batch_size": 3, "lr": 1e-3, "lora": {"rank": 4, "alpha": 8.0, "target_modules": list(ATTENTION)}}


# The cross-layout tests' layouts: (source model, layouts); each layout runs on its model's perturbed routers.
MOE_LAYOUTS = {
    "glm4_moe": {"dp2_ep2": {"dp": 2, "ep": 2, "micro_batch_size": 3, "routing_replay": "r3"},
                 "tp2": {"tp": 2, "micro_batch_size": 3, "routing_replay": "r3"},
                 "tp2_ep2": {"tp": 2, "ep": 2, "micro_batch_size": 3, "routing_replay": "r3"}},
    "glm4_moe_2l": {"pp2": {"pp": 2, "micro_batch_size": 3, "routing_replay": "r3"}},
    "qwen3_moe": {"pp2": {"pp": 2, "micro_batch_size": 3, "routing_replay": "r3"},
                  "dp2_ep2": {"dp": 2, "ep": 2, "micro_batch_size": 3, "routing_replay": "r3"},
                  "tp2": {"tp": 2, "micro_batch_size": 3, "routing_replay": "r3"},
                  "tp2_ep2": {"tp": 2, "ep": 2, "micro_batch_size": 3, "routing_replay": "r3"}},
    "deepseek_v3": {"dp2_ep2": {"dp": 2, "ep": 2, "micro_batch_size": 3, "routing_replay": "r3", "lr": 1e-4},
                    "tp2": {"tp": 2, "micro_batch_size": 3, "routing_replay": "r3", "lr": 1e-4},
                    "tp2_ep2": {"tp": 2, "ep": 2, "micro_batch_size": 3, "routing_replay": "r3", "lr": 1e-4},
                    "tp2_lora": {"tp": 2, **LORA_MOE}},
    "deepseek_v3_2l": {"pp2": {"pp": 2, "micro_batch_size": 3, "routing_replay": "r3", "lr": 1e-4}},
    "gpt_oss": {"pp2": {"pp": 2, "micro_batch_size": 3, "routing_replay": "r3"},
                "dp2_ep2": {"dp": 2, "ep": 2, "micro_batch_size": 3, "routing_replay": "r3"},
                "tp2": {"tp": 2, "micro_batch_size": 3, "routing_replay": "r3"},
                "tp2_ep2": {"tp": 2, "ep": 2, "micro_batch_size": 3, "routing_replay": "r3"}},
    "mixtral": {"pp2": {"pp": 2, "micro_batch_size": 3, "routing_replay": "r3"},
                "dp2_ep2": {"dp": 2, "ep": 2, "micro_batch_size": 3, "routing_replay": "r3"},
                "tp2": {"tp": 2, "micro_batch_size": 3, "routing_replay": "r3", "save": True},
                "tp2_ep2": {"tp": 2, "ep": 2, "micro_batch_size": 3, "routing_replay": "r3"},
                "tp2_off": {"tp": 2, "micro_batch_size": 3},
                "tp2_lora": {"tp": 2, **LORA_MOE}}}


class MoeLayoutRuns:
    """One 2-rank launch (layout_worker.py) over every model's layouts, each on its perturbed routers with its own
    batch (one start-up and one set of megatron imports for all the layout tests); its results read once."""

    def __init__(self, root, moe_dirs):
        from tests.learner.test_megatron_learner import _launch_layouts

        self.root, self.inputs, layouts = root, {}, {}
        for kind, own in MOE_LAYOUTS.items():
            perturbed = _perturbed_router_dir(moe_dirs[kind], root / f"{kind}_perturbed")
            ids = _ids()
            behaviour, routes = _hf_forward(moe_dirs[kind], ids)
            batch = _batch(ids, behaviour, routes, short_rows=True)
            torch.save(batch, root / f"{kind}.batch.pt")
            self.inputs[kind] = (perturbed, ids, routes, batch)
            layouts.update({f"{kind}_{name}": {**layout, "model_dir": perturbed, "batch": str(root / f"{kind}.batch.pt")}
                            for name, layout in own.items()})
        self.layouts = layouts
        self.proc = _launch_layouts(self.inputs["mixtral"][0], self.inputs["mixtral"][3], root, layouts, nproc=2,
                                    timeout_s=990)
        self._results = None

    def results(self, kind: str) -> dict[str, list[dict]]:
        """{layout: per-rank results} of `kind`'s layouts."""
        from tests.learner.test_megatron_learner import _layout_results

        if self._results is None:
            self._results = _layout_results(self.proc, self.root, self.layouts, nproc=2, timeout=1000)
        return {name: self._results[f"{kind}_{name}"] for name in MOE_LAYOUTS[kind]}


@pytest.fixture(scope="module")
def moe_layout_runs(tmp_path_factory, moe_dirs, world):
    runs = MoeLayoutRuns(tmp_path_factory.mktemp("moe_layouts"), moe_dirs)
    yield runs
    if runs.proc.poll() is None:  # a test failed before reading the results: the launch is not left behind
        runs.proc.kill()
        runs.proc.communicate()


@pytest.mark.timeout(1200)  # the first layout test waits for every test's layouts (MoeLayoutRuns.results)
def test_glm4_moe_under_tensor_and_expert_parallelism_matches_one_rank(moe_layout_runs):
    """GLM-4.5 on two gloo ranks, r3 on perturbed routers: DP2 x EP2 (4 of the 8 experts per rank),
    TP2 (sequence parallelism; the shared expert and q/k/v biases split over TP, the expert bias whole on each rank)
    and TP2 x EP2 give the one-rank learner's log-probs, loss, grad norm and router agreement, and after one step the
    same whole published weights (the expert bias included)."""
    _matches_one_rank(moe_layout_runs, "glm4_moe")


@pytest.mark.timeout(1200)  # (see the GLM-4.5 test above)
def test_deepseek_v3_under_tensor_and_expert_parallelism_matches_one_rank(moe_layout_runs):
    """DeepSeek-V3 as GLM-4.5 above: under TP2 its multi-latent attention's latent down-projections and norms are
    whole on each rank over its sequence-parallel positions (megarl.learner.layer_spec: the k RoPE part's gradient
    summed over every rank's heads), the up-projections and o_proj split by heads; DP2 x EP2, TP2 and TP2 x EP2 give
    the one-rank learner's log-probs, loss, grad norm, router agreement and, after one step, published weights. (lr
    1e-4: an expert weight whose gradient is near Adam's eps, 1e-8, moves by lr * g / (|g| + eps), where g carries
    fp32 noise of a percent; at the default 1e-3 that is 1e-5 apart between layouts, the comparison's bound.)
    LoRA on every latent-attention projection at TP2: the down-projections' adapters whole on each rank over its
    positions (their gradients summed over TP), the up-projections' and o_proj's split as the linears; the one-rank
    adapter's second step, log-probs and published adapter."""
    _lora_matches_one_rank(moe_layout_runs, "deepseek_v3")
    _matches_one_rank(moe_layout_runs, "deepseek_v3", lr=1e-4)


@pytest.mark.timeout(1200)  # (see the GLM-4.5 test above)
@pytest.mark.parametrize("kind, learner", [("glm4_moe_2l", {}), ("deepseek_v3_2l", {"lr": 1e-4})],
                         ids=["glm4_moe", "deepseek_v3"])
def test_dense_first_layers_under_pipeline_parallelism_match_one_stage(moe_layout_runs, kind, learner):
    """GLM-4.5 and DeepSeek-V3 at PP2 (the dense first layer on the first stage, the MoE layer with its shared
    expert and sigmoid router on the second: each stage builds its own layers' MLP by their global index in
    moe_layer_freq; the attention on both; the untied lm_head on the last): the one-stage learner's log-probs, loss,
    grad norm, router agreement and, after one step, both stages' published weights together (DeepSeek-V3 at lr 1e-4
    as above)."""
    _matches_one_rank(moe_layout_runs, kind, **learner)


def _lora_matches_one_rank(runs: "MoeLayoutRuns", kind: str) -> None:
    """`kind`'s "tp2_lora" layout (LORA_MOE on the attention; layout_worker: two steps, then the log-probs; whole
    adapters) gives the one-rank adapter's second step, log-probs and published adapter, every B having moved."""
    from megarl.config.schema import LoraConfig
    from tests.learner.test_megatron_learner import _close

    perturbed, ids, _, batch = runs.inputs[kind]
    lora_ref = _learner(perturbed, **{**LORA_MOE, "lora": LoraConfig(**LORA_MOE["lora"])})
    lora_ref.train_step(batch)
    lora_step, lora_logprobs = lora_ref.train_step(batch), lora_ref.logprobs(ids)
    lora_published = dict(lora_ref.publish_tensors())
    assert min(float(t.abs().max()) for n, t in lora_published.items() if "lora_B" in n) > 1e-3  # every B moved
    for rank in runs.results(kind)["tp2_lora"]:
        assert _close(rank["logprobs"], lora_logprobs)
        for key in ("loss", "grad_norm"):
            assert abs(rank["metrics"][key] - lora_step[key]) <= 1e-5 * abs(lora_step[key]), key
        assert set(rank["published"]) == set(lora_published)
        assert all(_close(rank["published"][n], t) for n, t in lora_published.items())


def _matches_one_rank(runs: "MoeLayoutRuns", kind: str, **learner) -> None:
    """`kind`'s 2-rank layouts (r3 on perturbed routers; but "tp2_lora": _lora_matches_one_rank) give the one-rank
    learner's log-probs, loss, grad norm, router agreement and lag-0 gap, and after one step its whole published
    weights (PP2: both stages')."""
    from tests.learner.test_megatron_learner import _close, _sources

    perturbed, ids, routes, batch = runs.inputs[kind]
    one_rank = _learner(perturbed, routing_replay="r3", micro_batch_size=3, **learner)
    ref_logprobs, ref = one_rank.logprobs(ids, routes), one_rank.train_step(batch)
    ref_published = dict(one_rank.publish_tensors())
    results = {layout: ranks for layout, ranks in runs.results(kind).items() if layout != "tp2_lora"}
    for layout, ranks in results.items():
        for rank in ranks:
            assert _close(rank["logprobs"], ref_logprobs), layout
            for key in ("loss", "grad_norm", "router/agreement", "lag0/logprob_gap_abs"):
                assert abs(rank["metrics"][key] - ref[key]) <= 1e-5 * max(1.0, abs(ref[key])), (layout, key)
        published = {}
        for rank in (_sources(ranks) if layout == "pp2" else ranks[:1]):
            published.update(rank["published"])
        assert set(published) == set(ref_published), layout
        assert all(_close(published[n], t) for n, t in ref_published.items()), layout


@pytest.mark.timeout(1200)  # (see the GLM-4.5 test above)
def test_gpt_oss_under_tensor_pipeline_and_expert_parallelism_matches_one_rank(moe_layout_runs):
    """gpt-oss on two gloo ranks, r3 on perturbed routers: PP2 (the sliding layer on the first
    stage, the full one on the second: each picks its own mask by its global index), DP2 x EP2 (2 of the 4 biased
    experts per rank), TP2 (sequence parallelism; the sinks and q/k/v biases split by heads, o_proj's and the
    router's bias whole) and TP2 x EP2 give the one-rank learner's log-probs, loss, grad norm and router agreement,
    and after one step the same whole published weights (the fused experts gathered over EP)."""
    _matches_one_rank(moe_layout_runs, "gpt_oss")


@pytest.mark.timeout(1200)  # (see the GLM-4.5 test above)
def test_qwen3_moe_under_tensor_pipeline_and_expert_parallelism_matches_one_rank(moe_layout_runs):
    """Qwen3-MoE (the unnormalised top-k of the softmax, per-head q/k RMSNorm) on two gloo ranks, r3 on perturbed
    routers: PP2 (one MoE layer per stage), DP2 x EP2 (2 of the 4 experts per rank), TP2 (sequence parallelism; the
    q/k norm weights whole on each rank, applied to its heads) and TP2 x EP2 give the one-rank learner's log-probs,
    loss, grad norm and router agreement, and after one step the same whole published weights."""
    _matches_one_rank(moe_layout_runs, "qwen3_moe")


@pytest.mark.timeout(1200)  # (see the GLM-4.5 test above)
def test_r3_under_tensor_pipeline_and_expert_parallelism_matches_one_rank(moe_layout_runs):
    """Two gloo ranks: PP2 (each stage replays only its own MoE layer), DP2 x EP2 (each rank
    holds 2 of the 4 experts; the alltoall sends each token to its replayed experts), TP2 (sequence parallelism:
    each TP rank's routers get its half of the positions, micro-batch widths padded to even) and TP2 x EP2 (the
    experts split over the two TP ranks) give the one-rank r3 learner's log-probs, loss, grad norm and router
    agreement, and after one step the same whole published weights. The learner's routers are perturbed, so a
    stage or rank that routed itself would compute another function; under TP every position of every layer goes
    to exactly its recorded experts (counted at the experts, over both ranks). TP2 with replay off gives the
    one-rank learner's own routing (log-probs, loss, grad norm, agreement). The TP2 r3 learner's checkpoint resumes
    on one rank: the same weights, and its next two steps are the one-rank learner's (Adam moments included).
    LoRA on the attention at TP2 (the adapters' collectives over the sequence-parallel positions) gives the
    one-rank adapter's second step, log-probs and published adapter."""
    from megarl.checkpoint import learner_state
    from tests.learner.test_megatron_learner import _close, _sources

    perturbed, ids, routes, batch = moe_layout_runs.inputs["mixtral"]
    layouts = MOE_LAYOUTS["mixtral"]
    refs = {}
    for replay in ("r3", "off"):
        learner = _learner(perturbed, routing_replay=replay, micro_batch_size=3)
        refs[replay] = (learner, learner.logprobs(ids, routes), learner.train_step(batch), dict(learner.publish_tensors()))
    _lora_matches_one_rank(moe_layout_runs, "mixtral")
    results = moe_layout_runs.results("mixtral")
    results.pop("tp2_lora")
    assert refs["off"][2]["router/agreement"] < 0.9  # (the perturbed routers disagree: replay shows)
    for layout, ranks in results.items():
        _, ref_logprobs, ref, ref_published = refs[layouts[layout].get("routing_replay", "off")]
        for rank in ranks:
            assert _close(rank["logprobs"], ref_logprobs), layout
            for key in ("loss", "grad_norm", "router/agreement", "router/token_diff_frac", "lag0/logprob_gap_abs"):
                assert abs(rank["metrics"][key] - ref[key]) <= 1e-5 * max(1.0, abs(ref[key])), (layout, key)
        published = {}
        for rank in (_sources(ranks) if layout == "pp2" else ranks[:1]):
            published.update(rank["published"])
        assert set(published) == set(ref_published), layout
        assert all(_close(published[n], t) for n, t in ref_published.items()), layout
        if layout in ("pp2", "tp2", "tp2_ep2"):  # (one DP rank: the micro-batches are the batch's)
            tp = layouts[layout].get("tp", 1)
            assert _summed(ranks, "expert_tokens") == _expected_expert_tokens(batch, 3, tp), layout
    ref_learner = refs["r3"][0]
    resumed = _learner(perturbed, routing_replay="r3", micro_batch_size=3)
    learner_state.load(resumed, moe_layout_runs.root / "mixtral_tp2.ckpt")
    assert _close(resumed.logprobs(ids, routes), ref_learner.logprobs(ids, routes))
    for _ in range(2):  # the second step's loss is of weights the first moved with the resumed Adam moments
        want = ref_learner.train_step(batch)["loss"]
        assert abs(resumed.train_step(batch)["loss"] - want) <= 1e-5 * abs(want)


def test_gpt_oss_samples_on_the_native_engine_and_its_lag0_gap_to_the_learner_is_fp32_noise(moe_dirs, world):
    """gpt-oss on the built-in engine's native forward (chosen by itself; its fused experts are published under the
    names transformers holds them by, which are views of the engine's stacked buffers): prompts longer than the
    sliding window, the megatron learner's step published and staged mid-generation (kv_on_update=recompute); every
    token's behaviour log-prob is the learner's own log-prob of it under the version that sampled it, within the
    fp32 bound. (keep against transformers over its cache: tests/sampler/test_engine_moe.py.)"""
    from megarl.protocols import GenerationRequest, SamplingParams
    from megarl.sampler import model as native
    from megarl.sampler.engine import BuiltinEngine

    path = moe_dirs["gpt_oss"]
    learner = _learner(path, micro_batch_size=3, lr=1e-2)
    v0 = dict(learner.publish_tensors())
    engine = BuiltinEngine(*native.load_pretrained(path), max_running=4, max_seq_len=32, kv_on_update="recompute")
    assert engine._impl is native
    gen = torch.Generator().manual_seed(4)
    requests = [GenerationRequest(str(i), torch.randint(0, VOCAB, (6 + 2 * i,), generator=gen).tolist(),
                                  SamplingParams(temperature=1.0, max_new_tokens=8), ()) for i in range(3)]
    for r in requests:
        engine.add_request(r)
    for _ in range(2):
        engine.step()
    done = {}
    ids = _ids()
    behaviour, routes = _hf_forward(path, ids)
    learner_v0 = _learner(path, micro_batch_size=3)
    learner.train_step(_batch(ids, behaviour, routes))
    v1 = dict(learner.publish_tensors())
    assert set(v1) == set(v0) and max((v1[n] - v0[n]).abs().max().item() for n in v0) > 1e-3
    engine.stage_weights(v1, 1)
    while engine.num_unfinished:
        done.update((c.request_id, c) for c in engine.step())
    tol = _tol(path)
    for c in done.values():
        row = torch.tensor([c.prompt_ids + c.token_ids])
        n = len(c.prompt_ids)
        swapped = c.versions.index(1)
        assert c.versions == [0] * swapped + [1] * (len(c.token_ids) - swapped) and 0 < swapped
        learner_lp = torch.cat([learner_v0.logprobs(row)[0, n:n + swapped], learner.logprobs(row)[0, n + swapped:]])
        gap = (torch.tensor(c.logprobs) - learner_lp).abs().max().item()
        assert gap <= tol, (c.request_id, gap, tol)

"""HF <-> megatron-core conversion: exact round trip, and same log-probs from both models."""
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Olmo2Config,
                          Olmo2ForCausalLM, Phi3Config,
                          Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, SmolLM3Config,
                          SmolLM3ForCausalLM)

from megarl.learner import packing
from megarl.learner.post_norms import post_norm_spec
from megarl.models import convert, families
from tests.helpers import LEARNER_TOL, MISTRAL_WINDOW, gemma3_model, qwen3_5_model

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=48, vocab_size=64, max_position_embeddings=64)


# RoPE scalings on a large base, so the long-wavelength frequencies they rescale exist in the model.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192, "rope_theta": 1e6}
LINEAR = {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}
# Llama 3 constants megatron-core's own rotary embedding does not take, and YaRN on an original context shorter than
# the test's rows (positions beyond it are what the scaling is for).
LLAMA3_CUSTOM = {**LLAMA3, "low_freq_factor": 2.0, "high_freq_factor": 8.0, "original_max_position_embeddings": 16384}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1e4}
ROPES = {"llama3_rope": LLAMA3, "llama3_custom_rope": LLAMA3_CUSTOM, "yarn_rope": YARN}


def _save(tmp_path, kind):
    torch.manual_seed(0)
    if kind == "qwen2":  # GQA, q/k/v bias, tied embeddings
        model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True, rope_theta=5000.0))
    elif kind == "llama":  # GQA, no bias, untied
        model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=False))
    elif kind == "qwen3":  # GQA, per-head q/k RMSNorm, heads * head_dim (64) wider than hidden (32), as Qwen3's
        model = Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=True))
    elif kind == "mistral":  # GQA, no bias, untied, a sliding window shorter than the test's rows
        model = MistralForCausalLM(MistralConfig(**TINY, sliding_window=MISTRAL_WINDOW, tie_word_embeddings=False))
    elif kind == "phi3":  # GQA, untied, fused qkv_proj and gate_up_proj
        model = Phi3ForCausalLM(Phi3Config(**TINY, tie_word_embeddings=False, pad_token_id=None, eos_token_id=2))
    elif kind == "smollm3":  # GQA, tied, its second layer without RoPE
        model = SmolLM3ForCausalLM(SmolLM3Config(**TINY, no_rope_layers=[1, 0], tie_word_embeddings=True,
                                                 pad_token_id=None, bos_token_id=1, eos_token_id=2))
    elif kind == "olmo2":  # GQA, untied, norms after attention and the MLP, q/k norms over the whole projection
        model = Olmo2ForCausalLM(Olmo2Config(**TINY, tie_word_embeddings=False, pad_token_id=None, bos_token_id=None,
                                             eos_token_id=2))
    elif kind == "gemma3":  # tests.helpers.GEMMA3: a local then a global layer, (1 + w) norms drawn away from 0
        model = gemma3_model(TINY)
    elif kind == "qwen3_5":  # tests.helpers.QWEN3_5: a gated-DeltaNet layer then a gated full-attention one, untied
        model = qwen3_5_model(TINY)
    elif kind in ROPES:  # Llama 3.x frequency scaling, YaRN
        model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True, rope_parameters=ROPES[kind]))
    else:  # linear position interpolation
        model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=False, rope_parameters=LINEAR))
    # Biases are zero-initialised; make them non-trivial so the bias packing is exercised. With RoPE
    # scaling (and SmolLM3's layer without it), sharpen attention (q/k x30) so positions matter enough for it to show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_()
            if name.endswith(("q_norm.weight", "k_norm.weight")) or (kind == "olmo2" and "norm" in name):
                p.normal_(1.0, 0.3)  # away from 1, so a dropped (or swapped) norm would show
            if (kind.endswith("_rope") or kind == "smollm3") and ("q_proj" in name or "k_proj" in name):
                p.mul_(30.0)
    path = tmp_path / kind
    model.save_pretrained(path)
    return model.eval(), load_file(path / "model.safetensors")


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3", "mistral", "phi3", "smollm3", "olmo2", "gemma3",
                                  "qwen3_5"])
def test_round_trip_is_exact(tmp_path, kind):
    """HF -> megatron -> HF gives back every tensor bit for bit (Phi-3's fused qkv_proj / gate_up_proj split into
    megatron's per-group qkv rows and fused back; Qwen3.5's gated-DeltaNet layer and gated q_proj)."""
    model, hf_state = _save(tmp_path, kind)
    mcore = convert.hf_to_mcore(hf_state, model.config)
    assert ("output_layer.weight" in mcore) == (kind in ("llama", "mistral", "phi3", "olmo2", "qwen3_5"))
    assert ("decoder.layers.0.self_attention.q_layernorm.weight" in mcore) == (kind in ("qwen3", "olmo2", "gemma3"))
    assert ("decoder.layers.0.mlp_bda.norm.weight" in mcore) == (kind in ("olmo2", "gemma3"))
    assert ("decoder.layers.0.input_layernorm.weight" in mcore) == (kind != "olmo2")  # OLMo 2: post-norms only
    back = convert.mcore_to_hf(mcore, model.config)
    assert set(back) == set(hf_state)
    for name, tensor in hf_state.items():
        assert back[name].shape == tensor.shape and torch.equal(back[name], tensor), name


def test_qkv_packing_is_per_query_group(tmp_path):
    model, hf_state = _save(tmp_path, "qwen2")
    qkv = convert.hf_to_mcore(hf_state, model.config)["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (hf_state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    d = 8  # head_dim; 2 query heads per group
    group1 = qkv[4 * d: 8 * d]
    assert torch.equal(group1[: 2 * d], q[2 * d: 4 * d])
    assert torch.equal(group1[2 * d: 3 * d], k[d: 2 * d])
    assert torch.equal(group1[3 * d:], v[d: 2 * d])


def test_qwen3_5_gated_qkv_is_per_query_group_with_the_gates_after_its_queries(tmp_path):
    """Qwen3.5's q_proj rows are [q_h | gate_h] per head; megatron's gated linear_qkv rows per query group g are
    [g's q heads | their gates | k_g | v_g] (its get_query_key_value_tensors' split with attention_output_gate)."""
    model, hf_state = _save(tmp_path, "qwen3_5")
    mcore = convert.hf_to_mcore(hf_state, model.config)
    assert "decoder.layers.0.self_attention.in_proj.weight" in mcore  # (layer 0: gated DeltaNet, fused in_proj)
    qkv = mcore["decoder.layers.1.self_attention.linear_qkv.weight"]
    q, k, v = (hf_state[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    d = 16  # head_dim; 2 query heads per group
    heads = q.view(4, 2, d, -1)  # [head, (q, gate), d, hidden]
    group1 = qkv[6 * d: 12 * d]
    assert torch.equal(group1[: 2 * d], heads[2:4, 0].reshape(2 * d, -1))
    assert torch.equal(group1[2 * d: 4 * d], heads[2:4, 1].reshape(2 * d, -1))
    assert torch.equal(group1[4 * d: 5 * d], k[d: 2 * d]) and torch.equal(group1[5 * d:], v[d: 2 * d])
    kwargs = convert.transformer_config_kwargs(model.config)
    assert kwargs["attention_output_gate"] and kwargs["linear_attention_freq"] == [1, 0]
    assert convert.gpt_model_kwargs(model.config)["rotary_percent"] == 0.25


def _megatron_tp_shard(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """TP rank `rank`'s megatron parameter, as megatron splits it: qkv and fc1 by rows (fc1 = [gate_r; up_r]),
    linear_proj / fc2 by input columns, norms replicated."""
    if name.endswith("linear_fc1.weight"):
        return torch.cat([half.chunk(tp)[rank] for half in full.chunk(2)])
    if "linear_qkv" in name:
        return full.chunk(tp)[rank]
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return full.chunk(tp, dim=1)[rank].contiguous()  # a parameter of its own, as megatron's
    return full


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3", "mistral"])
@pytest.mark.parametrize("tp", [2, 4])  # 2 KV heads: at tp=4 the layout is refused by name
def test_layer_shard_converts_to_the_tp_slices(tmp_path, kind, tp):
    """A TP rank's megatron layer shard converts (tp_size=tp) to exactly tp_shard's slices of the HF tensors."""
    from megarl.models import tp_shard

    model, hf_state = _save(tmp_path, kind)
    mcore = convert.hf_to_mcore(hf_state, model.config)
    prefix = "decoder.layers.1."
    for rank in range(tp):
        layer = {n[len(prefix):]: _megatron_tp_shard(n, t, tp, rank) for n, t in mcore.items() if n.startswith(prefix)}
        if tp == 4:
            with pytest.raises(ValueError, match="num_key_value_heads=2"):
                convert.mcore_layer_to_hf(layer, 1, model.config, tp_size=tp)
            return
        sliced = convert.mcore_layer_to_hf(layer, 1, model.config, tp_size=tp)
        expected = {n: tp_shard.shard(n, t, tp, rank) for n, t in hf_state.items() if n.startswith("model.layers.1.")}
        assert set(sliced) == set(expected)
        for name, tensor in expected.items():
            assert sliced[name].is_contiguous() and torch.equal(sliced[name], tensor), (rank, name)


def test_refuses_unsupported():
    with pytest.raises(ValueError, match="gpt2"):
        convert.check_supported({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="dynamic"):
        convert.check_supported(dict(model_type="llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    with pytest.raises(ValueError, match="longrope"):
        convert.check_supported(dict(model_type="llama", rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}))
    with pytest.raises(ValueError, match="MistralForCausalLM"):
        convert.check_supported(dict(model_type="llama", architectures=["MistralForCausalLM"]))
    with pytest.raises(ValueError, match="use_sliding_window"):
        convert.check_supported(dict(model_type="qwen2", use_sliding_window=True))
    gemma = dict(model_type="gemma3_text", num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                 sliding_window=4)
    convert.check_supported(gemma)
    for key, value in (("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
                       ("use_bidirectional_attention", True), ("hidden_activation", "silu")):
        with pytest.raises(ValueError, match=key):
            convert.check_supported({**gemma, key: value})
    with pytest.raises(ValueError, match="layer_types"):
        convert.check_supported({**gemma, "layer_types": ["sliding_attention"]})
    with pytest.raises(ValueError, match="attention factor"):
        convert.check_supported({**gemma, "rope_parameters": {"full_attention": {**YARN, "rope_theta": 1e6}}})


@pytest.mark.parametrize("model_type", ["gpt2", "olmoe", "qwen2_moe", "olmo2_unmapped"])
def test_every_refusal_of_a_model_type_names_the_matrix_and_the_generic_path(tmp_path, model_type):
    """The converter, the built-in engine's spec and `megarl train`'s start-up check each refuse a model type
    outside the families naming docs/models.md (the support matrix) and learner.backend=deepspeed."""
    import json

    from megarl.cli import check_model_dir
    from megarl.sampler.model import ModelSpec

    cfg = {"model_type": model_type, "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 48, "vocab_size": 64, "shared_expert_intermediate_size": 8,
           "num_experts": 4, "num_experts_per_tok": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for refuse in (convert.check_supported, ModelSpec.from_hf_config, lambda c: check_model_dir(tmp_path)):
        with pytest.raises(ValueError) as info:
            refuse(cfg)
        message = str(info.value)
        assert model_type in message and "docs/models.md" in message, message
        assert "generic path: learner.backend=deepspeed" in message and message.count("docs/models.md") <= 2, message


class _PerHeadNorm(torch.nn.Module):
    """OLMo 2's q/k norm weight applied per head (each head normalised over its own head_dim): the wrong reading."""

    def __init__(self, config, hidden_size, eps=1e-6, heads="num_attention_heads", **_unused):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.ones(getattr(config, heads) * hidden_size)), eps

    def forward(self, x):
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed * self.weight.view(x.shape[-2], x.shape[-1])


@pytest.fixture(scope="module")
def megatron_world(tmp_path_factory):
    """World-size-1 gloo group + megatron parallel state, torn down after the module."""
    from megatron.core import parallel_state, tensor_parallel

    from megarl.learner.cpu_shims import apply_cpu_shims

    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    apply_cpu_shims()
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3", "mistral", "phi3", "smollm3", "olmo2", "gemma3",
                                  "linear_rope", *ROPES])
def test_megatron_logprobs_match_hf(tmp_path, megatron_world, kind):
    """A GPTModel of the converted config and weights (rotary frequencies set as the learner sets them) gives
    transformers' log-probs, on rows longer than a sliding window and than a YaRN model's original context."""
    from megarl.learner import rotary_positions
    from megarl.learner.sdpa_attention import use_layer_masks

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    hf_model, hf_state = _save(tmp_path, kind)
    config = TransformerConfig(**convert.transformer_config_kwargs(hf_model.config),
                               use_cpu_initialization=True, perform_initialization=False)
    ids = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(1))
    s = ids.shape[1]  # (longer than Mistral's window)
    window = families.sliding_window(hf_model.config.to_dict())
    assert (window is not None) == (kind == "mistral")
    mask = packing.causal_mask(s, window=window)

    if kind == "gemma3":  # (megarl.learner.megatron's masks: one per window, each layer its own)
        from megarl.learner import gemma3

        assert families.layer_types(hf_model.config.to_dict()) == ("sliding_attention", "full_attention")
        windows, mask_index = families.mask_windows(hf_model.config.to_dict())
        assert windows == (MISTRAL_WINDOW, None) and mask_index == (0, 1)
        mask = torch.stack([packing.causal_mask(s, window=w) for w in windows])

    def megatron_logprobs(inv_freq=convert.inv_freq(hf_model.config),
                          rope=families.rope_layers(hf_model.config.to_dict()), per_head_qk_norm=False,
                          local_inv_freq=None, embed_scale=True):
        spec = get_gpt_layer_local_spec(**convert.layer_spec_kwargs(hf_model.config))
        if kind == "gemma3":  # (megarl.learner.layer_spec's Gemma 3 block)
            from megarl.learner.layer_spec import layer_spec

            spec = layer_spec(hf_model.config.to_dict(), config, sequence_parallel=False)
        if kind == "olmo2":  # (megarl.learner.layer_spec's OLMo 2 norms)
            spec = post_norm_spec(spec, hf_model.config.hidden_size, hf_model.config.rms_norm_eps)
            if per_head_qk_norm:  # the q/k norms per head, as Qwen3's: the weights' shape is the same
                attention = spec.submodules.self_attention.submodules
                attention.q_layernorm.module = attention.k_layernorm.module = _PerHeadNorm
        gpt = GPTModel(config=config, transformer_layer_spec=spec, **convert.gpt_model_kwargs(hf_model.config))
        rotary_positions.use_frequencies(gpt, inv_freq)
        rotary_positions.skip_layers(gpt, rope)
        if kind == "gemma3":  # (megarl.learner.megatron's Gemma 3 hooks)
            if embed_scale:
                gemma3.scale_embeddings(gpt, hf_model.config.hidden_size)
            rotary_positions.use_position_ids(gpt)
            local = convert.local_inv_freq(hf_model.config) if local_inv_freq is None else local_inv_freq
            gemma3.use_layer_rope(gpt, families.layer_types(hf_model.config.to_dict()), local)
            use_layer_masks(gpt, mask_index)
        missing, unexpected = gpt.load_state_dict(convert.hf_to_mcore(hf_state, hf_model.config), strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing)
        with torch.no_grad():
            logits = gpt.eval()(ids, torch.arange(s).expand_as(ids), mask)
        return torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])

    with torch.no_grad():
        hf = torch.log_softmax(hf_model(ids).logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])
    assert (megatron_logprobs() - hf).abs().max().item() <= LEARNER_TOL
    if kind == "olmo2":  # ... and only because the q/k norms span the whole projection
        assert (megatron_logprobs(per_head_qk_norm=True) - hf).abs().max().item() > 1e-3
    if kind == "smollm3":  # ... and only because its second layer did not rotate
        assert families.rope_layers(hf_model.config.to_dict()) == (True, False)
        assert (megatron_logprobs(rope=None) - hf).abs().max().item() > 1e-3
    if kind == "mistral":  # ... and only because the window was applied
        mask = packing.causal_mask(s)
        assert (megatron_logprobs() - hf).abs().max().item() > 1e-3
    if kind == "gemma3":  # ... and only because the embeddings were scaled, the local layer had its own RoPE and window
        assert (megatron_logprobs(embed_scale=False) - hf).abs().max().item() > 1e-3
        assert (megatron_logprobs(local_inv_freq=convert.inv_freq(hf_model.config)) - hf).abs().max().item() > 1e-3
        mask = torch.stack([packing.causal_mask(s)] * 2)
        assert (megatron_logprobs() - hf).abs().max().item() > 1e-3
    if kind.endswith("_rope"):  # ... and only because the scaling was mapped
        head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
        unscaled = megatron_logprobs(convert.rope_inv_freq(convert._rope_theta(hf_model.config.to_dict()), head_dim,
                                                           None))
        assert (unscaled - hf).abs().max().item() > 1e-3


@pytest.mark.parametrize("kind", ["linear_rope", *ROPES])
def test_rope_inv_freq_and_attention_factor_are_hfs(tmp_path, kind):
    """The frequencies the learner's rotary embedding and the engine's tables are built from, and yarn's factor on
    cos and sin, equal transformers' own rotary embedding's."""
    hf_model, _ = _save(tmp_path, kind)
    cfg = hf_model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    plain = convert.rope_inv_freq(cfg.rope_parameters["rope_theta"], head_dim, None)
    ours = convert.inv_freq(cfg)
    assert not torch.allclose(ours, plain)  # the scaling changes something at this base
    assert torch.allclose(ours, hf_model.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)
    factor = convert.rope_attention_factor(convert.rope_scaling(cfg))
    assert factor == hf_model.model.rotary_emb.attention_scaling and (factor != 1.0) == (kind == "yarn_rope")


# A GLM-4.5 config megarl converts (the tests' tiny one: tests/helpers.save_tiny_glm4_moe)
GLM4 = {"model_type": "glm4_moe", "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_size": 32, "head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4,
        "topk_group": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
        "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}


def test_glm4_moe_config_maps_to_megatrons_router_and_partial_rope():
    assert convert.check_supported(GLM4) is not None
    kwargs = convert.transformer_config_kwargs({**GLM4, "intermediate_size": 48, "moe_intermediate_size": 16,
                                                "rms_norm_eps": 1e-5, "routed_scaling_factor": 2.5})
    assert kwargs["moe_router_score_function"] == "sigmoid" and kwargs["moe_router_enable_expert_bias"]
    assert kwargs["moe_router_bias_update_rate"] == 0.0  # HF's bias is a fixed buffer
    assert (kwargs["moe_router_num_groups"], kwargs["moe_router_group_topk"]) == (4, 2)
    assert kwargs["moe_router_topk_scaling_factor"] == 2.5 and kwargs["moe_shared_expert_intermediate_size"] == 16
    assert kwargs["moe_layer_freq"] == [0, 1, 1]
    assert convert.gpt_model_kwargs({**GLM4, "vocab_size": 64})["rotary_percent"] == 0.5
    assert convert.inv_freq(GLM4).shape == (4,)  # 16 dims * 0.5 rotate: 4 frequencies
    # every group kept (GLM-4.5's own n_group = topk_group = 1): no group limit
    kwargs = convert.transformer_config_kwargs({**GLM4, "n_group": 1, "topk_group": 1, "intermediate_size": 48,
                                                "moe_intermediate_size": 16, "rms_norm_eps": 1e-5})
    assert kwargs["moe_router_num_groups"] is None and kwargs["moe_router_group_topk"] is None


@pytest.mark.parametrize("config, message", [
    ({"model_type": "qwen2_moe", "shared_expert_intermediate_size": 64},
     "unsupported MoE model 'qwen2_moe' \\(shared_expert_intermediate_size\\)"),
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [1]},
     "mlp_only_layers"),
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 2},
     "decoder_sparse_step=2"),
    ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, "router_jitter_noise": 0.1},
     "router_jitter_noise"),
    ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({**GLM4, "norm_topk_prob": False}, "norm_topk_prob"),
    ({**GLM4, "topk_group": 1}, "topk_group"),  # megatron would score a group by its best 4, HF by its best 2
    ({**GLM4, "n_group": 3}, "n_group"),
    ({**GLM4, "n_shared_experts": 0}, "n_shared_experts"),
    ({**GLM4, "first_k_dense_replace": 3}, "first_k_dense_replace"),
    # (16 dims * 0.1875: 3, odd)
    ({**GLM4, "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.1875}}, "partial_rotary_factor"),
])
def test_moe_configs_megarl_cannot_convert_exactly_are_refused_naming_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        convert.check_supported(config)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "glm4_moe"])
def test_moe_round_trip_keeps_every_per_expert_tensor(tmp_path, kind):
    from safetensors.torch import load_file

    from tests.helpers import save_tiny_glm4_moe, save_tiny_moe

    model_dir = save_tiny_glm4_moe(tmp_path) if kind == "glm4_moe" else save_tiny_moe(tmp_path, kind)
    cfg, hf = convert.load_pretrained(str(model_dir))
    mcore = convert.hf_to_mcore(hf, cfg)
    assert mcore["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"].shape == (
        2 * {"mixtral": 48, "qwen3_moe": 24, "glm4_moe": 16}[kind], 32)
    if kind == "glm4_moe":  # the first layer dense, the shared expert and the router's bias
        assert mcore["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 48, 32)
        assert mcore["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"].shape == (2 * 16, 32)
        assert torch.equal(mcore["decoder.layers.2.mlp.router.expert_bias"],
                           hf["model.layers.2.mlp.gate.e_score_correction_bias"])
    back = convert.mcore_to_hf(mcore, cfg)
    saved = load_file(f"{model_dir}/model.safetensors")
    assert set(back) == set(saved) and all(torch.equal(back[k], saved[k]) for k in saved)


def test_gpt_oss_round_trip_is_exact_and_deinterleaves_the_fused_experts(tmp_path):
    """gpt-oss's experts are saved fused, x @ W, gate and up interleaved by column (gate_up_proj [E, H, 2I]):
    megatron's expert e gets linear_fc1 rows cat[gate, up] and their biases, linear_fc2 = down_proj[e].T; the sinks,
    o_proj's and the router's biases have megatron homes; back to HF bit for bit."""
    from tests.helpers import save_tiny_gpt_oss

    model_dir = save_tiny_gpt_oss(tmp_path)
    cfg, hf = convert.load_pretrained(str(model_dir))
    mcore = convert.hf_to_mcore(hf, cfg)
    experts = "model.layers.1.mlp.experts."
    gate_up, bias = hf[experts + "gate_up_proj"][3], hf[experts + "gate_up_proj_bias"][3]
    fc1 = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1."
    assert torch.equal(mcore[fc1 + "weight"], torch.cat([gate_up[:, 0::2].t(), gate_up[:, 1::2].t()]))
    assert torch.equal(mcore[fc1 + "bias"], torch.cat([bias[0::2], bias[1::2]]))
    assert torch.equal(mcore["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"],
                       hf["model.layers.1.mlp.experts.down_proj"][3].t())
    assert torch.equal(mcore["decoder.layers.0.self_attention.core_attention.softmax_offset"],
                       hf["model.layers.0.self_attn.sinks"])
    assert torch.equal(mcore["decoder.layers.0.mlp.router.bias"], hf["model.layers.0.mlp.router.bias"])
    back = convert.mcore_to_hf(mcore, cfg)
    saved = load_file(f"{model_dir}/model.safetensors")
    assert set(back) == set(saved) and all(torch.equal(back[k], saved[k]) for k in saved)
    kwargs = convert.transformer_config_kwargs(cfg)
    assert (kwargs["softmax_type"], kwargs["add_bias_linear"], kwargs["glu_linear_offset"],
            kwargs["activation_func_clamp_value"]) == ("learnable", True, 1.0, 2.0)
    assert families.layer_windows(cfg) == (4, None)


def test_gemma3_and_gpt_oss_layer_windows_come_from_one_layer_types_with_each_familys_default():
    """Gemma 3's and gpt-oss's sliding and full layers give one mask per distinct window, each layer its index
    (families.mask_windows, what both learners build their masks from); without `layer_types` each family takes
    transformers' default: Gemma 3 every sliding_window_pattern-th layer full, gpt-oss alternating, sliding first."""
    gemma = {"model_type": "gemma3_text", "num_hidden_layers": 4, "sliding_window": 3, "sliding_window_pattern": 2}
    gpt_oss = {"model_type": "gpt_oss", "num_hidden_layers": 4, "sliding_window": 3}
    for cfg in (gemma, gpt_oss):
        assert families.layer_types(cfg) == ("sliding_attention", "full_attention") * 2
        assert families.layer_windows(cfg) == (3, None, 3, None)
        assert families.mask_windows(cfg) == ((3, None), (0, 1, 0, 1))
        # (the DeepSpeed learner's packed-row masks, by layer type: the full layers' without the window)
        assert families.windows_by_layer_type(cfg) == {"sliding_attention": 3, "full_attention": None}
    full = {**gpt_oss, "layer_types": ["full_attention"] * 4, "sliding_window": None}
    assert families.layer_windows(full) == (None,) * 4 and families.mask_windows(full) == ((None,), None)
    mistral = {"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": 5}
    assert families.layer_types(mistral) is None and families.mask_windows(mistral) == ((5,), None)
    assert families.windows_by_layer_type(mistral) == {"": 5}


@pytest.mark.parametrize("change, message", [
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config"),  # (MXFP4 loads: test_mxfp4)
    ({"layer_types": ["sliding_attention"]}, "layer_types"),
    ({"sliding_window": None}, "sliding_window"),
    ({"attention_bias": False}, "attention_bias"),
])
def test_gpt_oss_configs_megarl_cannot_convert_are_refused_naming_the_field(change, message):
    config = {"model_type": "gpt_oss", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "hidden_size": 32, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
              "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"], "attention_bias": True}
    with pytest.raises(ValueError, match=message):
        convert.check_supported({**config, **change})
@pytest.mark.parametrize("q_lora_rank", [12, None])
def test_deepseek_v3_round_trip_is_exact_and_maps_the_latent_attention(tmp_path, q_lora_rank):
    """Every tensor of a DeepSeek-V3 directory comes back bitwise: the multi-latent attention (a q latent, or one
    q_proj when q_lora_rank is null; the kv latent and its shared k RoPE rows; both latent norms), GLM-4.5's MoE
    (first layer dense, shared expert, the router's e_score_correction_bias) and the untied lm_head."""
    from safetensors.torch import load_file

    from tests.helpers import save_tiny_deepseek_v3

    model_dir = save_tiny_deepseek_v3(tmp_path, q_lora_rank=q_lora_rank)
    cfg, hf = convert.load_pretrained(str(model_dir))
    mcore = convert.hf_to_mcore(hf, cfg)
    attn = "decoder.layers.1.self_attention."
    assert mcore[attn + "linear_kv_down_proj.weight"].shape == (16 + 4, 32)  # [kv latent; shared k rope]
    assert mcore[attn + "linear_kv_up_proj.weight"].shape == (4 * (8 + 6), 16)  # per head [k nope; v]
    assert mcore[attn + "linear_proj.weight"].shape == (32, 4 * 6)
    if q_lora_rank is None:
        assert mcore[attn + "linear_q_proj.weight"].shape == (4 * 12, 32) and attn + "q_layernorm.weight" not in mcore
    else:
        assert mcore[attn + "linear_q_up_proj.weight"].shape == (4 * 12, 12)
        assert torch.equal(mcore[attn + "q_layernorm.weight"], hf["model.layers.1.self_attn.q_a_layernorm.weight"])
    assert torch.equal(mcore[attn + "kv_layernorm.weight"], hf["model.layers.1.self_attn.kv_a_layernorm.weight"])
    assert torch.equal(mcore["decoder.layers.2.mlp.router.expert_bias"],
                       hf["model.layers.2.mlp.gate.e_score_correction_bias"])
    assert mcore["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 48, 32)
    back = convert.mcore_to_hf(mcore, cfg)
    saved = load_file(f"{model_dir}/model.safetensors")
    assert set(back) == set(saved) and all(torch.equal(back[k], saved[k]) for k in saved)


# A DeepSeek-V3 config as the hub's (no head_dim: transformers sets it to qk_rope_head_dim), at the tests' sizes
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
               "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16, "rms_norm_eps": 1e-6,
               "n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
               "first_k_dense_replace": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "q_lora_rank": 12,
               "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
               "max_position_embeddings": 64, "rope_scaling": {"type": "yarn", "factor": 4.0, "mscale": 1.0,
                                                               "mscale_all_dim": 0.5, "beta_fast": 32, "beta_slow": 1,
                                                               "original_max_position_embeddings": 16}}


def test_deepseek_v3_config_maps_to_megatrons_latent_attention_yarn_and_router():
    """MLATransformerConfig's dims, the softmax scale's mscale(factor, mscale_all_dim) (transformers'
    yarn_apply_mscale), YaRN's frequencies over the rope dims and their attention factor as transformers computes
    them, and GLM-4.5's router."""
    import math

    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

    kwargs = convert.transformer_config_kwargs(DEEPSEEK_V3)
    assert kwargs["multi_latent_attention"] and kwargs["num_query_groups"] == 4
    assert (kwargs["q_lora_rank"], kwargs["kv_lora_rank"], kwargs["qk_head_dim"], kwargs["qk_pos_emb_head_dim"],
            kwargs["v_head_dim"]) == (12, 16, 8, 4, 6)
    assert kwargs["moe_router_score_function"] == "sigmoid" and kwargs["moe_layer_freq"] == [0, 1, 1]
    hf_config = DeepseekV3Config(**{k: v for k, v in DEEPSEEK_V3.items() if k != "model_type"})
    mscale = 0.1 * kwargs["mscale_all_dim"] * math.log(kwargs["rotary_scaling_factor"]) + 1.0  # megatron's MLA
    assert math.isclose(mscale ** 2 / math.sqrt(8 + 4), yarn_apply_mscale(hf_config.rope_parameters, 12 ** -0.5))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    assert torch.equal(convert.inv_freq(DEEPSEEK_V3), inv_freq)
    assert convert.rope_attention_factor(convert.rope_scaling(DEEPSEEK_V3)) == factor != 1.0
    assert convert.layer_spec_kwargs(DEEPSEEK_V3)["multi_latent_attention"]


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_interleave": False}, "rope_interleave"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope scaling 'linear'"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
])
def test_deepseek_v3_configs_megarl_cannot_map_exactly_are_refused_naming_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        convert.transformer_config_kwargs({**DEEPSEEK_V3, **change})


def test_deepseek_v3_samples_at_sampler_tp2_and_adapts_its_latent_projections_as_a_group():
    """The built-in engine cuts the multi-latent attention's HF tensors by heads (megarl.models.tp_shard), so
    sampler.tp=2 (at learner.tp=1, as every MoE model) passes the layout check; LoRA adapters take its projections at
    any learner.tp (tests/learner/test_moe_learner.py runs TP2), and an adapter on k or v alone is refused naming the
    modules (kv_b_proj's rows are both)."""
    from megarl.config.schema import LoraConfig
    from megarl.models import layout, lora

    cfg = {**DEEPSEEK_V3, "vocab_size": 64}
    layout.check_layout(cfg, learner_tp=2, sampler_tp=1)
    layout.check_layout(cfg, sampler_tp=2)
    lora.check(DEEPSEEK_V3, LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    with pytest.raises(ValueError, match="learner.lora.target_modules: k_proj/v_proj .*kv_b_proj"):
        lora.check(DEEPSEEK_V3, LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"]))


def test_phi3s_fused_projections_run_unsplit_and_say_where():
    """Phi-3's qkv_proj / gate_up_proj have no per-rank slices: a built-in engine at sampler.tp > 1 and a shard
    conversion are refused naming the key; sampler.tp=1 at any learner layout is taken. A LoRA adapter sits on each
    fused module, so q/k/v (and gate/up) are adapted together or not at all (peft's DeepSpeed learner too)."""
    from megarl.config.schema import LoraConfig
    from megarl.models import layout
    from megarl.models.lora_targets import check_peft

    cfg = {"model_type": "phi3", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "hidden_size": 32, "intermediate_size": 48, "vocab_size": 64}
    layout.check_layout(cfg, learner_tp=2, learner_pp=2, sampler_tp=1)
    with pytest.raises(ValueError, match="sampler.tp=2: phi3's fused qkv_proj / gate_up_proj"):
        layout.check_layout(cfg, sampler_tp=2)
    with pytest.raises(ValueError, match="tp_size=1"):
        convert.mcore_layer_to_hf({}, 0, cfg, tp_size=2)
    with pytest.raises(ValueError, match="learner.lora.target_modules: q_proj/k_proj/v_proj .*qkv_proj"):
        check_peft(cfg, LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj"]))
    check_peft(cfg, LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"]))


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 8.0}])
def test_gemma3s_older_config_fields_give_transformers_layer_kinds_and_ropes(scaling):
    """A Gemma 3 config.json as the hub's first releases wrote it (no layer_types or rope_parameters:
    sliding_window_pattern, rope_theta, rope_local_base_freq, rope_scaling) maps to the layer kinds and RoPE
    frequencies transformers builds from it."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    old = dict(model_type="gemma3_text", hidden_size=32, intermediate_size=48, num_hidden_layers=7,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64, sliding_window=4,
               sliding_window_pattern=3, rope_theta=1e6, rope_local_base_freq=2e4, rope_scaling=scaling)
    hf = Gemma3ForCausalLM(Gemma3TextConfig(**{k: v for k, v in old.items() if k != "model_type"}))
    assert families.layer_types(old) == tuple(hf.config.layer_types)
    assert families.layer_types(old).count("full_attention") == 2  # (layers 3 and 6)
    rotary = hf.model.rotary_emb
    assert torch.equal(convert.inv_freq(old), rotary.full_attention_inv_freq)
    assert torch.equal(convert.local_inv_freq(old), rotary.sliding_attention_inv_freq)
    assert (convert.rope_scaling(convert.layer_config(old, "full_attention")) is None) == (scaling is None)
    with pytest.raises(ValueError, match="rope_type"):  # (transformers would run it unscaled)
        convert.check_supported({**old, "rope_scaling": {"type": "linear", "factor": 8.0}})


def test_gemma3_layers_recomputed_in_the_backward_get_their_own_micro_batchs_angles(tmp_path, megatron_world):
    """Under learner.recompute_activations=full a layer's forward reruns in the backward, after later micro-batches'
    forwards where a pipeline schedule interleaves them: a local layer's rotary angles travel with the layer's
    inputs (megarl.learner.gemma3.use_layer_rope), so the gradient is the one without recompute."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from megarl.learner import gemma3, rotary_positions
    from megarl.learner.layer_spec import layer_spec
    from megarl.learner.sdpa_attention import use_layer_masks

    hf_model, hf_state = _save(tmp_path, "gemma3")
    cfg = hf_model.config.to_dict()
    s = 12
    first = torch.randint(0, 64, (2, s), generator=torch.Generator().manual_seed(1))
    later = torch.randint(0, 64, (2, s), generator=torch.Generator().manual_seed(2))
    windows, mask_index = families.mask_windows(cfg)
    mask = torch.stack([packing.causal_mask(s, window=w) for w in windows])

    def first_grads(recompute: bool) -> dict:
        extra = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1} \
            if recompute else {}
        config = TransformerConfig(**convert.transformer_config_kwargs(cfg), **extra, use_cpu_initialization=True,
                                   perform_initialization=False)
        gpt = GPTModel(config=config, transformer_layer_spec=layer_spec(cfg, config, sequence_parallel=False),
                       **convert.gpt_model_kwargs(cfg))
        gpt.load_state_dict(convert.hf_to_mcore(hf_state, cfg), strict=False)
        rotary_positions.use_frequencies(gpt, convert.inv_freq(cfg))
        rotary_positions.use_position_ids(gpt)
        gemma3.scale_embeddings(gpt, cfg["hidden_size"])
        gemma3.use_layer_rope(gpt, families.layer_types(cfg), convert.local_inv_freq(cfg))
        use_layer_masks(gpt, mask_index)
        gpt.train()
        loss = gpt(first, torch.arange(s).expand(2, s), mask).float().logsumexp(-1).mean()
        # another micro-batch's forward, at other positions (not a shift: RoPE would not tell one from the other)
        gpt(later, (torch.arange(s) * 5 % 13).expand(2, s), mask)
        loss.backward()
        return {n: p.grad.clone() for n, p in gpt.named_parameters() if p.grad is not None}

    plain, recomputed = first_grads(False), first_grads(True)
    assert plain.keys() == recomputed.keys()
    for name, grad in plain.items():
        assert (recomputed[name] - grad).abs().max().item() <= 1e-6 * max(1.0, grad.abs().max().item()), name

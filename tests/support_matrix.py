"""docs/models.md's support matrix and the tests that back each of its cells.

`MATRIX` holds one row per family of megarl/models/families.py and, per column, a `Cell`: the text the table shows
and the pytest node ids that show it. A cell claims something unless its text is one of `UNCLAIMED`; a claiming
cell names at least one test. tests/test_support_matrix.py fails when docs/models.md's table is not `render()`'s,
when a family has no row, when a claiming cell names no test, or when a named test is not collected.

    python -m tests.support_matrix          # rewrite the table in docs/models.md from MATRIX
    python -m tests.support_matrix --check  # exit 1 when the doc's table differs (what the test checks)

To claim a cell: add or find the test that shows it, name its node id here, run the command above.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "models.md"
BEGIN = "<!-- support matrix: written by `python -m tests.support_matrix` from tests/support_matrix.py -->"
END = "<!-- end of support matrix -->"

COLUMNS = ("megatron learner", "DeepSpeed learner", "built-in engine (in-flight swaps, keep and recompute)", "vLLM",
           "SGLang (names: its loaders; serving: megarl's stand-in)", "LoRA", "R3")
_SGL = COLUMNS[4]
# Cell texts that claim nothing, so name no test: "—" (does not apply) and "not tested".
UNCLAIMED = ("—", "not tested")


@dataclass(frozen=True)
class Cell:
    text: str
    tests: tuple[str, ...] = ()


NT = Cell("not tested")
NA = Cell("—")

_CONVERT = "tests/models/test_convert.py::"
_MODEL = "tests/sampler/test_model.py::"
_ENGINE = "tests/sampler/test_engine.py::"
_MEGATRON = "tests/learner/test_megatron_learner.py::"
_FAMILY = _MEGATRON + "test_family_logprobs_match_hf_at_tp1_and_its_tp2_and_pp2_steps_match_tp1"
_DS = "tests/learner/test_deepspeed.py::test_logprobs_equal_a_transformers_forward"
_DS_EXPORT = "tests/learner/test_deepspeed.py::test_export_is_the_checkpointed_weights"
_PACKED = "tests/learner/test_packing.py::test_a_packed_step_is_the_unpacked_step"
_MOE = "tests/learner/test_moe_learner.py::"
_DS_MOE = "tests/learner/test_deepspeed_moe.py::"
_ENGINE_MOE = "tests/sampler/test_engine_moe.py::"
_VLLM = "tests/sampler/vllm/test_vllm_families.py::test_lag0_logprobs_and_a_publish_match_the_learner"
_TP = "tests/sampler/test_tensor_parallel.py::"


_LORA_ENGINE = "tests/sampler/test_lora_engine.py::test_an_adapter_version_of_every_family_samples_with_pefts_logprobs"


def _lora(kind: str, *more: str) -> Cell:
    """A dense family's adapter: the learner's and the engine's log-probs are peft's on transformers' model."""
    return Cell("yes", (f"tests/learner/test_lora.py::test_every_dense_familys_adapter_equals_peft[{kind}]",
                        f"{_LORA_ENGINE}[{kind}]") + more)


def _moe_lora(kind: str, what: str = "attention projections", learner_cases: tuple[str, ...] = (),
              more: tuple[str, ...] = ()) -> Cell:
    """An MoE family's adapter on its attention projections: the learner's and the engine's log-probs are peft's."""
    learner = "tests/learner/test_lora.py::test_an_moe_familys_attention_adapter_equals_peft"
    return Cell(f"{what} (learner and built-in engine equal peft)",
                tuple(f"{learner}[{case}]" for case in (kind,) + learner_cases) + (f"{_LORA_ENGINE}[{kind}]",) + more)


_SGLANG_LOADS = ("tests/sampler/sglang_contract/test_family_loads.py::"
                 "test_each_familys_publish_loads_into_its_own_sglang_model_class")
_SGLANG_SERVER = "tests/sampler/test_sglang_server.py::"


def _sglang(kind: str, text: str = "yes", server: str | None = None) -> Cell:
    """A family on SGLang: the learner's publish through the family's own SGLang model class's load_weights (both
    supported releases), and megarl's stand-in server serving it across an in-flight update (`server`: another
    test of that, else the per-family one)."""
    serving = server or (f"{_SGLANG_SERVER}test_each_family_serves_a_request_spanning_an_update_with_both_versions"
                         f"[{kind}]")
    return Cell(text, (f"{_SGLANG_LOADS}[0.5.21]", f"{_SGLANG_LOADS}[0.5.23]", serving))


def _engine_tp2_and_paged(kind: str) -> tuple[str, ...]:
    """A sigmoid-routed family's engine at sampler.tp=2 (TP1's logits, and its completions and routes across in-flight
    swaps, the paged layout under keep) and on the paged layout (transformers' log-probs across a swap)."""
    return (f"{_TP}test_tp2_forward_equals_tp1_and_is_bit_identical_across_ranks[{kind}]",
            f"{_TP}test_a_sigmoid_routed_moe_swapped_in_flight_at_tp2_equals_tp1[{kind}-keep]",
            f"{_TP}test_a_sigmoid_routed_moe_swapped_in_flight_at_tp2_equals_tp1[{kind}-recompute]",
            f"{_ENGINE}test_paged_layout_gives_the_contiguous_layouts_completions[{kind}-keep]",
            f"{_ENGINE}test_paged_layout_gives_the_contiguous_layouts_completions[{kind}-recompute]")


def _engine(kind: str) -> tuple[str, ...]:
    """The built-in engine's tests of a dense family: behaviour log-probs against transformers, swaps under keep
    and recompute."""
    return (f"{_ENGINE}test_behaviour_logprobs_equal_hf[{kind}-sampling0]",
            f"{_ENGINE}test_kv_policy_on_swap[{kind}-keep]", f"{_ENGINE}test_kv_policy_on_swap[{kind}-recompute]")


# (row label, model_type, {column: Cell}) in the table's order.
MATRIX: list[tuple[str, str, dict[str, Cell]]] = [
    ("Qwen2 (`qwen2`)", "qwen2", {
        "megatron learner": Cell("TP1, TP2, PP2, DP2", (f"{_MEGATRON}test_logprobs_match_hf",
                                                        f"{_MEGATRON}test_every_layout_matches_tp1")),
        "DeepSpeed learner": Cell("ZeRO 1/2/3", (f"{_DS}[qwen_zero1]", f"{_DS}[qwen_zero2_token_budget_recompute]",
                                                 f"{_DS}[qwen_zero3_kl]")),
        "built-in engine (in-flight swaps, keep and recompute)": Cell("yes", _engine("qwen2")),
        "vLLM": Cell("yes", ("tests/sampler/vllm/test_vllm_engine.py::"
                             "test_generation_and_lag0_logprobs_match_transformers",
                             "tests/sampler/vllm/test_vllm_engine.py::"
                             "test_update_mid_rollout_versions_and_kv_policy_exact[keep]")),
        _SGL: _sglang("qwen2", server=(
            f"{_SGLANG_SERVER}test_request_spanning_an_update_finishes_with_both_versions_and_new_weights_logprobs")),
        "LoRA": Cell("yes", ("tests/learner/test_lora.py::test_adapter_equals_peft_and_the_merged_weights",
                             "tests/sampler/test_lora_engine.py::"
                             "test_adapter_update_mid_rollout_keeps_per_token_versions_exact[keep-contiguous]")),
        "R3": NA}),
    ("Llama (`llama`; RoPE `linear`, `llama3` with any constants, `yarn` with its attention factor)", "llama", {
        "megatron learner": Cell("TP1 (TP shards converted exactly); YaRN: TP1, TP2, PP2", (
            f"{_CONVERT}test_megatron_logprobs_match_hf[llama]",
            f"{_CONVERT}test_megatron_logprobs_match_hf[yarn_rope]",
            f"{_CONVERT}test_layer_shard_converts_to_the_tp_slices[2-llama]", f"{_FAMILY}[llama_yarn]")),
        "DeepSpeed learner": Cell("ZeRO 3 + offload; YaRN: ZeRO 2", (f"{_DS}[llama_zero3_offload]",
                                                                     f"{_DS}[llama_yarn_zero2]")),
        "built-in engine (in-flight swaps, keep and recompute)": Cell("yes", _engine("llama") + (
            f"{_MODEL}test_prefill_matches_hf[yarn_rope]", f"{_MODEL}test_prefill_matches_hf[llama3_rope]")),
        "vLLM": Cell("yes", (f"{_VLLM}[llama]",)), _SGL: _sglang("llama"), "LoRA": _lora("llama"), "R3": NA}),
    ("Qwen3 (`qwen3`: per-head q/k RMSNorm, heads wider than hidden / heads)", "qwen3", {
        "megatron learner": Cell("TP1, TP2, PP2", (f"{_FAMILY}[qwen3]",
                                                   f"{_CONVERT}test_megatron_logprobs_match_hf[qwen3]")),
        "DeepSpeed learner": Cell("ZeRO 2", (f"{_DS}[qwen3_zero2]", f"{_DS_EXPORT}[qwen3_zero2]")),
        "built-in engine (in-flight swaps, keep and recompute)": Cell("yes", _engine("qwen3")),
        "vLLM": Cell("yes", (f"{_VLLM}[qwen3]",)),
        _SGL: _sglang("qwen3"), "LoRA": _lora("qwen3"), "R3": NA}),
    ("Mistral (`mistral`: `sliding_window`, in the learners' attention mask and the engine's)", "mistral", {
        "megatron learner": Cell("TP1, TP2, PP2, packed rows", (f"{_FAMILY}[mistral]",
                                                                f"{_PACKED}[megatron-mistral groups]")),
        "DeepSpeed learner": Cell("ZeRO 2, packed rows", (f"{_DS}[mistral_zero2]", f"{_PACKED}[deepspeed-mistral groups]")),
        "built-in engine (in-flight swaps, keep and recompute)": Cell("yes", _engine("mistral")),
        "vLLM": Cell("yes", (f"{_VLLM}[mistral]",)),
        _SGL: _sglang("mistral"), "LoRA": _lora("mistral"), "R3": NA}),
    ("Phi-3 (`phi3`: fused `qkv_proj` and `gate_up_proj`, split for megatron and fused back on publish and export)",
     "phi3", {
        "megatron learner": Cell("TP1, TP2, PP2 (publishes whole tensors)", (f"{_FAMILY}[phi3]",)),
        "DeepSpeed learner": Cell("ZeRO 2", (f"{_DS}[phi3_zero2]", f"{_DS_EXPORT}[phi3_zero2]")),
        "built-in engine (in-flight swaps, keep and recompute)": Cell("yes, at sampler.tp=1", _engine("phi3") + (
            f"{_CONVERT}test_phi3s_fused_projections_run_unsplit_and_say_where",)),
        "vLLM": Cell("yes", (f"{_VLLM}[phi3]",)),
        _SGL: _sglang("phi3"),
        "LoRA": Cell("yes (one adapter on each fused module, as peft's; DeepSpeed learner too)", _lora("phi3").tests + (
            f"{_CONVERT}test_phi3s_fused_projections_run_unsplit_and_say_where",
            "tests/learner/test_deepspeed_lora.py::test_published_adapter_in_the_engine_is_peft_merged[phi3]")),
        "R3": NA}),
    ("SmolLM3 (`smollm3`: `no_rope_layers`, layers attending without RoPE)", "smollm3", {
        "megatron learner": Cell("TP1, TP2, PP2", (f"{_FAMILY}[smollm3]",)),
        "DeepSpeed learner": Cell("ZeRO 2", (f"{_DS}[smollm3_zero2]", f"{_DS_EXPORT}[smollm3_zero2]")),
        "built-in engine (in-flight swaps, keep and recompute)": Cell("yes (its forward; swaps as the others')", (
            f"{_MODEL}test_prefill_matches_hf[smollm3]",
            f"{_MODEL}test_batched_decode_with_different_lengths_matches_hf[smollm3]")),
        "vLLM": Cell("yes (vLLM's transformers backend)", (f"{_VLLM}[smollm3]",)),
        _SGL: _sglang("smollm3", "yes (0.5.23, by its transformers backend; 0.5.21's refuses transformers 5.25's TP "
                                 "plan)"),
        "LoRA": _lora("smollm3"), "R3": NA}),
    ("OLMo 2 (`olmo2`: RMSNorm after attention and the MLP, none before; q/k RMSNorm over the whole projection)",
     "olmo2", {
        "megatron learner": Cell("TP1, TP2, PP2 (publishes whole tensors)", (
            f"{_FAMILY}[olmo2]", f"{_CONVERT}test_megatron_logprobs_match_hf[olmo2]")),
        "DeepSpeed learner": Cell("ZeRO 2", (f"{_DS}[olmo2_zero2]", f"{_DS_EXPORT}[olmo2_zero2]",
                                             "tests/learner/test_deepspeed.py::"
                                             "test_first_step_equals_the_megatron_learner[olmo2_zero2]")),
        "built-in engine (in-flight swaps, keep and recompute)": Cell("yes, at sampler.tp=1", _engine("olmo2") + (
            f"{_MODEL}test_prefill_matches_hf[olmo2]", f"{_MODEL}test_shard_spec_is_one_tp_ranks_share[olmo2]")),
        "vLLM": Cell("yes", (f"{_VLLM}[olmo2]",)), _SGL: _sglang("olmo2"), "LoRA": _lora("olmo2"), "R3": NA}),
    ("Gemma 3 text (`gemma3_text`: embeddings scaled by sqrt(hidden), (1 + w) RMSNorms before and after attention "
     "and the MLP, per-head q/k RMSNorm, GeGLU, `query_pre_attn_scalar`, local sliding-window and global layers "
     "(`layer_types`) with their own RoPE)", "gemma3_text", {
        "megatron learner": Cell("TP1, TP2, PP2, packed rows", (
            f"{_FAMILY}[gemma3]", f"{_CONVERT}test_megatron_logprobs_match_hf[gemma3]",
            f"{_CONVERT}test_round_trip_is_exact[gemma3]", f"{_PACKED}[megatron-gemma3 groups]")),
        "DeepSpeed learner": Cell("ZeRO 2, packed rows", (
            f"{_DS}[gemma3_zero2]", f"{_DS_EXPORT}[gemma3_zero2]",
            "tests/learner/test_deepspeed.py::test_first_step_equals_the_megatron_learner[gemma3_zero2]",
            f"{_PACKED}[deepspeed-gemma3 groups]")),
        "built-in engine (in-flight swaps, keep and recompute)": Cell("yes, TP2 too", _engine("gemma3") + (
            f"{_MODEL}test_prefill_matches_hf[gemma3]",
            f"{_MODEL}test_batched_decode_with_different_lengths_matches_hf[gemma3]",
            "tests/sampler/test_tensor_parallel.py::test_tp2_forward_equals_tp1_and_is_bit_identical_across_ranks"
            "[gemma3]")),
        "vLLM": Cell("yes", (f"{_VLLM}[gemma3_text]",)), _SGL: _sglang("gemma3"), "LoRA": _lora("gemma3"), "R3": NA}),
    ("Mixtral (`mixtral`)", "mixtral", {
        "megatron learner": Cell("TP1, TP2, PP2, DP2 x EP2, TP2 x EP2 (docs/moe.md)", (
            f"{_MOE}test_moe_logprobs_match_transformers[mixtral]",
            f"{_MOE}test_r3_under_tensor_pipeline_and_expert_parallelism_matches_one_rank")),
        "DeepSpeed learner": Cell("ZeRO 1", (f"{_DS_MOE}test_moe_publishes_and_exports_the_save_pretrained_state"
                                             "[mixtral-1]",)),
        "built-in engine (in-flight swaps, keep and recompute)": Cell("yes", (
            f"{_ENGINE_MOE}test_logprobs_and_routes_equal_transformers[sampling0]",
            f"{_ENGINE_MOE}test_routes_across_an_inflight_update_come_from_the_weights_that_computed_them[keep]",
            f"{_ENGINE_MOE}test_routes_across_an_inflight_update_come_from_the_weights_that_computed_them"
            "[recompute]")),
        "vLLM": Cell("yes", (f"{_VLLM}[mixtral]",)),
        _SGL: _sglang("mixtral", "yes (routes; untied: SGLang's class ties no lm_head)", server=(
            "tests/sampler/test_sglang_routes.py::"
            "test_routes_through_the_sglang_compatible_server_equal_transformers")),
        "LoRA": Cell("yes (TP2)", (f"{_MOE}test_r3_under_tensor_pipeline_and_expert_parallelism_matches_one_rank",)),
        "R3": Cell("yes", (f"{_MOE}test_r3_replays_the_sampler_routes_exactly[mixtral]",
                           f"{_DS_MOE}test_r3_forces_the_recorded_routes_in_every_pass"))}),
    ("Qwen3-MoE (`qwen3_moe`)", "qwen3_moe", {
        "megatron learner": Cell("TP1; TP2, PP2, DP2 x EP2, TP2 x EP2 equal to TP1", (
            f"{_MOE}test_moe_logprobs_match_transformers[qwen3_moe]",
            f"{_MOE}test_moe_logprobs_match_transformers[qwen3_moe_norm_topk]",
            f"{_MOE}test_qwen3_moe_under_tensor_pipeline_and_expert_parallelism_matches_one_rank")),
        "DeepSpeed learner": Cell("ZeRO 3", (f"{_DS_MOE}test_moe_publishes_and_exports_the_save_pretrained_state"
                                             "[qwen3_moe-3]",)),
        "built-in engine (in-flight swaps, keep and recompute)": Cell("yes", (
            f"{_ENGINE_MOE}test_qwen3_moe_logprobs_and_routes_equal_transformers",
            "tests/sampler/test_tensor_parallel.py::test_tp2_forward_equals_tp1_and_is_bit_identical_across_ranks"
            "[qwen3_moe]")),
        "vLLM": Cell("yes", (f"{_VLLM}[qwen3_moe]",)),
        _SGL: _sglang("qwen3_moe", "yes (untied: SGLang's class ties no lm_head)"), "LoRA": _moe_lora("qwen3_moe"),
        "R3": Cell("yes (megatron, DeepSpeed)", (f"{_MOE}test_r3_replays_the_sampler_routes_exactly[qwen3_moe]",
                                                 f"{_DS_MOE}test_r3_on_qwen3_moe_unnormalised_routing_is_exact"))}),
    ("GLM-4.5 (`glm4_moe`: partial RoPE, q/k/v bias and q/k norm from its config, shared expert, sigmoid router "
     "with expert bias, group-limited top-k and scaling, first dense layers)", "glm4_moe", {
        "megatron learner": Cell("TP1; TP2, PP2, DP2 x EP2, TP2 x EP2 equal to TP1; HF export", (
            f"{_MOE}test_moe_logprobs_match_transformers[glm4_moe]",
            f"{_MOE}test_a_checkpoint_of_an_moe_learner_exports_to_a_directory_transformers_loads[glm4_moe]",
            f"{_MOE}test_glm4_moe_under_tensor_and_expert_parallelism_matches_one_rank",
            f"{_MOE}test_dense_first_layers_under_pipeline_parallelism_match_one_stage[glm4_moe]",
            f"{_CONVERT}test_moe_round_trip_keeps_every_per_expert_tensor[glm4_moe]",
            f"{_MOE}test_moe_publishes_the_per_expert_hf_names[glm4_moe]")),
        "DeepSpeed learner": Cell("ZeRO 2 (publish and export with the router expert bias)", (
            f"{_DS_MOE}test_sigmoid_routed_logprobs_match_transformers[glm4_moe]",
            f"{_DS_MOE}test_moe_publishes_and_exports_the_save_pretrained_state[glm4_moe-2]")),
        "built-in engine (in-flight swaps, keep and recompute)": Cell(
            "yes (native forward, routes), sampler.tp=2 and the paged KV layout too", _engine("glm4_moe")
            + _engine_tp2_and_paged("glm4_moe") + (
            f"{_ENGINE_MOE}test_native_moe_logprobs_and_routes_equal_transformers[glm4_moe-sampling1]",
            f"{_ENGINE_MOE}test_native_moe_across_an_inflight_update_equals_transformers_over_its_cache[glm4_moe-keep]",
            f"{_ENGINE_MOE}test_native_moe_across_an_inflight_update_equals_transformers_over_its_cache"
            "[glm4_moe-recompute]",
            f"{_ENGINE_MOE}test_glm4_moe_runs_natively_with_its_router_and_names_what_it_refuses",
            f"{_MOE}test_sigmoid_routed_families_sample_on_the_native_engine_from_the_learners_publish[glm4_moe-keep]",
            f"{_MOE}test_sigmoid_routed_families_sample_on_the_native_engine_from_the_learners_publish"
            "[glm4_moe-recompute]")),
        "vLLM": Cell("yes", (f"{_VLLM}[glm4_moe]",)), _SGL: _sglang("glm4_moe"), "LoRA": _moe_lora("glm4_moe"),
        "R3": Cell("yes (megatron, DeepSpeed; the built-in engine's routes)", (
            f"{_MOE}test_r3_replays_the_sampler_routes_exactly[glm4_moe]",
            f"{_DS_MOE}test_r3_replays_at_the_sigmoid_router[glm4_moe]",
            f"{_MOE}test_r3_learner_runs_the_engines_routes_across_an_inflight_update[glm4_moe]"))}),
    ("gpt-oss (`gpt_oss`: attention sinks, sliding and full layers by `layer_types`, biases on every linear, fused "
     "experts with the clamped SwiGLU, biased router, YaRN)", "gpt_oss", {
        "megatron learner": Cell("TP1; TP2, PP2, DP2 x EP2, TP2 x EP2 equal to TP1; MXFP4 checkpoints (dequantized on "
                                 "load, exported as float)", (
            f"{_MOE}test_moe_logprobs_match_transformers[gpt_oss_mxfp4]",
            f"{_MOE}test_a_checkpoint_of_an_moe_learner_exports_to_a_directory_transformers_loads[gpt_oss_mxfp4]",
            "tests/models/test_mxfp4.py::test_an_mxfp4_gpt_oss_directory_loads_as_the_float_checkpoint_transformers_"
            "makes_of_it",
            f"{_MOE}test_moe_logprobs_match_transformers[gpt_oss]",
            f"{_MOE}test_gpt_oss_under_tensor_pipeline_and_expert_parallelism_matches_one_rank",
            f"{_CONVERT}test_gpt_oss_round_trip_is_exact_and_deinterleaves_the_fused_experts",
            f"{_MOE}test_moe_publishes_the_per_expert_hf_names[gpt_oss]",
            "tests/learner/test_sdpa_attention.py::test_sinks_match_transformers_eager_attention[packed_window]",
            f"{_PACKED}[megatron-gpt_oss]")),
        "DeepSpeed learner": Cell("ZeRO 1, packed rows", (f"{_PACKED}[deepspeed-gpt_oss]",)),
        "built-in engine (in-flight swaps, keep and recompute)": Cell(
            "yes (native forward, routes; MXFP4 checkpoints too), at sampler.tp=1", _engine("gpt_oss") + (
            f"{_ENGINE_MOE}test_an_mxfp4_gpt_oss_checkpoint_samples_with_the_logprobs_of_transformers_dequantized_model",
            f"{_ENGINE_MOE}test_native_moe_logprobs_and_routes_equal_transformers[gpt_oss-sampling1]",
            f"{_ENGINE_MOE}test_native_moe_across_an_inflight_update_equals_transformers_over_its_cache[gpt_oss-keep]",
            f"{_ENGINE_MOE}test_native_moe_across_an_inflight_update_equals_transformers_over_its_cache"
            "[gpt_oss-recompute]",
            f"{_ENGINE}test_paged_layout_gives_the_contiguous_layouts_completions[gpt_oss-keep]",
            f"{_MOE}test_gpt_oss_samples_on_the_native_engine_and_its_lag0_gap_to_the_learner_is_fp32_noise")),
        "vLLM": Cell("yes", (f"{_VLLM}[gpt_oss]",)), _SGL: _sglang("gpt_oss", "yes (SGLang holds the sinks in bf16)"),
        "LoRA": _moe_lora("gpt_oss"),
        "R3": Cell("yes (megatron, DeepSpeed; the built-in engine's routes)", (
            f"{_MOE}test_r3_replays_the_sampler_routes_exactly[gpt_oss]",
            f"{_DS_MOE}test_r3_on_gpt_oss_replays_at_its_router",
            f"{_MOE}test_r3_learner_runs_the_engines_routes_across_an_inflight_update[gpt_oss]"))}),
    ("DeepSeek-V3 (`deepseek_v3`, Kimi-K2's architecture: multi-latent attention with or without a q latent, "
     "interleaved YaRN RoPE with its mscale, GLM-4.5's MoE)", "deepseek_v3", {
        "megatron learner": Cell("TP1 (packed rows with shared prefixes too); TP2, PP2, DP2 x EP2, TP2 x EP2 equal to "
                                 "TP1; HF export", (
            f"{_MOE}test_moe_logprobs_match_transformers[deepseek_v3]",
            f"{_PACKED}[megatron-deepseek_v3 groups]",
            f"{_MOE}test_deepseek_v3_under_tensor_and_expert_parallelism_matches_one_rank",
            f"{_MOE}test_dense_first_layers_under_pipeline_parallelism_match_one_stage[deepseek_v3]",
            f"{_MOE}test_a_checkpoint_of_an_moe_learner_exports_to_a_directory_transformers_loads[deepseek_v3]",
            f"{_MOE}test_moe_logprobs_match_transformers[deepseek_v3_q_full]",
            f"{_MOE}test_sdpa_attention_takes_mla_split_head_dims_as_transformers_eager_attention",
            f"{_CONVERT}test_deepseek_v3_round_trip_is_exact_and_maps_the_latent_attention[12]",
            f"{_CONVERT}test_deepseek_v3_round_trip_is_exact_and_maps_the_latent_attention[None]",
            f"{_MOE}test_moe_publishes_the_per_expert_hf_names[deepseek_v3]")),
        "DeepSpeed learner": Cell("ZeRO 1, 3 (publish and export with the router expert bias)", (
            f"{_DS_MOE}test_sigmoid_routed_logprobs_match_transformers[deepseek_v3]",
            f"{_DS_MOE}test_moe_publishes_and_exports_the_save_pretrained_state[deepseek_v3-1]",
            f"{_DS_MOE}test_moe_publishes_and_exports_the_save_pretrained_state[deepseek_v3-3]")),
        "built-in engine (in-flight swaps, keep and recompute)": Cell(
            "yes (native forward: a latent cache, absorbed decode, routes), sampler.tp=2 (heads split, the latents "
            "whole) and the paged KV layout too", _engine("deepseek_v3") + _engine_tp2_and_paged("deepseek_v3") + (
                f"{_ENGINE_MOE}test_native_moe_logprobs_and_routes_equal_transformers[deepseek_v3-sampling1]",
                f"{_ENGINE_MOE}test_native_moe_across_an_inflight_update_equals_transformers_over_its_cache"
                "[deepseek_v3-keep]",
                f"{_ENGINE_MOE}test_native_moe_across_an_inflight_update_equals_transformers_over_its_cache"
                "[deepseek_v3-recompute]",
                f"{_ENGINE_MOE}test_deepseek_v3_caches_one_latent_per_position_and_equals_transformers[12]",
                f"{_ENGINE_MOE}test_deepseek_v3_caches_one_latent_per_position_and_equals_transformers[None]",
                f"{_ENGINE_MOE}test_deepseek_v3_shards_its_heads_and_keeps_its_latents_whole",
                f"{_ENGINE_MOE}test_deepseek_v3_decode_stays_transformers_full_forward_over_a_long_continuously_batched_run",
                f"{_ENGINE_MOE}test_deepseek_v3_tokens_after_a_keep_swap_are_the_new_weights_over_the_old_latent_cache",
                f"{_MOE}test_sigmoid_routed_families_sample_on_the_native_engine_from_the_learners_publish"
                "[deepseek_v3-keep]",
                f"{_MOE}test_sigmoid_routed_families_sample_on_the_native_engine_from_the_learners_publish"
                "[deepseek_v3-recompute]")),
        "vLLM": Cell("yes (CPU: a latent of 512 + 64 RoPE dims)", (f"{_VLLM}[deepseek_v3]",)),
        _SGL: _sglang("deepseek_v3"),
        "LoRA": _moe_lora("deepseek_v3", "the latent attention's projections, learner TP1 and TP2",
                          ("deepseek_v3_q_proj",), (
            f"{_CONVERT}test_deepseek_v3_samples_at_sampler_tp2_and_adapts_its_latent_projections_as_a_group",
            f"{_MOE}test_deepseek_v3_under_tensor_and_expert_parallelism_matches_one_rank")),
        "R3": Cell("yes (megatron, DeepSpeed; the built-in engine's routes)", (
            f"{_MOE}test_r3_replays_the_sampler_routes_exactly[deepseek_v3]",
            f"{_DS_MOE}test_r3_replays_at_the_sigmoid_router[deepseek_v3]",
            f"{_MOE}test_r3_learner_runs_the_engines_routes_across_an_inflight_update[deepseek_v3]"))}),
]


def claimed_tests() -> set[str]:
    """Every node id a cell names."""
    return {test for _, _, cells in MATRIX for cell in cells.values() for test in cell.tests}


def render() -> str:
    """The markdown table of MATRIX, as docs/models.md holds it between BEGIN and END."""
    lines = ["| family (`model_type`) | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for label, _, cells in MATRIX:
        lines.append(f"| {label} | " + " | ".join(cells[column].text for column in COLUMNS) + " |")
    return "\n".join(lines)


def doc_table(text: str) -> str:
    """The table docs/models.md holds between BEGIN and END; ValueError naming the markers when they are absent."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"{DOC}: the support matrix's markers are missing ({BEGIN!r} ... {END!r})")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def write_doc(path: Path = DOC) -> bool:
    """Rewrite the table in `path` from MATRIX; whether anything changed."""
    text = path.read_text()
    new = text.replace(f"{BEGIN}\n{doc_table(text)}\n{END}", f"{BEGIN}\n{render()}\n{END}")
    path.write_text(new)
    return new != text


if __name__ == "__main__":
    if "--check" in sys.argv[1:]:
        same = doc_table(DOC.read_text()) == render()
        print(f"{DOC}: the support matrix is {'' if same else 'not '}the one tests/support_matrix.py claims")
        sys.exit(0 if same else 1)
    print(f"{DOC}: {'rewritten' if write_doc() else 'already'} from tests/support_matrix.py")

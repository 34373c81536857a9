"""BuiltinEngine on a mixture-of-experts model (tiny Mixtral): log-probs and routes equal transformers',
and across an in-flight update every position's routes are those of the weights that computed it."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from megarl.protocols import GenerationRequest, SamplingParams
from megarl.sampler.engine import BuiltinEngine
from megarl.sampler.model import ModelSpec, load_pretrained
from tests.sampler import make_tiny_model

TOL = 1e-5
LAYERS, TOP_K, EXPERTS = 2, 2, 4


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("mixtral"), "mixtral")
    return path, *load_pretrained(str(path))


def requests(n, sampling, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 12, (n,), generator=gen).tolist()
    return [GenerationRequest(str(i), torch.randint(0, 32, (k,), generator=gen).tolist(), sampling)
            for i, k in enumerate(lens)]


def save_version(model_dir: Path, weights: dict, out: Path) -> Path:
    """An HF directory of `weights` (transformers converts the per-expert names only when it loads a directory)."""
    out.mkdir()
    shutil.copy(model_dir / "config.json", out / "config.json")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def hf_reference(ids: list[int], *versions: tuple[Path, int | None]) -> tuple[torch.Tensor, np.ndarray]:
    """transformers' log-probs [len(ids), V] and routes [len(ids), layers, top_k], each (model dir, end) of
    `versions` computing positions up to `end` (None: to the end) over the KV cache the earlier ones left:
    what an engine that keeps its cache across an update computed."""
    from transformers import AutoModelForCausalLM

    chosen, logits, cache, begin = [], [], None, 0
    for model_dir, end in versions:
        hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out: chosen.append(out[2]))
                 for layer in hf.model.layers]
        end = len(ids) if end is None else end
        with torch.inference_mode():
            out = hf(torch.tensor([ids[begin:end]]), past_key_values=cache, use_cache=True)
        for h in hooks:
            h.remove()
        logits.append(out.logits[0].float())
        cache, begin = out.past_key_values, end
    # chosen: per forward call, per layer, [tokens, top_k]
    per_call = [torch.stack(chosen[i:i + LAYERS], dim=1) for i in range(0, len(chosen), LAYERS)]
    return torch.log_softmax(torch.cat(logits), -1), torch.cat(per_call).numpy()


def test_spec_parses_mixtral_and_refuses_tensor_parallel(mixtral):
    _, cfg, _ = mixtral
    spec = ModelSpec.from_hf_config(cfg)
    assert (spec.num_experts, spec.top_k, spec.is_moe) == (EXPERTS, TOP_K, True)
    with pytest.raises(ValueError, match="tensor parallelism .* mixture-of-experts"):
        spec.shard(2)
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        ModelSpec.from_hf_config(dict(cfg, num_experts_per_tok=5))


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0, max_new_tokens=8),
                                      SamplingParams(temperature=1.0, max_new_tokens=10)])
def test_logprobs_and_routes_equal_transformers(mixtral, sampling):
    path, cfg, weights = mixtral
    completions = BuiltinEngine(cfg, weights, max_running=4, version=3).generate(requests(6, sampling))
    for c in completions:
        n = len(c.prompt_ids)
        assert c.routes.dtype == np.uint8 and c.routes.shape == (n + len(c.token_ids) - 1, LAYERS, TOP_K)
        logp, routes = hf_reference(c.prompt_ids + c.token_ids, (path, None))
        expected = [logp[n - 1 + i, tok].item() for i, tok in enumerate(c.token_ids)]
        assert max(abs(a - b) for a, b in zip(c.logprobs, expected)) <= TOL
        np.testing.assert_array_equal(c.routes, routes[:-1])  # the last token is never an input
        assert c.versions == [3] * len(c.token_ids)


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_routes_across_an_inflight_update_come_from_the_weights_that_computed_them(mixtral, policy, tmp_path):
    """v1 computes the prompt and the first decode inputs; v2 the rest ("recompute": all of it again)."""
    path, cfg, weights = mixtral
    gen = torch.Generator().manual_seed(5)
    v2 = {k: t + 0.3 * torch.randn(t.shape, generator=gen) if k.endswith("gate.weight") else t.clone()
          for k, t in weights.items()}  # a different router: the two versions route many tokens differently
    v2_dir = save_version(path, v2, tmp_path / "v2")
    engine = BuiltinEngine(cfg, weights, max_running=4, kv_on_update=policy)
    reqs = requests(4, SamplingParams(temperature=1.0, max_new_tokens=10), seed=1)
    for r in reqs:
        engine.add_request(r)
    done = {}
    for _ in range(3):  # step 1: prefill (token 1) + decode (token 2); then 2 decodes: positions < n + 3 by v1
        done.update((c.request_id, c) for c in engine.step())
    engine.stage_weights(v2, 1)
    while engine.num_unfinished:
        done.update((c.request_id, c) for c in engine.step())
    differ = 0
    for r in reqs:
        c = done[r.request_id]
        n = len(c.prompt_ids)
        assert c.versions == [0] * 4 + [1] * 6
        ids = c.prompt_ids + c.token_ids
        split = n + 3  # v1 computed positions [0, split); v2 the later ones and, under "recompute", all again
        _, expected = hf_reference(ids, *([(v2_dir, None)] if policy == "recompute" else [(path, split), (v2_dir, None)]))
        np.testing.assert_array_equal(c.routes, expected[:-1])
        _, all_v1 = hf_reference(ids, (path, None))
        differ += int((all_v1[:-1] != c.routes).any(axis=(1, 2)).sum())
    assert differ > 0  # the test can tell the versions apart


def test_routes_survive_slot_packing(mixtral):
    """Requests of different lengths finish, survivors move slots: each keeps its own routes."""
    path, cfg, weights = mixtral
    reqs = [GenerationRequest(r.request_id, r.prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=2 + i))
            for i, r in enumerate(requests(6, None, seed=2))]
    for c in BuiltinEngine(cfg, weights, max_running=3).generate(reqs):
        _, routes = hf_reference(c.prompt_ids + c.token_ids, (path, None))
        np.testing.assert_array_equal(c.routes, routes[:-1])


def test_dense_models_record_no_routes(tmp_path):
    path = make_tiny_model(tmp_path, "qwen2")
    cfg, weights = load_pretrained(str(path))
    [c] = BuiltinEngine(cfg, weights).generate(requests(1, SamplingParams(temperature=0.0, max_new_tokens=3)))
    assert c.routes is None

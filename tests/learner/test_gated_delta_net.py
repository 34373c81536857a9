"""megatron-core's own GatedDeltaNet (megatron/core/ssm/gated_delta_net.py) against transformers' Qwen3.5 /
Qwen3-Next gated-DeltaNet layer on CPU: megarl.learner.cpu_shims.apply_gated_delta_net_shims lets it build and run
without flash-linear-attention, and megarl.models.gated_delta_net maps the weights both ways exactly."""
import pytest
import torch
import torch.distributed as dist

from megarl.learner.gated_delta_net import build_layer
from megarl.models import gated_delta_net as gdn

# Two key heads serving two value heads each (the grouped layout megatron and transformers repeat q/k for), widths
# of the tiny models' (tests/helpers.py QWEN3_NEXT_TINY).
HYBRID = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, layer_types=["linear_attention", "full_attention"],
              linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
              linear_num_value_heads=4, rms_norm_eps=1e-6)


@pytest.fixture(scope="module")
def megatron_world(tmp_path_factory):
    from megatron.core import parallel_state, tensor_parallel

    from megarl.learner.cpu_shims import apply_cpu_shims, apply_gated_delta_net_shims

    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    apply_cpu_shims()
    apply_gated_delta_net_shims()
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _hf_layer(model_type: str):
    """transformers' gated-DeltaNet layer 0 of a tiny random model of `model_type`, with every weight away from
    its initial value (norm weights of one, dt_bias of ones would hide a swapped or misplaced tensor)."""
    from transformers import Qwen3_5TextConfig, Qwen3NextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    torch.manual_seed(0)
    if model_type == "qwen3_5_text":
        config = Qwen3_5TextConfig(**HYBRID)
        layer = Qwen3_5GatedDeltaNet(config, 0)
    else:
        config = Qwen3NextConfig(**HYBRID, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                                 shared_expert_intermediate_size=16)
        layer = Qwen3NextGatedDeltaNet(config, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return config, layer.eval()


def test_without_the_shims_megatron_cores_module_refuses_to_build():
    """The reason for apply_gated_delta_net_shims: megatron-core 0.16.1 imports fla for l2norm and the chunked
    kernel, and its constructor refuses without them (this machine has no flash-linear-attention)."""
    import importlib.util

    from megatron.core.ssm import gated_delta_net

    if importlib.util.find_spec("fla") is not None:
        pytest.skip("flash-linear-attention is installed")
    source = open(gated_delta_net.__file__).read()
    assert "from fla.modules.l2norm import l2norm" in source and "if not HAVE_FLA:" in source


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_round_trip_is_exact(model_type):
    config, layer = _hf_layer(model_type)
    hf = {name: t.detach() for name, t in layer.state_dict().items()}
    if model_type == "qwen3_next":
        hf = gdn.qwen3_next_to_qwen3_5(hf, config.to_dict())
    back = gdn.mcore_to_hf(gdn.hf_to_mcore(hf), config.to_dict())
    assert back.keys() == hf.keys()
    for name in hf:
        assert torch.equal(back[name], hf[name]), name


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_megatron_cores_gated_delta_net_equals_transformers(megatron_world, model_type):
    """The same layer, the same input (two rows, 70 positions: past one 64-token chunk of the chunked rule), the
    output equal within fp32 rounding: both run the chunked delta rule in fp32 over the same sums, so the bound is
    a few ulps of the output's scale, far below what a misplaced head, gate or norm weight moves."""
    config, layer = _hf_layer(model_type)
    hf = {name: t.detach() for name, t in layer.state_dict().items()}
    if model_type == "qwen3_next":
        hf = gdn.qwen3_next_to_qwen3_5(hf, config.to_dict())
    mlayer = build_layer(config.to_dict()).eval()
    missing, unexpected = mlayer.load_state_dict(gdn.hf_to_mcore(hf), strict=False)
    assert not unexpected and all(name.endswith("_extra_state") for name in missing), (missing, unexpected)
    x = torch.randn(2, 70, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = layer(x)
        got, bias = mlayer(x.transpose(0, 1).contiguous(), attention_mask=None)
    assert bias is None
    got = got.transpose(0, 1)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 1e-5 * scale, (got - want).abs().max().item()


def test_a_tp_ranks_share_is_its_heads_of_every_part_in_megatrons_order():
    """At TP2 rank r's fused projection is [q_r | k_r | v_r | z_r | b_r | a_r] (its key heads' q and k, the value
    heads they serve for v, z, b and a), the order its forward splits the rank's output in; the conv holds the same
    heads of q, k and v; dt_bias / A_log its value heads; out_proj its value heads' input columns. Rows are labelled
    (part, head) so a rank holding another head, or the parts in another order, shows."""
    cfg = {"linear_num_key_heads": 2, "linear_key_head_dim": 3, "linear_num_value_heads": 4, "linear_value_head_dim": 2}
    parts = [("q", 2, 3), ("k", 2, 3), ("v", 4, 2), ("z", 4, 2), ("b", 4, 1), ("a", 4, 1)]  # (part, heads, head width)
    labels = [(part, head) for part, heads, width in parts for head in range(heads) for _ in range(width)]
    code = {label: i for i, label in enumerate(dict.fromkeys(labels))}
    in_proj = torch.tensor([code[label] for label in labels], dtype=torch.float32)[:, None]
    for rank in range(2):
        want = [code[(part, head)] for part, heads, width in parts
                for head in range(rank * heads // 2, (rank + 1) * heads // 2) for _ in range(width)]
        assert gdn.tp_slice("in_proj.weight", in_proj, cfg, 2, rank)[:, 0].tolist() == want
        conv = in_proj[:sum(h * w for _, h, w in parts[:3])]
        conv_want = [c for c in want if any(c == code[(p, h)] for p in "qkv" for h in range(4) if (p, h) in code)]
        assert gdn.tp_slice("conv1d.weight", conv, cfg, 2, rank)[:, 0].tolist() == conv_want
        assert gdn.tp_slice("dt_bias", torch.arange(4.0), cfg, 2, rank).tolist() == [2.0 * rank, 2.0 * rank + 1]
        assert torch.equal(gdn.tp_slice("out_proj.weight", torch.eye(8), cfg, 2, rank), torch.eye(8)[:, 4 * rank:4 * rank + 4])
    assert torch.equal(gdn.tp_slice("out_norm.weight", torch.ones(2), cfg, 2, 1), torch.ones(2))
    with pytest.raises(ValueError, match="learner.tp=4 does not divide linear_num_key_heads=2"):
        gdn.tp_slice("in_proj.weight", in_proj, cfg, 4, 0)


TP2_SCRIPT = '''
import json, sys
import torch, torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megarl.learner.cpu_shims import apply_cpu_shims, apply_gated_delta_net_shims
from megarl.learner.gated_delta_net import build_layer
from megarl.models import gated_delta_net as gdn
from tests.learner.test_gated_delta_net import _hf_layer

dist.init_process_group("gloo")
apply_cpu_shims()
apply_gated_delta_net_shims()
parallel_state.initialize_model_parallel(2, 1)
tensor_parallel.model_parallel_cuda_manual_seed(0)
rank, gaps = parallel_state.get_tensor_model_parallel_rank(), {}
for model_type in ("qwen3_5_text", "qwen3_next"):
    config, layer = _hf_layer(model_type)
    cfg = config.to_dict()
    hf = {name: t.detach() for name, t in layer.state_dict().items()}
    if model_type == "qwen3_next":
        hf = gdn.qwen3_next_to_qwen3_5(hf, cfg)
    mlayer = build_layer(cfg).eval()
    shard = {name: gdn.tp_slice(name, t, cfg, 2, rank) for name, t in gdn.hf_to_mcore(hf).items()}
    missing, unexpected = mlayer.load_state_dict(shard, strict=False)
    assert not unexpected and all(name.endswith("_extra_state") for name in missing), (missing, unexpected)
    x = torch.randn(2, 70, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = layer(x)
        got = mlayer(x.transpose(0, 1).contiguous(), attention_mask=None)[0].transpose(0, 1)
    gaps[model_type] = ((got - want).abs().max() / want.abs().max()).item()
if rank == 0:
    print("GAPS " + json.dumps(gaps), flush=True)
parallel_state.destroy_model_parallel()
dist.destroy_process_group()
'''


def test_at_tp2_megatron_cores_layer_from_each_ranks_share_equals_transformers(tmp_path):
    """Two gloo ranks at learner.tp=2, each holding tp_slice's share (its key heads, their value heads): the
    row-parallel output projection's sum over the ranks equals transformers' layer within the TP1 bound (the
    ranks' partial sums add in another order). The ranks are forked from one process that imported megatron once
    (tests/forked_ranks.py): the layer's math is under test, not the launch."""
    import json

    from tests.helpers import run_forked_ranks

    script = tmp_path / "gdn_tp2.py"
    script.write_text(TP2_SCRIPT)
    proc = run_forked_ranks(script, 2, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    gaps = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("GAPS "))[5:])
    assert set(gaps) == {"qwen3_5_text", "qwen3_next"} and max(gaps.values()) <= 1e-5, gaps

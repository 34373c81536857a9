"""Every CPU shim is needed, and fixes the megatron line it names.

Each layout below runs a full learner step — build, DDP, optimizer, forward/backward, grad norm, clipped
optimizer step — with NO shims (or only the ones it is not about), and then repeatedly: the run must die with the
CPU-torch CUDA error (or a CUDA tensor-type check) inside a function that exactly one shim patches; that shim is
applied and the run retried.  The run must end in success, and every shim must have been needed in one of the
layouts: one process (TP1), and two ranks for PP=2 (p2p, tied embeddings across stages) and the distributed
optimizer.  Each failure happens on every rank before any collective, so the ranks retry in step.  Deleting any
shim (or its effect) fails the test.  Every rank of every layout is a fork of one process that imported megatron
unpatched (tests/learner/cpu_shim_worker.py: importing megatron costs several CPU-s, not paid per rank and layout).
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megarl.learner import cpu_shims
from tests.helpers import REPO

# The megatron function (file, qualified name) each shim rewrites.  The deepest megatron frame of
# the failure must be one of them.
SITES = {
    ("tensor_parallel/random.py", "CudaRNGStatesTracker.add"): "rng_tracker",
    ("tensor_parallel/random.py", "_get_cuda_rng_state"): "rng_tracker",
    ("distributed/param_and_grad_buffer.py", "_ParamAndGradBuffer.__init__"): "grad_buffer",
    ("optimizer/optimizer.py", "FP32Optimizer.__init__"): "fp32_optimizer",
    ("pipeline_parallel/schedules.py", "forward_backward_no_pipelining"): "schedule_token_count",
    ("pipeline_parallel/schedules.py", "forward_backward_pipelining_without_interleaving"): "schedule_token_count",
    ("models/common/embeddings/rotary_pos_embedding.py", "RotaryEmbedding.get_emb"): "rotary",
    ("utils.py", "GlobalMemoryBuffer.get_tensor"): "memory_buffer",
    ("optimizer/clip_grads.py", "get_grad_norm_fp32"): "grad_norm",
    ("utils.py", "local_multi_tensor_l2_norm"): "grad_norm",
    ("optimizer/clip_grads.py", "clip_grad_by_total_norm_fp32"): "clip_grads",
    ("pipeline_parallel/p2p_communication.py", "P2PCommunicator._communicate_shapes"): "p2p",
    ("pipeline_parallel/p2p_communication.py", "P2PCommunicator._communicate"): "p2p",
    ("models/common/language_module/language_module.py", "LanguageModule.setup_embeddings_and_output_layer"):
        "tied_embedding_sync",
    ("optimizer/optimizer.py", "MixedPrecisionOptimizer.__init__"): "distributed_optimizer",
    ("optimizer/distrib_optimizer.py", "DistributedOptimizer._build_model_and_main_param_groups"):
        "distributed_optimizer",
    ("transformer/moe/router.py", "Router.gating"): "moe_router_device",
    ("transformer/moe/moe_utils.py", "RouterGatingLinearFunction.forward"): "moe_gating_gemm",
    ("transformer/moe/token_dispatcher.py", "MoEAlltoAllTokenDispatcher.__init__"): "moe_dispatcher_streams",
    ("transformer/moe/token_dispatcher.py", "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize"):
        "moe_dispatcher_streams",
    ("tensor_parallel/mappings.py", "_gather_along_first_dim"): "moe_collectives_device",
    ("tensor_parallel/mappings.py", "_reduce_scatter_along_first_dim"): "moe_collectives_device",
    ("tensor_parallel/mappings.py", "_AllToAll.forward"): "moe_collectives_device",
    # all_to_all_single refusing the split sizes maybe_move_tensor_to_cpu left as tensors (a TypeError
    # raised in torch under mappings.all_to_all: told apart by its message, see SCRIPT)
    ("tensor_parallel/mappings.py", "all_to_all", "split sizes"): "moe_split_sizes",
    ("tensor_parallel/layers.py", "LinearWithGradAccumulationAndAsyncCommunication.backward"): "moe_sequence_parallel",
    ("transformer/moe/router.py", "TopKRouter.__init__"): "expert_bias",
    ("models/common/embeddings/yarn_rotary_pos_embedding.py", "YarnRotaryEmbedding.__init__"): "mla_rotary",
    ("models/common/embeddings/yarn_rotary_pos_embedding.py", "YarnRotaryEmbedding.get_emb"): "mla_rotary",
}

MOE_SHIMS = {name for name in cpu_shims.SHIMS if name.startswith("moe_")}
# (model, layout, processes, the shims it must need). The multi-rank layouts start with every other shim
# applied: a forward-pass failure on the first pipeline stage would leave the last one blocked in
# its receive, and those shims are already proven by the one-process layout. The mixture-of-experts run
# (two ranks at learner.tp=2, so sequence parallel, each holding 2 of the 4 experts) needs the six MoE shims and the
# memory buffer's (its all-gathers), and
# none of them applied beforehand: every MoE failure happens on both ranks before the collective that would pair
# them. The GLM-4.5 run (one process, every other shim applied) needs the router expert bias's, the DeepSeek-V3 run
# its multi-latent attention's rotary embedding's.
LAYOUTS = [
    ("qwen2", {}, 1, set(cpu_shims.SHIMS) - {"p2p", "tied_embedding_sync", "distributed_optimizer",
                                              "distributed_optimizer_load", "memory_buffer", "expert_bias",
                                              "mla_rotary"}
                             - MOE_SHIMS),
    ("qwen2", {"pp": 2}, 2, {"p2p", "tied_embedding_sync"}),
    ("qwen2", {"dp": 2, "use_distributed_optimizer": True}, 2, {"distributed_optimizer"}),
    ("mixtral", {"tp": 2, "ep": 2}, 2, MOE_SHIMS | {"memory_buffer"}),  # sequence parallelism's all-gather buffers
    ("glm4_moe", {}, 1, {"expert_bias"}),
    ("deepseek_v3", {}, 1, {"mla_rotary"}),
]


IDS = ["tp1", "pp2", "dp2_distributed_optimizer", "moe_tp2_ep2", "glm4_moe_expert_bias", "deepseek_v3_mla_rotary"]
WORKER = Path(__file__).with_name("cpu_shim_worker.py")
CASE_LIMIT_S = 150  # a layout whose ranks hang (a collective a peer never joins) fails alone, its ranks killed


@pytest.fixture(scope="module")
def needed(tmp_path_factory) -> dict[str, dict]:
    """{layout id: {"needed": [the shims its run needed]}, or its ranks' exit status and output}: every layout in
    one cpu_shim_worker.py process."""
    out = tmp_path_factory.mktemp("shims")
    cases = []
    for name, (kind, layout, nproc, expected) in zip(IDS, LAYOUTS, strict=True):
        # (the dense one-process run leaves the MoE shims out: it must not need them)
        preapplied = sorted(set(cpu_shims.SHIMS) - expected - (MOE_SHIMS if kind == "qwen2" and nproc == 1 else set()))
        cases.append({"name": name, "kind": kind, "layout": layout, "nproc": nproc, "preapplied": preapplied})
    sites = json.dumps({"|".join(k): v for k, v in SITES.items()})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(WORKER), str(out), sites, json.dumps(cases), str(CASE_LIMIT_S)],
                          capture_output=True, text=True, timeout=len(cases) * CASE_LIMIT_S + 60, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return {name: json.loads((out / f"{name}.json").read_text()) for name in IDS}


@pytest.mark.timeout(len(LAYOUTS) * CASE_LIMIT_S + 120)  # (the first test's setup runs every layout)
@pytest.mark.parametrize("name, expected", [(name, expected) for name, (*_, expected) in zip(IDS, LAYOUTS)], ids=IDS)
def test_each_shim_is_needed_and_sufficient(needed, name, expected):
    assert "needed" in needed[name], needed[name]
    assert set(needed[name]["needed"]) == expected


def test_every_shim_is_covered_by_a_layout():
    # distributed_optimizer_load is needed by loading a checkpoint, not by a training step (below).
    covered = set().union(*(expected for _, _, _, expected in LAYOUTS)) | {"distributed_optimizer_load"}
    assert covered == set(cpu_shims.SHIMS)


LOAD_SCRIPT = textwrap.dedent('''
    import sys, traceback
    import torch, torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from megarl.algo.config import LossConfig
    from megarl.checkpoint import learner_state
    from megarl.config.schema import LearnerConfig
    from megarl.learner import cpu_shims
    from megarl.distributed.lifetime import exit_process
    from megarl.learner.megatron import MegatronLearner
    from megarl.protocols import TrainBatch

    model_dir = sys.argv[1]
    dist.init_process_group("gloo", init_method="file://" + model_dir + "/store", rank=0, world_size=1)
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                 intermediate_size=32, vocab_size=32)).save_pretrained(model_dir)
    cpu_shims.apply_cpu_shims([name for name in cpu_shims.SHIMS if name != "distributed_optimizer_load"])
    cpu_shims.apply_cpu_shims = lambda: None

    def learner():
        return MegatronLearner(model_dir, LearnerConfig(micro_batch_size=2, use_distributed_optimizer=True),
                               LossConfig())

    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(4, 8)
    mask[:, 0] = 0
    trained = learner()
    trained.train_step(TrainBatch(input_ids=ids, loss_mask=mask, behaviour_logprobs=-3.0 * mask,
                                  versions=torch.zeros(4, 8, dtype=torch.long), advantages=mask, learner_version=0))
    learner_state.save(trained, model_dir + "/ckpt", step=1, keep=1, model_dir=model_dir)
    try:
        learner_state.load(learner(), model_dir + "/ckpt")
        print("LOADED WITHOUT THE SHIM")
    except KeyError as error:
        frame = [f for f, _ in traceback.walk_tb(error.__traceback__) if "megatron/core/" in f.f_code.co_filename][-1]
        print("FAILED", frame.f_code.co_qualname, repr(error))
    cpu_shims.SHIMS["distributed_optimizer_load"]()
    loaded = learner()
    learner_state.load(loaded, model_dir + "/ckpt")
    print("DIFF", (loaded.logprobs(ids) - trained.logprobs(ids)).abs().max().item())
''')


def test_loading_a_distributed_optimizer_checkpoint_needs_its_shim(tmp_path):
    """Without distributed_optimizer_load, loading fails where the shim says (torch Adam's per-parameter
    step); with it, the loaded learner computes what the saved one did."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "FAILED DistributedOptimizer._set_main_param_and_optimizer_states KeyError('step')" in proc.stdout
    assert "DIFF 0.0" in proc.stdout


def test_rewrite_refuses_a_moved_line():
    from megatron.core.pipeline_parallel import schedules

    original = schedules.get_forward_backward_func
    with pytest.raises(RuntimeError, match="no longer contains"):
        cpu_shims._rewrite(schedules, "get_forward_backward_func", [("device='tpu'", "device='cpu'")])
    assert schedules.get_forward_backward_func is original


def test_apply_is_idempotent():
    cpu_shims.apply_cpu_shims()
    from megatron.core.pipeline_parallel import schedules

    patched = schedules.forward_backward_no_pipelining
    cpu_shims.apply_cpu_shims()
    assert schedules.forward_backward_no_pipelining is patched

"""Every CPU shim is needed, and fixes the megatron line it names.

One subprocess (importing megatron costs ~9 s, so not one per shim) runs a full learner step — build,
DDP, optimizer, forward/backward, grad norm, clipped optimizer step — with NO shims, and then
repeatedly: the run must die with the CPU-torch CUDA error (or a CUDA tensor-type assert) inside a function that exactly one shim
patches; that shim is applied and the run retried.  The test asserts that the run ends in success
and that every shim in SHIMS was needed on the way, so deleting any shim (or its effect) fails it.
"""
import json
import subprocess
import sys
import textwrap

import pytest

from megarl.learner import cpu_shims

# The megatron function (file, function name) each shim rewrites.  The deepest megatron frame of
# the failure must be one of them.
SITES = {
    ("tensor_parallel/random.py", "add"): "rng_tracker",
    ("tensor_parallel/random.py", "_get_cuda_rng_state"): "rng_tracker",
    ("distributed/param_and_grad_buffer.py", "__init__"): "grad_buffer",
    ("optimizer/optimizer.py", "__init__"): "fp32_optimizer",
    ("pipeline_parallel/schedules.py", "forward_backward_no_pipelining"): "schedule_token_count",
    ("models/common/embeddings/rotary_pos_embedding.py", "get_emb"): "rotary",
    ("utils.py", "get_tensor"): "memory_buffer",
    ("optimizer/clip_grads.py", "get_grad_norm_fp32"): "grad_norm",
    ("utils.py", "local_multi_tensor_l2_norm"): "grad_norm",
    ("optimizer/clip_grads.py", "clip_grad_by_total_norm_fp32"): "clip_grads",
}

SCRIPT = textwrap.dedent('''
    import json, sys, traceback
    import torch, torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from megarl.algo.config import LossConfig
    from megarl.learner import cpu_shims
    from megarl.config.schema import LearnerConfig
    from megarl.learner.megatron import MegatronLearner
    from megarl.protocols import TrainBatch

    model_dir, sites = sys.argv[1], {tuple(k.split("|")): v for k, v in json.loads(sys.argv[2]).items()}
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, intermediate_size=32, vocab_size=32,
                                 tie_word_embeddings=True)).save_pretrained(model_dir)
    dist.init_process_group("gloo", init_method="file://" + model_dir + "/store", rank=0, world_size=1)
    # The learner applies all shims itself; here they are applied one at a time by this loop.
    apply_all = cpu_shims.apply_cpu_shims
    cpu_shims.apply_cpu_shims = lambda: None
    ids = torch.randint(0, 32, (4, 8))
    mask = torch.ones(4, 8)
    mask[:, 0] = 0
    batch = TrainBatch(input_ids=ids, loss_mask=mask, behaviour_logprobs=-3.0 * mask,
                       versions=torch.zeros(4, 8, dtype=torch.long), advantages=mask, learner_version=0)
    needed = []
    for _ in range(len(cpu_shims.SHIMS) + 1):
        try:
            learner = MegatronLearner(model_dir, LearnerConfig(micro_batch_size=2, grad_clip=1e-3),
                                      LossConfig())
            metrics = learner.train_step(batch)
            assert learner.version == 1 and metrics["grad_norm"] > 0, metrics
            break
        except (AssertionError, TypeError) as error:
            frames = [f for f in traceback.extract_tb(error.__traceback__) if "megatron/core/" in f.filename]
            # Either CPU torch refusing a CUDA call, or megatron asserting a CUDA tensor type.
            if "Torch not compiled with CUDA enabled" not in str(error) and "cuda" not in frames[-1].line:
                raise
            site = (frames[-1].filename.split("megatron/core/")[1], frames[-1].name)
            if site not in sites:
                print(json.dumps({"unshimmed_site": site}))
                sys.exit(1)
            shim = sites[site]
            assert shim not in needed, f"{shim} applied but {site} still fails"
            needed.append(shim)
            cpu_shims.SHIMS[shim]()
    print(json.dumps({"needed": needed}))
''')


def test_each_shim_is_needed_and_sufficient(tmp_path):
    sites = {"|".join(k): v for k, v in SITES.items()}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), json.dumps(sites)],
                          capture_output=True, text=True, timeout=85)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    needed = json.loads(proc.stdout.strip().splitlines()[-1])["needed"]
    assert sorted(needed) == sorted(cpu_shims.SHIMS), needed


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

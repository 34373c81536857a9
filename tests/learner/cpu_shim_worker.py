"""The CPU shims' cases (tests/learner/test_cpu_shims.py), each rank of each case a fork of this one process.

    python tests/learner/cpu_shim_worker.py OUT_DIR SITES_JSON CASES_JSON CASE_LIMIT_S

This process imports torch, transformers and megatron-core once and patches nothing; each case's ranks are forks of
it (importing megatron costs several CPU-s, which a process per rank and case paid again), so each starts from
megatron as imported, unpatched, like a fresh interpreter. A case's ranks meet over a file store in OUT_DIR. Each
rank runs a full learner step with only the case's preapplied shims, then repeatedly: the step must die with the
CPU-torch CUDA error (or a CUDA tensor-type check) inside a function that exactly one shim patches (SITES); that shim
is applied and the step retried. OUT_DIR/<case>.json: {"needed": [...]} from rank 0, or every rank's exit status
and output where a rank failed or outlived CASE_LIMIT_S (its ranks killed).
"""
import json
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import MixtralConfig, MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from megarl.algo.config import LossConfig
from megarl.config.schema import LearnerConfig
from megarl.learner import cpu_shims
from megarl.learner.megatron import MegatronLearner
from megarl.protocols import TrainBatch


def save_model(model_dir: str, kind: str) -> None:
    torch.manual_seed(0)
    if kind == "mixtral":  # mixture of experts: megatron's MoE layer, alltoall dispatcher
        MixtralForCausalLM(MixtralConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2, intermediate_size=32, vocab_size=32,
                                         num_local_experts=4, num_experts_per_tok=2)).save_pretrained(model_dir)
    elif kind == "glm4_moe":  # a router with an expert bias (a buffer megatron allocates on the GPU)
        from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
        Glm4MoeForCausalLM(Glm4MoeConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=2, intermediate_size=32, moe_intermediate_size=16,
                                         vocab_size=32, n_routed_experts=4, num_experts_per_tok=2,
                                         first_k_dense_replace=1, num_nextn_predict_layers=0)
                           ).save_pretrained(model_dir)
    elif kind == "deepseek_v3":  # multi-latent attention: a rotary embedding per layer, built for the GPU
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
        DeepseekV3ForCausalLM(DeepseekV3Config(
            hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            intermediate_size=32, moe_intermediate_size=16, vocab_size=32, n_routed_experts=4,
            num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=8,
            kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, num_nextn_predict_layers=0)
                              ).save_pretrained(model_dir)
    else:
        Qwen2ForCausalLM(Qwen2Config(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=1, intermediate_size=32, vocab_size=32,
                                     tie_word_embeddings=True)).save_pretrained(model_dir)


def needed_shims(case: dict, sites: dict, rank: int, out_dir: str) -> list[str]:
    """One rank of `case`: the shims its step needed, in the order it needed them."""
    model_dir, layout, kind = os.path.join(out_dir, case["name"]), case["layout"], case["kind"]
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/{case['name']}.store", rank=rank,
                            world_size=case["nproc"], timeout=timedelta(seconds=60))
    if rank == 0:  # rank 0 writes the model, the others wait for it
        save_model(model_dir, kind)
    dist.barrier()
    # The learner applies all shims itself; here they are applied one at a time by this loop.
    cpu_shims.apply_cpu_shims = lambda: None
    for shim in case["preapplied"]:
        cpu_shims.SHIMS[shim]()
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(4, 8)
    mask[:, 0] = 0
    batch = TrainBatch(input_ids=ids, loss_mask=mask, behaviour_logprobs=-3.0 * mask,
                       versions=torch.zeros(4, 8, dtype=torch.long), advantages=mask, learner_version=0)
    needed = []
    for _ in range(len(cpu_shims.SHIMS) + 1):
        site = None
        try:
            learner = MegatronLearner(model_dir, LearnerConfig(micro_batch_size=2, grad_clip=1e-3, **layout),
                                      LossConfig())
            if kind == "mixtral":  # expert parallelism: each rank holds its own 4 / ep experts
                assert len(learner.gpt.decoder.layers[0].mlp.experts.local_experts) == 4 // layout.get("ep", 1)
            metrics = learner.train_step(batch)
            assert learner.version == 1 and metrics["grad_norm"] > 0, metrics
        except (AssertionError, TypeError, RuntimeError, NameError) as error:
            frame = [f for f, _ in traceback.walk_tb(error.__traceback__)
                     if "megatron/core/" in f.f_code.co_filename][-1]
            site = (frame.f_code.co_filename.split("megatron/core/")[1], frame.f_code.co_qualname)
            # CPU torch refusing a CUDA call, megatron checking for a CUDA tensor type, megatron's name bound
            # only with Transformer Engine, or gloo's all_to_all_single refusing split sizes given as tensors.
            if isinstance(error, NameError):
                if "te_general_gemm" not in str(error):
                    raise
            elif isinstance(error, TypeError) and "all_to_all_single" in str(error):
                site = site + ("split sizes",)
            elif "Torch not compiled with CUDA enabled" not in str(error) and "torch.cuda." not in str(error) \
                    and "requires CUDA" not in str(error) \
                    and "cuda" not in traceback.extract_tb(error.__traceback__)[-1].line:
                raise
        # Every rank fails at its own first unshimmed site (e.g. both stages allocating a p2p buffer),
        # before the communication that would pair them: agree on what to apply.
        sites_seen = [None] * dist.get_world_size()
        dist.all_gather_object(sites_seen, site)
        if not any(sites_seen):
            break
        unknown = [s for s in sites_seen if s and s not in sites]
        if unknown:
            raise AssertionError(f"unshimmed site {unknown[0]}")
        for shim in dict.fromkeys(sites[s] for s in sites_seen if s):
            assert shim not in needed, f"{shim} applied but {sites_seen} still fail"
            needed.append(shim)
            cpu_shims.SHIMS[shim]()
    dist.barrier()
    dist.destroy_process_group()
    return needed


def fork_rank(case: dict, sites: dict, rank: int, out_dir: str, log) -> int:
    """A child running `case`'s `rank` (its output in `log`); the child never returns here."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        needed = needed_shims(case, sites, rank, out_dir)
        if rank == 0:
            with open(os.path.join(out_dir, case["name"] + ".json"), "w") as f:
                json.dump({"needed": needed}, f)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:  # not a plain exit: it can abort in gloo's threads (megarl.distributed.lifetime.exit_process)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_case(case: dict, sites: dict, out_dir: str, limit_s: float) -> None:
    logs = [tempfile.TemporaryFile() for _ in range(case["nproc"])]
    pids = [fork_rank(case, sites, rank, out_dir, log) for rank, log in enumerate(logs)]
    status, deadline = {}, time.monotonic() + limit_s
    while len(status) < len(pids):
        for rank, pid in enumerate(pids):
            if rank not in status:
                done, code = os.waitpid(pid, os.WNOHANG)
                if done:
                    status[rank] = os.waitstatus_to_exitcode(code)
        if len(status) < len(pids) and time.monotonic() > deadline:
            for rank, pid in enumerate(pids):
                if rank not in status:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    status[rank] = f"killed after {limit_s} s"
        time.sleep(0.05)
    if any(code != 0 for code in status.values()):
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read().decode(errors="replace")[-4000:])
        with open(os.path.join(out_dir, case["name"] + ".json"), "w") as f:
            json.dump({"status": [status[rank] for rank in range(len(pids))], "output": outputs}, f)


def main() -> None:
    out_dir, sites, cases, limit_s = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), float(sys.argv[4])
    sites = {tuple(k.split("|")): v for k, v in sites.items()}
    for case in cases:  # one at a time: the ranks of one case share the cores
        run_case(case, sites, out_dir, limit_s)


if __name__ == "__main__":
    main()

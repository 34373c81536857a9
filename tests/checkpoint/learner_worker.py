"""The learner processes of tests/checkpoint/test_learner_state.py (argv: SCENARIO MODEL_DIR WORK_DIR).

Run with plain `python` (one rank, a FileStore world of 1) or under torchrun (the `layouts` scenario,
two ranks).  Results go to WORK_DIR as torch files for the test to compare.

  reference  one learner trains N+M steps untouched (the reference); a second trains N steps, saves
             checkpoint N under WORK/ckpt and draws from every RNG right after the save
  resume     a new process loads WORK/ckpt, draws from every RNG, trains M steps; then saves step N+M
             (the test kills it in that save: MEGARL_TEST_CHECKPOINT_PAUSE_S holds it before the commit)
  layouts    two ranks load WORK/ckpt under DP=2, PP=2 and TP=2 (log-probs, one more step); under TP=2,
             a save in which rank 1 hits its file-size limit (RLIMIT_FSIZE: a real EFBIG); and a
             distributed-optimizer checkpoint saved under DP=2 and continued under TP=2
"""
import json
import os
import random
import resource
import signal
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megarl.algo.config import LossConfig
from megarl.checkpoint import learner_state
from megarl.checkpoint.storage import CheckpointError
from megarl.config.schema import LearnerConfig
from megarl.distributed.lifetime import run_then_exit
from megarl.learner.megatron import MegatronLearner
from megarl.protocols import TrainBatch

N, M = 2, 2  # steps before the checkpoint, steps after it
VOCAB, ROWS, WIDTH, PROMPT = 64, 16, 16, 4


def batch(step: int) -> TrainBatch:
    """The fixed batch of `step`: random tokens, completions of random length, behaviour log-probs
    of some other policy (so some ratios clip) and a random advantage per row."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (ROWS, WIDTH), generator=g)
    mask = torch.zeros(ROWS, WIDTH)
    for row, length in enumerate(torch.randint(2, WIDTH - PROMPT + 1, (ROWS,), generator=g).tolist()):
        mask[row, PROMPT:PROMPT + length] = 1.0
    mu = (-4.0 + 0.3 * torch.randn(ROWS, WIDTH, generator=g)) * mask
    adv = torch.randn(ROWS, 1, generator=g).expand(ROWS, WIDTH) * mask
    return TrainBatch(input_ids=ids, loss_mask=mask, behaviour_logprobs=mu,
                      versions=torch.where(mask > 0, 0, -1), advantages=adv, learner_version=0)


PROBE = torch.randint(0, VOCAB, (6, WIDTH), generator=torch.Generator().manual_seed(7))


def learner(model_dir: str, **layout) -> MegatronLearner:
    return MegatronLearner(model_dir, LearnerConfig(micro_batch_size=8, lr=1e-2, **layout), LossConfig())


def train(lrn: MegatronLearner, steps) -> list[dict]:
    return [lrn.train_step(batch(s)) for s in steps]


def draws(lrn: MegatronLearner) -> dict:
    """One draw from every RNG the checkpoint restores, and megatron's tracked model-parallel RNG states."""
    tracker = {k: v.clone() for k, v in lrn.tensor_parallel.get_cuda_rng_tracker().get_states().items()}
    return {"torch": torch.rand(3), "python": random.random(), "numpy": float(np.random.rand()), "tracker": tracker}


def main() -> None:
    scenario, model_dir, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:  # plain python: a world of one
        dist.init_process_group("gloo", store=dist.FileStore(str(work / f"store.{scenario}"), 1), rank=0, world_size=1)
    if scenario == "reference":
        ref = learner(model_dir)
        losses = [m["loss"] for m in train(ref, range(N + 1))]
        after_next = dict(ref.publish_tensors())  # the weights one step past the checkpoint
        losses += [m["loss"] for m in train(ref, range(N + 1, N + M))]
        torch.save({"losses": losses, "after_next": after_next, "final": dict(ref.publish_tensors())},
                   work / "reference.pt")
        lrn = learner(model_dir)
        train(lrn, range(N))
        logprobs = lrn.logprobs(PROBE)
        path = learner_state.save(lrn, work / "ckpt", step=N, keep=2, model_dir=model_dir,
                                  run_state={"note": "from the reference scenario"})
        torch.save({"logprobs": logprobs, "probe": PROBE, "draws": draws(lrn), "path": str(path),
                    "published": dict(lrn.publish_tensors())}, work / "saved.pt")
    elif scenario == "resume":
        lrn = learner(model_dir)
        manifest = learner_state.load(lrn, work / "ckpt")
        got = draws(lrn)
        losses = [m["loss"] for m in train(lrn, range(N, N + M))]
        torch.save({"manifest": manifest, "draws": got, "losses": losses, "final": dict(lrn.publish_tensors())},
                   work / "resumed.pt")
        print("RESUMED", flush=True)
        learner_state.save(lrn, work / "ckpt", step=N + M, keep=2, model_dir=model_dir)  # killed in here
    elif scenario == "layouts":
        for name, layout in (("dp2", {"dp": 2}), ("pp2", {"pp": 2}), ("tp2", {"tp": 2})):
            lrn = learner(model_dir, **layout)
            continue_from(lrn, work / "ckpt" / "step_00000002", work / f"layout_{name}")  # `resume` runs meanwhile
            if name != "tp2":
                parallel_state.destroy_model_parallel()
        disk_full(lrn, model_dir, work)
        parallel_state.destroy_model_parallel()
        # The distributed optimizer: trained and saved under DP=2, continued under TP=2.
        lrn = learner(model_dir, dp=2, use_distributed_optimizer=True)
        train(lrn, range(N))
        learner_state.save(lrn, work / "distopt_ckpt", step=N, keep=1, model_dir=model_dir)
        parallel_state.destroy_model_parallel()
        continue_from(learner(model_dir, tp=2, use_distributed_optimizer=True), work / "distopt_ckpt",
                      work / "layout_distopt_dp2_to_tp2")
    dist.destroy_process_group()


def continue_from(lrn: MegatronLearner, checkpoint: Path, out: Path) -> None:
    """Load, log-probs of the probe, one more step; every rank writes what it saw and published
    (a PP stage publishes only its own layers)."""
    manifest = learner_state.load(lrn, checkpoint)
    at_load = dict(lrn.publish_tensors())  # what this layout would publish of the checkpoint's state
    logprobs = lrn.logprobs(PROBE)
    metrics = train(lrn, [N])[0]
    published = dict(lrn.publish_tensors())  # collective: every rank iterates
    torch.save({"manifest": manifest, "logprobs": logprobs, "metrics": metrics, "published": published,
                "published_at_load": at_load},
               f"{out}.rank{dist.get_rank()}.pt")


def disk_full(lrn: MegatronLearner, model_dir: str, work: Path) -> None:
    """Save once (the good checkpoint), then save again with rank 1 unable to write files over 4 KiB."""
    root = work / "full_ckpt"
    learner_state.save(lrn, root, step=N + 1, keep=2, model_dir=model_dir)
    before = lrn.logprobs(PROBE)
    train(lrn, [N + 1])  # move the weights on, so loading the good checkpoint back is observable
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    error = None
    try:
        if dist.get_rank() == 1:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so the write fails with EFBIG instead of killing us
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
        learner_state.save(lrn, root, step=N + 2, keep=2, model_dir=model_dir)
    except CheckpointError as exc:
        error = str(exc)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    learner_state.load(lrn, root)
    reloaded = (lrn.logprobs(PROBE) - before).abs().max().item()
    (work / f"diskfull.rank{dist.get_rank()}.json").write_text(json.dumps({"error": error, "reloaded_diff": reloaded}))


if __name__ == "__main__":
    run_then_exit(main)  # not a plain exit: see megarl.distributed.lifetime

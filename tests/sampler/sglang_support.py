"""Shared by the SGLang tests: the subprocess environment, the stand-in learner, HF reference log-probs."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tests.helpers import REPO

ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
LEARNER = Path(__file__).parent / "sglang_learner.py"


def start_learner(model_dir: Path, weights_out: Path, port: int, world_size: int, weight_format: str, version: int,
                  store_port: int | None = None, lora: bool = False) -> subprocess.Popen:
    """tests/sampler/sglang_learner.py as a separate process (see its docstring)."""
    args = [str(model_dir), str(weights_out), str(port), str(world_size), weight_format, str(version)]
    args += ([] if store_port is None else [str(store_port)]) + (["--lora"] if lora else [])
    return subprocess.Popen([sys.executable, str(LEARNER), *args], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def hf_logprobs(model_dir: Path, weights: dict, ids: list[int], past=None):
    """(log_softmax of every position's logits [len(ids), V], the KV cache) of transformers' model of `model_dir`'s
    family with `weights` (HF checkpoint names: loaded from a directory of them, so that transformers converts what
    it holds otherwise, as an MoE's per-expert tensors), continuing from the KV cache `past` when given."""
    from transformers import AutoModelForCausalLM

    from tests.sampler import save_version

    with tempfile.TemporaryDirectory() as tmp:
        model = AutoModelForCausalLM.from_pretrained(save_version(Path(model_dir), weights, Path(tmp) / "version"),
                                                     dtype=torch.float32).eval()
    with torch.no_grad():
        # The cache positionally: transformers 4.x calls it past_key_values, 5.x `cache`.
        out = model(torch.tensor([ids]), None, None, past, use_cache=True)
    return torch.log_softmax(out.logits[0].double(), -1), out.past_key_values


def token_logprobs(logprobs: torch.Tensor, ids: list[int], start: int) -> torch.Tensor:
    """The log-probs of ids[start:] from a [len(ids), V] table whose row t predicts ids[t + 1]."""
    return logprobs[start - 1:-1].gather(1, torch.tensor(ids[start:])[:, None]).squeeze(1)

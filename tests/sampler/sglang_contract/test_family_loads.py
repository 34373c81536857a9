"""Each model family's publish, exactly as megarl's learner sends it to SGLang, loads into that family's own SGLang
model class, for the oldest and the newest release megarl supports.

For every family after Qwen2 a tiny HF model is built, the megatron learner publishes it (publish_worker.py: the
names, shapes, dtypes and order SGLangPublisher sends), and family_loads.py runs on SGLang's install
(sglang_env.install, as test_contract.py's): SGLang's class for the architecture is built on CPU and takes the
publish through its `load_weights`, call by call; every parameter written, every tensor landed, nothing refused.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megarl.sampler.sglang_engine import SUPPORTED_VERSIONS
from tests.helpers import REPO, run_forked_ranks, save_tiny_moe
from tests.sampler import make_tiny_model
from tests.sampler.sglang_contract import sglang_env

HERE = REPO / "tests" / "sampler" / "sglang_contract"
DENSE = ("llama", "qwen3", "mistral", "phi3", "smollm3", "olmo2", "gemma3")
MOE = ("qwen3_moe", "glm4_moe", "gpt_oss", "deepseek_v3")
# DeepSeek-V3's config.json fields SGLang's DeepseekV2 classes read and transformers' DeepseekV3Config no longer
# writes (a real DeepSeek-V3 / Kimi-K2 checkpoint's config.json carries them).
DEEPSEEK_V3_CONFIG = dict(moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid")
# What a release refuses, and why: SGLang 0.5.21 has no SmolLM3 class of its own, and its transformers backend
# knows no tensor-parallel style of transformers 5.25's SmolLM3 plan (its pin, transformers 5.12.1, has no such
# entry; that pin cannot be installed beside this environment's tokenizers).
REFUSED = {("0.5.21", "smollm3"): "Unsupported TP style 'embedding_rowwise' for Transformers backend"}


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """{family: its model directory, holding the learner's publish}."""
    root = tmp_path_factory.mktemp("families")
    dirs = {kind: make_tiny_model(root / kind, kind) for kind in DENSE + ("glm4_moe", "gpt_oss")}
    dirs["qwen3_moe"] = save_tiny_moe(root / "qwen3_moe", "qwen3_moe")  # untied, as Qwen3-MoE checkpoints are
    dirs["deepseek_v3"] = make_tiny_model(root / "deepseek_v3", "deepseek_v3", **DEEPSEEK_V3_CONFIG)
    proc = run_forked_ranks(HERE / "publish_worker.py", 1, *map(str, dirs.values()), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return dirs


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_each_familys_publish_loads_into_its_own_sglang_model_class(version, published, tmp_path):
    paths, install_s = sglang_env.install(version)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, paths), str(REPO)]), "OMP_NUM_THREADS": "1",
           "SGLANG_USE_CPU_ENGINE": "1"}
    proc = subprocess.run([sys.executable, str(HERE / "family_loads.py"), *map(str, published.values())], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"(install {install_s:.0f}s)\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["version"] == version
    expected = {kind: why for (v, kind), why in REFUSED.items() if v == version}
    assert set(result["refused"]) == set(expected) and all(
        why in result["refused"][kind] for kind, why in expected.items()), (result["refused"], proc.stderr[-6000:])
    assert set(result["loaded"]) == set(published) - set(expected)
    print(f"\nSGLang {version}: " + ", ".join(f"{k} -> {v['class']} ({v['tensors']} tensors in {v['calls']} calls)"
                                           for k, v in result["loaded"].items()))

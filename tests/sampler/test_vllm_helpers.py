"""The vLLM engine's pure parts (no vLLM needed: runs in the main suite); the real server is tests/sampler/vllm/."""
from __future__ import annotations

import pytest
import torch

from megarl.config.load import ConfigError, load_config
from megarl.sampler import vllm_engine
from megarl.sampler.vllm_ext import megarl_vllm_worker as ext


def test_versions_from_swaps():
    f = vllm_engine.versions_from_swaps
    assert f(5, 3, []) == [3] * 5
    assert f(5, 0, [(1, 2)]) == [0, 0, 1, 1, 1]
    assert f(5, 0, [(1, 0)]) == [1] * 5  # not started at the update: every token is new
    assert f(4, 0, [(1, 4)]) == [0] * 4  # finished before it
    assert f(6, 2, [(3, 1), (4, 1), (5, 4)]) == [2, 4, 4, 4, 5, 5]
    with pytest.raises(ValueError, match="decrease"):
        f(6, 0, [(1, 3), (2, 2)])


def test_counts_by_server_id():
    counts = {"cmpl-megarl7-0-1a2b3c4d": 5, "cmpl-megarl12-0-ffffffff": 0, "other": 3}
    assert vllm_engine.counts_by_server_id(counts) == {"megarl7": 5, "megarl12": 0}


def test_bucket_plan_roundtrip():
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7), "c": torch.randn(40, 40), "d": torch.randn(2)}
    spec = [(n, list(t.shape), "float32") for n, t in tensors.items()]
    plan = ext.bucket_plan(spec, bucket_bytes=200)
    assert [[t[0] for t in b["tensors"]] for b in plan] == [["a", "b"], ["c"], ["d"]]  # big tensor alone
    for bucket in plan:
        buf = torch.cat([tensors[n].view(-1).view(torch.uint8) for n, *_ in bucket["tensors"]])
        assert buf.numel() == bucket["nbytes"]
        for name, t in ext.unpack(buf, bucket):
            assert torch.equal(t, tensors[name])


def test_server_env_and_command():
    from megarl.config.schema import VLLMConfig

    env = vllm_engine.server_env({"RANK": "1", "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_PORT": "1",
                                  "PYTHONPATH": "/megarl", "HOME": "/root"}, VLLMConfig(), threads=2)
    assert "RANK" not in env and "TORCHELASTIC_USE_AGENT_STORE" not in env and "MASTER_PORT" not in env
    assert env["PYTHONPATH"].split(":") == [str(vllm_engine.EXT_DIR), str(vllm_engine.PORTABLE_DIR)]
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["OMP_NUM_THREADS"] == "2" and env["HOME"] == "/root"
    cmd = vllm_engine.server_command("/env/python", "/m", 1234, 0, max_model_len=64, max_num_seqs=8)
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--worker-extension-cls") + 1] == vllm_engine.WORKER_EXTENSION


def test_the_worker_extension_imports_without_megarl():
    """The server's python finds the worker extension and the LoRA merge it runs on the PYTHONPATH megarl gives it,
    with megarl itself unimportable (it is not installed in the vLLM environment)."""
    import os
    import subprocess
    import sys

    from megarl.config.schema import VLLMConfig

    env = vllm_engine.server_env(dict(os.environ), VLLMConfig(), threads=1)
    code = ("import sys; sys.modules['megarl'] = None\n"  # any `import megarl...` now raises ImportError
            "import megarl_vllm_worker as w; print(w.lora_merge.__file__)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(vllm_engine.PORTABLE_DIR / "lora_merge.py")


def test_check_model_head_dim():
    vllm_engine.check_model({"hidden_size": 64, "num_attention_heads": 2})
    with pytest.raises(ValueError, match="head_dim 16 < 32"):
        vllm_engine.check_model({"hidden_size": 64, "num_attention_heads": 4})


def test_config_picks_the_vllm_variant_and_refuses_truncation():
    cfg = load_config("configs/demo.yaml", ["sampler.engine=vllm"])
    assert cfg.model.path == "embedded:tiny-qwen2-count-hd32"
    assert load_config("configs/demo.yaml").model.path == "embedded:tiny-qwen2-count"
    with pytest.raises(ConfigError, match="sampling.top_p"):
        load_config("configs/demo.yaml", ["sampler.engine=vllm", "sampling.top_p=0.9"])
    assert load_config("configs/demo.yaml", ["sampler.engine=vllm",
                                             "sampler.kv_on_update=recompute"]).sampler.kv_on_update == "recompute"
    load_config("configs/demo.yaml", ["sampler.engine=vllm", "sampler.kv_on_update=recompute",
                                      "sampler.vllm.prefix_caching=true"])
    with pytest.raises(ConfigError, match="sampler.vllm.prefix_caching: needs sampler.kv_on_update=recompute"):
        load_config("configs/demo.yaml", ["sampler.engine=vllm", "sampler.vllm.prefix_caching=true"])
    with pytest.raises(ConfigError, match="sampler.vllm.server_args"):
        load_config("configs/demo.yaml", ["sampler.engine=vllm", "sampler.vllm.server_args=[--max-model-len=9]"])


def test_vllm_variant_has_head_dim_32():
    from megarl.models import embedded, tiny

    spec = embedded.EMBEDDED_MODELS["tiny-qwen2-count-hd32"]
    cfg = tiny.build_config(**dict(spec.config))
    assert cfg.hidden_size // cfg.num_attention_heads == 32
    # its own directory (the hash covers the config), same task and recipe as the demo's model
    demo = embedded.EMBEDDED_MODELS["tiny-qwen2-count"]
    assert embedded._spec_hash(spec) != embedded._spec_hash(demo)
    assert (spec.task, spec.recipe, spec.max_new_tokens) == (demo.task, demo.recipe, demo.max_new_tokens)

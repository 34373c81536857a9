"""Fixtures of the vLLM tests: the vLLM environment (built once per machine, ~4 min cold) and one real vLLM
server per test module (~50 s to start on 2 cores), on the embedded demo model's head_dim-32 variant."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM environment's python (megarl.sampler.vllm_env; a failed build fails the tests, never skips)."""
    from megarl.sampler.vllm_env import ensure_env

    start = time.monotonic()
    python, built_s = ensure_env()
    print(f"\nvllm env: {python} ({'built in %.0fs' % built_s if built_s else 'ready'}, {time.monotonic() - start:.1f}s)")
    return python


@pytest.fixture(scope="session")
def vllm_model_dir(embedded_cache_dir) -> Path:
    """tiny-qwen2-count-hd32: the demo's count model with 2 heads of 32 (vLLM on CPU needs head_dim >= 32)."""
    from megarl.embedded.registry import ensure_embedded_model

    return ensure_embedded_model("tiny-qwen2-count-hd32", cache_dir=embedded_cache_dir)


def start_engine(python, model_dir, tmp_path, *, max_running=8, context_length=128, request_timeout_s=120.0,
                 extra=()):
    from megarl.sampler.vllm_engine import SocketDir, VLLMEngine, server_command, server_env
    from megarl.config.schema import VLLMConfig

    sockets = SocketDir()
    cmd = server_command(python, model_dir, sockets.path, seed=0, max_model_len=context_length,
                         max_num_seqs=max_running, extra=list(extra))
    start = time.monotonic()
    engine = VLLMEngine.start(cmd, server_env(os.environ, VLLMConfig(), threads=1), Path(tmp_path) / "vllm.log", sockets,
                              model_dir=model_dir, max_running=max_running, context_length=context_length,
                              startup_timeout_s=600, request_timeout_s=request_timeout_s, update_timeout_s=120,
                              bucket_mb=0.1)
    print(f"\nvllm server {engine.client.url} up in {time.monotonic() - start:.1f}s")
    return engine

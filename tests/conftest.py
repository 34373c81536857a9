"""Session-wide fixtures shared by several test packages."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from megarl.embedded.builder_fingerprint import builder_fingerprint

USER_CACHE = Path("~/.cache/megarl/models").expanduser()  # where `megarl train` builds embedded models
FRESH_MODELS_ENV = "MEGARL_TEST_FRESH_MODELS"


@pytest.fixture(scope="session")
def embedded_cache_dir(tmp_path_factory) -> Path:
    """Where the test session's embedded models live. Their builds cost ~5 min of CPU together, so they are kept
    between sessions, in a directory named by the builder's fingerprint (megarl.embedded.builder_fingerprint: the
    builder's and tasks' code, torch and transformers versions): a change to how models are built rebuilds them, and
    the tests that check what a build produces (tests/embedded/test_tiny.py) check the current builder's output.
    MEGARL_TEST_FRESH_MODELS=1 builds them afresh into the session's temporary directory instead."""
    if os.environ.get(FRESH_MODELS_ENV) == "1":
        return tmp_path_factory.mktemp("megarl_models")
    return Path("~/.cache/megarl/test-models").expanduser() / builder_fingerprint()


def ensure_test_model(name: str, cache_dir: Path) -> Path:
    """ensure_embedded_model into the test cache; a build `megarl train` already made in the user's cache by this very
    code (its record's `builder` is this fingerprint: the README's first command builds the multi-turn demo's model)
    is copied instead of built again: the same code builds bit for bit the same model."""
    from megarl.embedded.registry import BUILD_RECORD, EMBEDDED_MODELS, ensure_embedded_model, spec_hash

    spec = EMBEDDED_MODELS[name]
    final = cache_dir / f"{name}-{spec_hash(spec, cache_dir)}"
    built = USER_CACHE / f"{name}-{spec_hash(spec, USER_CACHE)}"
    if os.environ.get(FRESH_MODELS_ENV) != "1" and not final.is_dir() and (built / BUILD_RECORD).is_file():
        try:
            record = json.loads((built / BUILD_RECORD).read_text())
        except (OSError, ValueError):
            record = {}
        if isinstance(record, dict) and record.get("builder") == builder_fingerprint():
            cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.copy-", dir=cache_dir))
            shutil.copytree(built, tmp, dirs_exist_ok=True)
            try:
                os.rename(tmp, final)  # atomic; another worker's copy may have landed first
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
    return ensure_embedded_model(name, cache_dir=cache_dir)


@pytest.fixture(scope="session")
def embedded_model_dir(embedded_cache_dir) -> Path:
    """The no-thinking embedded model (`tiny-qwen2-arith`, ~3-token completions), built on first
    request (kept: see embedded_cache_dir; ~30-45 s on one core). Request it only where it is needed."""
    return ensure_test_model("tiny-qwen2-arith", embedded_cache_dir)


@pytest.fixture(scope="session")
def embedded_think_model_dir(embedded_cache_dir) -> Path:
    """The thinking embedded model (`tiny-qwen2-arith-think`: "12+7=" -> "..........19<eos>" with a
    long-tailed filler run), built on first request (kept: see embedded_cache_dir; ~45-60 s on one core)."""
    return ensure_test_model("tiny-qwen2-arith-think", embedded_cache_dir)


@pytest.fixture(scope="session")
def embedded_count_model_dir(embedded_cache_dir) -> Path:
    """The demo's model (`tiny-qwen2-count`: "d-k=" -> "defghijk<eos>", run lengths set by the prompt),
    built on first request (kept: see embedded_cache_dir; ~40 s on one core)."""
    return ensure_test_model("tiny-qwen2-count", embedded_cache_dir)


@pytest.fixture(scope="session")
def embedded_moe_model_dir(embedded_cache_dir) -> Path:
    """The MoE demo's model (`tiny-mixtral-count`: a tiny Mixtral, 4 experts top-2, on the count task),
    built on first request (kept: see embedded_cache_dir; ~75 s of CPU on one core)."""
    return ensure_test_model("tiny-mixtral-count", embedded_cache_dir)


@pytest.fixture(scope="session")
def embedded_tool_model_dir(embedded_cache_dir) -> Path:
    """The multi-turn demo's chat model (`tiny-qwen2-tool`: "37*43" -> ">>> 37*43", the tool's "1591",
    "1591"), built on first request (kept: see embedded_cache_dir; ~80 s on one core)."""
    return ensure_test_model("tiny-qwen2-tool", embedded_cache_dir)


@pytest.fixture(scope="session")
def embedded_toolcall_model_dir(embedded_cache_dir) -> Path:
    """The tool model for OpenAI tool calling (`tiny-qwen2-toolcall`: the python tool in a tools block, the call as
    a <tool_call> JSON block), built on first request (kept: see embedded_cache_dir; ~5 min of CPU on one core)."""
    return ensure_test_model("tiny-qwen2-toolcall", embedded_cache_dir)


# The files whose tests run whole training jobs, launches or benchmarks (minutes each on 2 cores), longest first.
# The README's `-n 2 --dist loadfile` hands files to the two workers in collection order: collected first, these
# fill both workers from the start, and the many short files even out the end instead of one worker finishing a
# long file alone while the other idles.
LONG_FILES = (
    "tests/learner/test_deepspeed.py", "tests/roles/test_train_e2e.py", "tests/roles/test_replace.py",
    "tests/roles/test_faults.py",
    "tests/test_gpu_check.py", "tests/eval/test_eval.py", "tests/sampler/test_sglang_engine.py",
    "tests/roles/test_multiturn_e2e.py", "tests/sft/test_run.py", "tests/embedded/test_tiny.py",
    "tests/rollout/test_rewards.py", "tests/launch/test_slurm.py", "tests/checkpoint/test_train_resume_export.py",
    "tests/test_cli.py", "tests/config/test_load.py", "tests/rollout/test_datasets.py",
    "tests/checkpoint/test_learner_state.py", "tests/distributed/test_publish.py",
    "tests/learner/test_context_parallel.py",
)


def pytest_collection_modifyitems(config, items):
    order = {path: i for i, path in enumerate(LONG_FILES)}
    items.sort(key=lambda item: order.get(item.nodeid.split("::")[0], len(LONG_FILES)))  # stable: the rest keep theirs

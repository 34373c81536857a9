"""Session-wide fixtures shared by several test packages."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def embedded_model_dir(tmp_path_factory) -> Path:
    """The warm-started embedded default model, built once per test session (~30-45 s on one core)."""
    from megarl.models.tiny import ensure_embedded_model

    return ensure_embedded_model("tiny-qwen2-arith", cache_dir=tmp_path_factory.mktemp("megarl_models"))

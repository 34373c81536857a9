"""The fingerprint of the code an embedded model's build runs: its builders, tokenizer and configs, the tasks, chat
transcripts, tools and rewards they train and evaluate on (BUILD_SOURCES, read as syntax trees, so a comment or a
wrapped line changes nothing; the registry without its table of entries, whose entries are named by their own spec
hashes), and the torch and transformers versions. Every build records it (megarl.embedded.registry), and the test
suite keys its model cache by it, so a build made by the same code can be told from one made by other code."""
from __future__ import annotations

import ast
import hashlib
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding megarl/
BUILD_SOURCES = ("megarl/embedded/registry.py", "megarl/embedded/spec.py", "megarl/embedded/tiny.py",
                 "megarl/embedded/tiny_chat.py", "megarl/models/tiny_moe.py", "megarl/rollout/tasks.py",
                 "megarl/rollout/lap_count.py", "megarl/rollout/chat.py", "megarl/rollout/environment.py",
                 "megarl/rollout/rewards.py", "megarl/rollout/sandbox.py", "megarl/rollout/tool_calls.py")
REGISTRY, REGISTRY_TABLE = "megarl/embedded/registry.py", "EMBEDDED_MODELS"


def builder_fingerprint(root: Path = PACKAGE_ROOT) -> str:
    """12 hex digits of the code of BUILD_SOURCES under `root` and the installed torch and transformers versions."""
    from importlib.metadata import version  # the installed versions, without importing the packages

    digest = hashlib.sha256(f"torch {version('torch')} transformers {version('transformers')}".encode())
    for source in BUILD_SOURCES:
        tree = ast.parse((root / source).read_text())
        if source == REGISTRY:
            tree.body = [node for node in tree.body if not _assigns(node, REGISTRY_TABLE)]
        digest.update(f"{source}\n{ast.dump(tree)}\n".encode())
    return digest.hexdigest()[:12]


def _assigns(node: ast.stmt, name: str) -> bool:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return any(isinstance(t, ast.Name) and t.id == name for t in targets)

"""The import layering of docs/architecture.md ("Layers"): every `megarl.*` import in megarl/ (top-level, inside a
function or under TYPE_CHECKING alike) goes to its own layer or one below. Read from the source with ast: nothing is
imported, so no import side effect can hide or cause a violation."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO

# Top to bottom; a module may import its own layer and those below, never one above. Each name is a package or a
# module directly under megarl/ ("megarl" itself: megarl/__init__.py).
LAYERS = (
    ("cli", "roles"),  # the entry points: they wire everything
    ("eval", "sft", "checkpoint"),  # whole jobs around a learner or an engine, and the learner's saved state
    ("learner", "sampler"),  # the learner backends and the inference engines
    ("distributed", "observe", "embedded", "fleet_model"),  # transport, observers, model builders, the fleet model
    ("rollout",),  # tasks, rewards, episodes, batches: what a sample is made of
    ("models",),  # HF <-> megatron converters, layouts, MoE and LoRA names
    ("algo", "protocols", "config", "portable", "filelock", "cached_env", "check_memo", "run_lock", "ratelimit", "secret",
     "megarl"),  # pure math, shared types, the config schema, small stdlib utilities
)
# Rules stricter than the order (docs/architecture.md): rollout/ and models/ do not import each other.
FORBIDDEN = {("rollout", "models")}


def layer_of() -> dict[str, int]:
    return {name: rank for rank, names in enumerate(LAYERS) for name in names}


def unit(module: str) -> str:
    """The layering unit of a dotted module name: megarl.rollout.tasks -> rollout; megarl -> megarl."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "megarl"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, module) of every megarl import in the file; relative imports resolved against its package."""
    package = module_name(path, root)
    if path.name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            if target == "megarl":  # `from megarl import protocols`: the submodules are the targets
                found[-1:] = [(node.lineno, f"megarl.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name == "megarl" or name.startswith("megarl.")]


def violations(root: Path) -> list[str]:
    """Every import in the package at `root` (a megarl/ directory) that breaks LAYERS or FORBIDDEN, or that comes
    from or goes to a unit LAYERS does not place."""
    ranks = layer_of()
    found = []
    for path in sorted(root.rglob("*.py")):
        source = unit(module_name(path, root))
        where = path.relative_to(root.parent)
        if source not in ranks:
            found.append(f"{where}: megarl.{source} is in no layer (add it to LAYERS here and to docs/architecture.md)")
            continue
        for line, target in imports(path, root):
            dest = unit(target)
            if dest not in ranks:
                found.append(f"{where}:{line}: imports {target}, which is in no layer (add it to LAYERS)")
            elif ranks[dest] < ranks[source]:
                found.append(f"{where}:{line}: imports {target}: {dest} is a layer above {source}")
            elif (source, dest) in FORBIDDEN:
                found.append(f"{where}:{line}: imports {target}: {source} does not import {dest}")
    return found


def test_megarl_imports_follow_the_layers():
    found = violations(REPO / "megarl")
    assert not found, "upward imports (docs/architecture.md, \"Layers\"):\n" + "\n".join(found)


def test_layers_match_the_packages():
    """Every layer name is a package or module of megarl (a renamed one cannot leave a stale rule behind)."""
    root = REPO / "megarl"
    present = {p.stem for p in root.glob("*.py")} | {p.name for p in root.iterdir() if (p / "__init__.py").is_file()}
    stale = [name for names in LAYERS for name in names if name not in present | {"megarl", "__init__"}]
    assert not stale, f"LAYERS names what megarl/ does not hold: {stale}"


def write(root: Path, rel: str, text: str = "") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_an_upward_or_forbidden_import_is_found(tmp_path):
    root = tmp_path / "megarl"
    write(root, "__init__.py")
    write(root, "config/__init__.py")
    write(root, "config/load.py", "def check():\n    from megarl.learner.lr_schedule import LR_DECAYS\n")  # lazy
    write(root, "learner/__init__.py", "from megarl.config import load\n")  # downward: fine
    write(root, "rollout/__init__.py")
    write(root, "rollout/routes.py", "from ..models import moe\n")  # relative, and rollout -> models is forbidden
    write(root, "models/__init__.py")
    write(root, "models/tiny.py", "import megarl.rollout.tasks\n")
    write(root, "newpkg/__init__.py")
    found = violations(root)
    assert found == [
        "megarl/config/load.py:2: imports megarl.learner.lr_schedule: learner is a layer above config",
        "megarl/models/tiny.py:1: imports megarl.rollout.tasks: rollout is a layer above models",
        "megarl/newpkg/__init__.py: megarl.newpkg is in no layer (add it to LAYERS here and to docs/architecture.md)",
        "megarl/rollout/routes.py:1: imports megarl.models: rollout does not import models",
    ]

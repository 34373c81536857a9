"""The test cache's key for built embedded models (megarl.embedded.builder_fingerprint): it follows the code a build
runs, so a registry entry added or a comment edited keeps every built model (~5 CPU-min to rebuild them all)."""
import shutil

from megarl.embedded.builder_fingerprint import BUILD_SOURCES, REGISTRY, builder_fingerprint
from tests.helpers import REPO


def test_the_key_follows_the_build_code_not_the_registry_table_or_comments(tmp_path):
    for source in BUILD_SOURCES:
        (tmp_path / source).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / source, tmp_path / source)
    key = builder_fingerprint(tmp_path)
    assert key == builder_fingerprint(REPO)

    def edit(source: str, old: str, new: str) -> str:
        path = tmp_path / source
        text = path.read_text()
        assert old in text, (source, old)
        path.write_text(text.replace(old, new, 1))
        return builder_fingerprint(tmp_path)

    table = "EMBEDDED_MODELS: dict[str, EmbeddedSpec] = {\n"
    # An entry added: its own directory name (its spec hash) says it is new; the others stay built.
    assert edit(REGISTRY, table, table + '    "tiny-new": EmbeddedSpec(CountTask(), WarmStartRecipe()),\n') == key
    assert edit("megarl/rollout/tasks.py", "\nimport random\n", "\n# a comment\n\nimport random\n") == key
    # The code a build runs: the registry's own code and constants around the table, a builder, a task.
    changed = {edit(REGISTRY, "\ndef _spec_hash(", "\nNEW_CONSTANT = 1\n\n\ndef _spec_hash("),
               edit("megarl/embedded/tiny.py", "\nimport random\n", "\nimport random\nimport math\n"),
               edit("megarl/rollout/lap_count.py", "\nimport random\n", "\nimport random\nimport math\n")}
    assert key not in changed and len(changed) == 3

""".ci/quickstart.py: CI reads the two quickstart commands from the README; another shape is refused."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO

_spec = importlib.util.spec_from_file_location("ci_quickstart", REPO / ".ci" / "quickstart.py")
quickstart = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(quickstart)


def _readme(*blocks: str, after: str = "## Next\n\n```bash\nmegarl export x\n```\n") -> str:
    body = "\n".join(f"Some prose.\n\n```bash\n{b}\n```\n" for b in blocks)
    return f"# megarl\n\n## Quickstart (two commands)\n\n{body}\n{after}"


def test_the_readme_opens_with_a_main_run_and_the_test_suite():
    commands = quickstart.quickstart_commands((REPO / "README.md").read_text())
    assert commands["main"].startswith("pip install -e ") and " && megarl train configs/" in commands["main"]
    assert commands["test"].startswith("pip install -e ") and "python -m pytest -q -n 2 tests" in commands["test"]


def test_cli_prints_each_command_as_the_readme_has_it():
    readme = quickstart.quickstart_commands((REPO / "README.md").read_text())
    for which in ("main", "test"):
        out = subprocess.run([sys.executable, str(REPO / ".ci" / "quickstart.py"), which], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        assert out == readme[which] + "\n"


def test_blocks_after_the_quickstart_section_are_not_its_commands():
    commands = quickstart.quickstart_commands(_readme("pip install a && megarl train c.yaml", "python -m pytest t"))
    assert commands == {"main": "pip install a && megarl train c.yaml", "test": "python -m pytest t"}


@pytest.mark.parametrize("readme, error", [
    (_readme("pip install a && megarl train c.yaml"), "holds 1 ```bash blocks, expected 2"),
    (_readme("megarl train a.yaml", "megarl train b.yaml", "python -m pytest t"), "holds 3 ```bash blocks"),
    (_readme("pip install a &&\nmegarl train c.yaml", "python -m pytest t"), "main command is 2 lines"),
    (_readme("pip install a && megarl sft c.yaml", "python -m pytest t"), "does not end with a `megarl train`"),
    (_readme("megarl train c.yaml", "pip install a"), "second command does not run pytest"),
    ("# megarl\n\n## Install\n\n```bash\npip install a\n```\n", "no '## Quickstart' section"),
])
def test_another_shape_is_refused_naming_what_was_found(readme, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        quickstart.quickstart_commands(readme)

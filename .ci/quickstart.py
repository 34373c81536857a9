"""The README's quickstart commands, read from the README itself so that CI runs what a new user types and the two
can never drift.

The README's `## Quickstart` section (up to the next `## ` heading) opens the project with exactly two commands, each
a one-line ```bash block: the first installs megarl and runs the main job (it ends with its `megarl train`, to which
.ci/run appends `run.dir=`), the second installs the test extra and runs the test suite. Anything else there (a third
block, a block of two lines) is refused, naming what was found, so a README edit that changes the quickstart's shape
fails CI instead of silently running something else.

    python3 .ci/quickstart.py main     prints the first command
    python3 .ci/quickstart.py test     prints the second

Standard library only: .ci/run calls it before any environment exists.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
WHICH = ("main", "test")
_SECTION = re.compile(r"^## Quickstart\b.*?$(.*?)(?=^## |\Z)", re.M | re.S)
_BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)


def quickstart_commands(readme: str) -> dict[str, str]:
    """{"main": first command, "test": second command} of the README text's Quickstart section."""
    section = _SECTION.search(readme)
    if section is None:
        raise ValueError("README has no '## Quickstart' section")
    blocks = [b.strip() for b in _BASH_BLOCK.findall(section.group(1))]
    if len(blocks) != 2:
        raise ValueError(f"README's Quickstart holds {len(blocks)} ```bash blocks, expected 2 (main job, tests): "
                         f"{blocks}")
    for which, block in zip(WHICH, blocks):
        if "\n" in block:
            raise ValueError(f"README's Quickstart {which} command is {block.count(chr(10)) + 1} lines, expected "
                             f"one: {block!r}")
    main, test = blocks
    if not main.split("&&")[-1].strip().startswith("megarl train "):
        raise ValueError(f"README's Quickstart first command does not end with a `megarl train` run: {main!r}")
    if "pytest" not in test:
        raise ValueError(f"README's Quickstart second command does not run pytest: {test!r}")
    return {"main": main, "test": test}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in WHICH:
        print(f"usage: python3 .ci/quickstart.py {{{'|'.join(WHICH)}}}", file=sys.stderr)
        return 2
    try:
        print(quickstart_commands(README.read_text())[argv[0]])
    except ValueError as exc:
        print(f"ci: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

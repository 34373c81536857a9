"""docs/models.md's support matrix is the one tests/support_matrix.py claims, and every claim has a collected test."""
from __future__ import annotations

import subprocess
import sys

import pytest

from megarl.models.families import FAMILIES
from tests import support_matrix
from tests.helpers import REPO


def test_the_docs_table_is_the_one_the_tests_claim():
    assert support_matrix.doc_table(support_matrix.DOC.read_text()) == support_matrix.render(), (
        "docs/models.md's support matrix differs from tests/support_matrix.py's: run `python -m tests.support_matrix`")


def test_every_family_has_one_row_and_every_claiming_cell_names_a_test():
    assert [model_type for _, model_type, _ in support_matrix.MATRIX] == list(FAMILIES), \
        "tests/support_matrix.py's MATRIX: one row per megarl/models/families.py FAMILIES entry, in its order"
    for label, _, cells in support_matrix.MATRIX:
        assert set(cells) == set(support_matrix.COLUMNS), label
        for column, cell in cells.items():
            claims = cell.text not in support_matrix.UNCLAIMED
            assert claims == bool(cell.tests), (f"{label} / {column}: {cell.text!r} "
                                                f"{'names no test' if claims else 'claims nothing, names tests'}")


def test_a_render_of_another_claim_is_told_apart_from_the_doc(tmp_path, monkeypatch):
    doc = tmp_path / "models.md"
    doc.write_text(f"intro\n{support_matrix.BEGIN}\n| stale |\n{support_matrix.END}\nrest\n")
    assert support_matrix.write_doc(doc) and not support_matrix.write_doc(doc)
    assert support_matrix.doc_table(doc.read_text()) == support_matrix.render()
    assert doc.read_text().startswith("intro\n") and doc.read_text().endswith("\nrest\n")
    with pytest.raises(ValueError, match="markers are missing"):
        support_matrix.doc_table("| a table without its markers |")


def test_every_test_a_cell_names_is_collected():
    """One `pytest --collect-only` over the files the cells name, every marker included (the vLLM tests are
    deselected by default, not absent)."""
    claimed = support_matrix.claimed_tests()
    files = sorted({test.split("::", 1)[0] for test in claimed})
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "", "-p", "no:randomly",
                           *files], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = {line.strip() for line in proc.stdout.splitlines() if "::" in line}
    missing = sorted(claimed - collected)
    assert not missing, f"tests/support_matrix.py names tests that are not collected: {missing}"

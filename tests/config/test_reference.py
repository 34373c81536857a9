"""The config reference (megarl/config/reference.py, `megarl config`, docs/config.md) lists every key of the schema
with its type, default and comment, and docs/config.md is exactly what the schema renders."""
import dataclasses
from dataclasses import dataclass, field

import pytest

from megarl.cli import main
from megarl.config import reference
from megarl.config.schema import Config
from tests.helpers import REPO


def schema_keys(cls=Config, prefix=""):
    """Every leaf key of the schema, walked from the dataclasses themselves (not through reference.py)."""
    out = []
    for f in dataclasses.fields(cls):
        value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out += schema_keys(type(value), name + ".")
        else:
            out.append(name)
    return out


def test_docs_config_md_is_the_schema_rendered():
    written = (REPO / "docs" / "config.md").read_text()
    assert written == reference.render_markdown(), (
        "docs/config.md and megarl/config/schema.py disagree: regenerate it with `megarl config --markdown > docs/config.md`")


def test_every_schema_key_is_listed_with_a_comment():
    listed = {k.name: k for k in reference.keys()}
    missing = [name for name in schema_keys() if name not in listed]
    assert not missing, f"keys of the schema missing from the reference: {missing}"
    uncommented = [k.name for k in reference.keys() if not k.comment]
    assert not uncommented, f"schema keys without a comment (write one beside the field): {uncommented}"
    markdown = reference.render_markdown()
    assert all(f"| `{name}` |" in markdown for name in schema_keys())
    assert listed["learner.lr"].type == "float" and listed["learner.lr"].default == "0.001"
    assert listed["eval.sets[].name"].default == '"heldout"'


@dataclass
class Inner:
    """An inner section."""

    a: int = 1  # the a
    # A group: b and c
    # together.
    b: str = "x"
    c: float = 2.0

    d: bool = True
    e: list[str] = field(default_factory=lambda: ["p", "q"])  # trailing
    f: float = 3.0


def test_comments_above_trailing_and_grouped():
    comments = reference.field_comments(Inner)
    assert comments["a"] == "the a"
    assert comments["b"] == "A group: b and c together."
    assert comments["c"] == "(see {section}.b)"  # named by the block above b, no blank line between
    assert comments["d"] == ""  # a blank line ends the group
    assert comments["e"] == "trailing"
    assert comments["f"] == ""  # e's comment does not name f
    assert reference.format_value(Inner().e) == '["p", "q"]'
    assert reference.format_value(None) == "null" and reference.format_value(float("inf")) == "inf"


def test_lookup_key_section_and_unknown():
    assert [k.name for k in reference.lookup("learner.lr")] == ["learner.lr"]
    assert {k.name for k in reference.lookup("sampler.vllm")} == {
        n for n in schema_keys() if n.startswith("sampler.vllm.")}
    with pytest.raises(reference.UnknownKey, match=r"unknown config key 'learner.lrr'; did you mean: learner.lr\b"):
        reference.lookup("learner.lrr")
    with pytest.raises(reference.UnknownKey, match="did you mean: learner.lr_decay"):
        reference.lookup("lr_decay")  # the leaf alone: the keys it ends


def test_diff_lists_changed_keys_in_order():
    defaults = {"run": {"steps": 100, "dir": "a"}, "eval": {"sets": []}}
    config = {"run": {"steps": 7, "dir": "a"}, "eval": {"sets": [{"name": "h"}]}}
    assert reference.diff(config, defaults) == [("run.steps", "100", "7"), ("eval.sets", "[]", '[{name: "h"}]')]
    assert "every key at its default" in reference.render_diff([], "x.yaml")


def run_cli(capsys, *argv):
    with pytest.raises(SystemExit) as exit_:
        main(["config", *argv])
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


def test_cli_config(capsys):
    code, out, _ = run_cli(capsys)
    assert code == 0 and all(f"{name}: " in out for name in schema_keys())
    code, out, _ = run_cli(capsys, "learner.lr")
    assert code == 0 and out.splitlines()[1:] == ["learner.lr: float = 0.001", "    the peak learning rate (AdamW)"]
    code, _, err = run_cli(capsys, "learner.lrr")
    assert code == 2 and "unknown config key 'learner.lrr'; did you mean: learner.lr" in err
    code, out, _ = run_cli(capsys, "--diff", str(REPO / "configs" / "demo.yaml"), "run.steps=7")
    assert code == 0 and "run.steps" in out and "7   (default 100)" in out
    assert "checkpoint.dir" not in out  # interpolations resolved on both sides
    code, _, err = run_cli(capsys, "--diff", str(REPO / "configs" / "demo.yaml"), "learner.lrr=1")
    assert code == 2 and "unknown config key 'learner.lrr'" in err
    code, out, _ = run_cli(capsys, "--markdown")
    assert code == 0 and out == reference.render_markdown()

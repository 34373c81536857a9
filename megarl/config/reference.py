"""The config reference, read from the schema itself: every key of megarl/config/schema.py with its type, default
and the comment written beside it, rendered for `megarl config` (text) and docs/config.md (Markdown).

The comments are the documentation: a field's comment is the comment lines directly above it plus the comment
at the end of its line. A comment block above several fields with no comment of their own (no blank line
between) describes the group; those fields point at the group's first key. A section (a nested dataclass) is
described by its class docstring and the comment beside the field that holds it.
Pure functions of the schema classes (their source read with inspect/tokenize); nothing here prints.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import io
import json
import math
import re
import textwrap
import tokenize
import typing
from dataclasses import dataclass
from functools import lru_cache

from megarl.config.schema import Config


@dataclass(frozen=True)
class Key:
    """One config key: `name` dotted (a list's entries as `eval.sets[].name`), `type` as annotated, `default`
    as YAML writes it, `comment` the text beside it in the schema, `section` the dotted section it sits in."""

    name: str
    type: str
    default: str
    comment: str
    section: str


@dataclass(frozen=True)
class Section:
    """A nested dataclass of the schema: `name` dotted ("" for the top), `doc` its docstring and field comment."""

    name: str
    doc: str


def format_value(value) -> str:
    """A default as YAML writes it (strings quoted, null, true/false, inf)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if dataclasses.is_dataclass(value):
        return "{...}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {format_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


@lru_cache(maxsize=None)
def field_comments(cls: type) -> dict[str, str]:
    """{field name: its comment} for the dataclass `cls`, from its source (see the module docstring)."""
    lines, _ = inspect.getsourcelines(cls)
    source = textwrap.dedent("".join(lines))
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    src_lines = source.splitlines()
    body = ast.parse(source).body[0].body
    fields = [node for node in body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)]
    result: dict[str, str] = {}
    run: list[str] = []  # the fields since the last blank line (or other code)
    heads: list[str] = []  # fields with a comment block above them: a group's description
    previous_end = None
    for node in fields:
        name, first, last = node.target.id, node.lineno, node.end_lineno
        above = []
        line = first - 1
        while line >= 1 and line in comments and src_lines[line - 1].lstrip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        if not above and previous_end != first - 1:
            run = []
        elif above and previous_end != line:
            run = []
        own = " ".join(above + [comments[n] for n in range(first, last + 1) if n in comments])
        # an uncommented field that a comment of its group names (`lr_decay` in the lr_warmup_steps block)
        named = re.compile(rf"\b{re.escape(name)}\b")
        head = next((other for other in heads if other in run and named.search(result[other])), None)
        result[name] = own or (f"(see {{section}}.{head})" if head else "")
        run.append(name)
        if above:
            heads.append(name)
        previous_end = last
    return result


def _doc(cls: type) -> str:
    doc = cls.__doc__ or ""
    # dataclasses give an undocumented class a generated signature docstring: not documentation
    return "" if doc.startswith(cls.__name__ + "(") else " ".join(inspect.cleandoc(doc).split())


def _type_name(cls: type, name: str) -> str:
    annotation = {f.name: f.type for f in dataclasses.fields(cls)}[name]
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))


def _element_class(cls: type, name: str):
    """The dataclass a list field holds (list[EvalSetConfig] -> EvalSetConfig), or None."""
    hints = typing.get_type_hints(cls)
    args = typing.get_args(hints[name])
    return args[0] if args and dataclasses.is_dataclass(args[0]) else None


def _walk(cls: type, instance, prefix: str, doc: str, keys: list[Key], sections: list[Section]) -> None:
    sections.append(Section(prefix, doc))
    comments = field_comments(cls)
    nested = []  # sections after the section's own keys, so each section's keys stay together
    for f in dataclasses.fields(cls):
        name = f"{prefix}.{f.name}" if prefix else f.name
        value = getattr(instance, f.name)
        comment = comments.get(f.name, "").replace("{section}.", f"{prefix}." if prefix else "")
        if dataclasses.is_dataclass(value):
            own = "" if comment.startswith("(see ") else comment  # a group's comment is about its keys
            doc = _doc(type(value))
            nested.append((type(value), value, name, f"{own.rstrip('.')}. {doc}" if own and doc else own or doc))
            continue
        keys.append(Key(name, _type_name(cls, f.name), format_value(value), comment, prefix))
        element = _element_class(cls, f.name)
        if element is not None:  # a list of records: each entry's keys
            nested.append((element, element(), f"{name}[]", _doc(element)))
    for args in nested:
        _walk(*args, keys, sections)


@lru_cache(maxsize=None)
def reference() -> tuple[tuple[Key, ...], tuple[Section, ...]]:
    """Every key and section of the schema, in schema order."""
    keys: list[Key] = []
    sections: list[Section] = []
    _walk(Config, Config(), "", "", keys, sections)
    return tuple(keys), tuple(sections)


def keys() -> tuple[Key, ...]:
    return reference()[0]


class UnknownKey(KeyError):
    """A name that is neither a key nor a section of the schema; the message offers the closest ones."""

    def __str__(self) -> str:
        return self.args[0]


def lookup(name: str) -> list[Key]:
    """The key `name`, or every key of the section `name`; UnknownKey naming the closest keys otherwise."""
    all_keys = keys()
    exact = [k for k in all_keys if k.name == name]
    if exact:
        return exact
    inside = [k for k in all_keys if k.name.startswith(name + ".") or k.name.startswith(name + "[].")]
    if inside:
        return inside
    names = [k.name for k in all_keys] + [s.name for s in reference()[1] if s.name]
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.6)
    leaf = name.rsplit(".", 1)[-1]
    close += [n for n in names if n.rsplit(".", 1)[-1] == leaf and n not in close]
    hint = f"; did you mean: {', '.join(close[:5])}?" if close else "; `megarl config` lists every key"
    raise UnknownKey(f"unknown config key {name!r}{hint}")


def render_key(key: Key) -> str:
    """One key for the terminal: `name: type = default` and its comment below, indented."""
    head = f"{key.name}: {key.type} = {key.default}"
    if not key.comment:
        return head
    return head + "\n" + textwrap.fill(key.comment, width=100, initial_indent="    ", subsequent_indent="    ")


def render_text(selected: typing.Iterable[Key] | None = None) -> str:
    """The keys (default: all) for the terminal, each section headed by its description."""
    selected = keys() if selected is None else tuple(selected)
    docs = {s.name: s.doc for s in reference()[1]}
    out: list[str] = []
    section = None
    for key in selected:
        if key.section != section:
            section = key.section
            if section:
                out.append(f"\n[{section}]" + (f"  {docs[section]}" if docs.get(section) else ""))
        out.append(render_key(key))
    return "\n".join(out).lstrip("\n") + "\n"


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown() -> str:
    """docs/config.md: one table per section, every key with its type, default and comment."""
    out = ["# Config reference",
           "",
           "Every key of the run configuration (`megarl/config/schema.py`), with its type, default and the comment",
           "beside it in the schema. Generated: `megarl config --markdown > docs/config.md` (tests/config/",
           "test_reference.py fails when this file and the schema disagree). In the terminal: `megarl config`",
           "(every key), `megarl config KEY` (one key or a section), `megarl config --diff CONFIG.yaml` (what a",
           "config changes against these defaults). A YAML file sets keys by section (`learner:` / `  lr: 0.001`);",
           "the command line as `learner.lr=0.001`."]
    docs = {s.name: s.doc for s in reference()[1]}
    section = None
    for key in keys():
        if key.section != section:
            section = key.section
            out += ["", f"## `{section or 'top level'}`", ""]
            if docs.get(section):
                out += [docs[section], ""]
            out += ["| key | type | default | description |", "|---|---|---|---|"]
        out.append(f"| `{key.name}` | `{_md_cell(key.type)}` | `{_md_cell(key.default)}` | {_md_cell(key.comment)} |")
    return "\n".join(out) + "\n"


def flatten(tree, prefix: str = "") -> dict[str, object]:
    """{dotted key: value} of a nested dict (to_dict of a Config); a list is one value."""
    flat: dict[str, object] = {}
    for name, value in tree.items():
        dotted = f"{prefix}.{name}" if prefix else name
        if isinstance(value, dict):
            flat.update(flatten(value, dotted))
        else:
            flat[dotted] = value
    return flat


def diff(config: dict, defaults: dict) -> list[tuple[str, str, str]]:
    """(key, default, value) for every key whose value in `config` differs from `defaults` (both nested dicts,
    as megarl.config.load.to_dict gives them), in schema order."""
    new, old = flatten(config), flatten(defaults)
    return [(name, format_value(old.get(name)), format_value(value)) for name, value in new.items()
            if old.get(name) != value]


def render_diff(changes: list[tuple[str, str, str]], source: str) -> str:
    if not changes:
        return f"{source}: every key at its default\n"
    width = max(len(name) for name, _, _ in changes)
    lines = [f"{source}: {len(changes)} key(s) differ from the defaults"]
    lines += [f"  {name.ljust(width)}  {value}   (default {default})" for name, default, value in changes]
    return "\n".join(lines) + "\n"

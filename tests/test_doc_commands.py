"""Every shell command the README and docs/ show runs as typed: each ```bash / ```sh / ```console block
parses in a POSIX shell, and every megarl command in it (`megarl train|sft|placement|export`, `python -m
megarl.cli ...`, a raw `torchrun ... -m megarl.roles.worker` or `megarl.sft.run` launch, the launch/ scripts)
is split as the shell splits it and goes through megarl's own argument parsing and configuration checks
(megarl.cli.checked_config: keys, types, cross-field rules, topology), so a documented key that does not
exist or a value that does not parse fails here. Nothing is launched. A synopsis that is not meant to be
typed (`megarl train CONFIG [key=value ...]`) goes in a ```text block."""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from megarl.cli import build_parser, checked_config, parse_command_line
from megarl.config.load import load_config
from tests.helpers import REPO

SHELL_BLOCK = re.compile(r"^```(bash|sh|shell|console)[ \t]*\n(.*?)^```", re.S | re.M)
SEPARATORS = {"&&", "||", "|", ";", "&", "(", ")"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def shell_blocks() -> list[tuple[str, str]]:
    """(where, script) for every shell block; a console block keeps only its `$ ` lines (the rest is output)."""
    blocks = []
    for path in doc_files():
        text = path.read_text()
        for match in SHELL_BLOCK.finditer(text):
            lang, body = match.groups()
            if lang == "console":
                body = "".join(line[2:] + "\n" for line in body.splitlines() if line.startswith("$ "))
            line = text[:match.start()].count("\n") + 1
            blocks.append((f"{path.relative_to(REPO)}:{line}", body))
    return blocks


def simple_commands(script: str) -> list[list[str]]:
    """The script's simple commands as the shell splits them (quotes removed, comments dropped), split at
    newlines, &&, ||, |, ; and parentheses; continuation lines joined."""
    commands, pending = [], ""
    for line in script.replace("\\\n", " ").splitlines():
        pending += line + "\n"
        lexer = shlex.shlex(pending, posix=True, punctuation_chars=";&|()")
        lexer.whitespace_split = True
        try:
            tokens = list(lexer)
        except ValueError:  # a quote still open: the command goes on on the next line
            continue
        pending, current = "", []
        for token in tokens:
            if token in SEPARATORS:
                commands.append(current)
                current = []
            else:
                current.append(token)
        commands.append(current)
    return [c for c in commands if c]


ADD_SAMPLERS_SCRIPT = "launch/slurm_add_samplers.sbatch"


def megarl_arguments(words: list[str]) -> tuple[str, list[str]] | None:
    """(kind, arguments) of a command that runs megarl: ("cli", argv of megarl) or ("worker", CONFIG +
    overrides of a torchrun worker or launch script); None for any other command."""
    while words and ASSIGNMENT.match(words[0]):  # VAR=value before the command
        words = words[1:]
    if not words:
        return None
    if words[0] == "megarl":
        return "cli", words[1:]
    if words[:3] == ["python", "-m", "megarl.cli"]:
        return "cli", words[3:]
    for module in ("megarl.roles.worker", "megarl.sft.run"):
        if module in words and words[words.index(module) - 1] == "-m":
            return "worker", words[words.index(module) + 1:]
    scripts = [i for i, w in enumerate(words) if w.startswith("launch/") and w.endswith((".sh", ".sbatch"))]
    if scripts:
        script, arguments = words[scripts[0]], words[scripts[0] + 1:]
        if script == ADD_SAMPLERS_SCRIPT:  # its tasks run `megarl samplers add` with its arguments
            return "cli", ["samplers", "add", *arguments]
        return "worker", arguments
    return None


def check_megarl_command(kind: str, argv: list[str]) -> None:
    if kind == "worker":
        load_config(argv[0], argv[1:], check_files=False)  # data files are made by a command of the docs
        return
    try:
        args = parse_command_line(build_parser(), argv)
    except SystemExit as exc:
        raise AssertionError(f"megarl's argument parser refused {shlex.join(argv)} (exit {exc.code})") from None
    if args.command == "samplers":  # the overrides go over a running job's saved config: their keys and values
        load_config(None, getattr(args, "overrides", []), check_files=False)
    elif args.command != "export":  # export reads only a checkpoint
        checked_config(args, check_files=False)


BLOCKS = shell_blocks()
COMMANDS = [(where, *found) for where, script in BLOCKS for words in simple_commands(script)
            if (found := megarl_arguments(words)) is not None]


def test_the_docs_show_megarl_commands_of_every_kind():
    assert len(BLOCKS) >= 15
    kinds = {(kind, argv[0] if kind == "cli" else "") for _, kind, argv in COMMANDS}
    assert {("cli", "train"), ("cli", "sft"), ("cli", "placement"), ("worker", "")} <= kinds, kinds


@pytest.mark.skipif(shutil.which("sh") is None, reason="no POSIX shell")
@pytest.mark.parametrize("where, script", BLOCKS, ids=[where for where, _ in BLOCKS])
def test_every_shell_block_parses_in_a_posix_shell(where, script):
    proc = subprocess.run(["sh", "-n"], input=script, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"{where}: {proc.stderr}"


@pytest.mark.parametrize("where, kind, argv", COMMANDS, ids=[f"{w} {shlex.join(a)[:60]}" for w, _, a in COMMANDS])
def test_every_megarl_command_in_the_docs_passes_megarls_config_checks(where, kind, argv, monkeypatch):
    monkeypatch.chdir(REPO)  # the docs' paths are relative to the repository root
    check_megarl_command(kind, argv)


def checkpoint_dead_ends(commands: list[tuple[str, list[str]]]) -> list[str]:
    """What reads a checkpoint no earlier command of the sequence wrote: `megarl export|eval --checkpoint DIR` and
    `run.resume=true` need a run before them that saves into DIR (checkpoint.every_steps > 0), and a continuation
    that saves nothing leaves DIR's latest checkpoint behind it (a later export would miss its steps). Resolved
    from each command's real config, so a run.dir or checkpoint.dir override counts."""
    saved: dict[str, bool] = {}  # checkpoint.dir -> whether its latest checkpoint is the last run's
    problems = []
    for kind, argv in commands:
        if kind == "cli" and argv[0] in ("export", "eval"):
            args = parse_command_line(build_parser(), argv)
            wanted = str(Path(args.checkpoint)) if args.checkpoint else None
            if wanted is not None and not saved.get(wanted):
                problems.append(f"{shlex.join(argv)}: no earlier command saves checkpoints into {wanted}"
                                if wanted not in saved else
                                f"{shlex.join(argv)}: the run before it continued without saving (checkpoint.every_steps)")
            continue
        if kind == "cli" and argv[0] != "train":
            continue
        config_argv = argv[1:] if kind == "cli" else argv
        cfg = checked_config(parse_command_line(build_parser(), ["train", *config_argv]), check_files=False)[0] \
            if kind == "cli" else load_config(argv[0], argv[1:], check_files=False)
        root, resumes = str(Path(cfg.checkpoint.dir)), str(cfg.run.resume).lower() == "true"
        if resumes and root not in saved:
            problems.append(f"{shlex.join(argv)}: run.resume=true, but no earlier command saves into {root}")
        if cfg.checkpoint.every_steps > 0:
            saved[root] = True
        elif resumes or str(cfg.run.resume).lower() == "auto":
            saved[root] = False
    return problems


def doc_sequences() -> dict[str, list[tuple[str, list[str]]]]:
    """Each doc's megarl commands in document order (a sequence a reader types top to bottom)."""
    sequences: dict[str, list] = {}
    for where, kind, argv in COMMANDS:
        sequences.setdefault(where.split(":")[0], []).append((kind, argv))
    return sequences


@pytest.mark.parametrize("doc", sorted(doc_sequences()))
def test_no_doc_reads_a_checkpoint_its_commands_do_not_write(doc, monkeypatch):
    monkeypatch.chdir(REPO)
    assert checkpoint_dead_ends(doc_sequences()[doc]) == []


def test_a_checkpoint_dead_end_is_found(monkeypatch):
    monkeypatch.chdir(REPO)
    demo = ["train", "configs/demo.yaml"]
    export = ["export", "--checkpoint", "runs/demo/checkpoints", "--out", "hf"]
    evaluate = ["eval", "configs/demo.yaml", "--checkpoint", "runs/demo/checkpoints"]
    assert checkpoint_dead_ends([("cli", demo), ("cli", evaluate)]) == [
        f"{shlex.join(evaluate)}: no earlier command saves checkpoints into runs/demo/checkpoints"]
    saving = [*demo, "checkpoint.every_steps=50"]
    assert checkpoint_dead_ends([("cli", saving), ("cli", export), ("cli", evaluate)]) == []
    resume = [*demo, "run.resume=true"]
    assert "continued without saving" in checkpoint_dead_ends([("cli", saving), ("cli", resume), ("cli", export)])[0]
    assert "run.resume=true, but no earlier command" in checkpoint_dead_ends([("cli", resume)])[0]
    other_dir = [*saving, "run.dir=runs/other"]
    assert len(checkpoint_dead_ends([("cli", other_dir), ("cli", export)])) == 1


def test_what_the_checks_catch(monkeypatch):
    monkeypatch.chdir(REPO)
    # The bug that made this test: the shell removes the quotes of sft.eval_data='' (now: an empty string).
    [[*_, override]] = simple_commands("megarl sft configs/sft.yaml sft.eval_data=''")
    assert override == "sft.eval_data="
    check_megarl_command("cli", ["sft", "configs/sft.yaml", override])
    for argv, error in ((["train", "configs/demo.yaml", "run.stepz=3"], "unknown config key 'run.stepz'"),
                        (["train", "configs/demo.yaml", "run.steps=many"], "bad value for config key 'run.steps'"),
                        (["placement", "configs/demo.yaml", "--nnodes", "3"], "do not give")):
        with pytest.raises(ValueError, match=error):
            check_megarl_command("cli", argv)
    with pytest.raises(AssertionError, match="argument parser refused"):
        check_megarl_command("cli", ["train", "--nodes", "2", "configs/demo.yaml"])
    assert simple_commands("A=1 megarl train c.yaml x=1 && echo 'a # b' # note\nmegarl sft c.yaml | tee log") == [
        ["A=1", "megarl", "train", "c.yaml", "x=1"], ["echo", "a # b"], ["megarl", "sft", "c.yaml"], ["tee", "log"]]

"""The code blocks of the docs (docs/**/*.md and README.md), and the checks for those that cannot run here.

A block runs unless the line above it marks it (an HTML comment, invisible on the site and on GitHub):

    <!-- docs-example: check (trains MiniLM for minutes) -->   its commands are checked, not run
    <!-- docs-example: usage -->                              a usage line ([--json] [overrides]): its options exist

``text`` blocks (and blocks without a language) are output or layout, not code: nothing to run. A checked shell
block has each ``maxout`` command parsed by the real argparse parser (maxout.cli.build_parser) and its overrides
checked against the config (loading.precheck: unknown keys, wrong types, bad values; every problem), ``mlflow run``
against MLproject, ``make`` against the Makefile; any other command must at least split like a shell. A checked
Python block is compiled.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml
from markdown_it import MarkdownIt

from maxout import loading
from maxout.cli import build_parser, split_overrides

ROOT = Path(__file__).resolve().parents[1]
MARK = re.compile(r"^<!--\s*docs-example:\s*(check|usage)\b(.*?)-->\s*$")
SHELLS = ("bash", "sh", "shell", "console")
CODE = SHELLS + ("python",)
# maxout commands whose Makefile target passes ARGS on to them
MAKE_COMMANDS = {"check-hardware": "check-hardware", "benchmark": "benchmark", "audit": "audit"}
PLACEHOLDERS = ("...",)  # an elided rest of the command line in an example


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based, the opening fence
    lang: str
    mode: str  # run | check | usage | text
    reason: str
    source: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    return sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]


def blocks(paths: list[Path] | None = None) -> list[Block]:
    found = []
    for path in paths or pages():
        text = path.read_text()
        lines = text.splitlines()
        for token in MarkdownIt().parse(text):
            if token.type != "fence":
                continue
            start = token.map[0]
            lang = (token.info.split() or ["text"])[0].lower()
            above = next((lines[i].strip() for i in range(start - 1, -1, -1) if lines[i].strip()), "")
            mark = MARK.match(above)
            mode = "text" if lang not in CODE else mark.group(1) if mark else "run"
            reason = mark.group(2).strip().strip("()") if mark else ""
            found.append(Block(path, start + 1, lang, mode, reason, token.content))
    return found


def _words(text: str) -> list[str]:
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)  # |, &&, ;, > as words of their own
    lexer.whitespace_split = True
    return list(lexer)


def _split_commands(words: list[str]) -> list[list[str]]:
    """Words -> commands: cut at |, &&, ||, ; and a trailing &; redirections (> FILE) dropped."""
    out, current, skip = [], [], False
    for word in words:
        if skip:
            skip = False
        elif word in ("|", "||", "&&", ";", "&"):
            out.append(current)
            current = []
        elif word in (">", ">>", "<", "2>", "&>"):
            skip = True
        else:
            current.append(word)
    return [c for c in out + [current] if c]


def commands(source: str) -> list[list[str]]:
    """A shell block's commands, each as its words: comments dropped, continued lines (``\\``, an open quote)
    joined. A block that does not split like a shell raises ValueError."""
    out, pending = [], ""
    for line in source.splitlines():
        pending += line + "\n"
        if pending.rstrip().endswith("\\"):
            continue
        try:
            words = _words(pending.replace("\\\n", " "))
        except ValueError:  # an open quote: the command goes on on the next line
            continue
        out += _split_commands(words)
        pending = ""
    if pending.strip():
        _words(pending)  # raises: the block ends inside a quote
    return out


def _without_env(words: list[str]) -> list[str]:
    """``HF_TOKEN=hf_... maxout train ...`` -> the command after its environment assignments."""
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]
    return words


def maxout_argv(words: list[str]) -> list[str] | None:
    """The arguments of a maxout command: ``maxout ...``, ``python -m maxout ...``, ``torchrun [opts] -m maxout``."""
    words = _without_env(words)
    if words[:1] == ["maxout"]:
        return words[1:]
    if "-m" in words and words[0] in ("python", "python3", "torchrun") and words[words.index("-m") + 1:][:1] == [
            "maxout"]:
        return words[words.index("-m") + 2:]
    return None


@functools.cache
def parser() -> argparse.ArgumentParser:
    return build_parser()  # reads every config group's options: once


def _shown(word: str) -> str | None:
    """An example's word as typed: ``[--batch-size`` / ``64]`` (an optional part, shown in use) lose their
    brackets; ``...`` and ``model=...`` (the rest elided) are no word at all."""
    if word in PLACEHOLDERS or word.endswith("=..."):
        return None
    if word.startswith("[--"):
        return word[1:]
    return word[:-1] if word.endswith("]") and "[" not in word else word


def check_maxout(argv: list[str]) -> list[str]:
    """The problems of one maxout command line: argparse's, then its overrides' (each one, as the CLI lists them)."""
    argv = [w for w in map(_shown, argv) if w is not None]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = parser().parse_args(argv)
    except SystemExit as stop:
        return [] if stop.code == 0 else [f"maxout {' '.join(argv)}: {err.getvalue().strip()}"]
    problems = []
    if isinstance(getattr(args, "overrides", None), list):
        overrides = split_overrides(args.overrides, args.overrides_string)
        if args.command == "hpo" and not any(o.lstrip("+").startswith("hpo=") for o in overrides):
            overrides.insert(0, "hpo=default")  # as cmd_hpo does
        problems += [str(p) for p in loading.precheck(overrides)]
    if getattr(args, "grid", None):
        from maxout.insight.grid import parse_grid

        problems += _raised(parse_grid, args.grid)
    return [f"maxout {' '.join(argv)}: {p}" for p in problems]


def _raised(func, *args) -> list[str]:
    try:
        func(*args)
    except Exception as err:  # noqa: BLE001 - whatever the parser raises is the problem to report
        return [f"{type(err).__name__}: {err}"]
    return []


def check_mlflow_run(words: list[str]) -> list[str]:
    """``mlflow run . -e ENTRY -P key=value -A flag``: the entry point and its parameters are MLproject's, and the
    overrides it passes are valid for maxout (train, or hpo)."""
    project = yaml.safe_load((ROOT / "MLproject").read_text())
    entry, params, rest = "main", {}, words[2:]
    while rest:
        flag = rest.pop(0)
        if flag in ("-e", "--entry-point"):
            entry = rest.pop(0)
        elif flag in ("-P", "--param-list"):
            key, _, value = rest.pop(0).partition("=")
            params[key] = value
        elif flag in ("-A", "--docker-args"):
            rest.pop(0)
        elif flag != ".":
            return [f"mlflow run: unexpected {flag!r}"]
    if entry not in project["entry_points"]:
        return [f"mlflow run: no entry point {entry!r} in MLproject"]
    known = project["entry_points"][entry]["parameters"]
    problems = [f"mlflow run: -P {k} is not a parameter of entry point {entry!r}" for k in params if k not in known]
    command = ["train" if entry == "main" else entry, f"hardware={params.get('hardware', 'auto')}"]
    if params.get("overrides"):
        command += ["--overrides", params["overrides"]]
    if "nproc_per_node" in params:
        command += ["--nproc-per-node", params["nproc_per_node"]]
    return problems + check_maxout(command)


def check_make(words: list[str]) -> list[str]:
    makefile = (ROOT / "Makefile").read_text()
    variables = dict(w.split("=", 1) for w in words[1:] if "=" in w)
    problems = []
    for target in [w for w in words[1:] if "=" not in w]:
        if not re.search(rf"^{re.escape(target)}:", makefile, re.M):
            problems.append(f"make: no target {target!r} in the Makefile")
        elif target in MAKE_COMMANDS and "ARGS" in variables:
            problems += check_maxout([MAKE_COMMANDS[target], *shlex.split(variables["ARGS"])])
    return problems


def check_shell(block: Block) -> tuple[list[str], dict[str, int]]:
    """The problems of a checked shell block, and how many of its commands each checker looked at."""
    problems, counts = [], {"maxout": 0, "mlflow run": 0, "make": 0, "shell syntax only": 0}
    for words in commands(block.source):
        argv = maxout_argv(words)
        plain = _without_env(words)
        if argv is not None:
            counts["maxout"] += 1
            problems += check_maxout(argv)
        elif plain[:2] == ["mlflow", "run"]:
            counts["mlflow run"] += 1
            problems += check_mlflow_run(plain)
        elif plain[:1] == ["make"]:
            counts["make"] += 1
            problems += check_make(plain)
        else:
            counts["shell syntax only"] += 1
    return problems, counts


def check_usage(block: Block) -> list[str]:
    """Usage lines (``maxout audit [train's overrides] [--budget-s 600]``): the command exists, and so does every
    option it shows."""
    problems = []
    for line in block.source.splitlines():  # words as written: usage is no shell (`[train's overrides]`)
        words = line.split(" #")[0].replace("[", " ").replace("]", " ").split()
        argv = maxout_argv(words) if words else None
        if argv is None:
            problems += check_make(commands(line.split(" #")[0])[0]) if words[:1] == ["make"] else []
            continue
        command, path = parser(), []
        while argv and not argv[0].startswith("-"):
            sub = _subcommands(command)
            if argv[0] not in sub:
                break
            command = sub[argv[0]]
            path.append(argv.pop(0))
        if not path:
            problems.append(f"maxout {' '.join(argv)}: no such command")
            continue
        options = {o for a in command._actions for o in a.option_strings}
        problems += [f"maxout {' '.join(path)}: no option {w}" for w in argv if w.startswith("--")
                     and w.split("=")[0] not in options]
    return problems


def _subcommands(command: argparse.ArgumentParser) -> dict:
    return next((a.choices for a in command._actions if isinstance(a, argparse._SubParsersAction)), {})

"""The reference pages, written from the code at every build, so they cannot drift from it.

- ``reference/cli.md``: every command and option, read from ``maxout.cli.build_parser()`` (the real argparse tree);
- ``reference/config.md``: every config key with its type, default, valid values and comment, read from the typed
  dataclasses of ``maxout/config.py`` (types and defaults from the classes, comments and valid values from the
  source: the comment beside or above each field, the tuple its ``validate()`` checks it against);
- ``reference/hardware.md``: every hardware profile (``conf/hardware/*.yaml``) as one table;
- ``reference/optimizations.md``: every ``opt.*`` decision, the module that decides it, and the reason texts its
  ``supported``/``resolve`` functions (and the trainer's set-up) can give;
- ``reference/logged.md``: the params and metrics the code logs, found in its string literals.

docs/hooks/mkdocs_hooks.py hands these pages to mkdocs; tests/test_docs_reference.py checks them (and that every
config key has a comment). Nothing here imports torch: reading the code is enough.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import tokenize
import typing
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import yaml

import maxout
from maxout import config as config_module
from maxout.cli import build_parser
from maxout.optimizations import NAMES

PACKAGE = Path(maxout.__file__).parent
GENERATED_NOTE = "<!-- written by docs/hooks/gen_reference.py from the code at build time: edit the code, not this -->"


def cell(text: Any) -> str:
    """A value as one markdown table cell: no newline, no bare pipe."""
    return " ".join(str(text).split()).replace("|", "\\|")


def yaml_value(value: Any) -> str:
    """A default as a user writes it in an override (null, true, [a, b])."""
    if isinstance(value, str):
        return f'"{value}"' if value == "" else value
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


# ---------------------------------------------------------------------------------------------------- the CLI


class Command(NamedTuple):
    name: str  # "maxout registry list"
    help: str
    parser: argparse.ArgumentParser


def commands(parser: argparse.ArgumentParser, prefix: str = "maxout") -> Iterator[Command]:
    """Every command and sub-command, depth first, in the order the parser defines them."""
    for action in parser._actions:  # argparse keeps sub-commands as a _SubParsersAction among the actions
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield Command(f"{prefix} {name}", helps.get(name, ""), sub)
                yield from commands(sub, f"{prefix} {name}")


def _option_row(action: argparse.Action) -> str:
    name = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}` (positional)"
    if action.nargs in ("*", "?"):
        name += " (optional)" if action.option_strings == [] and action.nargs == "?" else ""
    takes = "" if action.nargs == 0 else (action.metavar or action.dest.upper())
    default = "" if action.default in (None, False, argparse.SUPPRESS) or action.nargs == 0 else action.default
    choices = ", ".join(map(str, action.choices)) if action.choices else ""
    required = "yes" if action.required else ""
    return (f"| {name} | {cell(takes)} | {cell(yaml_value(default) if default != '' else '')} | {cell(choices)} | "
            f"{required} | {cell(action.help or '')} |")


def cli_page() -> str:
    parser = build_parser()
    out = [GENERATED_NOTE, "# Command line", "",
           "Every command and option of `maxout`, read from its argparse parser (`maxout.cli.build_parser`). "
           "`maxout COMMAND --help` prints the same. Commands that take Hydra overrides take their options "
           "anywhere among them.", "", parser.description or "", ""]
    for cmd in [Command("maxout", "The entry point; `python -m maxout` is the same.", parser), *commands(parser)]:
        options = [a for a in cmd.parser._actions
                   if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
        out += [f"## `{cmd.name}`", "", cmd.help, "", "```text", cmd.parser.format_usage().strip(), "```", ""]
        if options:
            out += ["| argument | value | default | choices | required | what it does |",
                    "|---|---|---|---|---|---|", *(_option_row(a) for a in options), ""]
        if cmd.parser.epilog:
            out += ["```text", cmd.parser.epilog.strip(), "```", ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------- the config


class Key(NamedTuple):
    key: str  # hardware.precision
    type: str
    default: str
    valid: str
    comment: str


def _comments(source: str) -> dict[int, tuple[str, bool]]:
    """line -> (comment text, whether it stands on a line of its own)."""
    found = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            own_line = not tok.line[:tok.start[1]].strip()
            found[tok.start[0]] = (tok.string.lstrip("#").strip(), own_line)
    return found


def field_comments(cls: type, source: str | None = None) -> dict[str, str]:
    """Each field's comment in the source of ``cls`` (config.py's unless ``source`` is given): the one beside it, with
    the comment lines under it that go on in lower case, or else the block of comment lines just above it (a new
    sentence starts in upper case: that is how the source tells a block above the next field from the tail of the
    one beside this field)."""
    source = Path(config_module.__file__).read_text() if source is None else source
    comments = _comments(source)
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    items = [n for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    found: dict[str, str] = {}
    previous_end, previous_beside = node.lineno, None  # the field before, when a comment stands beside it
    for item in items:
        name = item.target.id
        above = [line for line in range(previous_end + 1, item.lineno) if line in comments and comments[line][1]]
        if previous_beside is not None:  # the tail of the previous field's comment
            while above and comments[above[0]][0][:1].islower():
                found[previous_beside] += " " + comments[above.pop(0)][0]
        beside = comments.get(item.end_lineno)
        beside = beside[0] if beside and not beside[1] else None
        text = beside or " ".join(comments[line][0] for line in above)
        if text:
            found[name] = text
        previous_end, previous_beside = item.end_lineno, name if beside else None
    return found


def _valid_values(cls: type) -> dict[str, tuple]:
    """field -> the tuple its ``validate()`` checks it with (``self.precision in PRECISIONS``)."""
    source = Path(config_module.__file__).read_text()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    found = {}
    for compare in ast.walk(node):
        if (isinstance(compare, ast.Compare) and isinstance(compare.ops[0], ast.In)
                and isinstance(compare.left, ast.Attribute) and isinstance(compare.left.value, ast.Name)
                and compare.left.value.id == "self" and isinstance(compare.comparators[0], ast.Name)):
            values = getattr(config_module, compare.comparators[0].id, None)
            if isinstance(values, tuple):
                found[compare.left.attr] = values
    return found


def _section(hint: Any) -> type | None:
    """The dataclass a field holds (``Optional[HpoConfig]`` too), or None."""
    union = typing.get_origin(hint) is typing.Union
    args = [a for a in typing.get_args(hint) if a is not type(None)] if union else [hint]
    return args[0] if len(args) == 1 and is_dataclass(args[0]) else None


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Union:
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(hint))
    if hint is Any:
        return "any"
    return getattr(hint, "__name__", str(hint))


def config_keys(cls: type = config_module.Config, prefix: str = "") -> list[Key]:
    """Every key of the config, dotted, sections walked in their field order."""
    hints = typing.get_type_hints(cls)
    comments, valid = field_comments(cls), _valid_values(cls)
    keys = []
    for f in fields(cls):
        section = _section(hints[f.name])
        if section is not None:
            keys += config_keys(section, f"{prefix}{f.name}.")
            if comments.get(f.name):  # a section's own comment (hpo: when it is on) is worth a row
                keys.append(Key(f"{prefix}{f.name}", "section or null" if f.default is None else "section",
                                yaml_value(f.default) if f.default is not MISSING else "",
                                "", comments[f.name]))
            continue
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        keys.append(Key(f"{prefix}{f.name}", _type_name(hints[f.name]), yaml_value(default),
                        ", ".join(map(str, valid.get(f.name, ()))), comments.get(f.name, "")))
    return keys


def config_page() -> str:
    out = [GENERATED_NOTE, "# Configuration keys", "",
           "Every key of the typed config (`platform/maxout/config.py`), with the dataclass default. A config group "
           "(`hardware=h100`, `model=tiny`, ...) sets its own values on top: [Config groups](config-groups.md), "
           "[Hardware profiles](hardware.md). Set any key with an override, `maxout train train.lr=3e-5`; "
           "`maxout train --cfg` prints the resolved config. Valid values are the ones `validate()` checks; the "
           "other checks (ranges, combinations) list every bad value at once before a run.", ""]
    keys = config_keys()
    for section in dict.fromkeys(k.key.split(".")[0] for k in keys):
        rows = [k for k in keys if k.key.split(".")[0] == section]
        out += [f"## `{section}`", "", "| key | type | default | valid values | what it does |",
                "|---|---|---|---|---|"]
        out += [f"| `{k.key}` | {cell(k.type)} | `{cell(k.default)}` | {cell(k.valid)} | {cell(k.comment)} |"
                for k in rows]
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------- hardware


def hardware_page() -> str:
    profiles = {p.stem: yaml.safe_load(p.read_text()) for p in sorted((PACKAGE / "conf" / "hardware").glob("*.yaml"))}
    names = ["auto", "cpu", "low_mem", "gpu"] + [n for n in profiles if n not in ("auto", "cpu", "low_mem", "gpu")]
    names = [n for n in names if n in profiles]
    keys = [f.name for f in fields(config_module.HardwareConfig) if f.name != "name"]
    out = [GENERATED_NOTE, "# Hardware profiles", "",
           "Every profile in `platform/maxout/conf/hardware/`, read from its YAML (each file comments its "
           "trade-offs). `hardware=auto` picks one from the device: a name in `match`, else `low_mem` for GPUs "
           "with at most `max_memory_gb`, else `gpu`, else `cpu`. A blank cell is the dataclass default "
           "([Configuration keys](config.md#hardware)). A setting the device cannot honour is turned off at run "
           "time with its reason ([Optimization decisions](optimizations.md)).", "",
           "| key | " + " | ".join(f"`{n}`" for n in names) + " |", "|---|" + "---|" * len(names)]
    for key in keys:
        row = [cell(yaml_value(profiles[n][key])) if key in profiles[n] else "" for n in names]
        out.append(f"| `{key}` | " + " | ".join(row) + " |")
    out.append("")
    for name in names:
        out += [f"## `{name}`", "", "```yaml", (PACKAGE / "conf" / "hardware" / f"{name}.yaml").read_text().rstrip(),
                "```", ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------- optimizations


def _text(node: ast.AST) -> str | None:
    """A reason as text: a string, or an f-string with its fields as ``{expression}``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}"
                       for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):  # reason + " -> fp32"
        left, right = _text(node.left), _text(node.right)
        if left is None and right is None:
            return None
        return (left or "{" + ast.unparse(node.left) + "}") + (right or "{" + ast.unparse(node.right) + "}")
    return None


def reasons(tree: ast.AST) -> list[str]:
    """Every reason text in ``tree``: ``(False, "...")`` and a Decision's fourth argument."""
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Tuple) and len(node.elts) == 2  # (False, "why"), returned or in an if-expression
                and isinstance(node.elts[0], ast.Constant) and node.elts[0].value is False):
            text = _text(node.elts[1])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Decision" and len(node.args) == 4:
            text = _text(node.args[3])
        else:
            continue
        if text:
            found.append(text)
    return list(dict.fromkeys(found))


class Decided(NamedTuple):
    name: str
    modules: list[str]  # optimizations/<module>.py that decide it or check its support
    reasons: list[str]


def _decision_name(call: ast.Call, constants: dict[str, str]) -> str | None:
    """The name a ``Decision(...)`` / ``decide(...)`` call records: a string, or a module constant (``NAME``)."""
    func = call.func.id if isinstance(call.func, ast.Name) else None
    if func in ("Decision", "decide") and call.args:
        first = call.args[0]
        if isinstance(first, ast.Constant):
            return first.value
        if isinstance(first, ast.Name):
            return constants.get(first.id)
    return None


def _constants(tree: ast.Module) -> dict[str, str]:
    return {n.targets[0].id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
            and isinstance(n.targets[0], ast.Name) and isinstance(n.value, ast.Constant)
            and isinstance(n.value.value, str)}


def _function_reasons(tree: ast.Module, func: ast.FunctionDef) -> list[str]:
    """The reasons of ``func`` and of the functions of its module it calls (resolve() asks supported())."""
    own = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    called = [own[c.func.id] for c in ast.walk(func) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
              and c.func.id in own and own[c.func.id] is not func]
    return reasons(func) + [r for f in called for r in reasons(f)]


def decisions() -> list[Decided]:
    """Each name of ``optimizations.NAMES``: the modules that decide it (a ``Decision("name", ...)`` in the module)
    or whose support check the trainer's set-up asks (``decide("name", ..., module.supported(...))`` in
    train/setup.py), and the reason texts of those functions and calls."""
    modules = {p.stem: ast.parse(p.read_text()) for p in sorted((PACKAGE / "optimizations").glob("*.py"))
               if p.stem not in ("__init__", "base")}
    found: dict[str, tuple[list[str], list[str]]] = {name: ([], []) for name in NAMES}
    for stem, tree in modules.items():
        constants = _constants(tree)
        own = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
        for func in own.values():
            calls = [(c, _decision_name(c, constants)) for c in ast.walk(func) if isinstance(c, ast.Call)]
            calls = [(c, name) for c, name in calls if name in found]
            several = len({name for _, name in calls}) > 1  # dataloader.resolve decides four: each call's own
            for call, name in calls:
                mods, texts = found[name]
                mods.append(stem)
                if not several:
                    texts += _function_reasons(tree, func)
                    continue
                texts += reasons(ast.Expression(call))
                checks = [a for a in call.args[2:3] if isinstance(a, ast.Call) and isinstance(a.func, ast.Name)]
                texts += [r for a in checks if a.func.id in own for r in reasons(own[a.func.id])]
    setup = ast.parse((PACKAGE / "train" / "setup.py").read_text())
    aliases = {a.asname or a.name: a.name for n in ast.walk(setup) if isinstance(n, ast.ImportFrom)
               and (n.module or "").endswith("optimizations") for a in n.names}
    for call in [c for c in ast.walk(setup) if isinstance(c, ast.Call)]:
        name = _decision_name(call, {})
        if name not in found:
            continue
        mods, texts = found[name]
        texts += reasons(ast.Expression(call)) if len(call.args) == 4 else []
        for inner in [c for c in ast.walk(call) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)]:
            module = aliases.get(getattr(inner.func.value, "id", ""))
            if module in modules:
                mods.append(module)
                func = next((f for f in modules[module].body if isinstance(f, ast.FunctionDef)
                             and f.name == inner.func.attr), None)
                texts += _function_reasons(modules[module], func) if func is not None else []
    return [Decided(name, list(dict.fromkeys(mods)), list(dict.fromkeys(texts)))
            for name, (mods, texts) in found.items()]


def optimizations_page() -> str:
    out = [GENERATED_NOTE, "# Optimization decisions", "",
           "Every optimization the trainer decides on, in the order a run logs them (`optimizations.NAMES`). Each "
           "run logs `opt.<name>.requested`, `opt.<name>.effective` and, when they differ, `opt.<name>.reason`: one "
           "of the texts below, with its `{fields}` filled in. The modules are in `platform/maxout/optimizations/`; "
           "why each falls back and what it buys: [How optimizations are decided](../explanation/optimizations.md).",
           "", "| decision | modules | reasons it can give |", "|---|---|---|"]
    found = decisions()
    for d in found:
        out.append(f"| [`{d.name}`](#{d.name}) | {', '.join(f'`{m}.py`' for m in d.modules)} | "
                   f"{len(d.reasons)} |")
    out.append("")
    for d in found:
        out += [f"## {d.name}", "", f"Params: `opt.{d.name}.requested`, `opt.{d.name}.effective`, "
                f"`opt.{d.name}.reason`. Decided in: {', '.join(f'`{m}.py`' for m in d.modules) or 'train/setup.py'}.",
                ""]
        for module in d.modules:
            doc = ast.get_docstring(ast.parse((PACKAGE / "optimizations" / f"{module}.py").read_text())) or ""
            out += [f"`{module}.py`: {doc.split(chr(10) + chr(10))[0].strip()}", ""] if doc else []
        out += ([f"- `{cell(r).replace('`', '')}`" for r in d.reasons] or ["No fallback: it runs as requested."])
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------- logged names

PARAM = re.compile(r"^(opt|cfg|device|dist|derived|batch_finder|hpo|best)\.[A-Za-z_<>{}.]+$")
METRIC = re.compile(r"^(train|eval|test|perf|mem|gpu|time|hpo|best|audit|cv|fold|benchmark)/[A-Za-z0-9_/<>{}]+$")
FILE_SUFFIX = re.compile(r"\.(json|csv|png|md|txt|yaml|pt|journal|lock|db)$")
DERIVED_ANY = re.compile(r"^derived\.<[^>]+>$")


def _derived_keys(tree: ast.AST) -> list[str]:
    """The keys of ``*.derived = {...}`` and ``*.derived[...] = ...`` (train/setup.py's derived numbers)."""
    keys = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            target = node.targets[0]
            if getattr(target, "attr", None) == "derived" and isinstance(node.value, ast.Dict):
                for inner in ast.walk(node.value):  # nested: **({"test_samples": ...} if ... else {}), comprehensions
                    if isinstance(inner, ast.Dict):
                        keys += [_text(k) or "" for k in inner.keys if k is not None]
                    elif isinstance(inner, ast.DictComp):
                        keys.append(_text(inner.key) or "")
            elif (isinstance(target, ast.Subscript) and getattr(target.value, "attr", None) == "derived"
                  and _text(target.slice)):
                keys.append(_text(target.slice))
    return [k for k in dict.fromkeys(keys) if k]


def _literal(node: ast.AST) -> str | None:
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "<" + ast.unparse(v.value) + ">"
                       for v in node.values)
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def logged_names() -> dict[str, dict[str, set[str]]]:
    """{"params" | "metrics": {name: {the modules that write it}}}, from the package's string literals."""
    found: dict[str, dict[str, set[str]]] = {"params": {}, "metrics": {}}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            text = _literal(node)
            # a file name, a prefix that is joined to more (``"gpu/rank_"``), or run.py's ``derived.<k>`` (the
            # derived keys themselves are read from set-up's dict below) is no name of its own
            if not text or FILE_SUFFIX.search(text) or text.endswith((".", "_")) or DERIVED_ANY.match(text):
                continue
            kind = "params" if PARAM.match(text) else "metrics" if METRIC.match(text) else None
            if kind:
                found[kind].setdefault(text, set()).add(module)
        for key in _derived_keys(tree):
            found["params"].setdefault(f"derived.{key}".replace("{", "<").replace("}", ">"), set()).add(module)
    found["params"].update({f"opt.{n}.{part}": {"optimizations/__init__.py"} for n in NAMES
                            for part in ("requested", "effective", "reason")})
    found["params"].update({f"cfg.{k.key}": {"config.py"} for k in config_keys()
                            if not k.key.startswith(("hpo", "debug", "resume")) and k.type != "section"})
    return found


def logged_page() -> str:
    found = logged_names()
    out = [GENERATED_NOTE, "# Logged params and metrics", "",
           "Every param and metric name the code writes, found in its string literals (`<...>` is a part filled in "
           "at run time: a label, a rank, a config key), with the modules that write it. `cfg.*` is every config "
           "key ([Configuration keys](config.md)), `opt.*` every decision ([Optimization decisions]"
           "(optimizations.md)). Names the code builds from parts (`test/*` from `eval/*`, the per-class "
           "`eval/<score>/<label>`, `best/<metric>`) and what each one means: [What a run logs](what-a-run-logs.md).",
           ""]
    for kind, title in (("params", "Params"), ("metrics", "Metrics")):
        names = found[kind]
        out += [f"## {title}", ""]
        for prefix in dict.fromkeys(re.split(r"[./]", n)[0] for n in sorted(names)):
            rows = sorted(n for n in names if re.split(r"[./]", n)[0] == prefix)
            out += [f"### `{prefix}{'.' if kind == 'params' else '/'}*` ({len(rows)})", "",
                    "| name | written by |", "|---|---|"]
            out += [f"| `{cell(n)}` | {', '.join(f'`{m}`' for m in sorted(names[n]))} |" for n in rows]
            out.append("")
    return "\n".join(out)


PAGES = {
    "reference/cli.md": cli_page,
    "reference/config.md": config_page,
    "reference/hardware.md": hardware_page,
    "reference/optimizations.md": optimizations_page,
    "reference/logged.md": logged_page,
}

"""The house keeps its shape: the imports are read from the code (ast) and checked against the rules each room
states in its own docstring, a line ``May import: a, b, c.``

A room is a top-level module (``config.py``) or a package (``train/``, whose rules are in ``train/__init__.py``).
An import counts wherever it stands (module level, inside a function, under ``if TYPE_CHECKING``), and importing
``maxout.x.y`` from outside ``x`` also runs the package ``maxout.x`` first, so it counts as an import of that too.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "platform" / "maxout"
RULE = re.compile(r"May import:\s*(?P<rooms>[^.]*)\.")
LAZY = "lazy:"  # what a function-level import's comment must say: why it is not at the top
GROUND_FLOOR = {"errors", "paths", "cells", "config", "hardware", "optimizations", "metrics"}


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    target: str  # dotted module name inside the package
    line: int


class House:
    """One package's modules, imports, rooms and rules, read from its files."""

    def __init__(self, package: Path):
        self.package, self.name = package, package.name
        self.modules = {self._module(p): p for p in sorted(package.rglob("*.py"))}
        self.imports = [imp for name, path in self.modules.items() for imp in self._imports(name, path)]
        self.rooms = {self.room(m) for m in self.modules}
        self.rules = {room: self._rule(room) for room in self.rooms}

    def _module(self, path: Path) -> str:
        parts = list(path.relative_to(self.package.parent).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    def room(self, module: str) -> str:
        """``maxout.train.loop`` -> ``train``; ``maxout.config`` -> ``config``; ``maxout`` -> ``maxout``."""
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else parts[0]

    def _imports(self, name: str, path: Path) -> list[Import]:
        found = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in self.modules else base for a in node.names]
            else:
                continue
            for target in targets:
                if target == self.name or target.startswith(self.name + "."):
                    while target not in self.modules:  # `from maxout.x import Name`: the module holding Name
                        target = target.rsplit(".", 1)[0]
                    found.append(Import(name, target, node.lineno))
        return found

    def _rule(self, room: str) -> set[str]:
        holder = self.modules[self.name if room == self.name else f"{self.name}.{room}"]
        match = RULE.search(ast.get_docstring(ast.parse(holder.read_text())) or "")
        if not match:
            return {"<no 'May import:' line in its docstring>"}
        listed = re.sub(r"\([^)]*\)", "", match["rooms"]).replace("\n", " ")  # (asides) are prose
        allowed = {r.strip() for r in listed.split(",") if r.strip()}
        return set() if allowed == {"nothing"} else allowed

    def graph(self) -> dict[str, set[str]]:
        """Module -> the modules its imports run: each target, and each package above it that the importer is not
        already inside."""
        out: dict[str, set[str]] = {m: set() for m in self.modules}
        for imp in self.imports:
            parts = imp.target.split(".")
            for depth in range(2, len(parts) + 1):
                target = ".".join(parts[:depth])
                if target != imp.importer and not imp.importer.startswith(target + "."):
                    out[imp.importer].add(target)
        return out

    def cycles(self) -> list[list[str]]:
        """Strongly connected components of more than one module (Tarjan)."""
        graph, index, low, stack, on_stack, found = self.graph(), {}, {}, [], set(), []

        def visit(v: str) -> None:
            index[v] = low[v] = len(index)
            stack.append(v)
            on_stack.add(v)
            for w in sorted(graph[v]):
                if w not in index:
                    visit(w)
                    low[v] = min(low[v], low[w])
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                component = []
                while not component or component[-1] != v:
                    component.append(stack.pop())
                    on_stack.discard(component[-1])
                if len(component) > 1:
                    found.append(sorted(component))

        for v in sorted(graph):
            if v not in index:
                visit(v)
        return found

    def broken_rules(self) -> list[str]:
        """Each import its room's rules do not allow, and each rule that names no room."""
        broken = [f"{room}: may import {sorted(allowed)}" for room, allowed in self.rules.items()
                  if allowed - self.rooms - {"anything"}]
        for imp in self.imports:
            room, allowed = self.room(imp.importer), self.rules[self.room(imp.importer)]
            target = self.room(imp.target)
            if target != room and target != self.name and target not in allowed and "anything" not in allowed:
                broken.append(f"{imp.importer}:{imp.line} imports {imp.target} ({room} may import "
                              f"{', '.join(sorted(allowed)) or 'nothing'})")
        return broken

    def unexplained_lazy_imports(self) -> list[str]:
        """Function-level imports without a ``# lazy: why`` comment on their line, on another line of their run of
        consecutive imports, or on the line just above that run."""
        found: set[str] = set()  # a set: a nested function's imports are seen from the outer one too
        for path in self.modules.values():
            lines = path.read_text().splitlines()
            for fn in ast.walk(ast.parse("\n".join(lines))):
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for run in _import_runs(fn):
                        first, last = run[0].lineno, run[-1].end_lineno
                        if not any(LAZY in line for line in lines[max(first - 2, 0):last]):
                            found.add(f"{path.relative_to(self.package.parent)}:{first}")
        return sorted(found)


def _import_runs(fn: ast.AST) -> list[list[ast.stmt]]:
    """Runs of consecutive import statements in every statement list inside ``fn``."""
    runs = []
    for node in ast.walk(fn):
        for field in ("body", "orelse", "finalbody"):
            current: list[ast.stmt] = []
            block = getattr(node, field, None)
            for stmt in block if isinstance(block, list) else []:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    current.append(stmt)
                elif current:
                    runs.append(current)
                    current = []
            runs += [current] if current else []
    return runs


HOUSE = House(PACKAGE)


def test_no_import_cycle_between_modules():
    assert HOUSE.cycles() == []


@pytest.mark.parametrize("room", sorted(HOUSE.rooms))
def test_room_imports_only_what_its_docstring_allows(room):
    assert [b for b in HOUSE.broken_rules() if b.startswith((f"{room}:", f"maxout.{room}:", f"maxout.{room}."))
            or (room == "maxout" and b.startswith("maxout:"))] == []


def test_the_floors_as_the_readme_draws_them():
    for room in GROUND_FLOOR:
        assert HOUSE.rules[room] <= GROUND_FLOOR, f"{room} is on the ground floor but may import {HOUSE.rules[room]}"
    assert not HOUSE.rules["optimizations"] & {"config", "hardware"}
    assert not HOUSE.rules["tracking"] & {"registry", "train", "hpo", "insight", "cli"}
    assert "tracking" not in HOUSE.rules["serving"]
    assert not HOUSE.rules["registry"] & {"train", "hpo"}
    assert not HOUSE.rules["train"] & {"loading", "cli", "hpo", "insight", "registry"}
    assert [room for room, allowed in HOUSE.rules.items() if "cli" in allowed] == ["__main__"]


def test_every_function_level_import_says_why_it_is_lazy():
    assert HOUSE.unexplained_lazy_imports() == []


def test_no_platform_init_hides_the_stdlib_platform_module():
    assert not (PACKAGE.parent / "__init__.py").exists()


def test_the_checks_find_a_cycle_a_broken_rule_and_an_unexplained_lazy_import(tmp_path):
    """The same checks on a made-up house that breaks each rule once: they must be able to fail."""
    files = {
        "__init__.py": '"""Root. May import: nothing."""\n',
        "errors.py": '"""Ground floor. May import: nothing."""\n',
        "config.py": '"""Ground floor. May import: errors."""\nfrom .errors import E\n\n\n'
                     'def load():\n    from .train import run  # lazy: start-up\n',
        "train/__init__.py": '"""Train wing. May import: errors, config (an aside)."""\nfrom .run import x\n',
        "train/run.py": 'from ..config import load\n\n\ndef f():\n    import json\n',
    }
    for name, text in files.items():
        (tmp_path / "maxout" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "maxout" / name).write_text(text)
    house = House(tmp_path / "maxout")
    assert house.rules["train"] == {"errors", "config"} and house.rules["errors"] == set()
    assert house.cycles() == [["maxout.config", "maxout.train", "maxout.train.run"]]
    assert house.broken_rules() == ["maxout.config:6 imports maxout.train.run (config may import errors)"]
    assert house.unexplained_lazy_imports() == ["maxout/train/run.py:5"]

"""The GPU report's sections: what each needs, how long it may take, and how one runs.

A section is a function ``run(ctx)`` that measures one claim and records what it found with ``ctx.record(key,
value)``, plus how to show it (``markdown(results)``, ``chart(results, path)``). ``benchmarks/gpu/sections``
lists them in order of value; another issue adds its own by appending a Section there.

Each section runs in its own process (``python -m benchmarks.gpu_report --child NAME``): a CUDA error, an
out-of-memory search or a hung compile cannot take the others down, and the report kills it at its time limit.
Every ``record`` is written to disk at once (a temp file, then a rename), so a section that is killed or crashes
still leaves what it had measured. A section that raises is marked failed with the first line of its error.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from maxout.errors import first_line

SCALES = ("full", "smoke")  # full: the real models (GPU); smoke: tiny models, a few steps (CPU, CI)


@dataclass(frozen=True)
class Section:
    name: str
    title: str
    run: Callable[["Context"], None]
    needs: tuple = ()  # "cuda", or importable modules ("accelerate", "pytest", ...)
    min_s: dict = field(default_factory=lambda: {"full": 30, "smoke": 5})  # not started with less time left
    max_s: dict = field(default_factory=lambda: {"full": 120, "smoke": 120})  # killed after this long
    markdown: Optional[Callable[[dict], str]] = None
    chart: Optional[Callable[[dict, Path], bool]] = None  # draws a PNG; False: nothing to draw
    why_cuda: str = "needs a CUDA device"  # the skip reason where none is visible


@dataclass(frozen=True)
class Plan:
    """One device call: which sections, in registry order, each at most ``limits[name]`` seconds (None: whatever the
    budget has left), within ``budget_s`` for the whole command. A GPU machine is lent for 15 minutes in all (its
    start, the transfers and the idle gaps count), so the report is two calls planned to fit, not one long one."""

    name: str
    budget_s: float
    limits: dict  # section name -> seconds at most, or None for what is left
    what: str = ""

    @property
    def sections(self) -> list[str]:
        return list(self.limits)


@dataclass
class Context:
    """What a section runs with: the scale, a scratch folder shared by all sections, the results of the sections
    before it, its deadline, and the file its records go to."""

    name: str
    scale: str
    work: Path
    previous: dict
    deadline: float  # time.time() by which the section must be done (the report kills it then)
    result_file: Path
    results: dict = field(default_factory=dict)

    @property
    def full(self) -> bool:
        return self.scale == "full"

    def left(self) -> float:
        """Seconds until the deadline."""
        return self.deadline - time.time()

    def record(self, key: str, value: Any) -> None:
        self.results[key] = value
        self.save("running")

    def save(self, status: str, **extra: Any) -> None:
        payload = {"status": status, "results": self.results, **extra}
        tmp = self.result_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, indent=1, default=str))
        os.replace(tmp, self.result_file)


def run_child(section: Section, ctx: Context) -> int:
    """The child process's side: run the section and leave its status and results in ``ctx.result_file``."""
    ctx.save("running")
    try:
        section.run(ctx)
    except BaseException as err:  # noqa: BLE001 - whatever it is, it goes into the report as one line
        ctx.save("failed", error=f"{type(err).__name__}: {first_line(err)}", traceback=traceback.format_exc()[-4000:])
        return 1
    ctx.save("ok")
    return 0

"""Stand-in sections for tests/test_gpu_report.py: each behaves like a real section that works, fails, hangs, crashes or
cannot run, in a child process of the real report runner, in seconds."""

from __future__ import annotations

import os
import time
from pathlib import Path

from benchmarks.gpu.registry import Context, Plan, Section


def works(ctx: Context) -> None:
    ctx.record("value", 42)
    ctx.record("previous", sorted(ctx.previous))  # what the sections before it left
    ctx.record("parent", os.getppid())  # the runner's pid, or the tests' warm server's (tests/warm_maxout.py)
    ctx.record("own_group", os.getpgid(0) == os.getpid())  # the runner's kill at its limit ends the group whole


def raises(ctx: Context) -> None:
    ctx.record("half", "done")
    raise ValueError("boom\nthe second line stays out of the report")


def hangs(ctx: Context) -> None:
    ctx.record("pid", os.getpid())
    if os.environ.get("FAKE_PID_FILE"):  # a test that kills the runner itself ends this process afterwards
        Path(os.environ["FAKE_PID_FILE"]).write_text(str(os.getpid()))
    ctx.record("first", "measured")
    time.sleep(120)


def crashes(ctx: Context) -> None:
    ctx.record("before", "the crash")
    os._exit(3)  # like a segfault in a CUDA kernel: no exception, no status


def chart(results: dict, path: Path) -> bool:
    from benchmarks.gpu.sections.charts import bars

    return bars(path, ["value"], {"measured": [results["value"]]}, "units", "a stand-in")


def markdown(results: dict) -> str:
    return f"| value |\n|---|\n| {results['value']} |"


FAST = {"full": 1, "smoke": 1}
SECTIONS = [
    Section("works", "Works", works, min_s=FAST, max_s={"full": 60, "smoke": 60}, markdown=markdown, chart=chart),
    Section("raises", "Raises", raises, min_s=FAST),
    # 8 s: the hung section's own fresh process must record its first figure before its limit, even on a loaded
    # machine (a limit of 3 s left ~2 s for that, and the message then lost "what it recorded before is kept")
    Section("hangs", "Hangs", hangs, min_s=FAST, max_s={"full": 8, "smoke": 8}),
    Section("crashes", "Crashes", crashes, min_s=FAST),
    Section("needs_gpu", "Needs a GPU", works, needs=("cuda",), min_s=FAST, why_cuda="needs a CUDA device, here"),
    Section("needs_lib", "Needs a library", works, needs=("no_such_library_here",), min_s=FAST),
    Section("late", "Comes too late", works, min_s={"full": 10_000, "smoke": 10_000}),
]
PLANS = (Plan("quick", budget_s=60, limits={"works": 30, "hangs": 2, "needs_gpu": None}),
         # the hung section for as long as a test needs it running: a runner killed mid-section
         Plan("hold", budget_s=600, limits={"works": 30, "hangs": 600}))

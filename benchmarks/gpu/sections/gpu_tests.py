"""2. ``pytest -m gpu``: pass or fail per test, from pytest's JUnit XML (or, when the run was cut short, its
verbose lines so far).

Every test must be reached within the call's minutes (the H200 run reached 11 of 20 in 195 s, one after another):
the tests run in WORKERS pytest-xdist processes sharing the GPU (16 cores: their compiles overlap), and each test is
stopped at its own limit (pytest-timeout) so one slow test cannot starve the rest. Both plugins are on the GPU image;
without them the run is serial and unbounded per test."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from ..registry import Context, Section

ROOT = Path(__file__).resolve().parents[3]
# "tests/t.py::test PASSED [ 50%]" (serial) or "[gw0] [ 50%] PASSED tests/t.py::test" (xdist)
VERBOSE_LINE = re.compile(r"^(?:(?P<id>\S+::\S+) (?P<outcome>PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)|"
                          r"\[gw\d+\] \[\s*\d+%\] (?P<outcome2>PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) "
                          r"(?P<id2>\S+::\S+))")
# pytest-xdist's -v names each test as it hands it to a worker, alone on a line: a test named so with no outcome line
# was still running when the run was cut
STARTED_LINE = re.compile(r"^(?P<id>tests/\S+::\S+)\s*$")
WORKERS = 4
TEST_LIMIT_S = 75


def gpu_test_files(root: Path = ROOT) -> list[Path]:
    """The test files that hold gpu-marked tests (collecting the others would import what the GPU machine lacks:
    moto, boto3, the Docker SDK)."""
    return [p for p in sorted((root / "tests").glob("test_*.py")) if "mark.gpu" in p.read_text()]


def parse_junit(path: Path) -> list[dict]:
    """One row per test case: id, outcome (passed / failed / error / skipped), seconds, first line of the message."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = {"failure": "failed"}.get(kind, kind)
                message = ((found.get("message") or found.text or "").strip().splitlines() or [""])[0][:300]
                break
        module = case.get("classname", "").replace(".", "/")
        rows.append({"id": f"{module}.py::{case.get('name')}", "outcome": outcome,
                     "seconds": float(case.get("time", 0.0)), "message": message})
    return rows


def parse_verbose(output: str) -> list[dict]:
    """Rows from ``pytest -v`` lines (what a run that was killed had printed)."""
    return [{"id": m["id"] or m["id2"], "outcome": (m["outcome"] or m["outcome2"]).lower(), "seconds": None,
             "message": ""} for m in map(VERBOSE_LINE.match, output.splitlines()) if m]


def unfinished(output: str, finished: list[dict]) -> list[str]:
    """The tests ``pytest -v`` started in ``output`` that have no outcome among ``finished`` (in the order started)."""
    done = {r["id"] for r in finished}
    started = (m["id"] for m in map(STARTED_LINE.match, output.splitlines()) if m)
    return [test for test in dict.fromkeys(started) if test not in done]


def parallel_options(workers: int, test_limit_s: float | None) -> list[str]:
    """pytest-xdist's and pytest-timeout's options, each where its plugin is installed."""
    import importlib.util

    options = []
    if workers > 1 and importlib.util.find_spec("xdist") is not None:
        options += ["-n", str(workers)]
    if test_limit_s and importlib.util.find_spec("pytest_timeout") is not None:
        options += [f"--timeout={test_limit_s:.0f}"]
    return options


def run_pytest(files: list[Path], junit: Path, timeout: float, marker: str = "gpu", cwd: Path = ROOT,
               options: tuple = ()) -> dict:
    """Run pytest on ``files`` with ``-m marker`` in a subprocess; the per-test rows and a summary."""
    command = [sys.executable, "-m", "pytest", "-m", marker, "-v", "-p", "no:cacheprovider", f"--junitxml={junit}",
               "-o", "junit_family=xunit2", *options, *map(str, files)]
    # deterministic tests need cuBLAS's fixed workspace before the process's first matmul, whichever test runs first.
    # The command is the whole of what this pytest runs: a PYTEST_ADDOPTS of the caller's (a plugin, -x, a timing
    # file) is left out, as it would change what the report counts.
    env = {**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},
           "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8")}
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        output, code = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or ""), None
    rows = parse_junit(junit) if code is not None and junit.exists() else parse_verbose(output)
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("passed", "failed", "error", "skipped")}
    running = unfinished(output, rows) if code is None else []
    return {"tests": rows, "summary": {**counts, "exit_code": code, "timed_out": code is None,
                                       **({"unfinished": running} if running else {}),
                                       "files": [str(f.relative_to(cwd)) for f in files],
                                       **({"options": list(options)} if options else {})},
            "output_tail": output.splitlines()[-30:]}


def run(ctx: Context) -> None:
    # Each worker compiles with its share of the cores (the report set the threads to all of them).
    threads = max(int(os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", os.cpu_count() or 1)) // WORKERS, 1)
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = str(threads)
    limit = min(TEST_LIMIT_S, max(ctx.left() - 20, 10))
    result = run_pytest(gpu_test_files(), ctx.work / "gpu-tests.xml", timeout=max(ctx.left() - 10, 10),
                        options=tuple(parallel_options(WORKERS if ctx.full else 1, limit)))
    ctx.record("summary", result["summary"])
    ctx.record("tests", result["tests"])
    if result["summary"]["failed"] or result["summary"]["error"] or result["summary"]["timed_out"]:
        ctx.record("output_tail", result["output_tail"])


def markdown(results: dict) -> str:
    s = results.get("summary", {})
    head = (f"{s.get('passed', 0)} passed, {s.get('failed', 0)} failed, {s.get('error', 0)} errors, "
            f"{s.get('skipped', 0)} skipped (pytest exit code {s.get('exit_code')}"
            f"{', cut at the time limit' if s.get('timed_out') else ''}); files: {', '.join(s.get('files', []))}"
            + (f"; options `{' '.join(s['options'])}`" if s.get("options") else ""))
    if s.get("unfinished"):
        head += "; still running when cut: " + ", ".join(f"`{t}`" for t in s["unfinished"])
    lines = [head, "", "| test | outcome | seconds | message |", "|---|---|---|---|"]
    for t in results.get("tests", []):
        seconds = f"{t['seconds']:.1f}" if t["seconds"] is not None else "–"
        lines.append(f"| `{t['id']}` | {t['outcome']} | {seconds} | {t['message'].replace('|', '/')} |")
    return "\n".join(lines)


SECTION = Section("gpu_tests", "pytest -m gpu", run, needs=("cuda", "pytest"),
                  min_s={"full": 60, "smoke": 30}, max_s={"full": 150, "smoke": 120}, markdown=markdown,
                  why_cuda="needs a CUDA device: every gpu-marked test would skip")

"""2. ``pytest -m gpu``: pass or fail per test, from pytest's JUnit XML (or, when the run was cut short, its
verbose lines so far)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from ..registry import Context, Section

ROOT = Path(__file__).resolve().parents[3]
VERBOSE_LINE = re.compile(r"^(?P<id>\S+::\S+) (?P<outcome>PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")


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
    return [{"id": m["id"], "outcome": m["outcome"].lower(), "seconds": None, "message": ""}
            for m in map(VERBOSE_LINE.match, output.splitlines()) if m]


def run_pytest(files: list[Path], junit: Path, timeout: float, marker: str = "gpu", cwd: Path = ROOT) -> dict:
    """Run pytest on ``files`` with ``-m marker`` in a subprocess; the per-test rows and a summary."""
    command = [sys.executable, "-m", "pytest", "-m", marker, "-v", "-p", "no:cacheprovider", f"--junitxml={junit}",
               "-o", "junit_family=xunit2", *map(str, files)]
    # deterministic tests need cuBLAS's fixed workspace before the process's first matmul, whichever test runs first
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8")}
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        output, code = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or ""), None
    rows = parse_junit(junit) if code is not None and junit.exists() else parse_verbose(output)
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("passed", "failed", "error", "skipped")}
    return {"tests": rows, "summary": {**counts, "exit_code": code, "timed_out": code is None,
                                       "files": [str(f.relative_to(cwd)) for f in files]},
            "output_tail": output.splitlines()[-30:]}


def run(ctx: Context) -> None:
    result = run_pytest(gpu_test_files(), ctx.work / "gpu-tests.xml", timeout=max(ctx.left() - 15, 10))
    ctx.record("summary", result["summary"])
    ctx.record("tests", result["tests"])
    if result["summary"]["failed"] or result["summary"]["error"] or result["summary"]["timed_out"]:
        ctx.record("output_tail", result["output_tail"])


def markdown(results: dict) -> str:
    s = results.get("summary", {})
    head = (f"{s.get('passed', 0)} passed, {s.get('failed', 0)} failed, {s.get('error', 0)} errors, "
            f"{s.get('skipped', 0)} skipped (pytest exit code {s.get('exit_code')}"
            f"{', cut at the time limit' if s.get('timed_out') else ''}); files: {', '.join(s.get('files', []))}")
    lines = [head, "", "| test | outcome | seconds | message |", "|---|---|---|---|"]
    for t in results.get("tests", []):
        seconds = f"{t['seconds']:.1f}" if t["seconds"] is not None else "–"
        lines.append(f"| `{t['id']}` | {t['outcome']} | {seconds} | {t['message'].replace('|', '/')} |")
    return "\n".join(lines)


SECTION = Section("gpu_tests", "pytest -m gpu", run, needs=("cuda", "pytest"),
                  min_s={"full": 60, "smoke": 30}, max_s={"full": 210, "smoke": 120}, markdown=markdown,
                  why_cuda="needs a CUDA device: every gpu-marked test would skip")

"""Where the suite's wall time goes: a summary of the JUnit XML that ``make test`` writes (build/test-results.xml),
optionally with the machine's CPU use sampled from /proc/stat while it ran.

    .venv/bin/python -m benchmarks.suite_time sample --out build/cpu.log &      # before make test; kill it after
    .venv/bin/python -m benchmarks.suite_time summary [--junit build/test-results.xml] [--cpu build/cpu.log]
                                                      [--workers 2] [--top 25]

Why: the suite's goal is 15 minutes on CI's 2 cores, and CI draws machines whose CPUs differ by 2.5x (an AVX-512
one ran a fresh clone's .ci/run in 687 s, a Zen 1 one in 1932 s, the same commit). pytest's ``--durations`` names
the slowest tests only; what decides where time can be cut is how it is spread: how much the few slowest hold, which
modules, whether the xdist workers were busy the whole run (summed test time / workers against pytest's wall; test
time includes a test's fixtures' set-up), and whether the cores were (a suite bound by the CPU gains nothing from
more workers or from shorter waits, only from less work).

Standard library only: it reads files, and runs where the suite ran.
"""

from __future__ import annotations

import argparse
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from datetime import datetime
from pathlib import Path

THRESHOLDS_S = (60, 30, 15, 5, 1)


def cases(junit: Path) -> tuple[list[tuple[float, str]], float, float | None]:
    """(seconds, test id) of every test case, slowest first; pytest's wall seconds (the testsuite's time); and the
    unix time it started (the testsuite's local timestamp), None where the file has none."""
    root = ET.parse(junit).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    found = [(float(c.get("time", 0)), f"{c.get('classname')}::{c.get('name')}") for c in root.iter("testcase")]
    stamp = suite.get("timestamp") if suite is not None else None
    started = datetime.fromisoformat(stamp).timestamp() if stamp else None
    return sorted(found, reverse=True), float(suite.get("time", 0)) if suite is not None else 0.0, started


def cpu_busy(samples: list[tuple[float, list[int]]], start: float | None = None,
             end: float | None = None) -> float | None:
    """Share of the machine's CPU time that was not idle (idle + iowait) between the first and last sample inside
    [start, end] (pytest's own window, where known: not the install before it)."""
    samples = [(t, v) for t, v in samples if (start is None or t >= start) and (end is None or t <= end)]
    if len(samples) < 2:
        return None
    first, last = samples[0][1], samples[-1][1]
    deltas = [b - a for a, b in zip(first, last)]
    total = sum(deltas[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user)
    return 1 - (deltas[3] + deltas[4]) / total if total else None


def read_samples(path: Path) -> list[tuple[float, list[int]]]:
    """Lines of ``<unix time> cpu <user> <nice> ...`` (what ``sample`` writes)."""
    out = []
    for line in path.read_text().splitlines():
        words = line.split()
        if len(words) > 5 and words[1] == "cpu":
            out.append((float(words[0]), [int(w) for w in words[2:]]))
    return out


def summary(found: list[tuple[float, str]], wall_s: float, workers: int, top: int,
            busy: float | None = None) -> str:
    summed = sum(s for s, _ in found)
    lines = [f"{len(found)} tests, {summed:.0f} s of test time summed, pytest's wall {wall_s:.0f} s"]
    if wall_s:
        lines.append(f"workers busy: {summed / workers:.0f} s each on average of {wall_s:.0f} s "
                     f"({summed / workers / wall_s:.0%}), {workers} workers")
    if busy is not None:
        lines.append(f"CPU busy (all cores, /proc/stat samples inside pytest's window): {busy:.0%}")
    lines.append("")
    lines.append("| tests at least | count | seconds | share |")
    lines.append("|---|---|---|---|")
    for limit in THRESHOLDS_S:
        picked = [s for s, _ in found if s >= limit]
        lines.append(f"| {limit} s | {len(picked)} | {sum(picked):.0f} | {sum(picked) / summed:.0%} |"
                     if summed else f"| {limit} s | 0 | 0 | - |")
    modules: Counter = Counter()
    for seconds, test in found:
        modules[test.split("::")[0]] += seconds
    lines += ["", f"slowest {top} tests:"] + [f"{s:8.1f}  {t}" for s, t in found[:top]]
    lines += ["", f"slowest {top} modules:"] + [f"{s:8.1f}  {m}" for m, s in modules.most_common(top)]
    return "\n".join(lines)


def sample(out: Path, every_s: float, count: int | None = None) -> None:
    """Append /proc/stat's cpu line to ``out`` every ``every_s`` seconds: ``count`` lines, or until killed."""
    written = 0
    with out.open("a") as f:
        while count is None or written < count:
            with open("/proc/stat") as stat:
                f.write(f"{time.time():.1f} {stat.readline()}")
            f.flush()
            written += 1
            if count is None or written < count:
                time.sleep(every_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sample", help="append /proc/stat's cpu line to --out every --every-s seconds, until killed")
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--every-s", type=float, default=10.0)
    r = sub.add_parser("summary", help="summarize a pytest JUnit XML (and a sample log)")
    r.add_argument("--junit", type=Path, default=Path("build/test-results.xml"))
    r.add_argument("--cpu", type=Path, help="what `sample` wrote while the suite ran")
    r.add_argument("--workers", type=int, default=2, help="pytest-xdist workers the suite ran with")
    r.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    if args.command == "sample":
        sample(args.out, args.every_s)
        return 0
    if not args.junit.is_file():
        print(f"suite_time: --junit {args.junit}: no such file (make test writes build/test-results.xml)",
              file=sys.stderr)
        return 2
    found, wall, started = cases(args.junit)
    busy = (cpu_busy(read_samples(args.cpu), started, started + wall if started is not None else None)
            if args.cpu else None)
    print(summary(found, wall, args.workers, args.top, busy))
    return 0


if __name__ == "__main__":
    sys.exit(main())

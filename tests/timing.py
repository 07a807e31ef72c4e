"""Where the suite's time goes: a pytest plugin that splits each test's wall time by cause (issue 36's table).

    pytest -p tests.timing --timing-out=build/timing.json        # then: python -m tests.timing build/timing.json

Per test, measured in the test's own process (each xdist worker reports its own tests):
- ``subprocess:<kind>``: time the test was blocked waiting on a child process (``subprocess.run``, ``wait``,
  ``communicate``), by what the child is: a ``maxout`` CLI, ``torchrun``, ``mlflow run``, ``docker``, a server's
  set-up command (``initdb``, ``pg_ctl``), or ``other``;
- ``sleep:<kind>``: ``time.sleep`` in the test's thread, by who slept: a server coming up (``servers``: the
  PostgreSQL/mlflow/moto/olah/nginx/dockerd waits of tests/services.py, hub_server.py, stack.py, docker_engine.py),
  or anything else (``waits``: polling for a file, a process, a run);
- ``in-process``: the rest (training steps, imports, Hydra, MLflow client calls, ...);
- the CPU seconds of this process and of its reaped children during the test (``cpu_self``, ``cpu_children``; the
  commands tests/warm_maxout.py forks count as children):
  on 2 cores, the CPU a test asks for is what parallel runs must share.

Nothing here changes what a test does; it only reads clocks around calls that already happen.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests import warm_maxout  # its commands' processes are its server's children: timed and counted here

SERVER_WAITERS = {"wait_http", "_wait_port", "_start_daemon", "wait_port", "wait_for_port", "postgres",
                  "mlflow_server", "moto_s3", "hub_server", "gated", "server_process", "s3_process"}


class _Clock:
    def __init__(self) -> None:
        self.current: collections.Counter | None = None
        self.sleepers: collections.Counter = collections.Counter()  # who slept: "file:function", this test
        self.main = threading.main_thread()

    def add(self, key: str, seconds: float) -> None:
        if self.current is not None and threading.current_thread() is self.main:
            self.current[key] += seconds


CLOCK = _Clock()


def _kind(args) -> str:
    words = [str(a) for a in (args if isinstance(args, (list, tuple)) else [args])]
    text = " ".join(words)
    base = os.path.basename(words[0]) if words else ""
    if "torchrun" in text or "torch.distributed.run" in text:
        return "torchrun"
    if ("-m" in words and "maxout" in words) or base == "maxout":
        return "maxout"
    if "mlflow" in words and "run" in words:
        return "mlflow-run"
    if base == "docker" or base == "setpriv":
        return "docker"
    if any(w in text for w in ("initdb", "pg_ctl", "psql")):
        return "postgres"
    if "make" == base:
        return "make"
    if base.startswith("python") or words[:1] == [sys.executable]:
        return "python"
    return "other"


def _patch() -> None:
    real_sleep = time.sleep
    real_wait, real_communicate = subprocess.Popen.wait, subprocess.Popen.communicate

    def sleep(seconds):
        start = time.perf_counter()
        try:
            real_sleep(seconds)
        finally:
            frame, kind = sys._getframe(1), "waits"
            caller = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"
            if CLOCK.current is not None and threading.current_thread() is CLOCK.main:
                CLOCK.sleepers[caller] += time.perf_counter() - start
            for _ in range(6):
                if frame is None:
                    break
                if frame.f_code.co_name in SERVER_WAITERS:
                    kind = "servers"
                    break
                frame = frame.f_back
            CLOCK.add(f"sleep:{kind}", time.perf_counter() - start)

    def timed(real):
        def call(self, *args, **kwargs):
            if getattr(self, "_maxout_timing", False):  # communicate() calls wait(): count once
                return real(self, *args, **kwargs)
            self._maxout_timing = True
            start = time.perf_counter()
            try:
                return real(self, *args, **kwargs)
            finally:
                self._maxout_timing = False
                CLOCK.add(f"subprocess:{_kind(self.args)}", time.perf_counter() - start)
        return call

    time.sleep = sleep
    subprocess.Popen.wait = timed(real_wait)
    warm_maxout.Process.wait = timed(warm_maxout.Process.wait)
    warm_maxout.Process.communicate = timed(warm_maxout.Process.communicate)
    _time_store_creation()
    subprocess.Popen.communicate = timed(real_communicate)


def _time_store_creation() -> None:
    """A new MLflow SQL store runs every schema migration (seconds each): counted as ``store:migrations``."""
    import mlflow.store.db.utils as db_utils

    real = db_utils._initialize_tables

    def initialize(engine):
        start = time.perf_counter()
        try:
            return real(engine)
        finally:
            CLOCK.add("store:migrations", time.perf_counter() - start)

    db_utils._initialize_tables = initialize


def pytest_addoption(parser):
    parser.addoption("--timing-out", default=None, help="write each test's time split (JSON lines) to this file")


def pytest_configure(config):
    if config.getoption("--timing-out"):
        _patch()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The test's outcome for its record: failed if any phase failed, else skipped if one was, else passed."""
    report = (yield).get_result()
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    if rank[report.outcome] > rank[getattr(item, "_timing_outcome", "passed")]:
        item._timing_outcome = report.outcome


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = item.config.getoption("--timing-out")
    if not path:
        yield
        return
    CLOCK.current = counter = collections.Counter()
    CLOCK.sleepers = collections.Counter()
    self0, kids0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    warm0 = warm_maxout.children_cpu_s()
    start = time.perf_counter()
    yield
    wall = time.perf_counter() - start
    CLOCK.current = None
    self1, kids1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    record = {"test": item.nodeid, "outcome": getattr(item, "_timing_outcome", "passed"), "wall": wall,
              "split": dict(counter),
              "in-process": max(0.0, wall - sum(counter.values())),
              "cpu_self": (self1.ru_utime + self1.ru_stime) - (self0.ru_utime + self0.ru_stime),
              "cpu_children": (kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime)
              + warm_maxout.children_cpu_s() - warm0,
              "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
              "sleepers": {k: round(v, 2) for k, v in CLOCK.sleepers.most_common(3) if v >= 0.5}}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as out:
        out.write(json.dumps(record) + "\n")


def table(path: str) -> str:
    """The time split summed over the suite, and the 15 files that take longest."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    total = collections.Counter()
    per_file = collections.Counter()
    for r in records:
        total.update(r["split"])
        total["in-process"] += r["in-process"]
        per_file[r["test"].split("::")[0]] += r["wall"]
    wall = sum(r["wall"] for r in records)
    lines = [f"{len(records)} tests, {wall:.0f} s of test time (summed over workers); CPU: "
             f"{sum(r['cpu_self'] for r in records):.0f} s in the test processes, "
             f"{sum(r['cpu_children'] for r in records):.0f} s in their children", "",
             "| where | seconds | share |", "|---|---:|---:|"]
    lines += [f"| {k} | {v:.0f} | {v / wall:.0%} |" for k, v in total.most_common()]
    lines += ["", "| file | seconds |", "|---|---:|"]
    lines += [f"| {k} | {v:.0f} |" for k, v in per_file.most_common(15)]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1]))

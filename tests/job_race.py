"""maxout commands that start at the same moment, each in a process of its own:
``python -m tests.job_race OUT_DIR '[["train", ...], ["registry", "list", ...]]'``.

The heavy libraries (torch, transformers, mlflow, optuna) and maxout's command modules are imported once, here (a
test starts this module forked from tests/warm_maxout.py's server, which imported them already); then this process
forks one child per command and releases them all at once (a pipe whose write end it closes), so that
they reach their first store access together: separate processes with their own pids, as separate jobs on one
machine would be. A child is what a fresh process that imported the same modules first would be (it inherits the
environment this process started with, and nothing else ran here), for one import instead of one per command: ~5
CPU-s less for each command after the first on the 2-core test machines. Each child's stdout and stderr go to
``OUT_DIR/<i>.log``; this process waits for every child, writes their exit codes to ``OUT_DIR/exit_codes.json`` in
command order, and exits 0. The fault suite starts several commands on one new store this way (tests/test_faults.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from maxout import cli

from . import warm_maxout

EXIT_CODES = "exit_codes.json"
ROOT = Path(__file__).resolve().parents[1]


def start_together(out: Path, commands: list[list[str]], env: dict | None = None,
                   timeout_s: float = 900) -> list[tuple[int, str]]:
    """From a test: ``commands`` started together by this module; each one's (exit code, output), in order."""
    out.mkdir()
    # forked warm: this module's own imports are the server's (preload), ~6 CPU-s less per race
    proc = warm_maxout.popen([str(out), json.dumps(commands)], program="tests.job_race", env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        said = proc.communicate(timeout=timeout_s)[0]
    finally:
        if proc.poll() is None:  # timed out: the children too (they are in its process group)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, said[-3000:]
    return results(out, len(commands))


def log_file(out: Path, i: int) -> Path:
    return out / f"{i}.log"


def results(out: Path, n: int) -> list[tuple[int, str]]:
    """(exit code, output) of each command, in order, once ``main`` is done."""
    codes = json.loads((out / EXIT_CODES).read_text())
    return [(codes[i], log_file(out, i).read_text(errors="replace")) for i in range(n)]


def main(out: Path, commands: list[list[str]]) -> int:
    start_r, start_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    children = {}
    for i, argv in enumerate(commands):
        pid = os.fork()
        if pid == 0:  # a child: its own output file, then wait for the start, then the command
            os.close(start_w)
            log = os.open(log_file(out, i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.close(log)
            os.read(start_r, 1)  # b"" once every write end is closed: all children start at once
            os.close(start_r)
            return cli.run(argv)  # the interpreter then exits as any maxout process does
        children[pid] = i
    os.close(start_r)
    os.close(start_w)  # the start
    codes: dict[int, int] = {}
    while len(codes) < len(children):
        pid, status = os.wait()
        codes[children[pid]] = os.waitstatus_to_exitcode(status)
    (out / EXIT_CODES).write_text(json.dumps([codes[i] for i in range(len(commands))]))
    return 0


if __name__ == "__main__":
    # Before the fork, so that the commands themselves start together: a no-op in a child of the warm server, which
    # preloaded them (how the tests start this module); not done at import, where a test process needs none of it.
    warm_maxout.preload()
    sys.exit(main(Path(sys.argv[1]), json.loads(sys.argv[2])))

"""One maxout command that starts at the same moment as its siblings:
``python -m tests.job_race READY_DIR N maxout-argv...``.

The heavy libraries (torch, transformers, mlflow, optuna) and maxout's command modules are imported first; then
the process writes ``READY_DIR/<pid>`` and waits until N such files exist, so that N processes reach their first
store access together (separate processes, as separate jobs on one machine would be). It exits with the command's
exit code: the fault suite starts several of these on one new store (tests/test_faults.py).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import mlflow  # noqa: F401  (imported before the start line, so that the commands themselves start together)
import optuna  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401

from maxout import cli
from maxout.hpo import study  # noqa: F401
from maxout.registry import promotion  # noqa: F401
from maxout.train import train  # noqa: F401


def main(ready_dir: Path, n: int, argv: list[str]) -> int:
    (ready_dir / str(os.getpid())).touch()
    deadline = time.monotonic() + 600
    while len(list(ready_dir.iterdir())) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(list(ready_dir.iterdir()))} of {n} processes got ready")
        time.sleep(0.005)
    return cli.run(argv)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]))

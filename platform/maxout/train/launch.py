"""``maxout train --nproc-per-node N``: torchrun for one node, started by maxout itself.

It runs torch's own launcher in this process (``torch.distributed.run`` with ``--standalone``: the elastic agent
and a c10d rendezvous on a free local port), which starts N copies of ``python -m maxout train`` with the same
arguments; each finds its place in the job from the environment torchrun sets (distributed.py). The same job runs
as ``torchrun --standalone --nproc-per-node=N -m maxout train ...``: nothing here replaces torchrun.

The input is checked here first, once (prepare.check: data, model, tracking store, checkpoint to resume), so a bad
command starts no process. When the job fails, torchrun knows which rank exited first and how; that becomes one
line, and if rank 0 itself died before it could close the run (SIGKILL, the out-of-memory killer), the run it
announced (distributed.announce_run) is ended FAILED here with that reason: no RUNNING run is left behind.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from ..config import Config
from ..errors import RUNTIME, MaxoutError
from . import prepare
from .distributed import RUN_FILE_ENV


def torchrun_args(nproc: int, train_args: list[str], log_dir: str) -> list[str]:
    """torchrun's own command line for one node of ``nproc`` processes running ``maxout train <train_args>``.
    ``log_dir``: where torchrun keeps its per-rank error files, a folder the caller removes (without one, torchrun
    makes a ``torchelastic_*`` folder in the temporary directory that nothing removes, one per job)."""
    return ["--standalone", f"--nproc-per-node={nproc}", f"--log-dir={log_dir}", "--module", "maxout", "train",
            *train_args]


def failure_reason(err: ChildFailedError) -> tuple[str, int]:
    """One line for the first failed rank (torchrun's ``get_first_failure``), and the exit code to pass on."""
    rank, failure = err.get_first_failure()
    how = (f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}")
    others = len(err.failures) - 1
    return (f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) failed first: {how}"
            + (f"; {others} more rank(s) failed" if others else "") + "; its own error line is above",
            failure.exitcode if failure.exitcode > 0 else RUNTIME)


def end_orphan_run(run_file: Path, reason: str) -> None:
    """The run rank 0 announced, ended FAILED if rank 0 died before it could end it."""
    if not run_file.is_file():
        return
    from ..tracking.mlflow_run import end_if_running  # lazy: mlflow takes 1.5 s to import; only a failure needs it

    announced = json.loads(run_file.read_text())
    if end_if_running(announced["tracking_uri"], announced["run_id"], "FAILED", reason):
        print(f"maxout: ended run {announced['run_id']} FAILED: rank 0 could not ({reason})", file=sys.stderr)


def launch(cfg: Config, nproc: int, train_args: list[str]) -> int:
    """Check the input, then run ``maxout train <train_args>`` as ``nproc`` processes on this node."""
    prepare.check(cfg)  # one line and exit 2 for bad input, before any process starts
    with tempfile.TemporaryDirectory(prefix="maxout-launch-") as tmp:
        run_file = Path(tmp) / "run.json"
        saved: Any = os.environ.get(RUN_FILE_ENV)
        os.environ[RUN_FILE_ENV] = str(run_file)  # the processes torchrun starts inherit it
        try:
            run(get_args_parser().parse_args(torchrun_args(nproc, train_args, log_dir=str(Path(tmp) / "torchrun"))))
        except ChildFailedError as err:
            reason, code = failure_reason(err)
            end_orphan_run(run_file, f"job failed: {reason}")
            raise MaxoutError(f"the job failed: {reason}", exit_code=code) from None
        finally:
            if saved is None:
                os.environ.pop(RUN_FILE_ENV, None)
            else:
                os.environ[RUN_FILE_ENV] = saved
    return 0

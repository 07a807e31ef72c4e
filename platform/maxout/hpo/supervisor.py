"""``hpo.workers`` > 1: N worker processes of one study on this machine, started and watched by the invocation.

The supervisor (study.run) has checked everything and started the study's one parent run; each worker is
``python -m maxout hpo <the same overrides> hpo.workers=1`` in a slot of its own (placement.py: threads, GPU, memory
share), told the parent run through ``MAXOUT_HPO_PARENT_RUN_ID``, so that its trials nest under that run. The
workers share the study's storage (journal file or RDB), the compile cache and the batch finder's cache.

- A worker that dies (killed by a signal: the kernel's out-of-memory killer, SIGKILL, a crash; or stopped by a
  SIGINT/SIGTERM sent to it alone) has its unfinished trial failed and re-queued with the same params, as the RDB
  heartbeats do (Optuna's RetryHeartbeatStaleTrialCallback, hpo.max_retry), and its trial's runs end KILLED. A
  new worker takes its slot while the study needs trials (at most ``RESPAWNS_PER_SLOT`` times). The others go on.
- A worker that exits with an error (a trial raised one, as it would stop a one-worker study) stops the others, and
  the invocation fails with that worker's error line.
- Ctrl-C or SIGTERM stops every worker (SIGINT, then SIGKILL after ``STOP_GRACE_S``); a worker stops at its next
  training step or evaluation (``StopRequested``); trials still RUNNING then are failed and their runs end KILLED. Workers run in sessions of their own, so a terminal's Ctrl-C reaches the
  supervisor alone and it decides; a worker whose supervisor is gone (SIGKILLed) notices at once and stops itself
  (``watch_supervisor``), so no process is left behind.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from typing import Any, Optional, Sequence

from optuna.trial import TrialState

from ..config import Config
from ..errors import MaxoutError, Terminated, raise_if_stop_requested, stop_error
from ..train import Callback
from . import storage as storage_mod
from .objective import HOST
from .placement import Slot

PARENT_VAR = "MAXOUT_HPO_PARENT_RUN_ID"  # a worker's parent run ("" without tracking); set only for workers
SUPERVISOR_VAR = "MAXOUT_HPO_SUPERVISOR_PID"
STOP_GRACE_S = 30.0
RESPAWNS_PER_SLOT = 3
POLL_S = 0.5
OWN_KEYS = ("hpo.workers=", "hpo.timeout_s=")  # what the supervisor sets for its workers
PROGRESS_BAR = re.compile(r"\d+%\|")  # tqdm's (MLflow's artifact downloads, weight loading)


def worker_parent() -> Optional[str]:
    """The supervisor's parent run id when this process is one of its workers ("" without tracking), else None."""
    return os.environ.get(PARENT_VAR)


def watch_supervisor() -> None:
    """A worker stops itself (SIGTERM: its trial ends KILLED and FAIL) once its supervisor is gone: a SIGKILLed
    supervisor can forward nothing, and its workers must not train on for nobody.

    Its lifeline is its standard input, a pipe whose only writing end the supervisor holds and never writes to:
    the kernel closes it when the supervisor exits, however it ends, and the read below returns end-of-file. That
    holds whichever process forked the worker (not only a parent watched with getppid), and costs no polling."""
    if not os.environ.get(SUPERVISOR_VAR):
        return

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(0, 4096):
                pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="maxout-supervisor-watch", daemon=True).start()


class StopRequested(Callback):
    """A study stops at a safe point, not wherever the signal lands (a worker, and a one-worker study in its own
    process alike). Raised from a signal handler, the
    KeyboardInterrupt may land inside a SQLite commit (the tracking store's lock stays held, and both workers block
    on it: "database is locked") or in a weakref callback, where Python prints and drops it ("Exception ignored
    in ...") and the worker trains on; the GPU report's smoke runs saw both, and the supervisor had to SIGKILL.
    So a worker's SIGINT and SIGTERM only record the stop; the trial raises it at its next training step or
    evaluation (KeyboardInterrupt, or Terminated for SIGTERM), which ends its run KILLED and its trial FAIL, and a
    worker between trials starts no next one."""

    def __init__(self) -> None:
        self.signal: Optional[int] = None
        self.asked = threading.Event()

    def error(self) -> BaseException:
        return stop_error(self.signal)

    def check(self) -> None:
        if self.asked.is_set():
            raise self.error()

    def on_train_start(self, state: Any) -> None:
        self.check()

    def on_step_end(self, state: Any) -> None:
        self.check()

    def on_evaluate(self, state: Any, metrics: dict) -> None:
        self.check()

    def after_trial(self, study: Any, trial: Any) -> None:
        """An Optuna callback: no next trial once the stop was asked for."""
        if self.asked.is_set():
            study.stop()

    def install(self) -> "StopRequested":
        def on_signal(number: int, frame: Any) -> None:
            self.signal = self.signal or number
            self.asked.set()

        self._previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
        return self

    def uninstall(self) -> None:
        """The handlers from before install() (a study run inside another program, a test, leaves them as found)."""
        for signum, handler in getattr(self, "_previous", {}).items():
            signal.signal(signum, handler)
        self._previous = {}


def worker_overrides(overrides: Sequence[str], timeout_s: Optional[float]) -> list[str]:
    kept = [o for o in overrides if not o.lstrip("+~").startswith(OWN_KEYS)]
    return [*kept, "hpo.workers=1", *([f"hpo.timeout_s={timeout_s:.3f}"] if timeout_s is not None else [])]


class Worker:
    """One worker process and a thread that prefixes its output lines with its slot."""

    def __init__(self, slot: Slot, overrides: list[str], parent_run_id: Optional[str]):
        self.slot = slot
        env = {**os.environ, **slot.env(), PARENT_VAR: parent_run_id or "",
               SUPERVISOR_VAR: str(os.getpid()), "PYTHONUNBUFFERED": "1"}
        # stdin: the worker's lifeline (watch_supervisor), held open here and never written
        self.proc = subprocess.Popen([sys.executable, "-m", "maxout", "hpo", *overrides, "--no-progress"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1, start_new_session=True)
        self.id = f"{HOST}:{self.proc.pid}"  # what its trials carry as the `worker` user attr
        self.tail: collections.deque = collections.deque(maxlen=40)
        self._pump = threading.Thread(target=self._forward, daemon=True)
        self._pump.start()

    def _forward(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail.append(line.rstrip("\n"))
            if line.strip() and not PROGRESS_BAR.search(line):  # N interleaved progress bars are noise
                sys.stderr.write(f"[worker {self.slot.index}] {line}")
        sys.stderr.flush()

    def finish(self) -> int:
        code = self.proc.wait()
        self.proc.stdin.close()
        self._pump.join(timeout=5)
        return code

    def error_line(self) -> str:
        """Its `maxout: error:` line, else the last line it wrote (a traceback's last line names the error)."""
        lines = [line for line in self.tail if line.strip()]
        marked = [line.split("maxout: error: ", 1)[1] for line in lines if "maxout: error: " in line]
        return marked[-1] if marked else (lines[-1].strip() if lines else f"exit {self.proc.returncode}")


def died(code: int) -> bool:
    """Killed by a signal, or stopped by SIGINT/SIGTERM sent to it alone (maxout exits 130 and 143 then)."""
    return code < 0 or code in (130, 143)


def how(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return {130: "interrupted (SIGINT)", 143: "terminated (SIGTERM)"}.get(code, f"exit {code}")


def requeue(study: Any, worker_id: str, cfg: Config, reason: str) -> list[int]:
    """Fail the dead worker's unfinished trials and queue each again with the same params (hpo.max_retry), as the
    RDB heartbeats do; end their MLflow runs KILLED. Returns the trial numbers re-queued."""
    retry = storage_mod.RetryLostTrial(cfg.hpo.max_retry, cfg.tracking, end_parent=False)
    trials = study.get_trials(deepcopy=False)
    retried = {n for t in trials for n in t.system_attrs.get("retry_history", [])}
    lost = []
    for t in trials:
        if t.user_attrs.get("worker") != worker_id or t.number in retried:
            continue
        if t.state == TrialState.RUNNING:
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        elif t.state != TrialState.FAIL:
            continue
        retry(study, study._storage.get_trial(t._trial_id), reason)
        lost.append(t.number)
    return lost


def fail_running(study: Any, worker_ids: set, cfg: Config, reason: str,
                 since: Optional[datetime] = None) -> list[int]:
    """After a stop: trials of these workers still RUNNING (a worker SIGKILLed past the grace) are failed, and
    their runs end KILLED. Not re-queued: the user stopped the study. ``since`` (a journal, which one machine
    owns): also a trial created after it that has no worker yet (a worker SIGKILLed between creating the trial and
    naming itself on it)."""
    failed = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        mine = t.user_attrs.get("worker") in worker_ids
        orphan = ("worker" not in t.user_attrs and since is not None and t.datetime_start is not None
                  and t.datetime_start >= since)
        if mine or orphan:
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            if cfg.tracking.backend == "mlflow" and t.user_attrs.get("mlflow_run_id"):
                storage_mod.end_lost_runs(cfg.tracking, t.user_attrs["mlflow_run_id"], None, reason)
            failed.append(t.number)
    return failed


def stop(workers: Sequence[Worker]) -> None:
    """SIGINT to every live worker (each ends its trial's run KILLED and its trial FAIL), SIGKILL after the grace;
    a second Ctrl-C skips the wait."""
    alive = [w for w in workers if w.proc.poll() is None]
    for w in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(w.proc.pid, signal.SIGINT)
    deadline = time.monotonic() + STOP_GRACE_S
    try:
        while any(w.proc.poll() is None for w in alive) and time.monotonic() < deadline:
            time.sleep(0.1)
    except KeyboardInterrupt:
        pass
    for w in alive:
        if w.proc.poll() is None:
            print(f"maxout: worker {w.slot.index} (pid {w.proc.pid}) did not stop within {STOP_GRACE_S:g} s: "
                  f"SIGKILL", file=sys.stderr)
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.proc.pid, signal.SIGKILL)
        w.finish()


def supervise(study: Any, slots: Sequence[Slot], overrides: Sequence[str], parent_run_id: Optional[str],
              cfg: Config, done: Any) -> None:
    """Run the workers until each has exited and the study is done (``done(study) -> bool``: n_trials or the
    timeout reached). See the module docstring for deaths, errors and Ctrl-C."""
    hpo = cfg.hpo
    started, since = time.monotonic(), datetime.now()  # Optuna's datetimes are naive local time

    def launch(slot: Slot) -> Worker:
        left = None if hpo.timeout_s is None else max(1.0, hpo.timeout_s - (time.monotonic() - started))
        return Worker(slot, worker_overrides(overrides, left), parent_run_id)

    live = {slot.index: launch(slot) for slot in slots}
    everyone: list[Worker] = list(live.values())
    deaths: collections.Counter = collections.Counter()
    try:
        while live:
            time.sleep(POLL_S)
            raise_if_stop_requested()  # a Ctrl-C whose KeyboardInterrupt got dropped (errors.py) still stops it
            for index, worker in list(live.items()):
                if worker.proc.poll() is None:
                    continue
                del live[index]
                code = worker.finish()
                if code == 0:
                    continue
                if not died(code):  # a trial failed: the study stops, as it does with one worker
                    raise MaxoutError(f"worker {index} failed: {worker.error_line()}")
                reason = (f"worker {index} ({worker.id}) {how(code)}; its trial was re-queued with the same "
                          f"params")
                lost = requeue(study, worker.id, cfg, reason)
                deaths[index] += 1
                again = deaths[index] <= RESPAWNS_PER_SLOT and not done(study)
                print(f"maxout: worker {index} (pid {worker.proc.pid}) {how(code)}: trial(s) "
                      f"{', '.join(map(str, lost)) or 'none'} re-queued; "
                      + ("a new worker takes its slot" if again else "its slot stays empty"), file=sys.stderr)
                if again:
                    live[index] = launch(worker.slot)
                    everyone.append(live[index])
    except BaseException as err:
        stop(everyone)
        interrupted = isinstance(err, (KeyboardInterrupt, Terminated))
        journal = not storage_mod.is_url(storage_mod.location(hpo, cfg.tracking))
        failed = fail_running(study, {w.id for w in everyone}, cfg,
                              "interrupted: the study's workers were stopped" if interrupted else
                              f"stopped: {str(err)[:500]}", since if journal else None)
        if failed:
            print(f"maxout: trial(s) {', '.join(map(str, failed))} were still running when the workers stopped: "
                  f"failed", file=sys.stderr)
        raise


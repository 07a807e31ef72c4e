"""9. HPO on one GPU: trials per hour of a real ``maxout hpo --workers N`` study with 1, 2 and 4 worker processes
sharing the device (issue 29). BERT-base (random, from its config: workloads.py) at 128 tokens; every trial does the
same work: one epoch over the demo table x4 (3,200 rows, 100 steps of 32 rows), compile off, the pruner off, the
random sampler, no model logged, ``hpo.warm_start`` as configured. Smoke (CPU): the tiny model, 64 rows, 1 and 2
workers, each study stopped after 2 trials a worker.

Each N is one study in its own store (an Optuna journal and a SQLite MLflow store in the scratch folder), run until
its time slot ends (smoke: its trial count), then stopped the way a user stops it, SIGINT to the supervisor (Ctrl-C),
and checked: no process of it left behind, no MLflow run left RUNNING. Figures per N:

- trials: finished (complete or pruned) before the SIGINT; wall seconds: launch to SIGINT, start-up included;
  trials/hour = trials x 3600 / wall seconds (what a user gets from a study of this length);
- steady trials/hour, start-up left out: per worker, its finished trials over the span from its first trial's start to
  its last one's end, summed over the workers (a trial cut by the SIGINT counts in neither);
- speed-up vs 1 worker on both; seconds per trial (sharing the device slows each trial down);
- device memory and utilization sampled by NVML every 0.5 s while the study ran (the device's used memory, the
  largest single process), and what the trial runs logged (``mem/peak_allocated_gb``, ``gpu/utilization_mean`` of
  their training windows).

Time (full: 520 s at most): first, AUTO_S for a study with ``--workers auto``, stopped at its first finished trial:
the N it picks and why (``hpo.workers_effective``, ``hpo.workers_reason`` on its parent run); its measurement also
caches one worker's GPU memory need, which ``--workers N`` otherwise measures in its first study (so neither the 2-
nor the 4-worker study pays it). Then what is left, less MARGIN_S, split evenly over the studies, each STOP_S of its
share kept for the stop and the reading: ~95 s from launch to SIGINT each. One round, 1, 2, 4: a study needs
~20-30 s of start-up on the GPU machine before its first trial and a minute or two of trials to count tens of them,
so the interleaved 1, 2, 4, 4, 2, 1 does not fit in the device's 540 s for a command; the second round, in the other
order, runs only where six studies of MIN_RUN_S fit (a longer --budget-s). For another order, run the section again.

Short (what a 5-minute call leaves it, under SHORT_S): scaled to fit, not skipped. No auto study, 1 and 2 workers,
each trial one epoch of the demo table once (800 rows, 25 steps of 32 rows), STOP_S_SHORT kept per study for the stop
and the reading. Fewer trials, so the steady rate (start-up left out) is the figure to read.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from .. import workloads
from ..registry import Context, Section

WORKERS = {"full": (1, 2, 4), "smoke": (1, 2)}
TRIALS_PER_WORKER = {"full": None, "smoke": 2}  # smoke stops a study after this many finished trials per worker
MIN_RUN_S = {"full": 100, "smoke": 30}  # launch to SIGINT; less than this: the round is not planned
MAX_RUN_S = {"full": 240, "smoke": 150}
# SIGINT to exit, then SIGTERM and SIGKILL 10 s apart: the supervisor's own grace for its workers (supervisor.py,
# STOP_GRACE_S = 30) and 15 s to end the runs and log the study's report. Usually a few seconds.
GRACE_S = {"full": 45, "smoke": 45}
STOP_S = {"full": 35, "smoke": 30}  # per study: the grace and the reading of its stores
# The --workers auto study (None: not at this scale): probe rounds of 1, 2, 4, 8 workers (a process start and 40
# steps each, ~15-20 s on the GPU machine), then the study's start and its first trial.
AUTO_S = {"full": 120, "smoke": None}
LATE_S = 2.0  # a trial finished this long after the SIGINT was run by a worker that did not stop
MARGIN_S = 10
SHORT_S = 300  # less than this at full scale: the short plan
STOP_S_SHORT = 15


def short(ctx: Context) -> bool:
    """Whether the section has only what a short call leaves it (full scale)."""
    return ctx.full and ctx.left() < SHORT_S


def trial_overrides(ctx: Context, is_short: bool = False) -> list[str]:
    """The fixed short trial: the same work whatever the sampler draws (target_effective_batch left out of the
    search space, the pruner off)."""
    if ctx.full:
        arch, batch, data = "bert_base", 32, workloads.demo(ctx.work, copies=1 if is_short else 4)
    else:
        arch, batch, data = "tiny", 16, workloads.demo(ctx.work, rows=64)
    return [*workloads.model(arch), *data, "data.max_length=128", "hardware.compile=false", "train.epochs=1",
            f"train.batch_size={batch}", f"train.target_effective_batch={batch}",
            "~hpo.search_space.train.target_effective_batch", "hpo.pruner.name=none", "hpo.sampler.name=random",
            "hpo.log_models=none", "hpo.n_trials=100000"]  # the section stops the study, not the trial count


def workers_option() -> bool:
    """Whether this maxout has ``hpo.workers`` (issue 29 part 1); without it only the 1-worker study runs."""
    import dataclasses

    from maxout.config import HpoConfig  # lazy: the parent process never imports maxout for this

    return "workers" in {f.name for f in dataclasses.fields(HpoConfig)}


def plan(ctx: Context, workers: tuple, stop_s: float | None = None) -> tuple[list, float]:
    """(the worker counts in order, seconds from launch to SIGINT for each): at full scale, a second round in the
    other order only where each of the six studies still gets MIN_RUN_S; smoke: one round (a code path)."""
    scale = ctx.scale
    left = ctx.left() - MARGIN_S
    stop_s = STOP_S[scale] if stop_s is None else stop_s
    for order in ([*workers, *reversed(workers)], list(workers)) if ctx.full else (list(workers),):
        run_s = left / len(order) - stop_s
        if run_s >= MIN_RUN_S[scale] or len(order) == len(workers):
            return order, min(run_s, MAX_RUN_S[scale])
    raise AssertionError("unreachable")


class DeviceSampler:
    """NVML every ``interval_s`` on a thread: the device's utilization, its used memory, and the largest single
    process's memory (each worker is one process). Nothing on a machine without NVML or a GPU."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s, self.samples, self.available = interval_s, [], False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "DeviceSampler":
        try:
            import pynvml  # lazy: nvidia-ml-py

            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no NVML or no GPU: no device figures
            return self
        self.available = True
        self._thread = threading.Thread(target=self._run, name="hpo-nvml", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        nvml, handle = self._nvml, self._handle
        while not self._stop.wait(self.interval_s):
            try:
                procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
                self.samples.append((time.time(), nvml.nvmlDeviceGetUtilizationRates(handle).gpu,
                                     nvml.nvmlDeviceGetMemoryInfo(handle).used,
                                     max([p.usedGpuMemory or 0 for p in procs], default=0), len(procs)))
            except Exception:
                return

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.available:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass

    def summary(self, since: Optional[float]) -> dict:
        """Peaks over the whole study; mean utilization from ``since`` (the first trial's start) on."""
        if not self.samples:
            return {}
        gib = 2.0**30
        busy = [s[1] for s in self.samples if since is None or s[0] >= since]
        return {"samples": len(self.samples), "device_used_peak_gb": max(s[2] for s in self.samples) / gib,
                "process_peak_gb": max(s[3] for s in self.samples) / gib,
                "processes_max": max(s[4] for s in self.samples),
                "utilization_mean": sum(busy) / len(busy) if busy else None}


class Journal:
    """The study's trials, read from its Optuna journal while the workers write it (one storage object: each read
    replays only the new records)."""

    def __init__(self, path: Path, study: str):
        self.path, self.study, self.storage, self.study_id = path, study, None, None

    def trials(self) -> list:
        import optuna  # lazy: not in the report's parent process
        from optuna.storages.journal import JournalFileBackend

        if self.study_id is None:
            if not self.path.exists():
                return []
            if self.storage is None:
                self.storage = optuna.storages.JournalStorage(JournalFileBackend(str(self.path)))
            try:
                self.study_id = self.storage.get_study_id_from_name(self.study)
            except KeyError:  # the supervisor has not created it yet
                return []
        return self.storage.get_all_trials(self.study_id, deepcopy=False)


def finished(trials: list, before: float = float("inf")) -> list:
    return [t for t in trials if t.state.name in ("COMPLETE", "PRUNED") and t.datetime_complete is not None
            and t.datetime_complete.timestamp() <= before]


def steady_per_hour(trials: list) -> Optional[float]:
    """Per worker (the trial's ``worker`` attribute, host:pid): finished trials / (last end - first start); summed."""
    by_worker: dict[str, list] = {}
    for t in trials:
        by_worker.setdefault(t.user_attrs.get("worker", "?"), []).append(t)
    rates = []
    for own in by_worker.values():
        span = max(t.datetime_complete.timestamp() for t in own) - min(t.datetime_start.timestamp() for t in own)
        if span > 0:
            rates.append(len(own) / span)
    return 3600 * sum(rates) if rates else None


def stop(proc: subprocess.Popen, grace: float) -> tuple[str, Optional[int]]:
    """Ctrl-C: SIGINT to the supervisor alone (it stops its workers), then SIGTERM, then SIGKILL, each after ``grace``
    seconds without an exit. Returns how it ended and the exit code."""
    for how, sig, wait in (("SIGINT", signal.SIGINT, grace), ("SIGTERM", signal.SIGTERM, 10),
                           ("SIGKILL", signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return ("exited by itself" if how == "SIGINT" else how.lower()), proc.returncode
        proc.send_signal(sig)
        try:
            return how, proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return "did not exit", proc.poll()


def tracked(folder: Path) -> dict:
    """The study's MLflow runs: the parent(s), the trial runs nested under them, any left RUNNING, and the trial
    runs' memory and utilization metrics."""
    import mlflow  # lazy: not in the report's parent process

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("maxout")
    runs = client.search_runs([experiment.experiment_id], max_results=50000) if experiment else []
    parents = [r for r in runs if r.data.tags.get("maxout.command") == "hpo"]
    trials = [r for r in runs if r.data.tags.get("maxout.command") == "hpo-trial"]
    parent_ids = {r.info.run_id for r in parents}

    def peak(key: str) -> Optional[float]:
        values = [r.data.metrics[key] for r in trials if key in r.data.metrics]
        return max(values) if values else None

    util = [r.data.metrics["gpu/utilization_mean"] for r in trials if "gpu/utilization_mean" in r.data.metrics]
    params = parents[0].data.params if parents else {}
    return {"parent_runs": len(parents), "trial_runs": len(trials),
            "trial_runs_nested": sum(r.data.tags.get("mlflow.parentRunId") in parent_ids for r in trials),
            "running": [r.info.run_id for r in runs if r.info.status == "RUNNING"],
            "trial_peak_allocated_gb": peak("mem/peak_allocated_gb"),
            "trial_peak_reserved_gb": peak("mem/peak_reserved_gb"),
            "trial_utilization_mean": sum(util) / len(util) if util else None,
            **{k: params[k] for k in ("hpo.workers", "hpo.workers_effective", "hpo.workers_reason") if k in params}}


def study(ctx: Context, workers: Any, label: str, run_s: float, target: Optional[int], with_option: bool,
          is_short: bool = False) -> dict:
    """One study: launch, watch (the journal for the trial count, psutil for the process tree), SIGINT at ``run_s``
    or at ``target`` finished trials, then the check for processes left behind and the reading of its stores."""
    import psutil  # lazy: the GPU image and the venv have it

    folder = ctx.work / "hpo" / label
    folder.mkdir(parents=True, exist_ok=True)
    name = f"gpu-report-{label}"
    command = [sys.executable, "-m", "maxout", "hpo", "--no-progress",
               *(["--workers", str(workers)] if with_option else []), *trial_overrides(ctx, is_short),
               f"hpo.study_name={name}", f"hpo.storage={folder / 'optuna.journal'}",
               f"tracking.uri=sqlite:///{folder / 'mlflow.db'}", f"tracking.artifact_location={folder / 'mlruns'}"]
    journal, seen = Journal(folder / "optuna.journal", name), {}
    log = open(folder / "maxout.log", "w")
    with DeviceSampler() as device:
        started = time.time()
        # Same process group as this section: the report's kill at the section's limit reaches the supervisor too.
        # OMP_NUM_THREADS stays unset: the supervisor splits the CPU threads between its workers.
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        top = psutil.Process(proc.pid)
        reason = "time slot"
        while proc.poll() is None:
            trials = journal.trials()
            try:
                for p in [top, *top.children(recursive=True), *trial_workers(trials)]:
                    seen.setdefault(p.pid, p)  # psutil.Process keeps the start time: a reused pid is not it
            except psutil.NoSuchProcess:
                pass
            if target is not None and len(finished(trials)) >= target:
                reason = f"{target} finished trials"
                break
            if time.time() - started >= run_s:
                break
            time.sleep(0.5)
        else:
            reason = f"exited by itself with code {proc.returncode}"
        signalled = time.time()
        how, code = stop(proc, GRACE_S[ctx.scale])
        stopped_s = time.time() - signalled
    log.close()
    left = [p for p in seen.values() if _alive(p)]
    left_behind = [_describe(p) for p in left]
    for p in left:  # not to leak into the next study; the result says they were there
        p.kill()
    trials = journal.trials()
    done = finished(trials, before=signalled)
    wall = signalled - started
    first_start = min((t.datetime_start.timestamp() for t in trials if t.datetime_start), default=None)
    result = {"workers": workers, "label": label, "trials": len(done), "wall_s": wall,
              "trials_per_hour": len(done) * 3600 / wall, "steady_trials_per_hour": steady_per_hour(done),
              "s_per_trial": (sum(t.datetime_complete.timestamp() - t.datetime_start.timestamp() for t in done)
                              / len(done)) if done else None,
              "first_trial_after_s": first_start - started if first_start else None,
              "workers_seen": len({t.user_attrs.get("worker") for t in trials if t.user_attrs.get("worker")}),
              "states": {s: sum(t.state.name == s for t in trials) for s in sorted({t.state.name for t in trials})},
              # Ctrl-C's promises: no trial finished after it (every worker stopped at once), none left RUNNING
              "finished_after_sigint": len(finished(trials)) - len(finished(trials, before=signalled + LATE_S)),
              "trials_left_running": [t.number for t in trials if t.state.name == "RUNNING"],
              "stopped_by": reason, "stop": how, "exit_code": code, "stop_s": stopped_s,
              "processes_seen": len(seen), "left_behind": left_behind, "device": device.summary(first_start),
              "tracked": tracked(folder)}
    if not done and reason.startswith("exited"):
        tail = (folder / "maxout.log").read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"the {label} study ended with code {code} before any trial finished: "
                           + " / ".join(tail))
    return result


def trial_workers(trials: list) -> list:
    """The processes of this host that ran these trials, as each worker names itself on its trials (the ``worker``
    user attr, host:pid): the workers also where another process forked them (the tests' warm server) or they were
    re-parented, which the supervisor's process tree would not show. A pid is taken only for a process started
    before its first trial there: not a later process that reused the pid of a worker that had ended."""
    import psutil  # lazy: see study()

    first: dict[str, float] = {}
    for t in trials:
        worker = t.user_attrs.get("worker")
        if worker and t.datetime_start is not None:
            first[worker] = min(first.get(worker, float("inf")), t.datetime_start.timestamp())
    found = []
    for worker, started in first.items():
        host, _, pid = worker.rpartition(":")
        if host == socket.gethostname():
            with contextlib.suppress(psutil.Error, ValueError):
                p = psutil.Process(int(pid))
                if p.create_time() <= started:
                    found.append(p)
    return found


def _alive(p: Any) -> bool:
    """Still running, and not a zombie (psutil's is_running also checks the pid was not reused)."""
    import psutil  # lazy: see study()

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _describe(p: Any) -> str:
    try:
        return f"{p.pid}: {' '.join(p.cmdline()[:5])}"
    except Exception:  # it ended meanwhile
        return f"{p.pid}"


def summarize(rows: list[dict]) -> list[dict]:
    """One row per worker count, pooled over its studies (rounds): trials and wall seconds summed, so trials/hour
    stays trials x 3600 / wall seconds; speed-ups against the 1-worker row."""
    out: list[dict] = []
    for n in dict.fromkeys(r["workers"] for r in rows):
        own = [r for r in rows if r["workers"] == n]
        trials, wall = sum(r["trials"] for r in own), sum(r["wall_s"] for r in own)
        steady = [r["steady_trials_per_hour"] for r in own if r["steady_trials_per_hour"]]
        peaks = lambda key: max([r["device"][key] for r in own if r["device"].get(key) is not None],  # noqa: E731
                                default=None)
        tracked_ = [r["tracked"] for r in own]
        out.append({"workers": n, "studies": len(own), "trials": trials, "wall_s": wall,
                    "trials_per_hour": trials * 3600 / wall, "steady_trials_per_hour":
                    sum(steady) / len(steady) if steady else None,
                    "s_per_trial": _mean([r["s_per_trial"] for r in own]),
                    "device_used_peak_gb": peaks("device_used_peak_gb"), "process_peak_gb": peaks("process_peak_gb"),
                    "utilization_mean": _mean([r["device"].get("utilization_mean") for r in own]),
                    "trial_peak_allocated_gb": max([t["trial_peak_allocated_gb"] for t in tracked_
                                                    if t["trial_peak_allocated_gb"] is not None], default=None),
                    "trial_utilization_mean": _mean([t["trial_utilization_mean"] for t in tracked_]),
                    "left_behind": sum(len(r["left_behind"]) for r in own),
                    "running_runs": sum(len(t["running"]) for t in tracked_),
                    "running_trials": sum(len(r.get("trials_left_running", [])) for r in own)})
    base = next((r for r in out if r["workers"] == 1), None)
    for r in out:
        r["speed_up"] = r["trials_per_hour"] / base["trials_per_hour"] if base and base["trials_per_hour"] else None
        r["steady_speed_up"] = (r["steady_trials_per_hour"] / base["steady_trials_per_hour"]
                                if base and base["steady_trials_per_hour"] and r["steady_trials_per_hour"] else None)
    return out


def _mean(values: list) -> Optional[float]:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def run(ctx: Context) -> None:
    # A report started with SIGINT ignored (nohup, a script's background job) would pass that on to the studies, and
    # the Ctrl-C that stops them would do nothing: with Python's own handler here, they start with the default.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    scale = ctx.scale
    with_option = workers_option()
    is_short = short(ctx)
    workers = ((1, 2) if is_short else WORKERS[scale]) if with_option else (1,)
    if with_option and AUTO_S[scale] is not None and not is_short:
        # First: auto's measurement also caches one worker's GPU memory need, which `--workers N` checks its share
        # against (auto_workers.py); measured here, it costs neither the 2- nor the 4-worker study.
        try:
            got = study(ctx, "auto", "auto", AUTO_S[scale] - STOP_S[scale], 1, with_option)
        except RuntimeError as err:  # optional: the worker counts below are the figure
            ctx.record("auto", {"error": str(err)[:1000]})
        else:
            keys = ("hpo.workers_effective", "hpo.workers_reason")
            ctx.record("auto", {**{k: got["tracked"].get(k) for k in keys}, "trials": got["trials"],
                                "wall_s": got["wall_s"], "stopped_by": got["stopped_by"]})
    stop_s = STOP_S_SHORT if is_short else STOP_S[scale]
    order, run_s = plan(ctx, workers, stop_s)
    model = "bert_base" if ctx.full else "tiny"
    ctx.record("setup", {"model": model, "overrides": trial_overrides(ctx, is_short)[len(workloads.model(model)):],
                         "order": order, "run_s": run_s, "stop_s": stop_s, "short": is_short,
                         "trials_per_worker": TRIALS_PER_WORKER[scale],
                         **({} if with_option else {"left_out": "This maxout has no hpo.workers (issue 29 part 1): "
                                                                "only 1 worker"})})
    studies: list[dict] = []
    for i, n in enumerate(order):
        per = TRIALS_PER_WORKER[scale]
        studies.append(study(ctx, n, f"w{n}-{i}", run_s, per * n if per else None, with_option, is_short))
        print(f"hpo: {n} worker(s): {studies[-1]['trials']} trials in {studies[-1]['wall_s']:.0f} s "
              f"(stopped by {studies[-1]['stopped_by']}, {studies[-1]['stop']})", flush=True)
        ctx.record("studies", studies)
        ctx.record("rows", summarize(studies))


def markdown(results: dict) -> str:
    fmt = lambda v, spec, suffix="": "–" if v is None else format(v, spec) + suffix  # noqa: E731
    setup = results.get("setup", {})
    lines = [f"Model: random {setup.get('model')}; one `maxout hpo --workers N` study per N in the order "
             f"{setup.get('order')}, each stopped by SIGINT (Ctrl-C) {fmt(setup.get('run_s'), '.0f')} s after launch"
             + (f" or at {setup['trials_per_worker']} finished trials a worker" if setup.get("trials_per_worker")
                else "") + "; trials/hour over the wall, steady over each worker's trials; trial: "
             f"`{' '.join(setup.get('overrides', []))}`." + (f" {setup['left_out']}." if setup.get("left_out") else ""),
             "", "| workers | trials | wall s | trials/hour | speed-up | steady trials/hour | speed-up | s per trial "
             "| device memory peak GiB | largest process GiB | trial peak allocated GiB | GPU util % (NVML) | "
             "GPU util % (trial runs) | after Ctrl-C: processes left / runs RUNNING / trials RUNNING |",
             "|" + "---|" * 14]
    for r in results.get("rows", []):
        lines.append(f"| {r['workers']} | {r['trials']} | {r['wall_s']:.0f} | {r['trials_per_hour']:.0f} | "
                     f"{fmt(r['speed_up'], '.2f', '×')} | {fmt(r['steady_trials_per_hour'], '.0f')} | "
                     f"{fmt(r['steady_speed_up'], '.2f', '×')} | {fmt(r['s_per_trial'], '.1f')} | "
                     f"{fmt(r['device_used_peak_gb'], '.1f')} | {fmt(r['process_peak_gb'], '.1f')} | "
                     f"{fmt(r['trial_peak_allocated_gb'], '.2f')} | {fmt(r['utilization_mean'], '.0f')} | "
                     f"{fmt(r['trial_utilization_mean'], '.0f')} | {r['left_behind']} / {r['running_runs']} / "
                     f"{r['running_trials']} |")
    lines.append("")
    for s in results.get("studies", []):
        t = s["tracked"]
        lines.append(f"- {s['label']}: first trial {fmt(s['first_trial_after_s'], '.0f')} s after launch; "
                     f"{s['workers_seen']} worker process(es) ran trials; trial states {s['states']}; stopped by "
                     f"{s['stopped_by']} ({s['stop']}, exit code {s['exit_code']}, {s['stop_s']:.1f} s to exit, "
                     f"{s['finished_after_sigint']} trials finished after it, trials left RUNNING: "
                     f"{s['trials_left_running'] or 'none'}); "
                     f"{t['trial_runs_nested']}/{t['trial_runs']} trial runs nested under {t['parent_runs']} parent "
                     f"run(s)" + (f"; LEFT BEHIND: {', '.join(s['left_behind'])}" if s["left_behind"] else "") + ".")
    auto = results.get("auto")
    if auto:
        said = (f"failed: {auto['error']}" if "error" in auto else
                f"picked {auto['hpo.workers_effective']} in {auto['wall_s']:.0f} s: {auto['hpo.workers_reason']}"
                if auto.get("hpo.workers_reason") else f"no pick logged: stopped by {auto['stopped_by']} first")
        lines.append(f"\n`--workers auto` (run first): {said}")
    return "\n".join(lines)


def chart(results: dict, path: Path) -> bool:
    from .charts import bars  # lazy: matplotlib

    rows = results.get("rows", [])
    series = {"trials/hour (wall, start-up included)": [r["trials_per_hour"] for r in rows],
              "steady trials/hour": [r["steady_trials_per_hour"] or 0.0 for r in rows]}
    return bars(path, [f"{r['workers']} worker(s)" for r in rows], series, "trials per hour",
                f"HPO throughput on one device ({results.get('setup', {}).get('model')})", fmt="%.0f")


SECTION = Section("hpo", "HPO: trials per hour with 1, 2 and 4 workers on one GPU", run, needs=("optuna", "mlflow"),
                  min_s={"full": 60, "smoke": 60}, max_s={"full": 520, "smoke": 300}, markdown=markdown,
                  chart=chart)

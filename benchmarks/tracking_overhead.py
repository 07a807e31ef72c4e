"""Tracking overhead: steady-state samples/s with the MLflow tracker against a real ``mlflow server`` vs the null
tracker, in one process, in interleaved repetitions (the mode order rotates every repetition, so drift in the
machine's load hits every mode alike). Target: <= 1% slowdown.

    .venv/bin/python -m benchmarks.tracking_overhead [--reps 5] [--steps 40] [--modes none,mlflow] [--interval 5]
                                                     [--store server|sqlite] [hydra overrides ...]

Modes: ``none`` (null tracker), ``mlflow`` (server + MLflow's system-metrics sampler every ``--interval`` s:
psutil, plus NVML on a GPU; the loop's own NVML utilization sampler runs on a GPU in every mode),
``mlflow-no-system`` (server, no sampler). Defaults: the demo project with MiniLM and train.log_every=1 (a metrics
batch every step: the logging path's worst case; the default is every 10 steps). Besides samples/s it reports the
CPU seconds this process's main thread, its other threads and the server process used during fit() (run it with
OMP_NUM_THREADS=1, else torch's intra-op threads count as background): on a shared machine that CPU comes out of
training. ``--store sqlite`` logs to an embedded SQLite store in this process instead of a server (what `make run`
uses, and what the GPU report measures: its machine carries the MLflow client, not the server).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from maxout.train import Callback

MODES = ("none", "mlflow", "mlflow-no-system")


def _cpu_seconds() -> tuple[float, float, float]:
    """CPU seconds so far of (this process's main thread, its other threads, its child processes: the server)."""
    import psutil

    me = psutil.Process()
    main_id = threading.main_thread().native_id
    threads = me.threads()
    main = sum(t.user_time + t.system_time for t in threads if t.id == main_id)
    background = sum(t.user_time + t.system_time for t in threads if t.id != main_id)
    children = 0.0
    for child in me.children(recursive=True):
        try:
            times = child.cpu_times()
            children += times.user + times.system
        except psutil.Error:
            pass
    return main, background, children


class FitWindow(Callback):
    """CPU seconds at the start and end of fit() (steps, logging, final evaluation), leaving out the run's fixed
    start-up and close-down (params, artifacts, end_run), which do not grow with training time."""

    def __init__(self) -> None:
        self.start = self.end = (0.0, 0.0, 0.0)

    def on_train_start(self, state) -> None:
        self.start = _cpu_seconds()

    def on_train_end(self, state) -> None:
        self.end = _cpu_seconds()


def logging_path_ms(cfg, steps: int = 1000) -> float:
    """Main-thread CPU per training step of the tracker's logging path (log_metrics with the loop's six metrics
    every step, plus the flushes): what the loop itself pays, whatever the machine's load."""
    from maxout.tracking.tracker import start

    tracker = start(cfg.tracking, run_name="logging-path", system_metrics=False)
    metrics = {"train/loss": 0.5, "train/lr": 1e-4, "train/epoch": 1.0, "perf/window_samples_per_s": 10.0,
               "perf/window_tokens_per_s": 600.0, "perf/window_it_per_s": 1.0}
    started = time.thread_time()
    for step in range(steps):
        tracker.log_metrics(metrics, step=step)
    tracker.flush()
    cost = (time.thread_time() - started) / steps * 1000
    tracker.close()
    return cost


@contextlib.contextmanager
def tracking_store(store: str, tmp: str) -> Iterator[list[str]]:
    """The tracking overrides for a run against ``store``: a real ``mlflow server`` or an embedded SQLite file."""
    backend = f"sqlite:///{Path(tmp) / 'mlflow.db'}"
    if store == "sqlite":
        yield ["tracking=local", f"tracking.uri={backend}",
               f"tracking.artifact_location={Path(tmp, 'artifacts').as_uri()}"]
        return
    from tests.services import mlflow_server  # lazy: the server's harness, only for --store server

    with mlflow_server(backend, artifacts_destination=Path(tmp, "artifacts").as_uri()) as url:
        yield ["tracking=server", f"tracking.uri={url}"]


def measure(overrides: list[str], reps: int, steps: int, modes: list[str], interval: float,
            store: str = "server", on_run: Callable[[dict], None] | None = None) -> dict:
    """``on_run``: called after each run with what measure() would return if it stopped there (every run so far in
    ``rows``, the summary of the whole repetitions among them, ``logging_path_ms`` None until the end), so a caller
    killed at a time limit keeps each figure."""
    from maxout import data, hardware, loading
    from maxout.train import train

    device = hardware.detect()
    common = [*overrides, f"train.max_steps={steps}", "train.epochs=1000", "train.log_every=1"]
    null_cfg = loading.load([*common, "tracking=none"], device=device)
    dataset = data.load(null_cfg.data)
    rows: list[dict] = []

    def figures(path_ms: float | None, partial: dict | None = None) -> dict:
        return {"device": device.name, "kind": device.kind, "store": store, "summary": summarize(rows, modes),
                "rows": rows + ([partial] if partial else []), "logging_path_ms": path_ms}

    with tempfile.TemporaryDirectory(prefix="maxout-overhead-") as tmp:
        with tracking_store(store, tmp) as where:
            server = [*common, *where, "tracking.log_model=false", "tracking.experiment_name=tracking-overhead"]
            configs = {"none": null_cfg,
                       "mlflow": loading.load([*server, "tracking.system_metrics=true",
                                               f"tracking.system_metrics_interval_s={interval}"], device=device),
                       "mlflow-no-system": loading.load([*server, "tracking.system_metrics=false"], device=device)}
            train(null_cfg, progress=False, device=device, verbose=False, dataset=dataset)  # warm-up, not counted
            for rep in range(reps):
                row = {}
                for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:
                    window, started = FitWindow(), time.perf_counter()
                    metrics = train(configs[mode], callbacks=[window], progress=False, device=device, verbose=False,
                                    dataset=dataset).metrics
                    main, background, server = (a - b for a, b in zip(window.end, window.start))
                    row[mode] = {"samples_s": metrics["perf/steady_samples_per_s"], "main_cpu_s": main,
                                 "background_cpu_s": background, "server_cpu_s": server,
                                 "wall_s": time.perf_counter() - started}
                    print(f"rep {rep + 1}/{reps} {mode:16s}: {row[mode]['samples_s']:8.2f} samples/s (steady); CPU s: "
                          f"main thread {main:.1f}, other threads {background:.1f}, server {server:.1f}; run "
                          f"{row[mode]['wall_s']:.0f} s", file=sys.stderr)
                    whole = len(row) == len(modes)  # a repetition's row, once every mode has run
                    if whole:
                        rows.append(row)
                    if on_run is not None:
                        on_run(figures(None, partial=None if whole else row))
            path_ms = logging_path_ms(configs["mlflow-no-system"])
    return figures(path_ms)


def summarize(rows: list[dict], modes: list[str]) -> dict:
    """Per mode, the medians over the repetitions in ``rows`` (each a mode -> figures dict); ratios vs ``none``."""
    if not rows:
        return {}
    summary = {}
    for mode in modes:
        ratios = [r[mode]["samples_s"] / r["none"]["samples_s"] for r in rows] if "none" in modes else []
        summary[mode] = {"median_samples_s": statistics.median(r[mode]["samples_s"] for r in rows),
                         "median_ratio": statistics.median(ratios) if ratios else None,
                         "ratios": ratios,
                         "server_cpu_s": statistics.median(r[mode]["server_cpu_s"] for r in rows),
                         "main_cpu_s": statistics.median(r[mode]["main_cpu_s"] for r in rows),
                         "background_cpu_s": statistics.median(r[mode]["background_cpu_s"] for r in rows),
                         "wall_s": statistics.median(r[mode]["wall_s"] for r in rows)}
    return summary


def null_batch(overrides: list[str]) -> int:
    from maxout import loading

    cfg = loading.load([*overrides, "tracking=none"])
    return cfg.train.target_effective_batch or cfg.batch_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="hydra overrides for every mode (default: the demo, MiniLM)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--modes", default="none,mlflow", help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--interval", type=float, default=5.0, help="system-metrics interval (s) for mode mlflow")
    parser.add_argument("--store", choices=("server", "sqlite"), default="server",
                        help="log to a real mlflow server (default) or an embedded SQLite store in this process")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown or "none" not in modes:
        parser.error(f"--modes needs 'none' and only {', '.join(MODES)} (got {args.modes})")
    out = measure(args.overrides, args.reps, args.steps, modes, args.interval, args.store)
    print(f"{out['device']} ({out['kind']}), {args.store} store, {args.reps} interleaved repetitions of "
          f"{args.steps} steps, log_every=1, system-metrics interval {args.interval:g} s\n")
    # CPU overhead: all the CPU used during fit() (main thread, other threads, server) over the null tracker's, as a
    # share of the null tracker's. On a saturated machine this is what tracking takes from training; unlike
    # samples/s it hardly moves with other processes' load.
    base = out["summary"]["none"]
    base_cpu = base["main_cpu_s"] + base["background_cpu_s"] + base["server_cpu_s"]
    print("| mode | median samples/s | median ratio vs null (per repetition) | CPU s/run: main, other threads, server "
          "| CPU overhead vs null |")
    print("|---|---|---|---|---|")
    for mode, s in out["summary"].items():
        cpu = s["main_cpu_s"] + s["background_cpu_s"] + s["server_cpu_s"]
        print(f"| {mode} | {s['median_samples_s']:.2f} | {s['median_ratio']:.3f} "
              f"({', '.join(f'{r:.3f}' for r in s['ratios'])}) | {s['main_cpu_s']:.1f}, {s['background_cpu_s']:.1f}, "
              f"{s['server_cpu_s']:.1f} | {(cpu - base_cpu) / base_cpu * 100:+.1f}% |")
    step_ms = 1000 / out["summary"]["none"]["median_samples_s"] * null_batch(args.overrides)
    print(f"\nlogging path, main thread: {out['logging_path_ms']:.3f} ms CPU per step (log_metrics + flushes) = "
          f"{out['logging_path_ms'] / step_ms * 100:.3f}% of a {step_ms:.0f} ms training step")
    return 0


if __name__ == "__main__":
    sys.exit(main())

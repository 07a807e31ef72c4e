"""Benchmark: time-to-best of maxout's default HPO against a plain study, which lever buys what, and a replay of
the plain study's real curves at hundreds of trials through Optuna's pruners on N simulated workers.

    .venv/bin/python benchmarks/hpo_time_to_best.py            # 48 MiniLM configurations x 4 epochs, 4 segments:
                                                               # hours on the shared 2-core CPU
    .venv/bin/python benchmarks/hpo_time_to_best.py --smoke    # the tiny model, 6 configurations, 2 epochs

1. Real runs. Two studies over the same configurations (the random sampler with one seed draws them once; they are
   queued in the same order into both), seeded deterministic training, each through the real CLI (`python -m maxout
   hpo ... --no-progress`), one MLflow store and one journal in a temporary folder:
   - plain: sequential, unpruned, no warm start (`hpo.workers=1 hpo.pruner.name=none hpo.warm_start=false`), torch's
     default threads (OMP_NUM_THREADS is not set: that is how a plain user runs; --threads N sets it for both);
   - maxout: its default HPO as shipped (`hpo=default`: its pruner, warm start, hpo.workers as the default says).
   The machine is shared and noisy, so the studies advance in segments (hpo.n_trials = 12, 24, 36, 48 joining the
   same study), alternating which goes first (P M, M P, P M, M P). A study's clock is the sum of its segments' wall
   times, process start to exit (start-up counted for both). Time-to-best: the clock at which a study first
   completes a trial within 0.01 of the plain study's best.
   Levers, from the same runs: pruning (trial-epochs and evaluations), parallel workers (training samples per
   wall-second), warm start (set-up seconds per trial), the compile cache (what hardware=cpu decided about compile).
2. Replay. Trials bootstrapped from the plain study's real curves (every plain trial ran every epoch), several
   random orders, replayed through Optuna's own pruners as a discrete-event simulation of N workers: a trial
   advances report by report at the measured seconds per epoch, per evaluation and per trial set-up, and the
   reports are made in time order, so a trial's pruning decision sees only what had been reported by then. For a
   grid of pruner settings and 1 and 2 workers: compute ratio, time-to-best, how often the best is kept; the pick
   for large studies (hpo_pruning.pick's rule); and the replay's prediction of the real maxout study.

Output: markdown tables (for benchmarks/RESULTS.md), a JSON of every figure (--json), a chart (--figure).
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import heapq
import json
import math
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.hpo_pruning import (WITHIN, Curve, Setting, configurations, curves, grid, matched,  # noqa: E402
                                    open_journal, pick, real_order, replay, same_curves, subsets)



def plain_overrides() -> list[str]:
    """Sequential (one worker, in its process), unpruned, no warm start."""
    return ["hpo.workers=1", "hpo.pruner.name=none", "hpo.warm_start=false"]


def base_overrides(args: argparse.Namespace, out: Path) -> list[str]:
    """What both studies share: the model, the data subsets, the epochs, the search space, the sampler that draws
    the configurations (both studies run queued trials, so the sampler only matters for the draw), the store."""
    return ["hardware=cpu", f"model={args.model}", "hpo=default", f"train.epochs={args.epochs}",
            "train.deterministic=true", "hpo.sampler.name=random", f"hpo.sampler.seed={args.seed}",
            "hpo.log_models=none", "~hpo.search_space.train.target_effective_batch",
            "hpo.search_space.train.lr.low=1e-6", "hpo.search_space.train.lr.high=5e-4",
            *subsets(args.train_rows, args.validation_rows, args.seed, out),
            f"tracking.uri=sqlite:///{out / 'mlflow.db'}", f"tracking.artifact_location={(out / 'art').as_uri()}",
            "tracking.system_metrics=false", f"hpo.storage={out / 'optuna.journal'}"]


def maxout_overrides(args: argparse.Namespace) -> list[str]:
    return [*([f"hpo.workers={args.workers}"] if args.workers else []), *shlex.split(args.maxout_overrides)]


# ------------------------------------------------------------------------------------------------ real runs


@dataclass
class Segment:
    study: str
    n_trials: int
    started: str  # ISO local time, the clock Optuna's datetime_complete uses
    wall_s: float
    log: str


def run_segment(name: str, base: list[str], overrides: list[str], n_trials: int, out: Path,
                threads: Optional[int] = None) -> Segment:
    # OMP_NUM_THREADS is left out for both unless --threads sets it: the plain user's torch default, and maxout's
    # supervisor sets its own.
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    log = out / f"{name}-{n_trials}.log"
    started = dt.datetime.now()
    t0 = time.perf_counter()
    with open(log, "w") as sink:
        code = subprocess.run([sys.executable, "-m", "maxout", "hpo", *base, *overrides, f"hpo.study_name={name}",
                               f"hpo.n_trials={n_trials}", "--no-progress"], cwd=ROOT, env=env, stdout=sink,
                              stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    if code:
        raise SystemExit(f"maxout hpo failed for study {name} (exit {code}): see {log}\n{log.read_text()[-3000:]}")
    return Segment(name, n_trials, started.isoformat(), wall, str(log))


def schedule(configs: int, segments: int) -> list[int]:
    """hpo.n_trials at the end of each segment: 12, 24, 36, 48 for 48 configurations in 4."""
    return [round(configs * (k + 1) / segments) for k in range(segments)]


def run_studies(args: argparse.Namespace, base: list[str], configs: list[dict], out: Path) -> list[Segment]:
    import mlflow
    import optuna

    # The store is created (its schema migrated, seconds on SQLite) before either study starts, so the study that
    # goes first does not pay for it.
    mlflow.MlflowClient(next(o.split("=", 1)[1] for o in base if o.startswith("tracking.uri="))).search_experiments()
    for name in ("plain", "maxout"):
        study = optuna.create_study(study_name=name, storage=open_journal(base), direction="maximize")
        for values in configs:
            study.enqueue_trial(values)
    done = []
    studies = {"plain": plain_overrides(), "maxout": maxout_overrides(args)}
    for k, n_trials in enumerate(schedule(len(configs), args.segments)):
        order = ("plain", "maxout") if k % 2 == 0 else ("maxout", "plain")  # P M, M P, P M, M P
        for name in order:
            segment = run_segment(name, base, studies[name], n_trials, out, args.threads)
            print(f"  segment {k + 1}/{args.segments}: {name} to {n_trials} trials in {segment.wall_s:.0f} s",
                  flush=True)
            done.append(segment)
    return done


def clock_of(when: dt.datetime, segments: list[Segment]) -> float:
    """A moment of a study's run on its own clock: the segments before it summed, plus the time into its own."""
    before = 0.0
    for s in segments:
        start = dt.datetime.fromisoformat(s.started)
        if when <= start + dt.timedelta(seconds=s.wall_s + 1.0):
            return before + max(0.0, (when - start).total_seconds())
        before += s.wall_s
    raise ValueError(f"{when} is after the study's last segment")


def trial_runs(base: list[str], study_name: str) -> dict[int, object]:
    """The study's trial runs in the MLflow store, by trial number."""
    import mlflow

    uri = next(o.split("=", 1)[1] for o in base if o.startswith("tracking.uri="))
    client = mlflow.MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("maxout").experiment_id],
                              f"tags.`maxout.hpo.study` = '{study_name}' and tags.`maxout.command` = 'hpo-trial'")
    return {int(r.data.tags["maxout.hpo.trial_number"]): r.data for r in runs}


def parent_params(base: list[str], study_name: str) -> list[dict]:
    """The workers each invocation (segment) of the study ran with, from its parent run's params (absent where
    this checkout has no hpo.workers), oldest first."""
    import mlflow

    uri = next(o.split("=", 1)[1] for o in base if o.startswith("tracking.uri="))
    client = mlflow.MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("maxout").experiment_id],
                              f"tags.`maxout.hpo.study` = '{study_name}' and tags.`maxout.command` = 'hpo'",
                              order_by=["attributes.start_time ASC"])
    return [{k: v for k, v in r.data.params.items() if k.startswith("hpo.workers")} for r in runs]


def study_figures(name: str, base: list[str], configs: list[dict], segments: list[Segment], target: float) -> dict:
    """A real study's figures from its journal and its trial runs (its queued configurations' trials only)."""
    import optuna
    from optuna.trial import TrialState

    from maxout.hpo.report import counts

    study = optuna.load_study(study_name=name, storage=open_journal(base))
    trials = matched(study, configs)
    # With N workers a study may finish up to N-1 trials past hpo.n_trials (each worker checks the finished count
    # before it starts one): the last segment's extra trials are sampled, not queued. Their time is in the clock;
    # their epochs are counted apart.
    finished = [t for t in study.get_trials(deepcopy=False) if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    queued = {t.number for t in trials}
    extra = [t for t in finished if t.number not in queued]
    own = [s for s in segments if s.study == name]
    c = counts(trials)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    timeline = sorted((clock_of(t.datetime_complete, own), t.value) for t in complete)
    reached = [at for at, value in timeline if value >= target - 1e-12]
    runs = trial_runs(base, name)
    per_trial = []
    for t in trials:
        data = runs.get(t.number)
        if data is None or "time/train_window_s" not in data.metrics:
            continue
        m = data.metrics
        trial_s = (t.datetime_complete - t.datetime_start).total_seconds()
        train_s, eval_s = m["time/train_window_s"], m.get("time/eval_s", 0.0)
        per_trial.append({"trial_s": trial_s, "train_s": train_s, "eval_s": eval_s,
                          "samples": m.get("train/samples", 0.0), "samples_per_s": m.get("perf/samples_per_s"),
                          "epochs": t.user_attrs.get("epochs_run", 0), "evaluations": t.user_attrs.get("evaluations", 0),
                          "model_load_s": m.get("time/model_load_s", 0.0), "tokenize_s": m.get("time/tokenize_s", 0.0),
                          "overhead_s": max(0.0, trial_s - train_s - eval_s)})
    segment_workers = []
    for s in own:  # the workers that finished trials in each segment (one process each)
        start = dt.datetime.fromisoformat(s.started)
        end = start + dt.timedelta(seconds=s.wall_s + 1.0)
        segment_workers.append(len({t.user_attrs.get("worker") for t in study.get_trials(deepcopy=False)
                                    if t.datetime_complete and start <= t.datetime_complete <= end}))
    any_run = next(iter(runs.values()), None)
    params = any_run.params if any_run is not None else {}
    median = lambda key: statistics.median(r[key] for r in per_trial) if per_trial else math.nan  # noqa: E731
    return {
        "name": name, "best": max(t.value for t in complete) if complete else math.nan,
        "time_to_best_s": reached[0] if reached else math.nan, "clock_s": sum(s.wall_s for s in own),
        "segments_s": [s.wall_s for s in own], "trial_epochs": c["hpo/trial_epochs_run"],
        "planned_epochs": c["hpo/trial_epochs_without_pruning"], "evaluations": int(c["hpo/trial_evaluations"]),
        "pruned": int(c["hpo/trials_pruned"]), "trials": len(trials), "workers": max(segment_workers or [0]),
        "segment_workers": segment_workers, "extra_trials": len(extra),
        "all_trial_epochs": counts(finished)["hpo/trial_epochs_run"],
        "all_pruned": int(counts(finished)["hpo/trials_pruned"]), "workers_params": parent_params(base, name),
        "timeline": timeline, "params": [t.params for t in trials],
        "epoch_s": statistics.median(r["train_s"] / r["epochs"] for r in per_trial if r["epochs"]) if per_trial
        else math.nan,
        "eval_s": statistics.median(r["eval_s"] / r["evaluations"] for r in per_trial if r["evaluations"])
        if per_trial else math.nan,
        "overhead_s": median("overhead_s"), "model_load_s": median("model_load_s"), "tokenize_s": median("tokenize_s"),
        "trial_s": median("trial_s"), "samples_per_s": (sum(r["samples"] for r in per_trial) /
                                                        sum(r["train_s"] for r in per_trial)) if per_trial else math.nan,
        "compile": {k: v for k, v in params.items() if k.startswith("opt.compile.")},
    }


def levers(plain: dict, maxout: dict) -> dict:
    """Each lever as a factor on the plain study's time, from the two real studies."""
    pruning = plain["trial_epochs"] / maxout["trial_epochs"]
    # Training throughput per wall-second: one trial's samples/s, times the workers running at once.
    parallel = maxout["workers"] * maxout["samples_per_s"] / plain["samples_per_s"]
    # Warm start: a plain trial's seconds with maxout's set-up instead of its own.
    warm = plain["trial_s"] / max(1e-9, plain["trial_s"] - plain["overhead_s"] + maxout["overhead_s"])
    # hardware=cpu leaves compile off (conf/hardware/cpu.yaml: ~40 s of inductor for MiniLM, little steady-state
    # gain; the trial runs' opt.compile.* params say so): no compile, so the shared cache buys nothing here.
    compile_cache = 1.0
    return {"pruning": pruning, "evaluations": plain["evaluations"] / max(1, maxout["evaluations"]),
            "parallel": parallel, "warm_start": warm, "compile_cache": compile_cache,
            "product": pruning * parallel * warm * compile_cache,
            "measured_time_to_best": plain["time_to_best_s"] / maxout["time_to_best_s"],
            "measured_clock": plain["clock_s"] / maxout["clock_s"]}


# ------------------------------------------------------------------------------------------------ replay


@dataclass
class Costs:
    """Seconds a simulated worker spends: per trained epoch, per evaluation, per trial's set-up."""

    epoch_s: float
    eval_s: float
    setup_s: float
    source: str = ""


@functools.lru_cache(maxsize=None)
def pruner_config(overrides: tuple) -> object:
    """The hpo config of a pruner setting, composed once (a composition costs a fraction of a second)."""
    from maxout.loading import load

    return load(["hardware=cpu", "model=tiny", "hpo=default", *overrides]).hpo


def simulate(trials: list[Curve], setting: Optional[Setting], costs: Costs, workers: int, study_name: str,
             target: Optional[float] = None, order: Optional[list] = None) -> dict:
    """A discrete-event simulation of ``workers`` workers on one study: each takes the next trial when free (ask),
    the trial advances report by report (set-up, then per report its epochs' training and one evaluation), and
    every report is made (trial.report, should_prune) in time order on one in-memory study, so a decision sees
    only the reports made before it, as with real parallel workers. ``setting`` None: no pruning."""
    import optuna
    from optuna.trial import TrialState

    from maxout.hpo.study import build_pruner

    every = setting.every if setting else 1
    reports = len(trials[0].values) // every
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if setting:
            pruner = build_pruner(pruner_config(tuple(setting.overrides(1.0)[1:])), reports)
        else:
            pruner = optuna.pruners.NopPruner()
        study = optuna.create_study(study_name=study_name, direction="maximize", pruner=pruner)
    queue = list(order if order is not None else range(len(trials)))
    events: list = []  # (time, sequence, worker, trial, curve index, k, epochs trained by the previous report)
    sequence = 0
    epochs = evaluations = pruned = 0.0
    best, first_at, finished_at = -math.inf, math.nan, 0.0
    timeline = []

    def start(worker: int, now: float) -> None:
        nonlocal sequence
        while queue:
            index = queue.pop(0)
            trial = study.ask()
            if index is None:  # a trial that failed in the real study
                study.tell(trial, state=TrialState.FAIL)
                continue
            kept = list(zip(trials[index].values, trials[index].epochs))[every - 1::every]
            due = now + costs.setup_s + kept[0][1] * costs.epoch_s + costs.eval_s
            heapq.heappush(events, (due, sequence, worker, trial, index, 1, 0.0))
            sequence += 1
            return

    for w in range(workers):
        start(w, 0.0)
    while events:
        now, _, worker, trial, index, k, _ = heapq.heappop(events)
        curve = trials[index]
        kept = list(zip(curve.values, curve.epochs))[every - 1::every]
        (_, value), at_epochs = kept[k - 1]
        trial.report(value, k)
        if k < len(kept) and trial.should_prune():
            study.tell(trial, state=TrialState.PRUNED)
            epochs, evaluations, pruned = epochs + at_epochs, evaluations + k, pruned + 1
        elif k < len(kept):
            due = now + (kept[k][1] - at_epochs) * costs.epoch_s + costs.eval_s
            heapq.heappush(events, (due, sequence, worker, trial, index, k + 1, at_epochs))
            sequence += 1
            continue
        else:
            final = max(v for (_, v), _ in kept)  # the trial's value is its best evaluation's (train.select_best)
            study.tell(trial, final)
            epochs, evaluations = epochs + curve.planned, evaluations + len(kept)
            best = max(best, final)
            timeline.append((now, final))
            if target is not None and math.isnan(first_at) and final >= target - 1e-12:
                first_at = now
        finished_at = max(finished_at, now)
        start(worker, now)
    planned = sum(trials[i].planned for i in (order if order is not None else range(len(trials))) if i is not None)
    return {"epochs": epochs, "evaluations": evaluations, "pruned": pruned, "best": best, "planned": planned,
            "time_to_best_s": first_at, "clock_s": finished_at, "timeline": timeline}


def bootstrap(recorded: list[Curve], n: int, seed: int) -> list[Curve]:
    rng = random.Random(seed)
    return [recorded[rng.randrange(len(recorded))] for _ in range(n)]


def replay_grid(recorded: list[Curve], costs: dict[int, Costs], plain_costs: Costs, n: int, orders: int,
                study_name: str) -> list[dict]:
    """Every grid setting on 1 and 2 workers, over ``orders`` bootstrap samples of ``n`` trials: the plain study
    (sequential, unpruned, plain costs) is each sample's reference for the best and the clock."""
    samples = [bootstrap(recorded, n, seed) for seed in range(orders)]
    references = []
    for sample in samples:
        ref_best = max(max(v for _, v in c.values) for c in sample)
        references.append(simulate(sample, None, plain_costs, 1, study_name, ref_best - WITHIN))
    settings = [s for s in grid() if s.min_resource <= len(recorded[0].values) // s.every]
    rows = []
    for setting in settings:
        for workers, cost in sorted(costs.items()):
            results = [simulate(sample, setting, cost, workers, study_name, ref["best"] - WITHIN)
                       for sample, ref in zip(samples, references)]
            kept = [r["best"] >= ref["best"] - WITHIN - 1e-12 for r, ref in zip(results, references)]
            ratios = [r["planned"] / r["epochs"] for r in results]
            # Compute saved on this worker count's costs: the same trials unpruned, one evaluation per epoch.
            base_s = [r["planned"] * (cost.epoch_s + cost.eval_s) for r in results]
            spent_s = [r["epochs"] * cost.epoch_s + r["evaluations"] * cost.eval_s for r in results]
            speedups = [ref["time_to_best_s"] / r["time_to_best_s"] for r, ref in zip(results, references)
                        if not math.isnan(r["time_to_best_s"])]
            rows.append({**asdict(setting), "label": setting.label(1.0), "workers": workers,
                         "ratio": statistics.median(ratios), "pruned": statistics.median(r["pruned"] for r in results),
                         "epochs": statistics.median(r["epochs"] for r in results),
                         "evaluations": statistics.median(r["evaluations"] for r in results),
                         "most_epochs": max(r["epochs"] for r in results),
                         "planned": results[0]["planned"],
                         "saved_with_eval": statistics.median(1 - s / b for s, b in zip(spent_s, base_s)),
                         "kept": sum(kept) / len(kept), "ok": all(kept),
                         "time_to_best_s": statistics.median(r["time_to_best_s"] for r in results),
                         "plain_time_to_best_s": statistics.median(ref["time_to_best_s"] for ref in references),
                         "time_to_best_speedup": statistics.median(speedups) if speedups else math.nan,
                         "clock_speedup": statistics.median(ref["clock_s"] / r["clock_s"]
                                                            for r, ref in zip(results, references))})
    return rows


def setting_of(overrides: list[str]) -> Optional[Setting]:
    """The pruner setting a study's overrides give (None: no pruning), in units of the recorded per-epoch reports."""
    from maxout.loading import load

    hpo = load(["hardware=cpu", "model=tiny", "hpo=default", *overrides]).hpo
    if hpo.pruner.name == "none":
        return None
    every = hpo.report_every_epochs or 1
    if hpo.report_every_steps is not None or every < 1 or float(every) != int(every):
        return None  # finer than the recorded curves: the replay cannot show it
    return Setting(int(every), hpo.pruner.min_resource, hpo.pruner.reduction_factor, hpo.pruner.patience)


def curve_difference(plain, maxout, configs: list[dict]) -> float:
    try:
        return same_curves(plain, maxout, configs)
    except KeyError:  # maxout reported at other steps (--maxout-overrides hpo.report_every_epochs=...)
        return math.nan


def curves_ok(recorded: list[Curve]) -> bool:
    return len({len(c.values) for c in recorded}) == 1


# ------------------------------------------------------------------------------------------------ output


def chart(plain: dict, maxout: dict, target: float, path: Path) -> None:
    from maxout.train.reports import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for study, color in ((plain, "tab:gray"), (maxout, "tab:blue")):
        xs, ys, best = [0.0], [math.nan], -math.inf
        for at, value in study["timeline"]:
            best = max(best, value)
            xs.append(at / 60)
            ys.append(best)
        xs.append(study["clock_s"] / 60)
        ys.append(best)
        ax.step(xs, ys, where="post", color=color, label=f"{study['name']} (workers {study['workers']})")
        ax.scatter([at / 60 for at, _ in study["timeline"]], [v for _, v in study["timeline"]], color=color, s=10,
                   alpha=0.4)  # each completed trial's score
        if not math.isnan(study["time_to_best_s"]):
            ax.axvline(study["time_to_best_s"] / 60, color=color, linestyle=":")
    ax.axhline(target, color="0.6", linestyle="--", label="plain best - 0.01")
    ax.set_xlabel("study clock, minutes (segments summed, start-up included)")
    ax.set_ylabel("best eval/macro_f1 so far")
    ax.legend(fontsize=8, loc="lower right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def compile_text(study: dict) -> str:
    c = study["compile"]
    text = f"requested {c.get('opt.compile.requested', '?')}, effective {c.get('opt.compile.effective', '?')}"
    return text + (f" ({c['opt.compile.reason']})" if c.get("opt.compile.reason") else "")


def report(args: argparse.Namespace, found: dict) -> str:
    p, m, lv = found["plain"], found["maxout"], found["levers"]
    lines = [f"## Time-to-best: {args.model}, {args.configs} configurations x {args.epochs} epochs, "
             f"{args.train_rows} training / {args.validation_rows} validation rows, {args.segments} segments "
             f"interleaved (P M, M P, ...), random sampler seed {args.seed}", "",
             "| study | best eval/macro_f1 | time-to-best s | total clock s | trial-epochs | evaluations | pruned | "
             "workers |", "|---|---|---|---|---|---|---|---|"]
    for s, overrides in ((p, plain_overrides()), (m, ["hpo=default", *maxout_overrides(args)])):
        lines.append(f"| {s['name']} (`{' '.join(overrides)}`) | {s['best']:.4f} | {s['time_to_best_s']:.0f} | "
                     f"{s['clock_s']:.0f} | {s['trial_epochs']:.1f} / {s['planned_epochs']:.0f} | {s['evaluations']} | "
                     f"{s['pruned']} | {s['workers']} |")
    lines += ["", f"**Time-to-best ratio plain / maxout: {lv['measured_time_to_best']:.2f}x** (target: the plain best "
              f"{p['best']:.4f} - 0.01); total clock ratio {lv['measured_clock']:.2f}x; segments (s): plain "
              f"{', '.join(f'{x:.0f}' for x in p['segments_s'])}; maxout "
              f"{', '.join(f'{x:.0f}' for x in m['segments_s'])}; maxout's workers per segment "
              f"{m['segment_workers']} (parent runs' params: {m['workers_params']}).", "",
              "| lever | plain | maxout | factor |", "|---|---|---|---|",
              f"| pruning: trial-epochs (evaluations) | {p['trial_epochs']:.1f} ({p['evaluations']}) | "
              f"{m['trial_epochs']:.1f} ({m['evaluations']}) | {lv['pruning']:.2f}x ({lv['evaluations']:.2f}x) |",
              f"| parallel workers: training samples per wall-second (workers x per-trial samples/s) | "
              f"{p['samples_per_s']:.1f} | {m['workers']} x {m['samples_per_s']:.1f} | {lv['parallel']:.2f}x |",
              f"| warm start: set-up s per trial (trial - training - evaluation; model load + tokenization) | "
              f"{p['overhead_s']:.2f} ({p['model_load_s']:.2f} + {p['tokenize_s']:.2f}) | {m['overhead_s']:.2f} "
              f"({m['model_load_s']:.2f} + {m['tokenize_s']:.2f}) | {lv['warm_start']:.2f}x |",
              f"| compile cache: hardware=cpu's compile decision (opt.compile.*) | {compile_text(p)} | "
              f"{compile_text(m)} | "
              f"{lv['compile_cache']:.2f}x |",
              f"| **product of the levers / measured** | | | **{lv['product']:.2f}x / {lv['measured_time_to_best']:.2f}x "
              f"(time-to-best), {lv['measured_clock']:.2f}x (clock)** |", "",
              f"Measured costs: plain {p['epoch_s']:.1f} s per epoch, {p['eval_s']:.1f} s per evaluation; maxout "
              f"{m['epoch_s']:.1f} s per epoch per worker, {m['eval_s']:.1f} s per evaluation."]
    r = found["replay"]
    if r:
        lines += ["", f"## Replay: {r['n']} trials bootstrapped from the plain study's {args.configs} real curves, "
                  f"{r['orders']} samples (seeds 0..{r['orders'] - 1}), discrete-event simulation of N workers", "",
                  "Costs per worker count: " + "; ".join(f"{w} worker(s): {c['epoch_s']:.1f} s/epoch, "
                                                        f"{c['eval_s']:.1f} s/evaluation, {c['setup_s']:.1f} s "
                                                        f"set-up ({c['source']})" for w, c in r["costs"].items()),
                  "", "| setting | workers | compute ratio | saved incl. evaluations | pruned | best kept (of "
                  "samples) | time-to-best speed-up vs plain | clock speed-up |", "|---|---|---|---|---|---|---|---|"]
        for row in sorted(r["rows"], key=lambda x: (x["workers"], -x["ratio"])):
            mark = " **(picked)**" if (row["label"] == r["chosen"]["label"] and row["workers"] == r["chosen"]["workers"]) \
                else ""
            lines.append(f"| {row['label']}{mark} | {row['workers']} | {row['ratio']:.2f}x | "
                         f"{row['saved_with_eval']:.0%} | {row['pruned']:.0f} | {row['kept']:.0%} | "
                         f"{row['time_to_best_speedup']:.2f}x | {row['clock_speedup']:.2f}x |")
        q = r["prediction"]
        if q:
            lines += ["", f"Replay's prediction for the real maxout study ({q['label']}, {q['workers']} worker(s), "
                      f"its real trial order): {q['epochs']:.1f} trial-epochs, {q['pruned']:.0f} pruned, best "
                      f"{q['best']:.4f}; real: {m['all_trial_epochs']:.1f} trial-epochs ({m['extra_trials']} "
                      f"trial(s) past the queue included), {m['all_pruned']} pruned, best "
                      f"{m['best']:.4f}. Largest difference between one configuration's reports in the two real "
                      f"studies: {found['curve_difference']:.2g}."]
    lines += ["", f"Run time {found['run_s']:.0f} s; load average {found['load']}; store {found['out']}."]
    return "\n".join(lines)


def parse(argv: Optional[list] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--configs", type=int, default=48)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--train-rows", type=int, default=96)
    parser.add_argument("--validation-rows", type=int, default=64)
    parser.add_argument("--segments", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS for both studies (default: unset, torch's own count, as a plain user "
                        "runs; on a machine shared with other work, 1 keeps torch's threads from spinning against it)")
    parser.add_argument("--workers", default="", help="hpo.workers for the maxout study (default: as shipped)")
    parser.add_argument("--maxout-overrides", default="", help="more overrides for the maxout study")
    parser.add_argument("--replay-trials", type=int, default=240)
    parser.add_argument("--replay-orders", type=int, default=20)
    parser.add_argument("--out", default="", help="the folder for the store and journal (default: a temp dir)")
    parser.add_argument("--json", default="", help="where to write every figure (default: OUT/time_to_best.json)")
    parser.add_argument("--figure", default=None, help="the chart (default: benchmarks/figures/hpo_time_to_best.png; "
                        "with --smoke, in the store's folder)")
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny model, 6 configurations, 2 epochs, 2 segments, a replay of 20 trials")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.configs, args.epochs, args.segments = "tiny", 6, 2, 2
        args.replay_trials, args.replay_orders = 20, 2
    if args.configs < args.segments:
        parser.error(f"--configs {args.configs}: at least one configuration per segment ({args.segments})")
    return args


def main(argv: Optional[list] = None) -> dict:
    t0 = time.perf_counter()
    args = parse(argv)
    os.chdir(ROOT)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="maxout-bench-ttb-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.figure is None:
        args.figure = str(out / "hpo_time_to_best.png" if args.smoke else ROOT / "benchmarks/figures/hpo_time_to_best.png")
    base = base_overrides(args, out)
    configs = configurations(base, args.configs, args.seed)
    segments = run_studies(args, base, configs, out)
    import optuna

    plain_study = optuna.load_study(study_name="plain", storage=open_journal(base))
    plain_best = max(t.value for t in matched(plain_study, configs) if t.value is not None)
    target = plain_best - WITHIN
    plain = study_figures("plain", base, configs, segments, target)
    maxout = study_figures("maxout", base, configs, segments, target)
    found = {"args": vars(args), "configurations": configs, "segments": [asdict(s) for s in segments],
             "target": target, "plain": plain, "maxout": maxout, "levers": levers(plain, maxout), "replay": None,
             # The largest difference between one configuration's reports in the two studies (0: the same curves;
             # torch's thread count per process can change the last digits).
             "curve_difference": curve_difference(plain_study, optuna.load_study(study_name="maxout",
                                                                                storage=open_journal(base)), configs)}

    print(f"  studies done at {time.perf_counter() - t0:.0f} s; replaying", flush=True)
    recorded = curves(plain_study, configs)
    if curves_ok(recorded):
        workers_m = max(1, maxout["workers"])
        plain_costs = Costs(plain["epoch_s"], plain["eval_s"], plain["overhead_s"], "plain study")
        # Per worker count, the costs of the real study that ran with it: maxout's for its workers; for one worker
        # (when maxout ran more) the plain study's training and evaluation with maxout's set-up (warm start); two
        # workers, when no study ran them, are assumed to share the cores with no gain (twice one worker's seconds).
        maxout_costs = Costs(maxout["epoch_s"], maxout["eval_s"], maxout["overhead_s"], "maxout study")
        costs = {workers_m: maxout_costs}
        if 1 not in costs:
            costs[1] = Costs(plain["epoch_s"], plain["eval_s"], maxout["overhead_s"],
                             "plain study's epoch and evaluation, maxout's set-up")
        if 2 not in costs:
            costs[2] = Costs(costs[1].epoch_s * 2, costs[1].eval_s * 2, costs[1].setup_s,
                             "assumed: one worker's seconds x2, no gain from sharing the cores")
        rows = replay_grid(recorded, costs, plain_costs, args.replay_trials, args.replay_orders, "maxout")
        chosen = pick([r for r in rows if r["workers"] == workers_m])
        setting = setting_of(["hpo=default", *maxout_overrides(args)])
        prediction = None
        if setting is not None:
            real = optuna.load_study(study_name="maxout", storage=open_journal(base))
            order = real_order(real, configs)
            sim = simulate(recorded, setting, maxout_costs, workers_m, "maxout", target, order)
            sequential = replay(recorded, setting, "maxout", order=order)
            prediction = {**{k: v for k, v in sim.items() if k != "timeline"}, "label": setting.label(1.0),
                          "workers": workers_m, "sequential": sequential}
        found["replay"] = {"n": args.replay_trials, "orders": args.replay_orders,
                           "costs": {w: asdict(c) for w, c in sorted(costs.items())}, "plain_costs": asdict(plain_costs),
                           "rows": rows, "chosen": chosen, "prediction": prediction}
    found["run_s"] = time.perf_counter() - t0
    found["load"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    found["out"] = str(out)
    if args.figure:
        chart(plain, maxout, target, Path(args.figure))
    text = report(args, found)
    Path(args.json or out / "time_to_best.json").write_text(json.dumps(found, indent=1, default=str))
    print(text)
    if args.figure:
        print(f"\nChart: {args.figure}")
    print(f"JSON: {args.json or out / 'time_to_best.json'}")
    return found


if __name__ == "__main__":
    main()

"""Benchmark: what pruning saves in an HPO study, the trade-off over pruner settings, and the per-trial overhead.

    .venv/bin/python benchmarks/hpo_pruning.py                   # 32 trials x 8 epochs, MiniLM; hours on the
                                                                 # shared 2-core CPU (see benchmarks/RESULTS.md)
    .venv/bin/python benchmarks/hpo_pruning.py --trials 4 --epochs 2 --model tiny --skip-overhead --skip-compile

1. Pruning. The demo project (MiniLM, a stratified subset of the training and validation tables), one study
   without pruning, then the same study with pruning. The random sampler with one seed draws the
   configurations, queued into both studies as trials 0, 1, ... (so the unpruned study can run on several worker
   processes and still train exactly those), and training is seeded and deterministic on one CPU thread, so a
   trial's learning curve is the same in both studies up to where pruning stops it: the studies differ only in
   what pruning stopped. The pruned study runs on one worker (its pruning depends on the trials' order).
   Reported per study: trial-epochs run, evaluations run, compute saved, the trials' time summed (one worker's
   wall time) and the elapsed time, best score.
2. Trade-off. Because the curves are reproducible, the unpruned study's curves are replayed through Optuna's own
   pruners (an in-memory study, same study name, so the same Hyperband brackets) for a grid of settings: report
   interval (every 0.5 or 1 epoch), Hyperband's min_resource and reduction_factor, with and without
   PatientPruner. Each gives the trial-epochs it would run and the best score it would keep, without training
   again. The pruned study (section 1) runs the setting picked from this curve (the most compute saved, counting
   evaluations too, at a best score within 0.01 of the unpruned study's), or with --pruned the given setting,
   then at the same time as the unpruned study; its real figures are checked against the replay's prediction.
3. Per-trial overhead: one-step trials (16 validation rows) with hpo.warm_start on and off and, with
   --before-src, an earlier checkout's code, each in its own process, interleaved: seconds per trial, and the
   set-up it logs (model load, tokenization).
4. Compile cache (--skip-compile to leave out): the tiny model with hardware.compile=true, tuning only optimizer-side
   hyper-parameters: a first process compiles into an empty TorchInductor cache, a second trial runs in the same
   process, a second process (another worker) on the now warm on-disk cache.

Everything lands in a temporary MLflow store and journal (printed at the end). Ratios come from one run: the
machine is shared, so seconds are noisy; trial-epochs and evaluations are the robust measure.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
WITHIN = 0.01  # the best score a pruned study may lose


def subsets(train_rows: int, validation_rows: int, seed: int, out: Path) -> list[str]:
    """Stratified subsets of the demo's tables, written to ``out``; the data overrides for them."""
    from maxout.data import read_table

    paths = []
    for name, rows in (("train", train_rows), ("validation", validation_rows)):
        table = read_table(f"projects/nli_demo/data/{name}.csv")
        if rows < len(table):
            table = table.groupby("label", group_keys=False).sample(frac=rows / len(table), random_state=seed)
        table.to_csv(out / f"{name}.csv", index=False)
        paths.append(f"data.{name}_path={out / f'{name}.csv'}")
    return paths


def store(out: Path, worker: int = 0) -> list[str]:
    """One MLflow store per worker process (SQLite serialises writers), one Optuna journal for all."""
    name = "mlflow.db" if worker == 0 else f"mlflow-{worker}.db"
    return [f"tracking.uri=sqlite:///{out / name}", f"tracking.artifact_location={(out / 'art').as_uri()}",
            "tracking.system_metrics=false", f"hpo.storage={out / 'optuna.journal'}"]


def worker_store(base: list[str], worker: int) -> list[str]:
    out = Path(next(o.split("=", 1)[1] for o in base if o.startswith("hpo.storage="))).parent
    return store(out, worker)


def tracking_uris(base: list[str]) -> list[str]:
    out = Path(next(o.split("=", 1)[1] for o in base if o.startswith("hpo.storage="))).parent
    return [f"sqlite:///{db}" for db in sorted(out.glob("mlflow*.db"))]


def base_overrides(args: argparse.Namespace, out: Path, write: bool = True) -> list[str]:
    return ["hardware=cpu", f"model={args.model}", "hpo=default", "hpo.workers=1", f"train.epochs={args.epochs}",
            f"hpo.n_trials={args.trials}", "hpo.sampler.name=random", f"hpo.sampler.seed={args.seed}",
            "hpo.log_models=none", "~hpo.search_space.train.target_effective_batch",
            "hpo.search_space.train.lr.low=1e-6", "hpo.search_space.train.lr.high=5e-4",
            f"hpo.report_every_epochs={args.report_every}", "train.deterministic=true",
            *(subsets(args.train_rows, args.validation_rows, args.seed, out) if write else
              [f"data.{name}_path={out / f'{name}.csv'}" for name in ("train", "validation")]), *store(out)]


# ------------------------------------------------------------------------------------------------ the studies


@dataclass
class StudyFigures:
    name: str
    overrides: list
    workers: int
    best: float
    epochs: float
    planned: float
    evaluations: int
    pruned: int
    elapsed_s: float
    trial_s: float  # the trials' durations summed: the wall time one worker would take


def open_journal(base: list[str]):
    import optuna

    journal = next(o.split("=", 1)[1] for o in base if o.startswith("hpo.storage="))
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(journal))


def configurations(base: list[str], n: int, seed: int) -> list[dict]:
    """The first ``n`` configurations the random sampler with ``seed`` draws (what hpo.sampler.seed gives)."""
    import optuna

    from maxout import loading
    from maxout.hpo import search_space

    cfg = loading.load(base)
    specs = search_space.load(cfg.hpo.search_space, cfg)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    draw = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    return [search_space.suggest(draw.ask(), specs) for _ in range(n)]


class Running:
    """A study run by ``workers`` ``maxout hpo`` processes of one torch thread each, with ``configs`` queued as its
    trials 0, 1, ... (so the pruned and unpruned studies train the same configurations under the same trial
    numbers, whatever the number of workers). One worker per MLflow store (SQLite serialises writers)."""

    def __init__(self, name: str, base: list[str], overrides: list[str], configs: list[dict], workers: int,
                 first_store: int = 0):
        import optuna

        self.name, self.base, self.overrides, self.configs, self.workers = name, base, overrides, configs, workers
        study = optuna.create_study(study_name=name, storage=open_journal(base), direction="maximize")
        for values in configs:
            study.enqueue_trial(values)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.started = time.perf_counter()
        self.logs = [Path(tempfile.gettempdir()) / f"maxout-bench-{name}-{i}.log" for i in range(workers)]
        self.procs = [subprocess.Popen([sys.executable, "-m", "maxout", "hpo", *base,
                                        *worker_store(base, first_store + i), *overrides, f"hpo.study_name={name}",
                                        f"hpo.n_trials={len(configs)}", "--no-progress"], cwd=ROOT, env=env,
                                       stdout=open(log, "w"), stderr=subprocess.STDOUT)
                      for i, log in enumerate(self.logs)]

    def wait(self) -> None:
        if any(p.wait() for p in self.procs):
            raise SystemExit(f"maxout hpo failed for study {self.name}: see {[str(log) for log in self.logs]}")


def matched(study, configs: list[dict]) -> list:
    """The study's finished trial of each queued configuration, in the configurations' order. By parameters, not
    trial number: a trial whose worker was lost (FAIL) is queued again under a later number."""
    from optuna.trial import TrialState

    finished = [t for t in study.get_trials(deepcopy=False) if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    return [next(t for t in finished if t.params == values) for values in configs]


def figures(name: str, study, configs: list[dict], overrides: list[str]) -> StudyFigures:
    """A study's figures from its storage: its queued configurations' trials only (a worker may start one trial
    more once the queue is empty)."""
    import optuna

    from maxout.hpo.report import counts

    trials = matched(study, configs)
    c = counts(trials)
    complete = [t.value for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    spent = sum((t.datetime_complete - t.datetime_start).total_seconds() for t in trials)
    elapsed = (max(t.datetime_complete for t in trials) - min(t.datetime_start for t in trials)).total_seconds()
    workers = len({t.user_attrs.get("worker") for t in study.get_trials(deepcopy=False)})
    return StudyFigures(name, overrides, workers, max(complete) if complete else math.nan, c["hpo/trial_epochs_run"],
                        c["hpo/trial_epochs_without_pruning"], int(c["hpo/trial_evaluations"]),
                        int(c["hpo/trials_pruned"]), elapsed, spent)


def real_order(study, configs: list[dict]) -> list[Optional[int]]:
    """The pruned study's trials by number: the configuration each ran, None for a trial that failed (the replay
    repeats the same sequence, so each trial meets the same Hyperband bracket and competitors)."""
    from optuna.trial import TrialState

    order: list[Optional[int]] = []
    for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number):
        index = next((i for i, values in enumerate(configs) if t.params == values), None)
        order.append(index if t.state in (TrialState.COMPLETE, TrialState.PRUNED) else None)
    return order


def load_study(base: list[str], name: str):
    import optuna

    return optuna.load_study(study_name=name, storage=open_journal(base))


def costs(base: list[str], study_name: str) -> tuple[float, float]:
    """Median seconds per trained epoch and per evaluation, from the study's trial runs."""
    import mlflow

    done = []
    for uri in tracking_uris(base):
        client = mlflow.MlflowClient(uri)
        runs = client.search_runs([client.get_experiment_by_name("maxout").experiment_id],
                                  f"tags.`maxout.hpo.study` = '{study_name}' and tags.`maxout.command` = 'hpo-trial'")
        done += [r.data.metrics for r in runs if "time/eval_s" in r.data.metrics]
    epoch = statistics.median(m["time/train_window_s"] / m["hpo/epochs_run"] for m in done)
    evaluation = statistics.median(m["time/eval_s"] / m["hpo/evaluations"] for m in done)
    return epoch, evaluation


# ------------------------------------------------------------------------------------------------ the replay


@dataclass
class Curve:
    """One trial of the unpruned study: its value at each report and the epochs trained by then."""

    values: list  # (report step, value)
    epochs: list  # epochs trained at each report
    planned: float


def curves(study, configs: list[dict]) -> list[Curve]:
    """The unpruned study's trial of each configuration, in the configurations' order."""
    out = []
    for t in matched(study, configs):
        steps = sorted(t.intermediate_values)
        per_report = t.user_attrs["epochs_planned"] / steps[-1]  # reports are evenly spaced in epochs
        out.append(Curve([(k, t.intermediate_values[k]) for k in steps], [k * per_report for k in steps],
                         t.user_attrs["epochs_planned"]))
    return out


@dataclass
class Setting:
    every: int  # report every this many recorded reports (1: as recorded; 2: half as often)
    min_resource: int
    reduction_factor: int
    patience: Optional[int]  # None: Hyperband alone; 0: PatientPruner(patience 0), the old default

    def overrides(self, recorded_every: float) -> list[str]:
        return [f"hpo.report_every_epochs={self.every * recorded_every:g}", f"hpo.pruner.min_resource={self.min_resource}",
                f"hpo.pruner.reduction_factor={self.reduction_factor}",
                f"hpo.pruner.patience={'null' if self.patience is None else self.patience}"]

    def label(self, recorded_every: float) -> str:
        chain = "Hyperband" if self.patience is None else f"Patient({self.patience})+Hyperband"
        return (f"{chain}, report every {self.every * recorded_every:g} ep, min_resource {self.min_resource}, "
                f"reduction {self.reduction_factor}")


def replay(trials: list[Curve], setting: Setting, study_name: str, direction: str = "maximize",
           order: Optional[list] = None) -> dict:
    """What a study with ``setting`` would have run, trial by trial in order, on these curves. ``order``: the
    curve each trial number runs (None: a failed trial), as in a real study; default: 0, 1, 2, ..."""
    import optuna
    from optuna.trial import TrialState

    from maxout.hpo.study import build_pruner
    from maxout.loading import load

    hpo = load(["hardware=cpu", "model=tiny", "hpo=default", *setting.overrides(1.0)[1:]]).hpo
    reports = len(trials[0].values) // setting.every
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        study = optuna.create_study(study_name=study_name, direction=direction, pruner=build_pruner(hpo, reports))
    epochs = evaluations = pruned = 0.0
    best = -math.inf if direction == "maximize" else math.inf
    for index in (order if order is not None else range(len(trials))):
        trial = study.ask()
        if index is None:
            study.tell(trial, state=TrialState.FAIL)
            continue
        curve = trials[index]
        kept = list(zip(curve.values, curve.epochs))[setting.every - 1::setting.every]
        stopped = None
        for k, ((_, value), at_epochs) in enumerate(kept, 1):
            trial.report(value, k)
            if k < len(kept) and trial.should_prune():
                stopped = at_epochs, k
                break
        if stopped:
            study.tell(trial, state=TrialState.PRUNED)
            epochs, evaluations, pruned = epochs + stopped[0], evaluations + stopped[1], pruned + 1
        else:
            final = max(v for (_, v), _ in kept) if direction == "maximize" else min(v for (_, v), _ in kept)
            study.tell(trial, final)  # the trial's value is its best evaluation's (train.select_best)
            epochs, evaluations = epochs + curve.planned, evaluations + len(kept)
            best = max(best, final) if direction == "maximize" else min(best, final)
    planned = sum(c.planned for c in trials)
    return {"epochs": epochs, "evaluations": evaluations, "pruned": pruned, "best": best, "planned": planned}


def grid() -> list[Setting]:
    return [Setting(every, min_resource, factor, patience)
            for every, min_resource, factor, patience in itertools.product((1, 2), (1, 2, 4), (2, 3, 4), (None, 0))]


def trade_off(trials: list[Curve], study_name: str, unpruned_best: float, epoch_s: float, eval_s: float,
              recorded_every: float) -> list[dict]:
    """Every grid setting, replayed: compute saved (trial-epochs; and with evaluations, in measured seconds)."""
    base_epochs = sum(c.planned for c in trials)
    # Without pruning nothing needs reports within epochs: the baseline evaluates once per epoch (train's default).
    baseline = base_epochs * (epoch_s + eval_s)
    rows = []
    for setting in grid():
        if setting.min_resource > len(trials[0].values) // setting.every:
            continue  # a rung past the last report: nothing could be pruned
        r = replay(trials, setting, study_name)
        rows.append({**asdict(setting), "label": setting.label(recorded_every), **r,
                     "saved": 1 - r["epochs"] / base_epochs, "ratio": base_epochs / r["epochs"],
                     "saved_with_eval": 1 - (r["epochs"] * epoch_s + r["evaluations"] * eval_s) / baseline,
                     "loss": unpruned_best - r["best"], "ok": unpruned_best - r["best"] <= WITHIN + 1e-12})
    return rows


def pick(rows: list[dict]) -> dict:
    """The most compute saved (evaluations counted) among the settings that keep the best score within 0.01."""
    ok = [r for r in rows if r["ok"]] or rows
    return max(ok, key=lambda r: (round(r["saved_with_eval"], 3), r["patience"] is None, -r["min_resource"]))


def trade_off_png(rows: list[dict], chosen: dict, path: Path) -> None:
    from maxout.train.reports import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for every, marker in ((1, "o"), (2, "s")):
        for patience, color in ((None, "tab:blue"), (0, "tab:orange")):
            sel = [r for r in rows if r["every"] == every and r["patience"] == patience]
            chain = "Hyperband" if patience is None else "PatientPruner(0)+Hyperband"
            ax.scatter([r["ratio"] for r in sel], [r["best"] for r in sel], marker=marker, color=color, alpha=0.7,
                       label=f"{chain}, report every {'1st' if every == 1 else '2nd'} recorded report")
    ax.scatter([chosen["ratio"]], [chosen["best"]], s=160, facecolors="none", edgecolors="black", label="picked")
    ax.axhline(max(r["best"] for r in rows) - WITHIN, color="0.5", linestyle=":", label="unpruned best - 0.01")
    ax.axvline(3, color="0.7", linestyle="--", label="3x less compute")
    ax.set_xlabel("compute ratio (trial-epochs without pruning / with)")
    ax.set_ylabel("best score kept (eval/macro_f1)")
    ax.legend(fontsize=7, loc="lower left")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def same_curves(unpruned, pruned, configs: list[dict]) -> float:
    """The largest difference between a configuration's reports in the pruned study and in the unpruned one
    (0: the replay's premise holds)."""
    worst = 0.0
    for a, b in zip(matched(unpruned, configs), matched(pruned, configs)):
        for k, v in b.intermediate_values.items():
            worst = max(worst, abs(a.intermediate_values[k] - v))
    return worst


def pruning(args: argparse.Namespace, out: Path) -> dict:
    """The unpruned study, the replay, the pruned study. With --pruned the pruned study runs at the same time as
    the unpruned one (both see the same machine load); without, it runs after, with the replay's pick. With
    --reuse, the studies of an earlier run are analysed again (nothing trains)."""
    base = base_overrides(args, out, write=not args.reuse)
    configs = configurations(base, args.trials, args.seed)
    pruned_overrides = args.pruned.split() if args.pruned else []
    pruned_run = None
    if not args.reuse:
        unpruned_run = Running("unpruned", base, ["hpo.pruner.name=none"], configs, args.workers)
        # One worker for the pruned study: its pruning decisions depend on the order its trials reach each rung.
        pruned_run = Running("pruned", base, pruned_overrides, configs, 1, args.workers) if args.pruned else None
        unpruned_run.wait()
    study_a = load_study(base, "unpruned")
    unpruned = figures("unpruned", study_a, configs, ["hpo.pruner.name=none"])
    recorded = curves(study_a, configs)
    epoch_s, eval_s = costs(base, "unpruned")
    rows = trade_off(recorded, "pruned", unpruned.best, epoch_s, eval_s, args.report_every)
    chosen = pick(rows)
    if not args.pruned:
        pruned_overrides = Setting(chosen["every"], chosen["min_resource"], chosen["reduction_factor"],
                                   chosen["patience"]).overrides(args.report_every)
        pruned_run = None if args.reuse else Running("pruned", base, pruned_overrides, configs, 1, args.workers)
    if pruned_run is not None:
        pruned_run.wait()
    study_b = load_study(base, "pruned")
    pruned = figures("pruned", study_b, configs, pruned_overrides)
    setting = next((Setting(r["every"], r["min_resource"], r["reduction_factor"], r["patience"]) for r in rows
                    if Setting(r["every"], r["min_resource"], r["reduction_factor"],
                               r["patience"]).overrides(args.report_every) == pruned_overrides), None)
    predicted = replay(recorded, setting, "pruned", order=real_order(study_b, configs)) if setting else None
    return {"unpruned": asdict(unpruned), "pruned": asdict(pruned), "rows": rows, "chosen": chosen,
            "predicted": predicted, "curve_difference": same_curves(study_a, study_b, configs), "epoch_s": epoch_s,
            "eval_s": eval_s}


# ------------------------------------------------------------------------------------------------ overhead


def overhead(args: argparse.Namespace, out: Path) -> dict:
    """Seconds per trial of one-step trials (16 validation rows: almost no compute), each variant in its own
    ``maxout hpo`` process, interleaved (A B C C B A): warm start on, off, and, with --before-src, the code of an
    earlier checkout (PYTHONPATH=<src>/platform; e.g. `git archive main platform | tar -x -C DIR`). The first trial
    of a process pays for its imports and first loads, so only the later ones count."""
    import mlflow

    base = ["hardware=cpu", f"model={args.model}", "hpo=default", "train.max_steps=1", "train.epochs=1",
            "hpo.pruner.name=none", "hpo.log_models=none", "tracking.log_model=false", "hpo.sampler.name=random",
            f"hpo.sampler.seed={args.seed}", f"hpo.n_trials={args.overhead_trials}",
            *subsets(args.train_rows, 16, args.seed, out / "short"), *store(out, 9)]
    variants = {"warm start (this checkout)": [], "hpo.warm_start=false": ["hpo.warm_start=false"]}
    if args.before_src:
        variants[f"before ({args.before_src})"] = []
    order = list(variants) + list(reversed(variants))
    rows: dict[str, list] = {name: [] for name in variants}
    client = mlflow.MlflowClient(f"sqlite:///{out / 'mlflow-9.db'}")
    for i, name in enumerate(order):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if name.startswith("before"):
            env["PYTHONPATH"] = str(Path(args.before_src) / "platform")
        study = f"overhead-{i}"
        done = subprocess.run([sys.executable, "-m", "maxout", "hpo", *base, *variants[name],
                               f"hpo.study_name={study}", "--no-progress"], cwd=ROOT, env=env, capture_output=True,
                              text=True)
        if done.returncode:
            raise SystemExit(f"maxout hpo ({name}) failed: {done.stderr[-2000:]}")
        trials = load_study(store(out, 9), study).get_trials(deepcopy=False)
        runs = client.search_runs([client.get_experiment_by_name("maxout").experiment_id],
                                  f"tags.`maxout.hpo.study` = '{study}' and tags.`maxout.command` = 'hpo-trial'")
        metrics = {int(r.data.tags["maxout.hpo.trial_number"]): r.data.metrics for r in runs}
        for t in trials[1:]:
            m = metrics[t.number]
            rows[name].append({"trial_s": (t.datetime_complete - t.datetime_start).total_seconds(),
                               "train_s": m["time/train_window_s"], "model_load_s": m.get("time/model_load_s"),
                               "tokenize_s": m.get("time/tokenize_s")})
    return {name: {key: statistics.median(r[key] for r in found) if found[0][key] is not None else None
                   for key in found[0]} for name, found in rows.items()}


# ------------------------------------------------------------------------------------------------ compile cache


def compile_cache(out: Path, threads: int) -> dict:
    """Two invocations as separate processes (a fresh process has no in-memory caches) on one cache dir."""
    import mlflow

    cache = out / "inductor-cache"
    # Only optimizer-side hyper-parameters: they leave the model's graph as it is, so a warm cache can serve it
    # (a sampled dropout or batch size is a different graph and compiles anew).
    base = ["hardware=cpu", "model=tiny", "hardware.compile=true", "hpo=default", "hpo.pruner.name=none",
            "train.max_steps=6", "train.epochs=1", "hpo.log_models=none", "hpo.study_name=compile",
            "~hpo.search_space.model.dropout", "~hpo.search_space.train.target_effective_batch",
            f"hpo.compile_cache_dir={cache}", *store(out)]
    env = {**{k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"},
           "OMP_NUM_THREADS": str(threads)}
    for n_trials in (2, 3):  # the first invocation runs 2 trials, the second one more
        done = subprocess.run([sys.executable, "-m", "maxout", "hpo", *base, f"hpo.n_trials={n_trials}",
                               "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"maxout hpo failed ({done.returncode}): {done.stderr[-2000:]}")
    client = mlflow.MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("maxout").experiment_id],
                              "tags.`maxout.hpo.study` = 'compile' and tags.`maxout.command` = 'hpo-trial'")
    by_trial = {int(r.data.tags["maxout.hpo.trial_number"]): r.data.metrics for r in runs}
    return {name: (by_trial[n]["time/compile_s"], by_trial[n]["compile/fxgraph_cache_hit"],
                   by_trial[n]["compile/fxgraph_cache_miss"])
            for n, name in enumerate(("cold, first process (trial 0)", "same process (trial 1)",
                                      "warm disk cache, second process (trial 2)"))}


# ------------------------------------------------------------------------------------------------ output


def print_pruning(args: argparse.Namespace, found: dict, figure: Optional[Path]) -> None:
    u, p = found["unpruned"], found["pruned"]
    print(f"\n## Pruning: {args.model}, {args.trials} trials x {args.epochs} epochs, {args.train_rows} training / "
          f"{args.validation_rows} validation rows, reports every {args.report_every:g} epoch, random sampler seed "
          f"{args.seed}\n")
    print("| study | best eval/macro_f1 | trial-epochs run | without pruning | compute saved | evaluations | "
          "pruned | trial time s (one worker) | elapsed s (workers) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in (u, p):
        overrides = " ".join(row["overrides"])
        print(f"| {row['name']} (`{overrides}`) | {row['best']:.4f} | {row['epochs']:.1f} | {row['planned']:.0f} | "
              f"{1 - row['epochs'] / row['planned']:.0%} ({row['planned'] / row['epochs']:.2f}x) | "
              f"{row['evaluations']} | {row['pruned']} | {row['trial_s']:.0f} | {row['elapsed_s']:.0f} "
              f"({row['workers']}) |")
    print(f"\ntrial-time ratio unpruned / pruned: {u['trial_s'] / p['trial_s']:.2f}x; best score difference "
          f"{u['best'] - p['best']:+.4f}; measured cost: {found['epoch_s']:.1f} s per trained epoch, "
          f"{found['eval_s']:.1f} s per evaluation")
    if found["predicted"]:
        q = found["predicted"]
        print(f"replay's prediction for the pruned study: {q['epochs']:.1f} trial-epochs, {q['evaluations']:.0f} "
              f"evaluations, {q['pruned']:.0f} pruned, best {q['best']:.4f}; largest difference between the two "
              f"studies' reports of one trial: {found['curve_difference']:.2g}")
    print("\n## Trade-off (replay of the unpruned study's curves)\n")
    print("| setting | compute ratio | compute saved | saved incl. evaluations | pruned | best | within 0.01 |")
    print("|---|---|---|---|---|---|---|")
    for r in sorted(found["rows"], key=lambda r: -r["ratio"]):
        mark = " **(picked)**" if r is found["chosen"] or r == found["chosen"] else ""
        print(f"| {r['label']}{mark} | {r['ratio']:.2f}x | {r['saved']:.0%} | {r['saved_with_eval']:.0%} | "
              f"{r['pruned']:.0f} | {r['best']:.4f} | {'yes' if r['ok'] else 'no'} |")
    if figure:
        print(f"\nChart: {figure}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--train-rows", type=int, default=128)
    parser.add_argument("--validation-rows", type=int, default=80)
    parser.add_argument("--report-every", type=float, default=0.5, help="epochs between the recorded reports")
    parser.add_argument("--pruned", default="", help="overrides for the pruned study (default: picked by replay)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2, help="processes for the unpruned study (1 thread each)")
    parser.add_argument("--overhead-trials", type=int, default=6)
    parser.add_argument("--before-src", default="", help="a checkout whose per-trial overhead to compare with")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: deterministic curves, and no spinning against other jobs)")
    parser.add_argument("--figure", default=str(ROOT / "benchmarks/figures/hpo_pruning_tradeoff.png"))
    parser.add_argument("--reuse", default="", help="analyse the studies of an earlier run's folder again")
    parser.add_argument("--skip-pruning", action="store_true")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--skip-compile", action="store_true")
    args = parser.parse_args()
    os.chdir(ROOT)
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.reuse) if args.reuse else Path(tempfile.mkdtemp(prefix="maxout-bench-hpo-"))
    (out / "short").mkdir(exist_ok=True)
    if not args.skip_pruning:
        found = pruning(args, out)
        (out / "pruning.json").write_text(json.dumps(found, indent=1, default=str))
        figure = Path(args.figure) if args.figure else None
        if figure:
            trade_off_png(found["rows"], found["chosen"], figure)
        print_pruning(args, found, figure)
    if not args.skip_overhead:
        found = overhead(args, out)
        print(f"\n## Per-trial overhead: one-step trials, {args.model}, median seconds per trial (trials after each "
              f"process's first)\n")
        print("| code | trial s | of which training | model load | tokenization |")
        print("|---|---|---|---|---|")
        show = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        for name, row in found.items():
            print(f"| {name} | {row['trial_s']:.2f} | {row['train_s']:.2f} | {show(row['model_load_s'])} | "
                  f"{show(row['tokenize_s'])} |")
    if not args.skip_compile:
        times = compile_cache(out, args.threads)
        print("\n## Compile cache: tiny model, hardware.compile=true, time/compile_s per trial\n")
        print("| trial | compile s | vs cold | FX-graph cache hits / misses |\n|---|---|---|---|")
        cold = times["cold, first process (trial 0)"][0]
        for name, (seconds, hits, misses) in times.items():
            print(f"| {name} | {seconds:.1f} | {seconds / cold:.2f}x | {hits:.0f} / {misses:.0f} |")
    print(f"\nMLflow store and journal: {out}")


if __name__ == "__main__":
    main()

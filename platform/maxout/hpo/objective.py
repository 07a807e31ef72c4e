"""One Optuna trial = one nested MLflow child run under the study's parent run.

Sampled values are set on the study's config (composed once; with hpo.warm_start=false they become Hydra
overrides on top of the user's and each trial composes anew) -> ``train(cfg, tracker=child, warm=...)``. The
trial reports its metric at each evaluation, every hpo.report_every_steps steps or hpo.report_every_epochs of an
epoch (k_folds=1; step = reports so far), or after each fold (k_folds>1; step = folds done, value = the running
mean over the folds so far), and a pruned trial stops at once. With k folds each fold trains in its own run
nested under the trial's run, which carries the per-fold and mean scores. Trials write no checkpoints (a trial is
never resumed), and a worker keeps the tokenizer and the tokenized tables between its trials (train/warm.py).

The child run ends FINISHED for COMPLETE and PRUNED trials and FAILED for failed ones (KILLED on Ctrl-C /
SIGTERM), tagged ``maxout.hpo.state``. Out of memory prunes the trial with the reason and the study goes on.
So does divergence (a non-finite loss or gradient norm, or a non-finite objective): the trial is pruned, so the
sampler learns to avoid its values and the study goes on, while its run ends FAILED with the step
(``maxout.diverged_at_step``) and logs no model. A pruned trial is never Optuna's best trial, and its epochs are
not counted as compute that pruning saved (the trial could not have gone on).
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import statistics
import sys
import warnings
from typing import Any, Optional, Sequence

import optuna
import torch
from optuna.storages import RetryHeartbeatStaleTrialCallback
from torch._dynamo.utils import counters

from .. import loading
from ..config import Config, HpoConfig
from ..data import Dataset
from ..errors import Diverged, OutOfMemory, Terminated, first_line
from ..hardware import DeviceInfo
from ..optimizations.compile import compile_seconds
from ..registry.promotion import beats
from ..tracking.tracker import Tracker, closing, start
from ..train import Callback, TrainResult, TrainState, train
from ..train.oom import free_cached
from ..train.run import log_model
from ..train.warm import WarmStart
from . import search_space

HOST = socket.gethostname()


def worker() -> str:
    """A trial's ``worker`` user attr: which process ran it. Read when asked, not at import: a process forked after
    the import (multiprocessing's fork, a pre-imported parent) has a pid of its own."""
    return f"{HOST}:{os.getpid()}"


def is_out_of_memory(err: BaseException) -> bool:
    """torch's own error, a backend's RuntimeError that says so, or maxout's (recovery exhausted, no batch fits)."""
    return isinstance(err, (torch.OutOfMemoryError, OutOfMemory)) or (isinstance(err, RuntimeError)
                                                                      and "out of memory" in str(err).lower())


def finite(value: float, metric: str) -> float:
    """An objective that is not a number cannot be compared: never a best trial, never a champion."""
    if not math.isfinite(value):
        raise Diverged(f"the objective {metric} is {value}: not a number any trial can be compared with")
    return value


def with_log_model(cfg: Config, log_model: bool) -> Config:
    return dataclasses.replace(cfg, tracking=dataclasses.replace(cfg.tracking, log_model=log_model))


def cache_counts() -> dict[str, int]:
    """TorchInductor's cumulative FX-graph cache hits and misses in this process."""
    return {k: int(counters["inductor"][k]) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")}


def frozen(trial: optuna.Trial) -> optuna.trial.FrozenTrial:
    """The stored view of a running trial (a live Trial does not expose its system attributes)."""
    return next(t for t in trial.study.get_trials(deepcopy=False) if t.number == trial.number)


class TrialReporter(Callback):
    """Reports the metric to Optuna at every evaluation of a trial (its evaluation schedule is the study's report
    schedule, hpo.report_every_steps / hpo.report_every_epochs; step = reports so far) and stops training at once
    (raises TrialPruned) when the pruner says so. Counts the epochs (fractional: a trial may stop mid-epoch) and
    evaluations the trial ran, over all its train() calls (folds)."""

    def __init__(self, trial: optuna.Trial, metric: str, tracker: Tracker, report: bool):
        self.trial, self.metric, self.tracker, self.report = trial, metric, tracker, report
        self.epochs_per_run: Optional[float] = None  # what one train() call plans, known when it starts
        self.evaluations = 0
        self._done_epochs = 0.0  # epochs of the finished train() calls
        self._run_epochs = 0.0  # epochs of the current one
        self._compile_start = 0.0
        self._reports = 0

    @property
    def epochs(self) -> float:
        return self._done_epochs + self._run_epochs

    def on_train_start(self, state: TrainState) -> None:
        self._compile_start, self._cache_start, self._reports = compile_seconds(), cache_counts(), 0
        self._done_epochs, self._run_epochs = self.epochs, 0.0
        if self.epochs_per_run is None:  # max_steps may end training before train.epochs
            self.epochs_per_run = state.total_steps / state.steps_per_epoch

    def compile_metrics(self) -> dict[str, float]:
        """This run's FX-graph cache hits and misses (whether the shared compile cache paid off)."""
        now = cache_counts()
        return {f"compile/{k}": float(now[k] - self._cache_start[k]) for k in now}

    def on_train_end(self, state: TrainState) -> None:
        self.tracker.log_metrics(self.compile_metrics(), step=state.step)

    def on_step_end(self, state: TrainState) -> None:
        self._run_epochs = state.step / state.steps_per_epoch

    def on_evaluate(self, state: TrainState, metrics: dict) -> None:
        self._run_epochs = state.step / state.steps_per_epoch
        self.evaluations += 1
        if not self.report:
            return
        self._reports += 1
        value = metrics[self.metric]
        self.trial.report(value, step=self._reports)
        if state.step < state.total_steps and self.trial.should_prune():  # at the end, pruning saves nothing
            # train() logs compile time only when it completes; a pruned trial carries it too.
            self.tracker.log_metrics({"time/compile_s": compile_seconds() - self._compile_start,
                                      **self.compile_metrics()}, step=state.step)
            raise optuna.TrialPruned(f"pruned at report {self._reports} (epoch {self._run_epochs:.2f}): "
                                     f"{self.metric}={value:.4f}")


def trial_settings(hpo: HpoConfig) -> dict[str, Any]:
    """What every trial's config gets on top of the user's: its evaluation schedule is the study's report schedule
    (k-fold trials report per fold and keep theirs), and no checkpoints (a trial is never resumed: a lost trial
    is re-run from its start)."""
    settings: dict[str, Any] = {"checkpoint.enabled": False}
    if hpo.k_folds == 1:
        settings["train.eval_interval"] = hpo.report_every_steps or 0
        settings["train.eval_every_epochs"] = hpo.report_every_epochs
    return settings


class Objective:
    def __init__(self, overrides: Sequence[str], specs: list, hpo: HpoConfig, dataset: Dataset,
                 folds: Optional[list[Dataset]], device: DeviceInfo, parent_run_id: Optional[str],
                 retried_by_heartbeat: bool, callbacks: Sequence[Callback] = (), progress: bool = False,
                 base: Optional[Config] = None, under: Optional[str] = None, supervised: bool = False):
        self.overrides, self.specs, self.hpo = list(overrides), specs, hpo
        self.dataset, self.folds, self.device = dataset, folds, device
        self.parent_run_id, self.retried_by_heartbeat = parent_run_id, retried_by_heartbeat
        # A worker of `--workers N`: trials nest under the supervisor's parent run (``under``, in another process),
        # and a dead worker's trials are re-queued by the supervisor, so a trial may be a retry.
        self.under, self.retried = under, retried_by_heartbeat or supervised
        self.callbacks, self.progress = list(callbacks), progress
        # Warm start (hpo.warm_start): the study's config with the trial settings, composed once; the tokenizer
        # and the tokenized tables, kept for every trial of this worker.
        self.base = search_space.apply(base, trial_settings(hpo)) if base is not None and hpo.warm_start else None
        self.warm = WarmStart() if hpo.warm_start else None

    def trial_config(self, values: dict[str, Any]) -> Config:
        """The study's config with the sampled values set; without warm start, composed anew by Hydra."""
        if self.base is not None:
            return search_space.apply(self.base, values)
        settings = search_space.overrides(trial_settings(self.hpo))
        return loading.load(self.overrides + settings + search_space.overrides(values), device=self.device)

    def __call__(self, trial: optuna.Trial) -> float:
        values = search_space.suggest(trial, self.specs)
        cfg = self.trial_config(values)
        retry_of = None
        if self.retried:  # only heartbeats and a supervisor re-queue; frozen() reads every trial of the study
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                retry_of = RetryHeartbeatStaleTrialCallback.retried_trial_number(frozen(trial))
        tags = {"maxout.command": "hpo-trial", "maxout.hpo.study": trial.study.study_name,
                "maxout.hpo.trial_number": trial.number, "maxout.hpo.state": "RUNNING",
                "maxout.hardware_profile": cfg.hardware.name, "maxout.model": cfg.model.name,
                "maxout.data": cfg.data.name, **({"maxout.hpo.retry_of": retry_of} if retry_of is not None else {})}
        child = start(cfg.tracking, run_name=f"trial-{trial.number}", tags=tags, nested=True, under=self.under,
                      system_metrics=cfg.tracking.system_metrics)  # the parent samples none
        reporter = TrialReporter(trial, self.hpo.metric, child, report=self.folds is None)
        state, status, reason, fail_in_storage, diverged = "FAIL", "FAILED", "", False, False
        try:
            trial.set_user_attr("worker", worker())
            if child.run_id:
                trial.set_user_attr("mlflow_run_id", child.run_id)
                trial.set_user_attr("mlflow_parent_run_id", self.parent_run_id)
            child.log_params({f"hpo.{key}": value for key, value in values.items()})
            value = self._folds(trial, cfg, child, reporter) if self.folds else self._single(trial, cfg, child,
                                                                                              reporter)
            child.log_metrics({"hpo/objective": value})
            state, status = "COMPLETE", "FINISHED"
            return value
        except optuna.TrialPruned as err:
            state, status, reason = "PRUNED", "FINISHED", str(err)
            raise
        except KeyboardInterrupt:  # Optuna marks the trial FAIL and stops the study
            status, reason = "KILLED", "interrupted"
            raise
        except Terminated:  # SIGTERM: Optuna does not catch it, so the trial would stay RUNNING
            status, reason = "KILLED", "terminated (SIGTERM)"
            fail_in_storage = not self.retried_by_heartbeat  # with heartbeats it goes stale and is re-queued
            raise
        except Diverged as err:  # these values cannot train: pruned, so the study goes on; the run itself FAILED
            state, reason, diverged = "PRUNED", str(err)[:2000], True
            trial.set_user_attr("pruned_reason", reason)
            raise optuna.TrialPruned(reason) from None
        except Exception as err:
            if not is_out_of_memory(err):
                reason = f"{type(err).__name__}: {err}"[:2000]
                raise
            free_cached(self.device.torch_device)
            state, status = "PRUNED", "FINISHED"
            reason = f"out of memory: {first_line(err)[:500]}"
            trial.set_user_attr("pruned_reason", reason)
            raise optuna.TrialPruned(reason) from None
        finally:
            planned = (reporter.epochs_per_run or cfg.train.epochs) * (len(self.folds) if self.folds else 1)
            if diverged:  # it could not have gone on: its unrun epochs are not compute that pruning saved
                planned = reporter.epochs
            trial.set_user_attr("epochs_run", reporter.epochs)
            trial.set_user_attr("epochs_planned", planned)
            trial.set_user_attr("evaluations", reporter.evaluations)
            child.log_metrics({"hpo/epochs_run": reporter.epochs, "hpo/epochs_planned": planned,
                               "hpo/evaluations": reporter.evaluations})
            child.set_tags({"maxout.hpo.state": state, **({"maxout.hpo.reason": reason} if reason else {})})
            child.close(status, reason=reason if status != "FINISHED" else "")
            if fail_in_storage:
                trial.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            print(f"maxout: trial {trial.number} {state} after {reporter.epochs:.2f}/{planned:g} epochs"
                  + (f" ({reason})" if reason else ""), file=sys.stderr)

    def _train(self, cfg: Config, tracker: Tracker, reporter: TrialReporter, dataset: Dataset) -> TrainResult:
        return train(cfg, tracker=tracker, callbacks=[reporter, *self.callbacks], progress=self.progress,
                     device=self.device, verbose=False, dataset=dataset, warm=self.warm)

    def _single(self, trial: optuna.Trial, cfg: Config, child: Tracker, reporter: TrialReporter) -> float:
        wanted, every = cfg.tracking.log_model, self.hpo.log_models == "all"  # tracking.log_model=false wins
        result = self._train(with_log_model(cfg, wanted and every), child, reporter, self.dataset)
        value = finite(result.metrics[self.hpo.metric], self.hpo.metric)
        model_uri = result.model_uri
        if wanted and self.hpo.log_models == "best" and self._beats_best(trial, value):
            model_uri = log_model(result.setup, child, result.metrics)  # and its scores (train/lineage.py)
        if model_uri:
            trial.set_user_attr("model_uri", model_uri)
        return value

    def _beats_best(self, trial: optuna.Trial, value: float) -> bool:
        try:
            best = trial.study.best_value
        except ValueError:  # no complete trial yet
            return True
        return beats(value, best, self.hpo.direction)

    def _folds(self, trial: optuna.Trial, cfg: Config, child: Tracker, reporter: TrialReporter) -> float:
        """k-fold: each fold is a run nested under the trial's; no model is logged (a fold's model is not the
        one to deploy)."""
        metric, k = self.hpo.metric, len(self.folds)
        fold_cfg = with_log_model(cfg, False)
        scores: list[float] = []
        for i, fold in enumerate(self.folds, 1):
            run = start(fold_cfg.tracking, run_name=f"trial-{trial.number}-fold-{i}", nested=True,
                                 system_metrics=False,
                                 tags={"maxout.command": "hpo-fold", "maxout.hpo.study": trial.study.study_name,
                                       "maxout.hpo.trial_number": trial.number, "maxout.hpo.fold": i})
            with closing(run):
                result = self._train(fold_cfg, run, reporter, fold)
            if i == 1:  # what every fold shares (optimizations, config, device) also goes on the trial's run
                child.log_params({k_: v for k_, v in result.params.items() if not k_.startswith("derived.")})
            scores.append(finite(result.metrics[metric], metric))
            mean = statistics.fmean(scores)
            child.log_metrics({f"fold/{metric}": scores[-1], f"cv/{metric}": mean}, step=i)
            trial.report(mean, step=i)
            if i < k and trial.should_prune():  # after the last fold, pruning would save nothing
                raise optuna.TrialPruned(f"pruned after fold {i}/{k}: mean {metric}={mean:.4f}")
        child.log_metrics({metric: statistics.fmean(scores), f"cv/{metric}_std": statistics.pstdev(scores)})
        return statistics.fmean(scores)

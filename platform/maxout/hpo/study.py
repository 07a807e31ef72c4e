"""``run(overrides)``: one worker's share of an Optuna study, as one parent MLflow run with a nested child per
trial. The CLI (``maxout hpo``), benchmarks and tests call this.

Everything that can be wrong (config, search space, data, model, storage, an existing study with another
direction) is checked before the parent run starts, so bad input leaves no run behind. Then:

    parent run (no system metrics: children sample them, both levels would sample twice)
      study.optimize(Objective)            one nested child run per trial (objective.py)
      until the study has hpo.n_trials finished trials (all workers together) or hpo.timeout_s passed
      report.log(...)                      counts, compute saved, best, trials.csv, plots
      promote_best_trial(cfg, best)        registers the best trial's model (registry.name set)
"""

from __future__ import annotations

import gc
import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import optuna
from optuna.study import MaxTrialsCallback
from optuna.trial import TrialState

from .. import hardware, loading
from ..config import Config, HpoConfig, to_dict
from ..errors import ConfigError, Terminated, first_line
from ..registry import promotion
from ..registry.client import client_for
from ..tracking.params import config_params, flatten
from ..tracking.redact import redact
from ..tracking.store import resolve_uri
from ..tracking.tracker import Tracker, closing, start
from ..optimizations import accumulation
from ..train import Callback, prepare
from ..train.evaluate import evaluation_steps
from ..train.setup import planned_steps
from . import auto_workers, placement, report, search_space, shared_parent, storage as storage_mod, supervisor
from .folds import kfold
from .objective import Objective, worker
from .report import BestTrial

# Attributes that define what a study's values mean: a worker that disagrees must not join it.
STUDY_ATTRS = ("metric", "k_folds", "report_every")
# How often a worker leaving a study with heartbeats looks again at the trials still RUNNING (settle_lost_trials):
# one query of the trials and one of the stale ones, so a short interval costs the database little.
SETTLE_POLL_S = 0.5


@dataclass
class StudyResult:
    study_name: str
    storage: str  # redacted: journal path or RDB URL
    parent_run_id: Optional[str]
    best: Optional[BestTrial]
    counts: dict = field(default_factory=dict)
    worker: bool = False  # a worker of a supervisor: it ran trials, the supervisor reports the study


def promote_best_trial(cfg: Config, best: BestTrial) -> None:
    """The model-registry hook, once per study invocation, after the parent run got its summary: with
    ``registry.name`` set, the study's best complete trial's model is registered and becomes champion if it
    beats the current one (promotion.register_and_promote, under the registry's promotion lock). A best trial
    that already has a version (another worker of the study registered it) is not registered twice."""
    if not cfg.registry.name:
        return
    if not best.model_uri or not best.run_id:
        print(f"maxout: registry: best trial {best.number} has no logged model to register "
              f"(hpo.k_folds={cfg.hpo.k_folds}, hpo.log_models={cfg.hpo.log_models})", file=sys.stderr)
        return
    client = client_for(cfg)
    if client.search_model_versions(f"name='{cfg.registry.name}' and run_id='{best.run_id}'"):
        print(f"maxout: registry: best trial {best.number} (run {best.run_id}) is registered already")
        return
    run = client.get_run(best.run_id)
    value = best.value if best.metric == cfg.registry.metric else run.data.metrics.get(cfg.registry.metric)
    if value is None:
        raise ConfigError(f"registry.metric={cfg.registry.metric!r}: best trial {best.number} has no such metric; "
                          f"set registry.metric={best.metric}")
    outcome = promotion.register_and_promote(best.run_id, best.model_uri, value, cfg,
                                            run.data.params.get("derived.data_fingerprint", ""), cfg.hardware.name,
                                            client=client)
    print(f"maxout: {outcome.summary()}")


def check_registry(cfg: Config) -> None:
    """Before any trial: registering the best trial needs a logged model, so a tracked single-split study."""
    if not cfg.registry.name:
        return
    promotion.check_train(cfg)
    if cfg.hpo.k_folds > 1 or cfg.hpo.log_models == "none":
        raise ConfigError(f"registry.name={cfg.registry.name!r} needs the best trial's model: k-fold trials and "
                          f"hpo.log_models=none log none (got hpo.k_folds={cfg.hpo.k_folds}, "
                          f"hpo.log_models={cfg.hpo.log_models}); use hpo.k_folds=1 with hpo.log_models=best")


def build_sampler(hpo: HpoConfig) -> Any:
    if hpo.sampler.name == "random":
        return optuna.samplers.RandomSampler(seed=hpo.sampler.seed)
    return optuna.samplers.TPESampler(seed=hpo.sampler.seed, n_startup_trials=hpo.sampler.n_startup_trials)


def report_unit(hpo: HpoConfig) -> str:
    """What one step of a trial's intermediate values (the pruner's resource) stands for."""
    if hpo.k_folds > 1:
        return "1 fold"
    return f"{hpo.report_every_steps} steps" if hpo.report_every_steps else f"{hpo.report_every_epochs:g} epochs"


def max_resource(cfg: Config, train_rows: int) -> Optional[int]:
    """Hyperband's resource is what a trial reports after: the reports of a whole trial of the study's config
    (k-fold: the folds); hpo.pruner.max_resource wins. None when the micro-batch is the batch finder's to pick
    and no target effective batch fixes the steps per epoch (Optuna then takes the first complete trial's)."""
    hpo = cfg.hpo
    if hpo.pruner.max_resource or hpo.k_folds > 1:
        return hpo.pruner.max_resource or hpo.k_folds
    micro = cfg.batch_size if cfg.batch_size != "auto" else cfg.train.target_effective_batch
    if micro is None:
        return None
    accum, _ = accumulation.plan(cfg.train.target_effective_batch, micro)
    per_epoch, total = planned_steps(math.ceil(train_rows / micro), accum, cfg.train)
    return len(evaluation_steps(per_epoch, total, hpo.report_every_steps or 0, hpo.report_every_epochs))


def build_pruner(hpo: HpoConfig, top: Optional[int]) -> Any:
    """HyperbandPruner over ``top`` reports (None: "auto"), wrapped in PatientPruner when hpo.pruner.patience is
    set; name none: never prune."""
    p = hpo.pruner
    if p.name == "none":
        return optuna.pruners.NopPruner()
    if top is not None and p.min_resource > top:
        raise ConfigError(f"hpo.pruner.min_resource={p.min_resource} is more than the {top} reports of a trial "
                          f"(one every {report_unit(hpo)}): no trial could ever be pruned")
    if top is None and p.bootstrap_count:
        raise ConfigError(f"hpo.pruner.bootstrap_count={p.bootstrap_count} needs a known number of reports per "
                          f"trial, and batch_size=auto without train.target_effective_batch leaves it open: set "
                          f"hpo.pruner.max_resource")
    hyperband = optuna.pruners.HyperbandPruner(min_resource=p.min_resource, max_resource=top or "auto",
                                               reduction_factor=p.reduction_factor,
                                               bootstrap_count=p.bootstrap_count)
    if p.patience is None:
        return hyperband
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.pruners.PatientPruner(hyperband, patience=p.patience, min_delta=p.min_delta)


def open_study(hpo: HpoConfig, storage: Any, where: str, sampler: Any = None, pruner: Any = None) -> Any:
    """Create the study, or join it when it exists (another worker, an earlier invocation). Joining a study
    that optimizes in the other direction, or another metric or fold count, is an error."""
    wanted = {"metric": hpo.metric, "k_folds": hpo.k_folds, "report_every": report_unit(hpo)}
    try:
        study_id = storage.get_study_id_from_name(hpo.study_name)
    except KeyError:
        study_id = None
    if study_id is not None:
        direction = storage.get_study_directions(study_id)[0].name.lower()
        if direction != hpo.direction:
            raise ConfigError(f"study {hpo.study_name!r} in {redact(where)} already exists with "
                              f"direction={direction}, not {hpo.direction}: use hpo.direction={direction} to join "
                              f"it, or another hpo.study_name")
        attrs = storage.get_study_user_attrs(study_id)
        for key in STUDY_ATTRS:
            if key in attrs and attrs[key] != wanted[key]:
                raise ConfigError(f"study {hpo.study_name!r} already exists with hpo.{key}={attrs[key]}, not "
                                  f"{wanted[key]}: its values would not compare; use another hpo.study_name")
    study = optuna.create_study(study_name=hpo.study_name, storage=storage, sampler=sampler, pruner=pruner,
                                direction=hpo.direction, load_if_exists=True)
    for key in STUDY_ATTRS:
        if key not in study.user_attrs:
            study.set_user_attr(key, wanted[key])
    return study


def finished(study: Any) -> int:
    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))


def optimize(study: Any, objective: Objective, hpo: HpoConfig, after_trial: Sequence[Callable] = ()) -> None:
    """Run trials until the STUDY has hpo.n_trials finished ones (counting every worker's), or the timeout.
    Several workers may overshoot by up to one trial each (the ones still running when the count is reached)."""
    callbacks = list(after_trial)
    if hpo.n_trials is not None:
        if finished(study) >= hpo.n_trials:
            print(f"maxout: study {study.study_name!r} already has {finished(study)} finished trials "
                  f"(hpo.n_trials={hpo.n_trials}): nothing to run; raise hpo.n_trials or use another "
                  f"hpo.study_name", file=sys.stderr)
            return
        callbacks.append(MaxTrialsCallback(hpo.n_trials, states=(TrialState.COMPLETE, TrialState.PRUNED)))
    # Everything alive now (libraries, the study's data) outlives every trial: frozen, the collection after each
    # trial (which frees the last model's cycles) skips it (0.5 s a trial before). A host that froze its heap
    # already (a process that forks workers from it, as a server or a test runner does) keeps it frozen.
    froze = gc.get_freeze_count() == 0
    if froze:
        gc.collect()
        gc.freeze()
    try:
        study.optimize(objective, timeout=hpo.timeout_s, callbacks=callbacks, gc_after_trial=True)
        requeued = settle_lost_trials(study, hpo)
        if requeued and hpo.timeout_s is None:  # a lost trial is run again, even past n_trials: none is lost
            study.optimize(objective, n_trials=requeued, callbacks=list(after_trial), gc_after_trial=True)
    finally:
        if froze:
            gc.unfreeze()


def settle_lost_trials(study: Any, hpo: HpoConfig) -> int:
    """Before a worker leaves a study with heartbeats (an RDB storage): fail the trials of workers that died, so
    that none stays RUNNING; returns how many of them it re-queued (RetryLostTrial, with the same params).

    Optuna finds a stale trial only when some worker starts a trial after the dead one's grace period; the worker
    that brings the study to n_trials starts none, so a worker killed within the grace period before the end left
    its trial RUNNING (test_hpo's killed-worker test, on a loaded machine). So this worker waits while trials are
    RUNNING, at most one grace period and one heartbeat interval, failing the stale ones as it goes; the trials
    of live workers keep their heartbeats and are theirs to finish."""
    if not storage_mod.heartbeats(study._storage):
        return 0

    def waiting() -> set:
        return {t._trial_id for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))}

    before, deadline = waiting(), time.monotonic() + hpo.grace_period_s + hpo.heartbeat_interval_s
    while study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) and time.monotonic() < deadline:
        # Looked at every SETTLE_POLL_S, not every heartbeat interval (60 s by default): a live worker's trial that
        # ends is seen within a second (the shared-parent test waited 60 s for a trial done seconds after).
        time.sleep(min(SETTLE_POLL_S, hpo.heartbeat_interval_s, max(0.0, deadline - time.monotonic())))
        with warnings.catch_warnings():  # marked experimental, as the heartbeats it reads (storage.py)
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
    return len(waiting() - before)


def run(overrides: Sequence[str], callbacks: Sequence[Callback] = (), device: Optional[Any] = None,
        on_best: Callable[[Config, BestTrial], None] = promote_best_trial, progress: bool = False) -> StudyResult:
    """The study named by ``hpo.study_name`` (``overrides`` must select an hpo config, e.g. ``hpo=default``), under
    one parent run: in this process (hpo.workers=1), or by N worker processes this one starts and watches
    (supervisor.py). A worker of such a supervisor runs trials only. ``callbacks`` are added to every trial's
    training in this process (tests inject failures with them)."""
    device = device or hardware.detect()
    overrides = list(overrides)
    cfg = loading.load(overrides, device=device)
    if cfg.hpo is None:
        raise ConfigError("no hpo config selected: add hpo=default (maxout hpo adds it unless hpo=... is given)")
    hpo = cfg.hpo
    under = supervisor.worker_parent()  # not None: this process is a worker of a supervisor
    stop = None
    if under is not None:
        hardware.apply_device_share(device)
        stop = supervisor.StopRequested().install()
        supervisor.watch_supervisor()
    specs = search_space.load(hpo.search_space, cfg)
    dataset = prepare.check(cfg).dataset  # data files, columns, labels, model availability, the tracking store
    check_registry(cfg)
    folds = kfold(dataset, hpo.k_folds, hpo.fold_seed) if hpo.k_folds > 1 else None
    top = max_resource(cfg, len(dataset.train))
    pruner = build_pruner(hpo, top)
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # maxout prints one line per trial instead
    where = storage_mod.location(hpo, cfg.tracking)
    if hpo.parent == "shared":
        shared_parent.check(where)
    # A lost trial's callback ends its worker's parent run too, unless that parent is another process's to end.
    storage = storage_mod.open_storage(hpo, cfg.tracking, supervised=under is not None or hpo.parent == "shared")
    study = open_study(hpo, storage, where, build_sampler(hpo), pruner)
    cache = storage_mod.compile_cache(hpo, cfg.tracking)

    def objective(parent_run_id: Optional[str], under: Optional[str] = under,
                  stop: Optional[supervisor.StopRequested] = stop) -> Objective:
        """The trials' objective; ``stop``: the safe-point stop its trainings check at each step and evaluation."""
        return Objective(overrides, specs, hpo, dataset, folds, device, parent_run_id,
                         storage_mod.heartbeats(storage), [*callbacks, *([stop] if stop else [])], progress, base=cfg,
                         under=under or None, supervised=supervisor.worker_parent() is not None)

    if stop is not None:  # a worker: its supervisor owns the parent run ("" when the study tracks nothing)
        optimize(study, objective(under or None), hpo, after_trial=[stop.after_trial])
        return StudyResult(hpo.study_name, redact(where), under or None, None, worker=True)

    def new_parent(workers: int, detached: bool = False) -> Tracker:
        return start(cfg.tracking, run_name=f"hpo-{hpo.study_name}", system_metrics=False, detached=detached,
                     tags={"maxout.command": "hpo", "maxout.hpo.study": hpo.study_name,
                           "maxout.hpo.storage": where, "maxout.hpo.worker": worker(), "maxout.hpo.workers": workers,
                           "maxout.model": cfg.model.name, "maxout.data": cfg.data.name})

    def describe(parent: Tracker, workers: int, reason: str) -> None:
        """The study's config and search space, on its parent run."""
        tree = to_dict(cfg)
        params = config_params(cfg)
        params.update(flatten({k: v for k, v in tree["hpo"].items() if k != "search_space"}, "hpo"))
        params.update({f"hpo.search_space.{k}": v for k, v in search_space.describe(specs).items()})
        params.update({"hpo.storage": where, "hpo.compile_cache_dir": cache,
                       "hpo.pruner.max_resource": top or "auto", "hpo.report_unit": report_unit(hpo),
                       "hpo.workers_effective": workers, "hpo.workers_reason": reason[:6000]})
        parent.log_params(params)
        parent.log_dict(tree, "config.yaml")

    if hpo.parent == "shared":
        return run_shared(cfg, study, where, objective, new_parent, describe, on_best)

    left = None if hpo.n_trials is None else hpo.n_trials - finished(study)
    choice = auto_workers.resolve(hpo.workers, overrides, cfg, device,
                                  storage_mod.store_dir(cfg.tracking) / "hpo_workers.json", left=left)
    workers, reason = choice.workers, choice.reason
    slots = placement.slots(workers, device) if workers > 1 else []
    parent = new_parent(workers)
    with closing(parent):
        describe(parent, workers, reason)
        print(f"maxout: study {hpo.study_name!r} in {redact(where)}: {finished(study)} finished trials; "
              f"{len(specs)} hyper-parameters, k_folds={hpo.k_folds}; {workers} worker(s) ({reason})"
              + (f": {'; '.join(slot.describe() for slot in slots)}" if slots else ""), file=sys.stderr)
        try:
            if workers == 1:
                optimize_here(study, lambda stop: objective(parent.run_id, stop=stop), hpo)
            else:
                supervisor.supervise(study, slots, overrides, parent.run_id, cfg, until(hpo))
        finally:  # the summary also lands on a study that stopped on a failed trial
            best, summary = report.log(parent, study, hpo.metric, hpo.direction, report_unit(hpo))
        if best is not None:
            on_best(cfg, best)
    return StudyResult(hpo.study_name, redact(where), parent.run_id, best, summary)


def optimize_here(study: Any, objective: Callable[[supervisor.StopRequested], Objective], hpo: HpoConfig) -> None:
    """The study's trials in this process, until it is done, with Ctrl-C and SIGTERM taken at a safe point (the
    trials' trainings check ``objective``'s stop at each step): a KeyboardInterrupt raised wherever the signal lands
    can be dropped by Python inside a weakref callback, and the study trained on until SIGKILL (the GPU report's
    smoke, one worker, under load: issue 36)."""
    stop = supervisor.StopRequested().install()
    try:
        optimize(study, objective(stop), hpo, after_trial=[stop.after_trial])
        stop.check()  # asked between trials, or after the last: the study ends as stopped, not done
    finally:
        stop.uninstall()


def run_shared(cfg: Config, study: Any, where: str, objective: Callable[..., Objective],
               new_parent: Callable[..., Tracker], describe: Callable[[Tracker, int, str], None],
               on_best: Callable[[Config, BestTrial], None]) -> StudyResult:
    """hpo.parent=shared (shared_parent.py): join the study's parent run, or create it; run trials under it; and
    end it with the study's summary if this invocation is the last to leave."""
    hpo = cfg.hpo
    if cfg.tracking.backend == "none":  # nothing to share: the trials run, untracked
        optimize_here(study, lambda stop: objective(None, stop=stop), hpo)
        return StudyResult(hpo.study_name, redact(where), None, None, worker=True)
    from mlflow import MlflowClient  # lazy: tracking=none never needs mlflow

    def create() -> str:
        parent = new_parent(1, detached=True)
        try:
            describe(parent, 1, "hpo.parent=shared: one worker per invocation")
        except BaseException as err:  # a parent that could not be described is no study's: it ends here
            parent.close("FAILED", f"{type(err).__name__}: {first_line(err)}")
            raise
        parent.release()  # RUNNING: the last invocation to leave ends it
        return parent.run_id

    client = MlflowClient(tracking_uri=resolve_uri(cfg.tracking)[0])
    parent_id, created = shared_parent.join(study, where, client, create)
    print(f"maxout: study {hpo.study_name!r} in {redact(where)}: {finished(study)} finished trials; "
          f"{'created' if created else 'joined'} its shared parent run {parent_id}", file=sys.stderr)
    summary: dict = {}
    best = None

    def finish(run_id: str, status: str = "FINISHED", reason: str = "") -> None:
        nonlocal best, summary
        parent = start(cfg.tracking, run_id=run_id)
        try:  # the summary also lands on a study that stopped, as with a parent of its own
            best, summary = report.log(parent, study, hpo.metric, hpo.direction, report_unit(hpo))
        finally:
            parent.close(status, reason)

    try:
        optimize_here(study, lambda stop: objective(parent_id, under=parent_id, stop=stop), hpo)
    except BaseException as err:  # stopped or failed: the last to leave ends the parent so, not FINISHED
        status = "KILLED" if isinstance(err, (KeyboardInterrupt, Terminated)) else "FAILED"
        reason = f"{type(err).__name__}: {first_line(err) or 'interrupted'}"
        shared_parent.leave(study, where, client, parent_id, lambda run_id: finish(run_id, status, reason))
        raise
    last = shared_parent.leave(study, where, client, parent_id, finish)
    if not last:
        print(f"maxout: study {hpo.study_name!r}: this invocation's trials are done; the last invocation to leave "
              f"ends the shared parent run {parent_id} with the study's summary", file=sys.stderr)
    elif best is not None:
        on_best(cfg, best)
    return StudyResult(hpo.study_name, redact(where), parent_id, best, summary, worker=not last)


def until(hpo: HpoConfig) -> Callable[[Any], bool]:
    """Whether the study is done, for the supervisor: hpo.n_trials finished trials, or hpo.timeout_s passed."""
    started = time.monotonic()
    return lambda study: ((hpo.n_trials is not None and finished(study) >= hpo.n_trials)
                          or (hpo.timeout_s is not None and time.monotonic() - started >= hpo.timeout_s))

"""HPO end to end: Optuna studies as nested MLflow runs on the tiny model (CPU), fold-level pruning, and the
pruner chain; bad input fails before any run starts. Two hand-started workers on PostgreSQL are below;
`maxout hpo --workers N` is in test_hpo_workers.py."""

from __future__ import annotations

import binascii
import os

import mlflow
import pytest
import torch

from maxout import cli, loading
from maxout.errors import ConfigError
from maxout.hpo import study as hpo_study
from maxout.train import Callback

from . import warm_maxout
from .conftest import runs_in, two_invocations_shared_one_study
from .services import free_port

# 48 training / 32 validation rows of the demo task: 3 optimizer steps per epoch at batch 16.
# One worker, in this process: the callbacks that inject failures live here (`--workers N`: test_hpo_workers.py).
BASE = ["hardware=cpu", "model=tiny", "hpo=default", "hpo.workers=1", "train.log_every=1", "hpo.sampler.seed=7"]

# The pruner settings that make pruning certain, whatever the (tiny, random) model scores: one report per epoch, and
# Hyperband with min_resource=1, max_resource=3, reduction_factor=3 has two brackets. Bracket 0 decides at step 1, and with
# bootstrap_count=1 the first trial to reach that rung is pruned (no competitor has finished it yet). Bracket 1
# decides first at step 3, the last one, where maxout never prunes: its trials always complete. PatientPruner
# is off, because it only asks Hyperband after a drop in the metric.
FORCED = ["hpo.report_every_epochs=1", "hpo.pruner.min_resource=1", "hpo.pruner.max_resource=3",
          "hpo.pruner.reduction_factor=3", "hpo.pruner.bootstrap_count=1", "hpo.pruner.patience=null"]


def bracket(study_name: str, number: int) -> int:
    """Hyperband's bracket for trial ``number``: crc32("<study>_<number>") modulo the total trial budget of the
    brackets (optuna/pruners/_hyperband.py); with the settings above the budgets are 3 (bracket 0) and 2."""
    return 0 if binascii.crc32(f"{study_name}_{number}".encode()) % 5 < 3 else 1


def study_name_where(*brackets_by_trial: set) -> str:
    """A study name whose trial i falls into one of the brackets brackets_by_trial[i]."""
    for i in range(10_000):
        name = f"study-{i}"
        if all(bracket(name, n) in allowed for n, allowed in enumerate(brackets_by_trial)):
            return name
    raise AssertionError("no such study name")


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture
def small_data(tmp_path):
    from maxout.data import read_table

    train = read_table("projects/nli_demo/data/train.csv").head(48)
    val = read_table("projects/nli_demo/data/validation.csv").head(32)
    train.to_csv(tmp_path / "train.csv", index=False)
    val.to_csv(tmp_path / "val.csv", index=False)
    return [f"data.train_path={tmp_path / 'train.csv'}", f"data.validation_path={tmp_path / 'val.csv'}"]


def store_overrides(store) -> list[str]:
    return [*store["overrides"], f"hpo.storage={store['dir'] / 'optuna.journal'}"]


class OutOfMemoryAt(Callback):
    """Raises CUDA's out-of-memory error at the first step of the n-th training run (0-based)."""

    def __init__(self, n: int):
        self.n, self.runs = n, -1

    def on_train_start(self, state):
        self.runs += 1

    def on_step_end(self, state):
        if self.runs == self.n:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


def dashboard_shows(storage: str, study_name: str) -> bool:
    """`optuna-dashboard <storage>` (the command docs/tutorials/hpo.md gives) serves the study from the same storage."""
    import subprocess
    import sys

    import requests

    from .services import stop, wait_http

    port = free_port()
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "optuna-dashboard"), storage,
                             "--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/api/studies", timeout_s=60, proc=proc)
        studies = requests.get(f"http://127.0.0.1:{port}/api/studies", timeout=10).json()["study_summaries"]
        return study_name in {s["study_name"] for s in studies}
    finally:
        stop(proc)


def children_of(runs, parent_id):
    return [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent_id]


def history(uri, run_id, key):
    return mlflow.MlflowClient(uri).get_metric_history(run_id, key)


def evaluations(uri, run_id):
    """Steps at which a run evaluated (train() logs the final metrics again at the last step)."""
    return sorted({m.step for m in history(uri, run_id, "eval/macro_f1")})


class CtrlCAt(Callback):
    """The terminal's Ctrl-C (SIGINT to this process) at step ``step`` of the first trial. What runs right after the
    kill tells whether the signal raised there (the old way, where a KeyboardInterrupt can land in a weakref callback
    and be dropped) or was recorded for the next safe point."""

    def __init__(self, step: int = 2):
        self.step, self.sent, self.ran_on = step, False, False

    def on_step_end(self, state):
        if state.step == self.step and not self.sent:
            import signal

            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)
            self.ran_on = True  # not reached if the handler raised inside this callback


def test_ctrl_c_stops_a_one_worker_study_at_a_safe_point_and_leaves_nothing_running(mlflow_store, small_data):
    import signal

    before = signal.getsignal(signal.SIGINT)
    ctrl_c = CtrlCAt()
    with pytest.raises(KeyboardInterrupt):
        hpo_study.run([*BASE, *small_data, *store_overrides(mlflow_store), "train.epochs=2", "hpo.n_trials=5",
                       "hpo.pruner.name=none", "hpo.study_name=ctrl-c"], callbacks=[ctrl_c])
    assert ctrl_c.sent and ctrl_c.ran_on  # recorded, raised at the next safe point
    assert signal.getsignal(signal.SIGINT) is before  # the caller's handler is back
    runs = runs_in(mlflow_store["uri"])
    assert [r.info.status for r in runs if r.info.status == "RUNNING"] == []
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    trials = children_of(runs, parent.info.run_id)
    assert parent.info.status == "KILLED" and len(trials) == 1  # no trial started after the Ctrl-C
    assert trials[0].info.status == "KILLED" and trials[0].data.tags["maxout.hpo.state"] == "FAIL"


@pytest.mark.slow
def test_four_trial_study_is_one_parent_with_nested_trials_pruned_and_oom(mlflow_store, small_data):
    # trial 0: bracket 0 (pruned at epoch 1); trial 2: out of memory (pruned, the study goes on);
    # trials 1 or 3: one in bracket 1 at least (completes).
    name = study_name_where({0}, {0, 1}, {0, 1}, {1})
    handed_over = []
    result = hpo_study.run(
        [*BASE, *small_data, *store_overrides(mlflow_store), *FORCED, "train.epochs=3", "hpo.n_trials=4",
         f"hpo.study_name={name}", "tracking.system_metrics=true", "tracking.system_metrics_interval_s=0.2",
         "registry.name=hpo-best"],
        callbacks=[OutOfMemoryAt(2)],
        on_best=lambda cfg, best: (handed_over.append(best), hpo_study.promote_best_trial(cfg, best)))

    runs = runs_in(mlflow_store["uri"])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1 and parents[0].info.run_id == result.parent_run_id
    parent = parents[0]
    children = {int(r.data.tags["maxout.hpo.trial_number"]): r for r in children_of(runs, parent.info.run_id)}
    assert sorted(children) == [0, 1, 2, 3] and len(runs) == 5
    for child in children.values():
        assert child.info.status == "FINISHED"  # complete and pruned trials alike
        assert child.data.tags["maxout.hpo.study"] == name
        assert {"hpo.train.lr", "hpo.model.dropout", "cfg.train.lr", "opt.precision.effective",
                "opt.compile.effective"} <= set(child.data.params)
        assert child.data.params["hpo.train.lr"] == child.data.params["cfg.train.lr"]  # the sample was applied

    states = {n: c.data.tags["maxout.hpo.state"] for n, c in children.items()}
    assert states[0] == "PRUNED" and states[2] == "PRUNED" and "COMPLETE" in (states[1], states[3])
    uri = mlflow_store["uri"]
    # Pruned at once: one evaluation for trial 0, three for a complete trial; its compile time is logged too.
    assert len(evaluations(uri, children[0].info.run_id)) == 1
    assert "time/compile_s" in children[0].data.metrics
    complete = [c for n, c in children.items() if states[n] == "COMPLETE"]
    assert all(len(evaluations(uri, c.info.run_id)) == 3 for c in complete)
    assert all(any(k.startswith("system/") for k in c.data.metrics) for c in complete)  # sampled on children
    assert "out of memory" in children[2].data.tags["maxout.hpo.reason"]
    assert children[2].data.metrics["hpo/epochs_run"] == pytest.approx(1 / 3)  # its first step of 3, then the error

    m = parent.data.metrics
    assert not any(k.startswith("system/") for k in m)  # ... and not on the parent: no double sampling
    assert parent.info.status == "FINISHED"
    assert m["hpo/trials_total"] == 4 and m["hpo/trials_failed"] == 0
    assert m["hpo/trials_pruned"] == 4 - len(complete) and m["hpo/trials_complete"] == len(complete)
    run_epochs = sum(c.data.metrics["hpo/epochs_run"] for c in children.values())
    assert m["hpo/trial_epochs_run"] == pytest.approx(run_epochs) and m["hpo/trial_epochs_without_pruning"] == 12
    assert m["hpo/compute_saved"] == pytest.approx(1 - run_epochs / 12)
    best_child = max(complete, key=lambda c: c.data.metrics["eval/macro_f1"])
    assert m["hpo/best_value"] == pytest.approx(best_child.data.metrics["eval/macro_f1"])
    best_run = children[int(parent.data.tags["maxout.hpo.best_trial"])]
    assert best_run.info.run_id == parent.data.tags["maxout.hpo.best_run_id"]
    assert best_run.data.metrics["eval/macro_f1"] == m["hpo/best_value"]
    assert {f"best.{k}" for k in ("train.lr", "model.dropout")} <= set(parent.data.params)

    client = mlflow.MlflowClient(uri)
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"trials.csv", "best.json", "config.yaml"} <= artifacts
    assert {f"plots/{p}.png" for p in ("optimization_history", "intermediate_values")} <= {
        a.path for a in client.list_artifacts(parent.info.run_id, "plots")}
    table = mlflow.artifacts.load_text(f"{parent.info.artifact_uri}/trials.csv").splitlines()
    assert len(table) == 5  # header + 4 trials

    assert dashboard_shows(str(mlflow_store["dir"] / "optuna.journal"), name)

    # The registry hook got the best trial, with the model that trial logged (hpo.log_models=best).
    assert len(handed_over) == 1 and handed_over[0].run_id == best_run.info.run_id
    assert handed_over[0].model_uri == best_run.data.tags["maxout.model_uri"]
    # ... and registered it: the first version of the model, champion, from the best trial's run.
    (version,) = client.search_model_versions("name='hpo-best'")
    assert version.run_id == best_run.info.run_id
    assert client.get_model_version_by_alias("hpo-best", "champion").version == version.version
    # A second call (another worker's summary of the same study) does not register it twice.
    hpo_study.promote_best_trial(loading.load([*BASE, *small_data, *store_overrides(mlflow_store),
                                               "registry.name=hpo-best"]), handed_over[0])
    assert len(client.search_model_versions("name='hpo-best'")) == 1


@pytest.mark.slow
def test_kfold_trial_pruned_after_a_fold_shows_fewer_fold_metrics(mlflow_store, small_data):
    name = study_name_where({0}, {1})  # trial 0: decided after fold 1 (pruned); trial 1: never pruned
    result = hpo_study.run([*BASE, *small_data, *store_overrides(mlflow_store), *FORCED, "hpo.k_folds=3",
                            "train.epochs=1", "hpo.n_trials=2", f"hpo.study_name={name}"])
    runs = runs_in(mlflow_store["uri"])
    trials = {int(r.data.tags["maxout.hpo.trial_number"]): r for r in children_of(runs, result.parent_run_id)}
    pruned, complete = trials[0], trials[1]
    assert pruned.data.tags["maxout.hpo.state"] == "PRUNED" and complete.data.tags["maxout.hpo.state"] == "COMPLETE"
    uri = mlflow_store["uri"]
    pruned_folds = history(uri, pruned.info.run_id, "fold/eval/macro_f1")
    complete_folds = history(uri, complete.info.run_id, "fold/eval/macro_f1")
    assert [p.step for p in pruned_folds] == [1] and [p.step for p in complete_folds] == [1, 2, 3]
    # Each fold trained in its own run under the trial's; the objective is the mean over the folds.
    assert len(children_of(runs, pruned.info.run_id)) == 1 and len(children_of(runs, complete.info.run_id)) == 3
    scores = [p.value for p in complete_folds]
    assert complete.data.metrics["hpo/objective"] == pytest.approx(sum(scores) / 3)
    assert result.best.value == pytest.approx(sum(scores) / 3) and result.best.model_uri is None
    assert complete.data.params["opt.precision.requested"] == "bf16"  # shared fold params on the trial run
    assert result.counts["hpo/trial_epochs_run"] == 1 + 3 and result.counts["hpo/trial_epochs_without_pruning"] == 6


def test_a_study_freezes_the_heap_for_its_trials_unless_its_host_froze_it_and_thaws_only_what_it_froze():
    """optimize() freezes what is alive before the trials (each trial's collection then skips it) and unfreezes
    after; a host that froze its heap itself (a process that forks workers, or this test runner: conftest) keeps it
    frozen, before and after the study."""
    import gc

    import optuna

    from maxout.config import HpoConfig

    seen = []

    def objective(trial):
        seen.append(gc.get_freeze_count())
        return trial.suggest_float("x", 0.0, 1.0)

    gc.unfreeze()  # as a fresh maxout process starts: nothing frozen
    try:
        hpo_study.optimize(optuna.create_study(), objective, HpoConfig(n_trials=1))
        assert seen[0] > 0 and gc.get_freeze_count() == 0  # frozen for its trial, thawed after
        gc.collect()
        gc.freeze()  # a host that froze its own heap
        hpo_study.optimize(optuna.create_study(), objective, HpoConfig(n_trials=1))
        assert seen[1] > 0 and gc.get_freeze_count() > 0  # still frozen after (frozen objects freed leave it)
    finally:
        gc.collect()
        gc.freeze()


def test_patient_pruner_asks_hyperband_only_after_the_metric_stalls(cpu_device):
    """The conservative chain on a real in-memory study: a trial behind the leader but still improving is kept
    while it improves; plain Hyperband (the default) prunes it at the first rung."""
    import optuna

    def steps_until_pruned(patience):
        # reduction_factor 5 > max_resource 4: a single bracket, so both trials compete at the same rungs.
        cfg = loading.load(["hardware=cpu", "model=tiny", "hpo=default", "train.epochs=4",
                            "hpo.pruner.reduction_factor=5", f"hpo.pruner.patience={patience}"], device=cpu_device)
        study = optuna.create_study(direction="maximize", pruner=hpo_study.build_pruner(cfg.hpo, 4))
        leader = study.ask()
        for step, value in enumerate([0.9, 0.95, 0.94, 0.93], 1):
            leader.report(value, step)
            assert not leader.should_prune()  # (Hyperband records a rung only when it is asked)
        study.tell(leader, 0.93)
        trailing = study.ask()
        for step, value in enumerate([0.1, 0.2, 0.15, 0.12], 1):  # improves, then stalls for 2 steps
            trailing.report(value, step)
            if trailing.should_prune():
                return step
        return None

    shipped = loading.load(["hardware=cpu", "hpo=default"], device=cpu_device).hpo  # Hyperband alone ...
    assert isinstance(hpo_study.build_pruner(shipped, 3), optuna.pruners.HyperbandPruner)
    conservative = loading.load(["hardware=cpu", "hpo=default", "hpo.pruner.patience=0"], device=cpu_device).hpo
    assert isinstance(hpo_study.build_pruner(conservative, 3), optuna.pruners.PatientPruner)  # ... or patient
    assert steps_until_pruned("null") == 1
    assert steps_until_pruned(1) == 4


def _existing_minimize_study(store):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # its "new study created" line is not maxout's output
    path = store["dir"] / "optuna.journal"
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))
    optuna.create_study(study_name="taken", storage=storage, direction="minimize")
    return [f"hpo.storage={path}", "hpo.study_name=taken"]


BAD = {
    "every_bad_setting_at_once": (["hpo.n_trials=0", "hpo.sampler.name=grid", "hpo.pruner.reduction_factor=1"], 2,
                                  "3 problems: hpo.n_trials=0 must be >= 1; hpo.sampler.name='grid' (valid: tpe, "
                                  "random); hpo.pruner.reduction_factor=1 must be >= 2"),
    "unknown_hyperparameter": (["+hpo.search_space.train.learning_rate={type:float,low:0.1,high:1.0}"], 2,
                               "unknown hyper-parameter 'train.learning_rate' in hpo.search_space"),
    "inverted_range": (["hpo.search_space.train.lr.low=1e-3", "hpo.search_space.train.lr.high=1e-5"], 2,
                       "hpo.search_space.train.lr: inverted range: low=0.001 > high=1e-05"),
    "empty_range": (["hpo.search_space.model.dropout.low=0.1", "hpo.search_space.model.dropout.high=0.1"], 2,
                    "hpo.search_space.model.dropout: empty range"),
    "no_choices": (["hpo.search_space.train.target_effective_batch.choices=[]"], 2,
                   "categorical needs a non-empty list of choices"),
    "value_the_config_rejects": (["hpo.search_space.model.dropout.high=1.5"], 2,
                                 "model.dropout=1.5 must be in [0, 1)"),
    "unreachable_storage": ([lambda s: [f"hpo.storage=postgresql+psycopg2://maxout:s3cret@127.0.0.1:{free_port()}/x"]],
                            1, "HPO storage unreachable at postgresql+psycopg2://maxout:***@127.0.0.1:"),
    "report_every_zero_steps": (["hpo.report_every_steps=0"], 2,
                                "hpo.report_every_steps=0 must be >= 1 (or null: report every "
                                "hpo.report_every_epochs of an epoch)"),
    "registry_without_a_model": (["registry.name=hpo-best", "hpo.k_folds=3"], 2,
                                  "registry.name='hpo-best' needs the best trial's model: k-fold trials"),
    "study_with_another_direction": ([_existing_minimize_study], 2,
                                     "study 'taken' in {dir}/optuna.journal already exists with direction=minimize, "
                                     "not maximize"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_nonzero_and_leaves_no_run(case, mlflow_store, capsys):
    extra, code, message = BAD[case]
    extra = [x for e in extra for x in (e(mlflow_store) if callable(e) else [e])]
    assert cli.main(["hpo", "hardware=cpu", "model=tiny", *store_overrides(mlflow_store), *extra]) == code
    err = capsys.readouterr().err.strip()
    assert err.startswith("maxout: error: ") and "\n" not in err, err
    assert message.format(dir=mlflow_store["dir"]) in err, err
    assert "s3cret" not in err
    assert runs_in(mlflow_store["uri"]) == []  # nothing started, so nothing left RUNNING


@pytest.mark.slow
def test_two_workers_on_postgres_lose_no_trial_when_one_is_killed(tmp_path, small_data):
    """Two `maxout hpo` processes on one study in a real PostgreSQL (Optuna storage and MLflow store). Worker A
    is SIGKILLed mid-trial; worker B finds A's trial stale by its heartbeat, re-queues it with the same params,
    runs it, and ends the runs A left RUNNING as KILLED."""
    import collections
    import signal
    import time

    import optuna
    from optuna.trial import TrialState

    from .services import create_database, postgres

    with postgres() as server:
        optuna_url, mlflow_url = create_database(server, "optuna"), create_database(server, "mlflow")
        mlflow.MlflowClient(mlflow_url).search_experiments()  # the schema, as a tracking server would own it
        overrides = ["hardware=cpu", "model=tiny", "hpo=default", "hpo.workers=1", *small_data, "train.epochs=3",
                     f"tracking.uri={mlflow_url}", f"tracking.artifact_location={(tmp_path / 'art').as_uri()}",
                     "tracking.system_metrics=false", f"hpo.storage={optuna_url}", "hpo.study_name=shared",
                     "hpo.n_trials=6", "hpo.pruner.name=none", "hpo.log_models=none",
                     # a grace of 10 beats: a live worker's beat (a PostgreSQL commit) held up for seconds on a
                     # loaded machine must not read as a dead worker's
                     "hpo.heartbeat_interval_s=1", "hpo.grace_period_s=10"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two workers on two cores

        def worker(name):
            log = open(tmp_path / f"{name}.log", "w")
            return warm_maxout.popen(["hpo", *overrides, "--no-progress"], env=env, stdout=log,
                                     stderr=warm_maxout.STDOUT)  # a process of its own, forked warm

        a, b = worker("a"), worker("b")
        storage = optuna.storages.RDBStorage(optuna_url)
        victim, deadline = None, time.monotonic() + 240
        while victim is None and time.monotonic() < deadline and a.poll() is None:
            try:
                trials = optuna.load_study(study_name="shared", storage=storage).get_trials(
                    deepcopy=False, states=(TrialState.RUNNING,))
            except KeyError:  # the study does not exist yet
                trials = []
            mine = [t for t in trials if t.user_attrs.get("worker", "").endswith(f":{a.pid}")]
            victim = mine[0].number if mine else None
            time.sleep(0.05)
        assert victim is not None, (tmp_path / "a.log").read_text()[-3000:]
        os.kill(a.pid, signal.SIGKILL)  # mid-trial: its child run is open and it is training
        assert a.wait(30) == -signal.SIGKILL
        assert b.wait(300) == 0, (tmp_path / "b.log").read_text()[-3000:]

        trials = optuna.load_study(study_name="shared", storage=storage).get_trials(deepcopy=False)
        by_number = {t.number: t for t in trials}
        assert by_number[victim].state == TrialState.FAIL
        retries = [t for t in trials if t.system_attrs.get("failed_trial") == victim]
        assert len(retries) == 1 and retries[0].state == TrialState.COMPLETE
        assert retries[0].params == by_number[victim].params  # the same trial again, not a new sample
        assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
        assert sum(t.state == TrialState.COMPLETE for t in trials) >= 6

        runs = runs_in(mlflow_url)
        assert not [r for r in runs if r.info.status == "RUNNING"]
        children = [r for r in runs if "maxout.hpo.trial_number" in r.data.tags]
        numbers = collections.Counter(int(r.data.tags["maxout.hpo.trial_number"]) for r in children)
        assert set(numbers.values()) == {1} and set(numbers) == set(by_number)  # every trial once, none twice
        lost = next(r for r in children if int(r.data.tags["maxout.hpo.trial_number"]) == victim)
        assert lost.info.status == "KILLED" and lost.data.tags["maxout.hpo.state"] == "FAIL"
        assert "lost" in lost.data.tags["maxout.status_reason"]
        retry_run = next(r for r in children if int(r.data.tags["maxout.hpo.trial_number"]) == retries[0].number)
        assert retry_run.data.tags["maxout.hpo.retry_of"] == str(victim)
        parents = {r.data.tags["maxout.hpo.worker"].split(":")[1]: r for r in runs
                   if r.data.tags.get("maxout.command") == "hpo"}
        assert parents[str(a.pid)].info.status == "KILLED" and parents[str(b.pid)].info.status == "FINISHED"
        assert parents[str(b.pid)].data.metrics["hpo/trials_failed"] == 1
        assert dashboard_shows(optuna_url, "shared")


def test_a_worker_that_lost_the_race_to_create_the_tables_opens_the_storage_again(tmp_path, monkeypatch):
    """Each worker's Optuna creates the storage's tables on a new database. Started together (a Slurm array's tasks:
    the array test failed on it), all but one failed on PostgreSQL's own unique index and stopped with "HPO storage
    unreachable": two processes opening optuna.storages.RDBStorage at the same moment on a fresh PostgreSQL database
    raised `IntegrityError (psycopg2.errors.UniqueViolation) duplicate key value violates unique constraint
    "pg_type_typname_nsp_index"` in 2 of 6 tries. The race, made certain here: the first attempt loses it; the
    worker opens the storage again, whose tables now exist."""
    import optuna
    import sqlalchemy

    from maxout.hpo import storage as storage_mod

    real, lost = optuna.storages.RDBStorage, []

    def racing(*args, **kwargs):
        if not lost:
            lost.append(True)
            raise sqlalchemy.exc.IntegrityError("CREATE TABLE studies ...", {}, Exception(
                'duplicate key value violates unique constraint "pg_type_typname_nsp_index"'))
        return real(*args, **kwargs)

    monkeypatch.setattr(optuna.storages, "RDBStorage", racing)
    cfg = loading.load(["hardware=cpu", "model=tiny", "hpo=default", "tracking=none",
                        f"hpo.storage=sqlite:///{tmp_path / 'optuna.db'}"])
    storage = storage_mod.open_storage(cfg.hpo, cfg.tracking)
    assert lost == [True] and isinstance(storage, real)


def test_on_postgres_workers_opening_a_new_storage_together_create_its_tables_one_at_a_time(monkeypatch):
    """The retry above still left a race: a fresh clone's suite (2026-11-27) had one of two `maxout hpo` processes
    fail with psycopg2.errors.DuplicateTable while both created Optuna's tables, which is no IntegrityError. On
    PostgreSQL each worker now opens the storage under an advisory lock: four threads released together on a new
    database, each slowed inside Optuna's own constructor, are never inside it at the same time, and all succeed."""
    import threading
    import time

    import optuna

    from maxout.config import HpoConfig, TrackingConfig
    from maxout.hpo import storage as storage_mod

    from .services import create_database, postgres

    real, inside, spans = optuna.storages.RDBStorage, [], []

    def slow(*args, **kwargs):  # the window the tables are created in, widened to make overlaps certain
        inside.append(1)
        began, concurrent = time.monotonic(), len(inside)
        time.sleep(0.3)
        try:
            return real(*args, **kwargs)
        finally:
            inside.pop()
            spans.append((began, time.monotonic(), concurrent))

    monkeypatch.setattr(optuna.storages, "RDBStorage", slow)
    with postgres() as server:
        url = create_database(server, "together")
        barrier, opened, errors = threading.Barrier(4), [], []

        def worker():
            barrier.wait()
            try:
                opened.append(storage_mod.open_storage(HpoConfig(storage=url), TrackingConfig()))
            except Exception as err:  # noqa: BLE001 - every failure is the test's to report
                errors.append(err)

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert errors == [] and len(opened) == 4 and all(isinstance(s, real) for s in opened)
        assert [c for *_, c in spans] == [1, 1, 1, 1]  # one at a time
        ordered = sorted(spans)
        assert all(a[1] <= b[0] for a, b in zip(ordered, ordered[1:]))
        monkeypatch.undo()  # Optuna's own code looks RDBStorage up where the stand-in was put
        study = optuna.create_study(storage=opened[0], study_name="after")  # and the storage works
        assert study.study_name == "after"


@pytest.mark.slow
def test_invocations_started_on_their_own_share_one_parent_run_with_hpo_parent_shared(tmp_path, small_data):
    """hpo.parent=shared, what a Slurm job array's tasks and a Kubernetes Job's pods run: two `maxout hpo` processes
    of one PostgreSQL study, started at the same moment (tests/job_race.py), nest every trial under ONE parent run:
    one creates it (under the study's advisory lock), the other joins it, and the last to leave ends it FINISHED
    with the study's summary. Before: each invocation had a parent run of its own."""

    import optuna

    from maxout.hpo import shared_parent

    from . import job_race
    from .services import create_database, postgres

    with pytest.raises(ConfigError, match="hpo.parent=shared runs one worker per invocation"):
        loading.load([*BASE, *small_data, "hpo.parent=shared", "hpo.workers=2"])
    with postgres() as server:
        optuna_url, mlflow_url = create_database(server, "optuna"), create_database(server, "mlflow")
        mlflow.MlflowClient(mlflow_url).search_experiments()  # the schema, as a tracking server would own it
        overrides = [*BASE, *small_data, "train.epochs=1", f"tracking.uri={mlflow_url}",
                     f"tracking.artifact_location={(tmp_path / 'art').as_uri()}", "tracking.system_metrics=false",
                     f"hpo.storage={optuna_url}", "hpo.study_name=array", "hpo.n_trials=4", "hpo.pruner.name=none",
                     "hpo.log_models=none", "hpo.parent=shared"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = job_race.start_together(tmp_path / "race", [["hpo", *overrides, "--no-progress"]] * 2, env=env,
                                       timeout_s=600)
        logs = [log for _, log in done]
        assert [code for code, _ in done] == [0, 0], [log[-3000:] for log in logs]

        runs = runs_in(mlflow_url)
        (parent,) = [r for r in runs if r.data.tags.get("maxout.command") == "hpo"]
        assert parent.info.status == "FINISHED" and parent.data.metrics["hpo/trials_complete"] >= 4
        trials = [r for r in runs if "maxout.hpo.trial_number" in r.data.tags]
        assert len(trials) >= 4 and {r.data.tags["mlflow.parentRunId"] for r in trials} == {parent.info.run_id}
        assert {r.info.status for r in runs} == {"FINISHED"}
        study = optuna.load_study(study_name="array", storage=optuna_url)
        assert study._storage.get_study_system_attrs(study._study_id)[shared_parent.PARENT_ATTR] == parent.info.run_id
        two_invocations_shared_one_study(study, logs, parent.info.run_id)
        assert sum("ends the shared parent run" in log for log in logs) <= 1  # the first to leave left it


@pytest.mark.slow
def test_trials_report_within_epochs_and_the_parent_plots_every_trials_curve(mlflow_store, small_data, warm_starts):
    """Reports every half epoch: 3 steps per epoch, 2 epochs -> evaluations after steps 2, 3, 5 and 6, so 4 reports
    per trial and a pruner whose resource (max_resource) is 4 reports. The trials share one warm start."""
    result = hpo_study.run([*BASE, *small_data, *store_overrides(mlflow_store), "train.epochs=2", "hpo.n_trials=2",
                            "hpo.report_every_epochs=0.5", "hpo.pruner.name=none", "hpo.log_models=none",
                            "~hpo.search_space.train.target_effective_batch"])  # (a batch of 32: 2 steps an epoch)
    runs = runs_in(mlflow_store["uri"])
    parent = next(r for r in runs if r.info.run_id == result.parent_run_id)
    assert parent.data.params["hpo.pruner.max_resource"] == "4" and parent.data.params["hpo.report_unit"] == "0.5 epochs"
    for child in children_of(runs, result.parent_run_id):
        assert evaluations(mlflow_store["uri"], child.info.run_id) == [2, 3, 5, 6]
        assert child.data.metrics["hpo/evaluations"] == 4 and child.data.metrics["hpo/epochs_run"] == 2
        assert child.data.params["cfg.checkpoint.enabled"] == "False"  # a trial is never resumed
    import optuna

    journal = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
        str(mlflow_store["dir"] / "optuna.journal")))
    trials = optuna.load_study(study_name=result.study_name, storage=journal).get_trials()
    assert [sorted(t.intermediate_values) for t in trials] == [[1, 2, 3, 4]] * 2
    assert len(warm_starts) == 1 and warm_starts[0].hits == 2  # trial 1 reused trial 0's tokenized tables
    plots = {a.path for a in mlflow.MlflowClient(mlflow_store["uri"]).list_artifacts(result.parent_run_id, "plots")}
    assert "plots/intermediate_values.png" in plots


def test_intermediate_values_plot_marks_where_pruned_trials_stopped(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt
    import optuna

    from maxout.hpo.report import intermediate_values

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    for number, (values, pruned) in enumerate([([0.5, 0.6, 0.7], False), ([0.3, 0.2], True), ([0.5, 0.8, 0.9], False)]):
        trial = study.ask()
        for step, value in enumerate(values, 1):
            trial.report(value, step)
        study.tell(trial, state=optuna.trial.TrialState.PRUNED) if pruned else study.tell(trial, max(values))
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    assert intermediate_values(study.get_trials(), "0.5 epochs", "maximize", tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
    lines = figures[0].axes[0].get_lines()
    crosses = [line for line in lines if line.get_marker() == "x" and len(line.get_xdata()) == 1]
    assert [(line.get_xdata()[0], line.get_ydata()[0]) for line in crosses] == [(2, 0.2)]  # the pruned trial's end
    labels = [t.get_text() for t in figures[0].axes[0].get_legend().get_texts()]
    assert "best: trial 2" in labels and "complete (2)" in labels and labels[-1].startswith("pruned (1)")
    assert not intermediate_values([], "0.5 epochs", "maximize", tmp_path / "none.png")


def test_report_schedule_sets_the_trials_evaluations_and_the_pruners_resource(cpu_device):
    from maxout.hpo.objective import trial_settings
    from maxout.train.evaluate import evaluation_steps

    def cfg(*extra):
        return loading.load(["hardware=cpu", "model=tiny", "hpo=default", "train.epochs=3",
                             "train.batch_size=16", *extra], device=cpu_device)

    # 48 rows at batch 16: 3 steps per epoch, 9 in all.
    assert sorted(evaluation_steps(3, 9, 0, 0.5)) == [2, 3, 5, 6, 8, 9]
    assert hpo_study.max_resource(cfg("hpo.report_every_epochs=0.5"), 48) == 6
    assert hpo_study.max_resource(cfg("hpo.report_every_epochs=1"), 48) == 3
    assert hpo_study.max_resource(cfg("hpo.report_every_steps=2"), 48) == 5  # steps 2, 4, 6, 8 and the last, 9
    assert hpo_study.max_resource(cfg("hpo.k_folds=4"), 48) == 4
    assert hpo_study.max_resource(cfg("hpo.pruner.max_resource=7"), 48) == 7
    assert hpo_study.max_resource(cfg("train.batch_size=auto", "train.target_effective_batch=null"), 48) is None
    assert trial_settings(cfg("hpo.report_every_steps=2").hpo) == {
        "checkpoint.enabled": False, "train.eval_interval": 2, "train.eval_every_epochs": 1.0}
    assert trial_settings(cfg("hpo.k_folds=3").hpo) == {"checkpoint.enabled": False}
    with pytest.raises(ConfigError, match="min_resource=7 is more than the 6 reports of a trial"):
        hpo_study.build_pruner(cfg("hpo.pruner.min_resource=7").hpo, 6)


def test_a_warm_trial_config_is_the_one_hydra_composes(cpu_device):
    """hpo.warm_start sets the sampled values on the study's config instead of composing it again (~1 s a trial):
    the same config, value for value."""
    from maxout.config import to_dict
    from maxout.hpo import search_space

    base = ["hardware=cpu", "model=tiny", "hpo=default", "train.epochs=2",
            "+hpo.search_space.hardware.precision={type:categorical,choices:[bf16,fp32]}"]
    study_cfg = loading.load(base, device=cpu_device)
    values = {"train.lr": 1.2345678901234e-05, "train.weight_decay": 0.0, "train.warmup_ratio": 0.1,
              "train.target_effective_batch": 32, "model.dropout": 0.25, "hardware.precision": "fp32"}
    composed = loading.load(base + search_space.overrides(values), device=cpu_device)
    assert to_dict(search_space.apply(study_cfg, values)) == to_dict(composed)


def test_warm_start_tokenizes_each_table_once(small_data, cpu_device):
    from maxout.data import load
    from maxout.train.warm import WarmStart

    cfg = loading.load(["hardware=cpu", "model=tiny", *small_data], device=cpu_device)
    dataset, warm = load(cfg.data), WarmStart()
    tokenizer = warm.tokenizer(cfg.model)
    assert warm.tokenizer(cfg.model) is tokenizer
    first = warm.encode(tokenizer, dataset.train, 64)
    assert warm.encode(tokenizer, dataset.train, 64) is first and warm.hits == 1
    assert warm.encode(tokenizer, dataset.train, 32) is not first  # another max_length is another encoding


def test_sampled_values_become_overrides_that_compose_the_trial_config(cpu_device):
    from maxout.hpo import search_space

    base = ["hardware=cpu", "model=tiny", "hpo=default", "~hpo.search_space.model.dropout",
            "+hpo.search_space.hardware.precision={type:categorical,choices:[bf16,fp32]}",
            "+hpo.search_space.hardware.compile={type:categorical,choices:[true,false]}",
            "+hpo.search_space.train.max_steps={type:int,low:4,high:32,log:true}"]
    cfg = loading.load(base, device=cpu_device)
    specs = search_space.load(cfg.hpo.search_space, cfg)
    assert {s.key for s in specs} == {"train.lr", "train.weight_decay", "train.warmup_ratio", "train.max_steps",
                                      "train.target_effective_batch", "hardware.precision", "hardware.compile"}
    # (the model section, emptied by ~hpo.search_space.model.dropout, is no error)
    values = {"train.lr": 1.5e-05, "train.weight_decay": 0.0, "train.warmup_ratio": 0.1,
              "train.target_effective_batch": 32, "hardware.precision": "fp32", "hardware.compile": True,
              "train.max_steps": 7}
    trial = loading.load(base + search_space.overrides(values), device=cpu_device)
    assert (trial.train.lr, trial.train.target_effective_batch, trial.hardware.precision, trial.hardware.compile,
            trial.train.max_steps) == (1.5e-05, 32, "fp32", True, 7)
    assert trial.hardware.name == "cpu"  # the sampled hardware.* keys apply on top of the profile


def test_out_of_memory_that_maxout_could_not_recover_prunes_like_torchs_own():
    from maxout.errors import MaxoutError, OutOfMemory
    from maxout.hpo.objective import is_out_of_memory
    from maxout.train.oom import OOMRecovery

    one_row = {"labels": torch.zeros(1), "input_ids": torch.zeros(1, 8)}
    with pytest.raises(OutOfMemory) as exhausted:  # recovery gives up at one row per forward pass
        OOMRecovery().halve("CUDA out of memory", [one_row], step=3, device_type="cpu")
    assert is_out_of_memory(exhausted.value)
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert not is_out_of_memory(MaxoutError("data.train_path='x.csv' not found"))


@pytest.mark.slow
def test_a_diverging_study_goes_on_and_its_champion_is_a_finite_loss_trial(mlflow_store, small_data):
    """Trials that draw lr=1e9 diverge at step 2: each is pruned (the sampler learns, the study goes on), its run
    ends FAILED naming the step, and it logs no model; the best trial and the registry's champion trained."""
    lrs = [1e9, 1e9, 1e-3, 1e9, 1e-3]  # what the random sampler with seed 6 draws, in order
    result = hpo_study.run([*BASE, *small_data, *store_overrides(mlflow_store), "train.epochs=1", "hpo.n_trials=5",
                            "hpo.sampler.name=random", "hpo.sampler.seed=6", "hpo.pruner.name=none",
                            "hpo.study_name=diverging", "~hpo.search_space.train", "~hpo.search_space.model",
                            "+hpo.search_space.train.lr={type:categorical,choices:[1e9,1e-3]}",
                            "registry.name=hpo-diverging"])
    runs = runs_in(mlflow_store["uri"])
    children = {int(r.data.tags["maxout.hpo.trial_number"]): r for r in children_of(runs, result.parent_run_id)}
    assert [float(children[n].data.params["cfg.train.lr"]) for n in range(5)] == lrs
    for n, child in children.items():
        tags = child.data.tags
        if lrs[n] == 1e9:
            assert child.info.status == "FAILED" and tags["maxout.hpo.state"] == "PRUNED"
            assert tags["maxout.diverged_at_step"] == "2" and "training diverged at step 2" in tags["maxout.hpo.reason"]
            assert "maxout.model_uri" not in tags and "eval/macro_f1" not in child.data.metrics
        else:
            assert child.info.status == "FINISHED" and tags["maxout.hpo.state"] == "COMPLETE"
            assert all(v == v for v in child.data.metrics.values())  # no NaN anywhere
    m = next(r for r in runs if r.info.run_id == result.parent_run_id).data.metrics
    assert (m["hpo/trials_complete"], m["hpo/trials_pruned"], m["hpo/trials_failed"]) == (2, 3, 0)
    assert m["hpo/compute_saved"] == 0.0  # a diverged trial could not have gone on: not compute pruning saved
    assert result.best is not None and lrs[result.best.number] == 1e-3
    client = mlflow.MlflowClient(mlflow_store["uri"])
    champion = client.get_model_version_by_alias("hpo-diverging", "champion")
    assert champion.run_id == result.best.run_id and len(client.search_model_versions("name='hpo-diverging'")) == 1
    trained = client.get_run(champion.run_id)
    assert trained.data.params["cfg.train.lr"] == "0.001" and 0 < trained.data.metrics["train/loss"] < 10
    diverged = [children[n].info.run_id for n in range(5) if lrs[n] == 1e9]
    exps = [e.experiment_id for e in client.search_experiments()]
    assert not [lm for lm in client.search_logged_models(exps) if lm.source_run_id in diverged]


def test_a_worker_leaving_the_study_fails_and_requeues_a_dead_workers_trial_and_leaves_a_live_ones():
    """hpo/study.settle_lost_trials on a real PostgreSQL: Optuna finds a dead worker's trial only when a worker
    starts a trial after its grace period, so the worker that brings the study to n_trials must look before it
    leaves (test_two_workers_on_postgres... once ended with the killed worker's trial still RUNNING). A trial whose
    worker stopped sending heartbeats is failed and re-queued with its params; one with live heartbeats is left."""
    import threading

    import optuna
    from optuna.trial import TrialState

    from maxout.config import HpoConfig, TrackingConfig
    from maxout.hpo import storage as storage_mod

    from .services import create_database, postgres

    # The live worker beats every 0.5 s; a grace of 5 s leaves its beats (PostgreSQL commits) seconds of slack
    hpo = HpoConfig(heartbeat_interval_s=1, grace_period_s=5)
    with postgres() as server:
        url = create_database(server, "optuna")
        storage = storage_mod.open_storage(HpoConfig(storage=url, heartbeat_interval_s=1, grace_period_s=5),
                                           TrackingConfig(name="none", backend="none"))
        study = optuna.create_study(study_name="settle", storage=storage)
        dead, live = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)}), study.ask()
        storage.record_heartbeat(dead._trial_id)  # then its worker is killed: no more heartbeats
        beating = threading.Event()

        def heartbeats() -> None:  # a live worker, still training
            while not beating.wait(0.5):
                storage.record_heartbeat(live._trial_id)

        thread = threading.Thread(target=heartbeats, daemon=True)
        thread.start()
        try:
            assert hpo_study.settle_lost_trials(study, hpo) == 1
        finally:
            beating.set()
            thread.join()
        states = {t.number: t.state for t in study.get_trials(deepcopy=False)}
        assert states[dead.number] == TrialState.FAIL and states[live.number] == TrialState.RUNNING
        (requeued,) = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        assert requeued.params == dead.params  # the same params, run by whoever starts the next trial


def test_a_trials_worker_is_the_process_that_ran_it_even_one_forked_after_the_import():
    """Read when asked, not at import: a process forked after the import (tests/job_race.py forks its commands from
    one pre-imported process) names itself, not its parent."""
    from maxout.hpo import objective

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child says its worker and leaves at once (no test machinery runs here)
        os.write(write, objective.worker().encode())
        os._exit(0)
    os.close(write)
    said = os.read(read, 1000).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert said == f"{objective.HOST}:{pid}" and objective.worker() == f"{objective.HOST}:{os.getpid()}"

"""The tracking spool: a journal that survives a crash (even mid-line), a sender that keeps records while the
server is unreachable and refuses to retry what MLflow rejects, and a replay that delivers each metric once, even
when acknowledgements were lost."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
import threading

import mlflow
import pytest
import sqlalchemy
from mlflow.entities import Metric, Param, RunTag

from maxout import cli
from maxout.tracking import spool
from maxout.tracking.datasets import DataInput

from .services import free_port
from .store_template import new_store


def metrics(steps, key="train/loss"):
    return [Metric(key, float(step) / 10, 1_700_000_000_000 + step, step) for step in steps]


def test_the_journal_reopens_with_what_was_not_acknowledged_in_order(tmp_path):
    path = tmp_path / "run.jsonl"
    journal = spool.Spool(path, "a" * 32, "http://server:5000")
    journal.append(params=[Param("cfg.lr", "0.1")])
    journal.append(metrics=metrics(range(1, 1501)), tags=[RunTag("maxout.run_key", "k")])  # 2 metric chunks + tags
    journal.ack(1)
    with open(path, "a") as f:
        f.write('{"seq": 99, "metrics": [["torn')  # SIGKILL in the middle of a write
    reopened = spool.Spool(path)
    assert reopened.run_id == "a" * 32 and reopened.tracking_uri == "http://server:5000"
    assert [r["seq"] for r in reopened.pending()] == [2, 3, 4]
    assert [len(r.get("metrics", [])) for r in reopened.pending()] == [1000, 500, 0]
    reopened.append(metrics=metrics([1501]))  # appends after the torn line, on a line of its own
    assert [r["seq"] for r in spool.Spool(path).pending()] == [2, 3, 4, 5]


def test_unreachable_server_keeps_records_and_replay_delivers_each_metric_once(tmp_path, capsys):
    store = new_store(tmp_path / "store.db")
    client = mlflow.MlflowClient(store)
    run_id = client.create_run(client.create_experiment("outage")).info.run_id
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    path = tmp_path / f"{run_id}.jsonl"
    journal = spool.Spool(path, run_id, down)
    journal.append(params=[Param("cfg.lr", "0.1")], metrics=metrics(range(1, 21)))
    journal.append(end=("FINISHED", 1_700_000_100_000))

    sender = spool.Sender(mlflow.MlflowClient(down), journal)
    assert sender.deliver() is False and sender.outages == 1 and sender.error is None
    assert len(journal.pending()) == 3
    lost_acks = shutil.copy(path, tmp_path / "copy.jsonl")  # as if the acks below never reached the disk

    assert cli.main(["tracking", "replay", str(path), "--tracking-uri", store]) == 0
    assert "replayed 3 records" in capsys.readouterr().out and not path.exists()
    assert spool.replay(lost_acks, store) == 3  # sent a second time ...
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, 21))  # ... yet every step is there once
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"cfg.lr": "0.1"}


def test_a_write_mlflow_refuses_is_reported_not_retried(tmp_path):
    store = new_store(tmp_path / "store.db")
    client = mlflow.MlflowClient(store)
    run_id = client.create_run(client.create_experiment("refused")).info.run_id
    client.log_param(run_id, "cfg.lr", "0.1")
    journal = spool.Spool(tmp_path / "run.jsonl", run_id, store)
    journal.append(params=[Param("cfg.lr", "0.2")])  # MLflow refuses to change a param
    sender = spool.Sender(client, journal)
    assert sender.deliver() is False and sender.outages == 0
    assert "Changing param values is not allowed" in str(sender.error)
    with pytest.raises(Exception, match="Changing param values"):
        spool.replay(journal.path, store)


def locked_error(database):
    """What a write to a SQLite file that another connection holds raises through SQLAlchemy, as in MLflow's store
    (with no busy timeout: at once, instead of after MLflow's 20 s)."""
    holder = sqlite3.connect(database)
    holder.execute("BEGIN EXCLUSIVE")
    engine = sqlalchemy.create_engine(f"sqlite:///{database}", connect_args={"timeout": 0})
    try:
        with engine.begin() as connection:
            connection.execute(sqlalchemy.text("CREATE TABLE probe (x INTEGER)"))
    except sqlalchemy.exc.OperationalError as err:
        return err
    finally:
        holder.rollback()
        holder.close()
        engine.dispose()
    raise AssertionError(f"a write to {database} under another connection's exclusive lock went through")


def test_a_busy_sqlite_store_is_retried_not_taken_for_a_refusal(tmp_path, caplog):
    """CI saw it: a run's metrics and its model's upload write to one SQLite file at once, and SQLite refuses one
    ("database is locked"). That write goes through on the next try; it must not fail the run."""
    store = new_store(tmp_path / "store.db")
    client = mlflow.MlflowClient(store)
    run_id = client.create_run(client.create_experiment("busy")).info.run_id
    busy = locked_error(tmp_path / "store.db")

    class BusyOnce:
        """The real client, whose first log_batch meets the locked store."""
        calls = 0

        def __getattr__(self, name):
            return getattr(client, name)

        def log_batch(self, *args, **kwargs):
            BusyOnce.calls += 1
            if BusyOnce.calls == 1:
                raise busy
            return client.log_batch(*args, **kwargs)

    journal = spool.Spool(tmp_path / "run.jsonl", run_id, store)
    journal.append(metrics=metrics(range(1, 6)))
    sender = spool.Sender(BusyOnce(), journal)
    with caplog.at_level(logging.WARNING, logger="maxout"):
        assert sender.deliver() is False
    assert sender.error is None and sender.outages == 1 and len(journal.pending()) == 1
    assert "tracking store busy (database is locked)" in caplog.text
    assert sender.deliver() is True and not journal.pending()
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == [1, 2, 3, 4, 5]


def test_an_upload_to_a_sqlite_store_is_retried_when_busy_and_writes_alone(tmp_path, monkeypatch):
    """The model's upload (config.yaml's, the model's) on a SQLite store: the sender delivers nothing meanwhile (two
    writes of one process at once can deadlock), and a busy store is tried again, not reported as a failure."""
    from maxout.config import TrackingConfig
    from maxout.tracking import tracker as tracker_mod

    monkeypatch.setattr(spool.Sender, "retry_s", 0.05)
    cfg = TrackingConfig(backend="mlflow", uri=new_store(tmp_path / "store.db"), experiment_name="busy",
                         system_metrics=False, spool_dir=str(tmp_path / "spool"))
    run = tracker_mod.start(cfg, run_name="busy upload")
    busy, tries, sender_could_deliver = locked_error(tmp_path / "store.db"), [], []

    def try_to_deliver():
        lock = run._sender._deliver_lock
        sender_could_deliver.append(lock.acquire(timeout=0.2))
        if sender_could_deliver[-1]:
            lock.release()

    def upload():
        tries.append(1)
        probe = threading.Thread(target=try_to_deliver)
        probe.start()
        probe.join()
        if len(tries) == 1:
            raise busy
        return "stored"

    try:
        assert run._store(upload) == "stored" and len(tries) == 2
        assert sender_could_deliver == [False, False]
    finally:
        run.close()
    assert mlflow.MlflowClient(cfg.uri).get_run(run.run_id).info.status == "FINISHED"


def test_a_runs_start_and_end_go_through_a_busy_store(tmp_path, monkeypatch):
    """The writes that cannot wait in the journal (a run's creation, its end) are tried again while the store is
    busy: the run exists once and never stays RUNNING. MLflow's end_run forgets the fluent run before it writes."""
    from maxout.config import TrackingConfig
    from maxout.tracking import tracker as tracker_mod

    busy, calls = locked_error(tmp_path / "lock-probe.db"), {}

    def busy_once(name):
        real = getattr(mlflow.MlflowClient, name)

        def write(self, *args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            if calls[name] == 1:
                raise busy
            return real(self, *args, **kwargs)
        return write

    for name in ("create_run", "set_terminated"):
        monkeypatch.setattr(mlflow.MlflowClient, name, busy_once(name))
    cfg = TrackingConfig(backend="mlflow", uri=new_store(tmp_path / "store.db"), experiment_name="busy",
                         system_metrics=False, spool_dir=str(tmp_path / "spool"))
    run = tracker_mod.start(cfg, run_name="busy start and end")
    run.log_metrics({"train/loss": 0.5}, step=1)
    run.close()
    assert calls == {"create_run": 2, "set_terminated": 2} and mlflow.active_run() is None
    client = mlflow.MlflowClient(cfg.uri)
    [only] = client.search_runs([client.get_experiment_by_name("busy").experiment_id])
    assert only.info.run_id == run.run_id and only.info.status == "FINISHED"
    assert only.data.metrics == {"train/loss": 0.5}


def test_fail_fast_http_settings_hold_while_any_thread_still_needs_them(monkeypatch):
    """The sender's thread and an upload open these at once: the first to close must not take away a setting the
    other still relies on (the upload would fall back to MLflow's minutes of retries); a user's value stays."""
    retries, timeout = "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"
    monkeypatch.delenv(retries, raising=False)
    monkeypatch.delenv(timeout, raising=False)
    sender, upload = spool.fail_fast_http(spool.SENDER_HTTP), spool.fail_fast_http({retries: "0"})
    sender.__enter__()
    upload.__enter__()
    sender.__exit__(None, None, None)  # the sender's context closes first, mid-upload
    assert os.environ.get(retries) == "0" and timeout not in os.environ
    upload.__exit__(None, None, None)
    assert retries not in os.environ
    monkeypatch.setenv(retries, "3")
    with spool.fail_fast_http({retries: "0"}):
        assert os.environ[retries] == "3"
    assert os.environ[retries] == "3"


VALIDATION = DataInput("demo-validation", "0123456789abcdef", "validation", "data/validation.csv", 4, ("text", "label"))


def test_a_format_1_journal_still_replays(tmp_path):
    """A journal written before model scores and inputs existed (four-item metrics, header format 1)."""
    store = new_store(tmp_path / "store.db")
    client = mlflow.MlflowClient(store)
    run_id = client.create_run(client.create_experiment("old")).info.run_id
    path = tmp_path / f"{run_id}.jsonl"
    path.write_text(json.dumps({"spool": 1, "run_id": run_id, "tracking_uri": store}) + "\n"
                    + json.dumps({"seq": 1, "metrics": [["eval/accuracy", 0.5, 1_700_000_000_000, 3]]}) + "\n")
    assert spool.replay(path, store) == 1
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval/accuracy")] == [(3, 0.5)]


@pytest.mark.slow  # two starts of a real server: ~30 s on a busy 2-core machine
def test_model_scores_and_inputs_survive_an_outage_and_its_replay(tmp_path):
    """A real `mlflow server` that goes away before the logged model's scores are sent, and comes back: the
    replayed journal gives the model its scores with their dataset (what the Models tab and search_logged_models
    show), and the run's history keeps the one point it had."""
    from maxout.config import TrackingConfig
    from maxout.tracking import tracker as tracker_mod
    from .test_reliability_e2e import Server

    server = Server(tmp_path)
    url = server.start()
    try:
        cfg = TrackingConfig(backend="mlflow", uri=url, experiment_name="scores", system_metrics=False,
                             spool_dir=str(tmp_path / "spool"))
        run = tracker_mod.start(cfg, run_name="scored run")
        run.log_inputs([VALIDATION])
        run.log_metrics({"eval/accuracy": 0.75, "eval/loss": 0.5}, step=3)
        run.flush()
        client = mlflow.MlflowClient(url)
        experiment = client.get_run(run.run_id).info.experiment_id
        model = client.create_logged_model(experiment, name="scored-run", source_run_id=run.run_id)
        assert run._sender.deliver()
        server.stop()
        run.log_metrics({"eval/accuracy": 0.75, "eval/loss": 0.5}, model_id=model.model_id, dataset=VALIDATION)
        run.close()  # the server is away: the scores and the run's end wait in the journal
        [left] = (tmp_path / "spool").glob("*.jsonl")
        assert any(len(m) == 7 for r in spool.Spool(left).pending() for m in r.get("metrics", []))
        server.start()
        assert spool.replay(left, url) == 2
        [logged] = client.search_logged_models([experiment])
        scores = {m.key: (m.value, m.step, m.dataset_name, m.dataset_digest) for m in logged.metrics}
        assert scores == {"eval/accuracy": (0.75, 3, "demo-validation", "0123456789abcdef"),
                          "eval/loss": (0.5, 3, "demo-validation", "0123456789abcdef")}
        assert [(m.step, m.value) for m in client.get_metric_history(run.run_id, "eval/accuracy")] == [(3, 0.75)]
        [given] = client.get_run(run.run_id).inputs.dataset_inputs
        assert (given.dataset.name, given.dataset.digest, given.tags[0].value) == (
            "demo-validation", "0123456789abcdef", "validation")
        assert client.get_run(run.run_id).info.status == "FINISHED"
    finally:
        server.stop()


def test_a_dataset_another_process_inserts_first_is_linked_and_not_refused(tmp_path):
    """Two HPO workers of a Slurm array (tests/test_slurm.py) started their first trials 0.2 s apart and logged the
    same dataset: MLflow's log_inputs reads the experiment's datasets, then inserts the ones it did not find, and the
    store's unique key refused the later insert (UNIQUE constraint failed: datasets...), which failed that worker's
    run. Here the other process's insert lands exactly between this write's read and its insert (a hook on the ORM
    query); the write is tried again, finds the dataset and links it: one dataset, both runs its inputs."""
    from mlflow.store.tracking.dbmodels.models import SqlDataset
    from sqlalchemy import event
    from sqlalchemy.orm import Session

    from maxout.tracking.mlflow_run import dataset_input

    store = new_store(tmp_path / "store.db")
    client = mlflow.MlflowClient(store)
    experiment = client.create_experiment("race")
    mine, other = (client.create_run(experiment).info.run_id for _ in range(2))
    raced = []

    def other_process_inserts_first(state):
        described = getattr(state.statement, "column_descriptions", None) or []
        if raced or not state.is_select or SqlDataset not in [d.get("entity") for d in described]:
            return None
        raced.append(True)
        rows = state.invoke_statement().freeze()  # this write's read: the dataset is not there yet ...
        mlflow.MlflowClient(store).log_inputs(other, datasets=[dataset_input(VALIDATION)])  # ... now it is
        return rows()

    journal = spool.Spool(tmp_path / f"{mine}.jsonl", mine, store)
    journal.append(inputs=[dataset_input(VALIDATION)])
    event.listen(Session, "do_orm_execute", other_process_inserts_first)
    try:
        sender = spool.Sender(client, journal)
        delivered = sender.deliver()
    finally:
        event.remove(Session, "do_orm_execute", other_process_inserts_first)
    assert raced == [True]
    assert delivered and sender.error is None, sender.error
    linked = {run: [(i.dataset.name, i.dataset.digest) for i in client.get_run(run).inputs.dataset_inputs]
              for run in (mine, other)}
    assert linked == {mine: [("demo-validation", "0123456789abcdef")], other: [("demo-validation", "0123456789abcdef")]}

"""Where a study lives, and what happens to the trials of a worker that dies.

- ``hpo.storage: null``: an Optuna journal file beside the local MLflow store (one machine; any number of
  processes may share it, the file is locked per write).
- an RDB URL (``postgresql+psycopg2://...``): shared by workers on many machines. Running trials send heartbeats;
  when a worker is killed, the next trial any other worker starts finds the stale trial, fails it, re-queues it
  with the same params (RetryHeartbeatStaleTrialCallback), and ends the dead worker's MLflow runs as KILLED.

``optuna-dashboard <storage>`` opens the same storage (the journal file path, or the URL).

A journal is checked before Optuna replays it (``check_journal``): a last record torn by a worker that died while
writing it (it was never complete, so never read) is cut off, under Optuna's own journal lock, with a warning;
a damaged record before the end (a bad disk) is a one-line error naming the file and the line, where Optuna would
fail with a traceback at its first read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional

import mlflow
import optuna
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock

from ..config import HpoConfig, TrackingConfig
from ..errors import MaxoutError, first_line
from ..paths import embedded_store, state_dir
from ..registry.lock import advisory_key
from ..tracking.redact import redact
from ..tracking.store import resolve_uri

CONNECT_TIMEOUT_S = 5  # an unreachable database fails in seconds, not after driver-default minutes
log = logging.getLogger("maxout")


SCHEMA_ATTEMPTS = 4  # opening an RDB storage whose tables another worker was creating at the same moment


def store_dir(tracking_cfg: TrackingConfig) -> Path:
    """Where the study's journal and the compile cache go by default: beside a SQLite tracking store's file, so that
    each store keeps its own studies; in the state dir for the embedded store, for servers, and whenever
    MAXOUT_STATE_DIR is set (in the container, beside the SQLite file that `mlflow run` mounts is no place to keep)."""
    uri, _ = resolve_uri(tracking_cfg)
    database = Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None
    if database is None or database == embedded_store()[0] or os.environ.get("MAXOUT_STATE_DIR"):
        return state_dir()
    return database.parent


def is_url(storage: str) -> bool:
    return "://" in storage


def location(hpo: HpoConfig, tracking_cfg: TrackingConfig) -> str:
    """The storage as given to optuna-dashboard: a journal file path or an RDB URL."""
    return hpo.storage or str(store_dir(tracking_cfg) / "optuna.journal")


def open_storage(hpo: HpoConfig, tracking_cfg: TrackingConfig, supervised: bool = False) -> Any:
    """The Optuna storage, connected (an unreachable database fails here, in seconds, with a one-line error).
    ``supervised``: this process is a worker of `maxout hpo --workers N`, whose parent run is the supervisor's: a
    lost trial's runs end KILLED, the parent run is the supervisor's to end."""
    where = location(hpo, tracking_cfg)
    if not is_url(where):
        path = Path(where).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        check_journal(path)
        return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    engine_kwargs: dict[str, Any] = {"pool_pre_ping": True}  # a worker outlives idle database connections
    if where.startswith(("postgresql", "mysql")):
        engine_kwargs["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT_S}
    try:
        # Workers starting together on a new database (a Slurm array's tasks, a Job's pods) each have Optuna create
        # its tables and stamp alembic's version, and all but one fail on what another created a moment before:
        # "duplicate key value violates unique constraint pg_type_typname_nsp_index" (IntegrityError), or
        # psycopg2.errors.DuplicateTable (a fresh clone's suite, 2026-11-27). On PostgreSQL the opening is one
        # process at a time, under an advisory lock; elsewhere a worker that lost opens it again, the tables there.
        with schema_lock(where):
            for attempt in range(SCHEMA_ATTEMPTS):
                try:
                    with warnings.catch_warnings():  # heartbeats are marked experimental; they make retries work
                        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                        return optuna.storages.RDBStorage(
                            where, engine_kwargs=engine_kwargs, heartbeat_interval=hpo.heartbeat_interval_s,
                            grace_period=hpo.grace_period_s,
                            heartbeat_stale_trial_callback=RetryLostTrial(hpo.max_retry, tracking_cfg,
                                                                          end_parent=not supervised))
                except Exception as err:
                    if attempt + 1 == SCHEMA_ATTEMPTS or not created_meanwhile(err):
                        raise
                    time.sleep(0.5 * (attempt + 1))
    except Exception as err:  # sqlalchemy's OperationalError / ArgumentError, a missing driver, ...
        first = first_line(err)
        if "import" in first.lower():  # SQLAlchemy 2.1 maps postgresql:// to psycopg 3, which is not installed
            raise MaxoutError(f"no database driver for {redact(where)} ({first}); for PostgreSQL use "
                              f"postgresql+psycopg2://user:password@host:5432/db") from None
        raise MaxoutError(f"HPO storage unreachable at {redact(where)} ({redact(first)}); "
                          f"check hpo.storage / MAXOUT_HPO_STORAGE, or use hpo.storage=null for a local "
                          f"journal file") from None


def created_meanwhile(err: Exception) -> bool:
    """The error of creating what another process created a moment before (a table, a type, a unique row)."""
    kind, text = type(err).__name__, str(err)
    return "IntegrityError" in kind or ("ProgrammingError" in kind and ("already exists" in text
                                                                       or "Duplicate" in text))


def schema_lock(where: str) -> contextlib.AbstractContextManager:
    """Opening an RDB storage one process at a time, on PostgreSQL (nothing elsewhere)."""
    if not where.startswith("postgresql"):
        return contextlib.nullcontext()
    return advisory_lock(where, "optuna-schema", namespace="maxout.hpo-storage")


@contextlib.contextmanager
def advisory_lock(url: str, name: str, namespace: str) -> Iterator[None]:
    """PostgreSQL's ``pg_advisory_lock`` for the block, on a session of its own: mutual exclusion between processes on
    every machine that reaches the database (the server frees it if the holder dies)."""
    import sqlalchemy  # lazy: only a storage on PostgreSQL takes a lock there

    engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool,
                                      connect_args={"connect_timeout": CONNECT_TIMEOUT_S})
    try:
        with engine.connect() as connection:
            key = {"key": advisory_key(name, namespace=namespace)}
            connection.execute(sqlalchemy.text("SELECT pg_advisory_lock(:key)"), key)
            try:
                yield
            finally:
                connection.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:key)"), key)
    finally:
        engine.dispose()


def check_journal(path: Path) -> None:
    """Repair a torn last record, refuse a damaged one before it (see the module docstring). Under the lock that
    Optuna's JournalFileBackend takes for each write, so no worker is writing while the file is read."""
    if not path.is_file():
        return
    lock = JournalFileSymlinkLock(str(path))
    lock.acquire()
    try:
        data = path.read_bytes()
        lines = data.split(b"\n")
        for number, line in enumerate(lines[:-1], 1):  # every line that has its newline: complete when written
            if not _parses(line):
                raise MaxoutError(f"HPO journal {path} is damaged at line {number} of {len(lines) - 1} (not a JSON "
                                  f"record: {line[:40]!r}); Optuna cannot replay the studies in it: move it away and "
                                  f"start afresh (every trial is also in MLflow), or set hpo.storage to another file")
        torn = lines[-1]  # what follows the last newline: nothing, unless a writer died mid-record
        if torn and _parses(torn):  # complete but for its newline: keep it
            with open(path, "ab") as f:
                f.write(b"\n")
                os.fsync(f.fileno())
        elif torn:
            with open(path, "r+b") as f:
                f.truncate(len(data) - len(torn))
                os.fsync(f.fileno())
            log.warning("maxout: HPO journal %s ended in a torn record (%d bytes, a worker died while writing "
                        "it); removed, the records before it are intact", path, len(torn))
    finally:
        lock.release()


def _parses(line: bytes) -> bool:
    try:
        json.loads(line.decode("utf-8"))
        return True
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False


def heartbeats(storage: Any) -> bool:
    """Whether a killed worker's trial is found and retried (RDB storage with heartbeats). Also for a study's
    storage, Optuna's cached wrapper around it, which has the method but not the attribute."""
    interval = getattr(storage, "get_heartbeat_interval", None)
    return interval is not None and interval() is not None


class RetryLostTrial:
    """Heartbeat-stale trial (its worker died or lost the database): re-queue it with the same params, and end
    the MLflow runs that worker left RUNNING (the trial's child, its fold runs, the worker's parent) as KILLED."""

    def __init__(self, max_retry: Optional[int], tracking_cfg: TrackingConfig, end_parent: bool = True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            self.retry = RetryHeartbeatStaleTrialCallback(max_retry=max_retry)
        self.tracking_cfg = tracking_cfg
        self.end_parent = end_parent  # False under `--workers N`: the parent run is the live supervisor's

    def __call__(self, study: Any, trial: Any, reason: Optional[str] = None) -> None:
        self.retry(study, trial)
        run_id = trial.user_attrs.get("mlflow_run_id")
        if self.tracking_cfg.backend == "mlflow" and run_id:
            end_lost_runs(self.tracking_cfg, run_id,
                          trial.user_attrs.get("mlflow_parent_run_id") if self.end_parent else None,
                          reason or f"worker {trial.user_attrs.get('worker', '?')} lost: no heartbeat for more than "
                                    f"the grace period; trial {trial.number} re-queued with the same params")


def end_lost_runs(tracking_cfg: TrackingConfig, run_id: str, parent_run_id: Optional[str], reason: str) -> None:
    client = mlflow.MlflowClient(tracking_uri=resolve_uri(tracking_cfg)[0])
    run = client.get_run(run_id)
    folds = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'")
    for lost in [run, *folds]:
        if lost.info.status == "RUNNING":
            client.set_tag(lost.info.run_id, "maxout.status_reason", reason)
            client.set_terminated(lost.info.run_id, "KILLED")
    client.set_tag(run_id, "maxout.hpo.state", "FAIL")
    if parent_run_id and client.get_run(parent_run_id).info.status == "RUNNING":
        client.set_tag(parent_run_id, "maxout.status_reason", reason)
        client.set_terminated(parent_run_id, "KILLED")


def compile_cache(hpo: HpoConfig, tracking_cfg: TrackingConfig) -> str:
    """Point TorchInductor's on-disk FX graph cache at a persistent folder shared by every trial (and worker on
    this machine), before anything compiles. A TORCHINDUCTOR_CACHE_DIR set by the user wins."""
    wanted = hpo.compile_cache_dir or str(store_dir(tracking_cfg) / "compile_cache")
    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(wanted).expanduser().resolve()))

"""Which MLflow store a run goes to, and whether it answers.

``MLFLOW_TRACKING_URI`` wins over ``tracking.uri`` (as MLflow users expect); without either, the embedded store:
MLflow's own default in the project root, ``mlflow.db`` plus artifacts under ``mlruns/`` (what ``mlflow run .`` uses
without a tracking URI, and what ``make ui`` opens). Every command opens an SQLite store through ``ensure_schema``
first, so that processes starting together on a new store do not create its schema twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
from pathlib import Path
from typing import Iterator, Optional

from ..config import TrackingConfig
from ..errors import MaxoutError
from ..paths import embedded_store
from . import container
from .redact import redact

# Where `make ui` serves the MLflow UI for the embedded store (its --host and --port).
UI_ADDRESS = "http://127.0.0.1:5000"
# MLflow 3's UI opens on its GenAI view (traces) unless the address picks the model-training one; the choice is a
# URL parameter of its own (workflowType, read by its experiment pages; checked on MLflow 3.17's UI bundle).
TRAINING_VIEW = "workflowType=machine_learning"

# What MLflow 3 accepts as a tracking store (a plain folder only with MLFLOW_ALLOW_FILE_STORE).
STORE_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks")


def local_store() -> tuple[str, str]:
    """The embedded store: (tracking URI, artifact root)."""
    database, artifacts = embedded_store()
    artifacts.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{database}", str(artifacts)


def resolve_uri(cfg: TrackingConfig) -> tuple[str, Optional[str]]:
    """(tracking URI, artifact location for new experiments; None: the store's default)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or cfg.uri
    if uri:
        return uri, cfg.artifact_location
    uri, artifacts = local_store()
    return uri, cfg.artifact_location or artifacts


def uri_source() -> str:
    """The setting a resolved URI came from, for messages that tell the user what to change."""
    return "MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "tracking.uri"


def is_http(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast, with the URI and a hint, instead of MLflow's minutes of retries against a dead server."""
    if not is_http(uri):
        return
    import requests  # lazy: only a server needs it (start-up)

    try:
        requests.get(uri.rstrip("/") + "/health", timeout=timeout_s)
    except requests.RequestException as err:
        fix = container.hint(container.NETWORK) if container.loopback(uri) else ""
        raise MaxoutError(f"MLflow tracking server unreachable at {redact(uri)} ({type(err).__name__}); "
                          f"start it (make platform-up) or use tracking=local{fix}") from None


def sqlite_file(uri: str) -> Optional[Path]:
    """The database file of an ``sqlite:///`` URI (relative or absolute); None for other stores and in-memory."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def ensure_schema(uri: str) -> None:
    """Open the store at ``uri`` once under a file lock, so that its schema exists before anything else uses it.

    MLflow creates (migrates) a new SQLite database's schema when a process first opens it, without a lock: two
    processes that open a new store at once both run the migrations, and both die (``table ... already exists``,
    alembic's "Online migration expected to match one row"). Here the first process creates the schema while
    the others wait on ``<database>.lock``; they then find it complete. The lock file is removed after a
    successful open: from then on the schema is complete, so a process that locks a newer lock file than another
    one does no harm. A directory where no lock file can be created (read-only) cannot take a new database either:
    the store is opened without the lock. Other stores (a server, PostgreSQL) create their schema themselves."""
    database = sqlite_file(uri)
    if database is None:
        return
    lock_path = database.with_name(database.name + ".lock")
    try:
        lock = open(lock_path, "a")
    except OSError:
        lock = None
    import mlflow  # lazy: 0.7 s of start-up that processes resolving a URI only (tracking=none) never need

    with lock if lock is not None else contextlib.nullcontext():
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed, or the process dies
        with _quiet("mlflow.store.db.utils", "alembic"):  # "Creating initial MLflow database tables..." and more
            client = mlflow.MlflowClient(tracking_uri=uri)  # opens the tracking store: the schema if missing
            client.search_experiments(max_results=1)
            client.search_registered_models(max_results=1)  # and the registry's view of it
        if lock is not None:
            lock_path.unlink(missing_ok=True)


@contextlib.contextmanager
def _quiet(*loggers: str) -> Iterator[None]:
    """Only warnings and errors from ``loggers`` meanwhile: a command's output stays its own lines."""
    saved = {name: logging.getLogger(name).level for name in loggers}
    for name in loggers:
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def ui_url(uri: str, experiment_id: Optional[str] = None, run_id: Optional[str] = None) -> str:
    """The MLflow UI page of a run, or of an experiment's runs table, in the model-training view: on the tracking
    server itself, or for the embedded store where ``make ui`` serves it."""
    base = re.sub(r"://[^/@\s]*@", "://", uri).rstrip("/") if is_http(uri) else UI_ADDRESS  # no login in a link
    if experiment_id is None:
        return f"{base}/#/?{TRAINING_VIEW}"
    page = f"runs/{run_id}" if run_id else "runs"
    return f"{base}/#/experiments/{experiment_id}/{page}?{TRAINING_VIEW}"

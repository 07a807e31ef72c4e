"""When the job runs inside `mlflow run`'s container, a store problem is usually a missing `mlflow run` argument.
These hints name the argument, so the one-line error says what to add (docs/tutorials/gpu-box.md)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

from ..paths import in_container

NETWORK = ("inside mlflow run's container 127.0.0.1 is the container itself: pass -A network=host to mlflow run, or "
           "set MLFLOW_TRACKING_URI to an address the container can reach")
LOGIN = "mlflow run passes the login into its container by name: add -A env-file=docker/run.env"
USER = ("mlflow run mounts your local store into its container, whose entrypoint trains as the store's owner: "
        "leave out -A user=... (or name that owner's uid)")
PROJECT = ("MLproject mounts the folder mlflow run starts in at the same path: start it in the folder that holds "
           "mlflow.db and mlruns/")
# Where `mlflow run` mounts a local SQLite store's file in its container, and the store's name in the folder that
# MLproject passes as MAXOUT_HOST_DIR (the folder mlflow run started in, mounted at the same path).
MOUNTED_STORE = "/mlflow/tmp/mlruns"
STORE_NAME = "mlflow.db"


def inside_mlflow_run() -> bool:
    """Whether this process is a job that `mlflow run` started in a container (it passes MLFLOW_RUN_ID)."""
    return bool(os.environ.get("MLFLOW_RUN_ID")) and in_container()


def hint(fix: str) -> str:
    """``"; <fix>"`` inside mlflow run's container, else nothing."""
    return f"; {fix}" if inside_mlflow_run() else ""


def loopback(uri: str) -> bool:
    return (urlparse(uri).hostname or "") in ("127.0.0.1", "localhost", "::1", "0.0.0.0")


def is_mounted_store(uri: str) -> bool:
    """Whether ``uri`` is `mlflow run`'s mount of a local store in its container. (After the run ends MLflow has
    dropped MLFLOW_RUN_ID from the environment, so inside_mlflow_run() no longer says so.)"""
    return uri.startswith("sqlite:") and uri.split(":///", 1)[-1] == MOUNTED_STORE and in_container()


def host_store_uri(uri: str) -> Optional[str]:
    """The embedded store as the host names it, ``sqlite:///<folder mlflow run started in>/mlflow.db``, when ``uri``
    is the container's mount of it; None when that cannot be checked. The folder comes from MLproject
    (MAXOUT_HOST_DIR, mounted at the same path), and it is named only when its mlflow.db is the very file mounted
    as the store (a store elsewhere on the host is not in that folder)."""
    folder = os.environ.get("MAXOUT_HOST_DIR")
    if not folder or not is_mounted_store(uri):
        return None
    candidate = Path(folder) / STORE_NAME
    try:
        same = candidate.is_absolute() and os.path.samefile(candidate, MOUNTED_STORE)
    except OSError:
        return None
    return f"sqlite:///{candidate}" if same else None

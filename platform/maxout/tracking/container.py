"""When the job runs inside `mlflow run`'s container, a store problem is usually a missing `mlflow run` argument.
These hints name the argument, so the one-line error says what to add (README: "mlflow run in the CUDA image")."""

from __future__ import annotations

import os
from urllib.parse import urlparse

from ..hardware import in_container

NETWORK = ("inside mlflow run's container 127.0.0.1 is the container itself: pass -A network=host to mlflow run, or "
           "set MLFLOW_TRACKING_URI to an address the container can reach")
LOGIN = "mlflow run passes the login into its container by name: add -A env-file=docker/run.env"
USER = ("mlflow run mounts your local store into its container, which must write it as you: add -A user=root to "
        "mlflow run (the container then hands the run's folders to you and trains as you, not as root)")
PROJECT = ("MLproject mounts the folder mlflow run starts in at the same path: start it in the folder that holds "
           "mlflow.db and mlruns/, with -A user=root")


def inside_mlflow_run() -> bool:
    """Whether this process is a job that `mlflow run` started in a container (it passes MLFLOW_RUN_ID)."""
    return bool(os.environ.get("MLFLOW_RUN_ID")) and in_container()


def hint(fix: str) -> str:
    """``"; <fix>"`` inside mlflow run's container, else nothing."""
    return f"; {fix}" if inside_mlflow_run() else ""


def loopback(uri: str) -> bool:
    return (urlparse(uri).hostname or "") in ("127.0.0.1", "localhost", "::1", "0.0.0.0")

"""Real services on loopback for tests: a throwaway PostgreSQL cluster, an `mlflow server` process, and moto's
S3-compatible HTTP server. Each picks a free port, so parallel test sessions do not collide.

PostgreSQL is installed on these machines but not running; initdb refuses root, so the cluster is created and
run as the ``postgres`` user in a directory it owns (see shared/platform-notes.md).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import pytest

from . import warm_maxout

PG_BIN = Path("/usr/lib/postgresql")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float = 60.0, proc: Optional[subprocess.Popen] = None) -> None:
    import requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            if requests.get(url, timeout=2).status_code < 500:
                return
        except requests.RequestException:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer within {timeout_s}s")


def _pg_bindir() -> Path:
    versions = sorted(PG_BIN.glob("*/bin/initdb"))
    if not versions:
        pytest.fail("PostgreSQL is not installed (apt-get install postgresql): the tests need a real server")
    return versions[-1].parent


@contextlib.contextmanager
def postgres(password: Optional[str] = None, listen: Sequence[str] = ()) -> Iterator[str]:
    """A fresh PostgreSQL cluster; yields a SQLAlchemy URL for database ``postgres`` (loopback). Trust auth, or
    with ``password``: TCP logins must give it (scram-sha-256), as on a real server. ``listen``: more addresses it
    listens on, with logins from their /24 allowed (the Slurm test cluster's nodes reach it on its bridge)."""
    bindir = _pg_bindir()
    root = Path(tempfile.mkdtemp(prefix="maxout-pg-"))
    as_pg = ["su", "postgres", "-c"] if os.geteuid() == 0 else ["bash", "-c"]
    port = free_port()
    data, log = root / "data", root / "log"
    auth = "-A trust"
    if password:
        (root / "pw").write_text(password)
        auth = f"--auth-local=trust --auth-host=scram-sha-256 --pwfile={root / 'pw'}"
    if os.geteuid() == 0:
        for path in (root, *root.iterdir()):
            shutil.chown(path, "postgres", "postgres")
    subprocess.run([*as_pg, f"{bindir}/initdb -D {data} {auth} -U postgres"], check=True, capture_output=True)
    method = "scram-sha-256" if password else "trust"
    with open(data / "pg_hba.conf", "a") as hba:
        hba.writelines(f"host all all {address}/24 {method}\n" for address in listen)
    addresses = ",".join(("127.0.0.1", *listen))
    subprocess.run([*as_pg, f"{bindir}/pg_ctl -D {data} -o '-p {port} -k {root} -c listen_addresses={addresses}' "
                            f"-l {log} -w start"], check=True, capture_output=True)
    try:
        yield f"postgresql+psycopg2://postgres{':' + password if password else ''}@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_pg, f"{bindir}/pg_ctl -D {data} -m immediate stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def create_database(url: str, name: str) -> str:
    """A new, empty database on the server of ``url``; returns its URL."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sqlalchemy.text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return url.rsplit("/", 1)[0] + f"/{name}"


@contextlib.contextmanager
def mlflow_server(backend_uri: str, artifacts_destination: Optional[str] = None,
                  extra_args: Sequence[str] = (), env: Optional[dict] = None,
                  port: Optional[int] = None) -> Iterator[str]:
    """``mlflow server`` as a real process; yields its http URL. With ``artifacts_destination`` artifacts are
    proxied (clients need no storage credentials)."""
    port = port or free_port()
    if backend_uri.startswith("sqlite:///") and not Path(backend_uri.removeprefix("sqlite:///")).exists():
        from .store_template import new_store  # seconds of migrations saved; the server adds its own Default

        new_store(Path(backend_uri.removeprefix("sqlite:///")))
    cmd = ["server", "--backend-store-uri", backend_uri, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    if artifacts_destination:
        cmd += ["--artifacts-destination", artifacts_destination]
    cmd += list(extra_args)
    # The server's output: in a temporary file, quoted when it does not come up, removed when it stops (the suite
    # starts a few dozen servers per run, and each run left its logs in /tmp).
    log = tempfile.NamedTemporaryFile(prefix="maxout-mlflow-server-", suffix=".log")
    # MLflow 3's server also starts a GenAI job runner (several huey worker processes): not needed here, and
    # heavy on a 2-core machine.
    server_env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **(env or {})}
    # `python -m mlflow server ...` forked from tests/warm_maxout.py's pre-imported process, its uvicorn in the same
    # process (warm_maxout.mlflow_command): a real server on its own port, pid and session, ~3 CPU-s and seconds of
    # wall less per start than a fresh interpreter for the CLI and a second one for uvicorn. The platform stack
    # (tests/stack.py) and the Docker tests' compose file start MLflow's CLI as it is, fresh.
    proc = warm_maxout.popen(cmd, program="mlflow", stdout=log, stderr=subprocess.STDOUT, env=server_env,
                             start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_http(url + "/health", timeout_s=180, proc=proc)  # ~5-8 CPU-s to start: minutes under load
        except (RuntimeError, TimeoutError) as err:
            raise type(err)(f"{err}; the server said:\n{Path(log.name).read_text(errors='replace')[-3000:]}") from None
        yield url
    finally:
        stop(proc)
        log.close()


def stop(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    import signal

    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


S3_ENV = {"AWS_ACCESS_KEY_ID": "maxout-test-key", "AWS_SECRET_ACCESS_KEY": "maxout-test-secret",
          "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def moto_s3(bucket: str = "maxout") -> Iterator[str]:
    """moto's S3-compatible HTTP server (what MLflow's own tests use), with ``bucket`` created; yields the
    endpoint URL. The caller sets S3_ENV (dummy credentials) where it needs them."""
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        boto3.client("s3", endpoint_url=endpoint, **_boto_kwargs()).create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        server.stop()


def _boto_kwargs() -> dict:
    return {"aws_access_key_id": S3_ENV["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": S3_ENV["AWS_SECRET_ACCESS_KEY"],
            "region_name": S3_ENV["AWS_DEFAULT_REGION"]}


def s3_keys(endpoint: str, bucket: str) -> list[str]:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, **_boto_kwargs())
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys += [o["Key"] for o in page.get("Contents", [])]
    return keys

"""docker/compose.yaml's platform stack as processes on loopback, for the end-to-end tests.

No Docker engine runs here, so the services run as the processes the containers would run: PostgreSQL from the
test setup (initialised with docker/postgres-init.sql, as the image's entrypoint does), moto's S3 server where
MinIO would be, and the `mlflow server` command line and environment read from compose.yaml (parsed, with
compose's variable interpolation, never retyped) with the service host names rewritten to loopback. Every
credential is a distinctive random value, so tests can scan what the runs left behind for them.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping

import yaml

from . import services, warm_maxout
from .conftest import ROOT

DOCKER = ROOT / "docker"
COMPOSE_FILE = DOCKER / "compose.yaml"
ENV_EXAMPLE = DOCKER / ".env.example"
SECRET_WORDS = ("PASSWORD", "SECRET", "KEY")

# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error}, and $$ for a literal $ (compose's rules)
_VARIABLE = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def load_compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def env_example() -> dict[str, str]:
    from dotenv import dotenv_values

    return dict(dotenv_values(ENV_EXAMPLE))


def referenced_variables(text: str) -> set[str]:
    return {m.group("name") for m in _VARIABLE.finditer(text) if m.group("name")}


def interpolate(value: str, env: Mapping[str, str]) -> str:
    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group("name"), match.group("op"), match.group("arg")
        current = env.get(name)
        unset_or_empty = not current
        if op in (":-", "-") and (current is None or (op == ":-" and unset_or_empty)):
            return arg
        if op in (":?", "?") and (current is None or (op == ":?" and unset_or_empty)):
            raise KeyError(f"compose would refuse to start: {name}: {arg}")
        return current or ""

    return _VARIABLE.sub(one, value)


def service(compose: dict, name: str, env: Mapping[str, str]) -> dict:
    """A service's command and environment as compose would pass them (variables interpolated)."""
    spec = compose["services"][name]
    command = [interpolate(str(part), env) for part in spec.get("command") or []]
    environment = {k: interpolate(str(v), env) for k, v in spec.get("environment", {}).items()}
    return {"command": command, "environment": environment, "volumes": spec.get("volumes", [])}


def option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def to_loopback(text: str, hosts: Mapping[str, str]) -> str:
    for container_address, local_address in hosts.items():
        text = text.replace(container_address, local_address)
    return text


def settings_for_tests() -> dict[str, str]:
    """docker/.env for the tests: .env.example's keys, credentials replaced by distinctive random values."""
    values = env_example()
    for key in values:
        if any(word in key for word in SECRET_WORDS):
            values[key] = f"{key.lower().replace('_', '-')}-{secrets.token_hex(8)}"
    values["MLFLOW_WORKERS"] = "1"  # 2 shared cores
    return values


def server_env(home: Path, **extra: str) -> dict[str, str]:
    """A container starts with its image's environment only; a local process gets just enough to run."""
    home.mkdir(parents=True, exist_ok=True)
    return {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home),
            "LANG": "C.UTF-8", **extra}


@dataclass
class Stack:
    uri: str  # the MLflow server, http://127.0.0.1:PORT
    s3: str  # the S3 endpoint (moto, in place of MinIO)
    bucket: str
    prefix: str  # where proxied artifacts go inside the bucket (--artifacts-destination)
    db_url: str  # SQLAlchemy URL of the `mlflow` database, as the `maxout` role
    settings: dict  # the docker/.env values in force
    server_log: Path
    hosts: dict  # compose host:port -> loopback, as the server was started with
    compose: dict
    users: dict = field(default_factory=dict)  # MLflow accounts: name -> password
    transcripts: list = field(default_factory=list)  # every process output and command line, for the scan

    def credentials(self) -> dict[str, str]:
        found = {k: v for k, v in self.settings.items() if any(w in k for w in SECRET_WORDS)}
        found.update({f"user {name}": password for name, password in self.users.items()})
        return found

    def client_env(self, user: str, direct: bool = False) -> dict[str, str]:
        """A client shell: the tracking URI and login only (proxied); plus S3 endpoint and keys (direct)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "AWS_"))}
        env.update(MLFLOW_TRACKING_URI=self.uri, MLFLOW_TRACKING_USERNAME=user,
                   MLFLOW_TRACKING_PASSWORD=self.users[user])
        if direct:
            env.update(self.s3_env())
        return env

    def s3_env(self) -> dict[str, str]:
        return {"MLFLOW_S3_ENDPOINT_URL": self.s3, "AWS_ACCESS_KEY_ID": self.settings["MLFLOW_S3_ACCESS_KEY"],
                "AWS_SECRET_ACCESS_KEY": self.settings["MLFLOW_S3_SECRET_KEY"], "AWS_DEFAULT_REGION": "us-east-1"}

    @contextlib.contextmanager
    def another_server(self, s3_endpoint: str, log_dir: Path) -> Iterator[tuple[str, Path]]:
        """A second server on the same databases (accounts included) whose artifact store is ``s3_endpoint``."""
        minio = self.compose["services"]["mlflow"]["environment"]["MLFLOW_S3_ENDPOINT_URL"]
        with mlflow_server(self.compose, self.settings, {**self.hosts, minio: s3_endpoint}, log_dir) as (url, log):
            self.transcripts.append(("another server", log))
            yield url, log

    def add_user(self, name: str) -> str:
        """An MLflow account, created by the admin the way docs/how-to/platform.md shows."""
        from unittest import mock

        from mlflow.server import get_app_client

        password = f"{name}-password-{secrets.token_hex(8)}"
        admin = {"MLFLOW_TRACKING_USERNAME": self.settings["MLFLOW_ADMIN_USERNAME"],
                 "MLFLOW_TRACKING_PASSWORD": self.settings["MLFLOW_ADMIN_PASSWORD"]}
        with mock.patch.dict(os.environ, admin):  # the admin's shell, for this call only
            get_app_client("basic-auth", tracking_uri=self.uri).create_user(name, password)
        self.users[name] = password
        return password


def init_postgres(admin_url: str, settings: Mapping[str, str], compose: dict) -> str:
    """What the postgres image does on a fresh volume: POSTGRES_USER with POSTGRES_PASSWORD, POSTGRES_DB, then
    the mounted init scripts run by psql as that user. Returns the `maxout` role's URL of POSTGRES_DB."""
    import sqlalchemy

    pg = service(compose, "postgres", settings)["environment"]
    user, password, db = pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"], pg["POSTGRES_DB"]
    engine = sqlalchemy.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sqlalchemy.text(f"CREATE ROLE {user} LOGIN SUPERUSER PASSWORD :pw"), {"pw": password})
        conn.execute(sqlalchemy.text(f"CREATE DATABASE {db} OWNER {user}"))
    engine.dispose()
    port = admin_url.rsplit(":", 1)[1].split("/")[0]
    for mount in compose["services"]["postgres"]["volumes"]:
        source, target = mount.split(":")[:2]
        if target.startswith("/docker-entrypoint-initdb.d/"):
            subprocess.run([str(services._pg_bindir() / "psql"), "-v", "ON_ERROR_STOP=1", "--no-psqlrc", "-h",
                            "127.0.0.1", "-p", port, "-U", user, "-d", db, "-f", str(DOCKER / source)],
                           check=True, capture_output=True, env={**os.environ, "PGPASSWORD": password})
    return f"postgresql+psycopg2://{user}:{password}@127.0.0.1:{port}/{db}"


@contextlib.contextmanager
def mlflow_server(compose: dict, settings: Mapping[str, str], hosts: Mapping[str, str],
                  log_dir: Path) -> Iterator[tuple[str, Path]]:
    """compose.yaml's `mlflow` service as a local process; yields (URL, log file)."""
    spec = service(compose, "mlflow", settings)
    command = [to_loopback(part, hosts) for part in spec["command"]]
    env = {k: to_loopback(v, hosts) for k, v in spec["environment"].items()}
    # The auth settings file compose mounts at MLFLOW_AUTH_CONFIG_PATH, with its hosts rewritten too.
    for mount in spec["volumes"]:
        source, target = mount.split(":")[:2]
        if target == env["MLFLOW_AUTH_CONFIG_PATH"]:
            local = log_dir / Path(source).name
            local.write_text(to_loopback((DOCKER / source).read_text(), hosts))
            env["MLFLOW_AUTH_CONFIG_PATH"] = str(local)
    port = services.free_port()
    command[command.index("--host") + 1] = "127.0.0.1"
    command[command.index("--port") + 1] = str(port)
    assert command[0] == "mlflow", command  # the venv's `mlflow`: its console script runs `python -m mlflow`
    log = log_dir / f"mlflow-server-{port}.log"
    with open(log, "w") as out:
        # forked from the tests' warm server (warm_maxout.mlflow_command): MLflow's CLI and uvicorn in one process of
        # their own, without an interpreter's imports for each (~8 CPU-s apiece on the Zen 1 CI CPU). The auth app
        # reads MLFLOW_AUTH_CONFIG_PATH when it is imported, in that process, which the warm server never imports
        proc = warm_maxout.popen(command[1:], program="mlflow", stdout=out, stderr=subprocess.STDOUT,
                                 env=server_env(log_dir / f"home-{port}", **env), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        services.wait_http(url + "/health", timeout_s=180, proc=proc)
        yield url, log
    finally:
        services.stop(proc, timeout_s=5)  # a test server need not drain its workers


def create_bucket(endpoint: str, bucket: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint, **services._boto_kwargs()).create_bucket(Bucket=bucket)


@contextlib.contextmanager
def s3_process() -> Iterator[tuple[str, subprocess.Popen]]:
    """moto's S3 server as its own process, with no bucket: state of its own (moto servers started inside one
    process share their buckets), and an endpoint that really goes down when the process is stopped."""
    port = services.free_port()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        services.wait_http(url, timeout_s=180, proc=proc)  # the same bound as the stack's other servers
        yield url, proc
    finally:
        services.stop(proc, timeout_s=5)


@contextlib.contextmanager
def platform(log_dir: Path) -> Iterator[Stack]:
    """The whole stack: PostgreSQL, an S3 endpoint with the bucket, the MLflow server, and one non-admin MLflow
    account, `trainer`."""
    compose, settings = load_compose(), settings_for_tests()
    destination = option(service(compose, "mlflow", settings)["command"], "--artifacts-destination")
    bucket, _, prefix = destination.removeprefix("s3://").partition("/")
    with services.postgres(password=secrets.token_hex(8)) as admin_url:
        db_url = init_postgres(admin_url, settings, compose)
        pg_port = admin_url.rsplit(":", 1)[1].split("/")[0]
        with contextlib.ExitStack() as stack:
            s3, _ = stack.enter_context(s3_process())  # MinIO, then what minio-init does: the bucket
            create_bucket(s3, bucket)
            minio = compose["services"]["mlflow"]["environment"]["MLFLOW_S3_ENDPOINT_URL"]
            hosts = {"@postgres:5432/": f"@127.0.0.1:{pg_port}/", minio: s3}
            uri, log = stack.enter_context(mlflow_server(compose, settings, hosts, log_dir))
            platform_stack = Stack(uri, s3, bucket, prefix, db_url, settings, log, hosts, compose)
            platform_stack.add_user("trainer")
            yield platform_stack

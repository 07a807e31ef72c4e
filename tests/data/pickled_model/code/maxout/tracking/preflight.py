"""Checks made before a run starts: will the tracking store and the artifact store accept it?

Without them a platform mistake surfaces late and slowly: MLflow retries a failing request for minutes
(7 retries with exponential back-off), and a run that started before its artifact store turned out to be missing
ends FAILED with half its artifacts. Each check here costs one request, fails in seconds, names the bad value
and the fix in one line, and runs before any run exists:

- ``store_problems``, before a run exists (train/prepare.py runs it once per command): the URI names a store
  MLflow 3 can use, an SQLite store's folder is writable, the server answers (``store.check_reachable``) and
  accepts the credentials (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD), MLFLOW_EXPERIMENT_ID, when set,
  names an experiment of that store, and the spool folder can hold the run's journal;
- ``check_artifact_store``, when a run is started (its experiment known): the experiment's artifact store answers.
  For proxied artifacts (``mlflow-artifacts:``) the server lists the experiment's folder in its bucket; for direct
  S3 (``s3://``) the client asks the endpoint for the bucket.

Credentials never appear in a message: only the user name.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

import mlflow
import requests
from mlflow.exceptions import MlflowException
from mlflow.utils.credentials import get_default_host_creds
from mlflow.utils.rest_utils import http_request

from ..config import TrackingConfig
from ..errors import ConfigError, MaxoutError, collect
from ..paths import check_writable
from . import container, spool
from .redact import redact
from .store import STORE_SCHEMES, check_reachable, ensure_schema, is_http, resolve_uri, uri_source

PROBE_TIMEOUT_S = 30
_ARTIFACTS_API = "/api/2.0/mlflow-artifacts/artifacts"


def store_problems(cfg: TrackingConfig, ready: bool = True) -> list[MaxoutError]:
    """Everything wrong with the tracking store ``cfg`` resolves to, and with the run's spool folder, as a list
    (empty: they will take the run). ``ready``: nothing else is wrong with the command, so the experiment lookup (a
    store query) is worth making."""
    problems = _uri_problems(cfg, ready)
    collect(problems, check_writable, Path(cfg.spool_dir or spool.default_dir()), "tracking.spool_dir")
    return problems


def _uri_problems(cfg: TrackingConfig, ready: bool) -> list[MaxoutError]:
    uri, _ = resolve_uri(cfg)
    source = uri_source()
    scheme = urlparse(uri).scheme.split("+")[0]
    if scheme not in STORE_SCHEMES and not (scheme in ("", "file") and os.environ.get("MLFLOW_ALLOW_FILE_STORE")):
        return [ConfigError(f"{source}={redact(uri)!r} is not a tracking store MLflow 3 can use (valid schemes: "
                            f"{', '.join(STORE_SCHEMES)}); use e.g. sqlite:///mlflow.db or http://host:5000")]
    problems: list[MaxoutError] = []
    if scheme == "sqlite":
        database = Path(uri.split(":///", 1)[-1])
        collect(problems, check_writable, database.parent, f"the directory of {source}")
        collect(problems, _check_database_writable, database, f"{source}={redact(uri)!r}")
    if collect(problems, check_reachable, uri) is None or not collect(problems, check_credentials, uri):
        return problems
    experiment_id = os.environ.get("MLFLOW_EXPERIMENT_ID")
    if experiment_id and ready and not problems:
        collect(problems, _experiment_exists, uri, experiment_id)
    return problems


def _check_database_writable(database: Path, setting: str) -> None:
    """An existing SQLite file this process may not write (it belongs to another user) fails at the first write,
    after the run started; say so now."""
    if database.is_file() and not os.access(database, os.R_OK | os.W_OK):
        raise ConfigError(f"{setting} is not writable by this process (uid {os.getuid()}; the file belongs to uid "
                          f"{database.stat().st_uid}){container.hint(container.USER) or ': run as its owner'}")


def _experiment_exists(uri: str, experiment_id: str) -> None:
    # A SQLite store that does not exist yet holds no experiment (and asking would create it, noisily).
    exists = not uri.startswith("sqlite:") or Path(uri.split(":///", 1)[-1]).is_file()
    if exists:
        try:
            ensure_schema(uri)
            mlflow.MlflowClient(uri).get_experiment(experiment_id)
        except MlflowException:
            exists = False
    if not exists:
        raise ConfigError(f"MLFLOW_EXPERIMENT_ID={experiment_id!r} is not an experiment in {redact(uri)}; unset "
                          f"it, or set MLFLOW_EXPERIMENT_NAME instead")


def _get(uri: str, endpoint: str, params: dict) -> Any:
    """One GET with MLflow's own client credentials, no retries, and any status returned as it came (MLflow would
    retry a 500 for minutes)."""
    try:
        return http_request(get_default_host_creds(uri), endpoint, "GET", max_retries=0, retry_codes=frozenset(),
                            timeout=PROBE_TIMEOUT_S, params=params)
    except (MlflowException, requests.RequestException, OSError) as err:
        raise MaxoutError(f"MLflow tracking server at {redact(uri)} stopped answering ({type(err).__name__}); "
                          f"check it (make platform-up) and retry") from None


def _server_message(resp: Any) -> str:
    """MLflow's JSON error message; for anything else (an HTML error page) the status reason only."""
    try:
        return str(resp.json()["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return f"{resp.reason or 'error'}, see the server's log"


def check_credentials(uri: str) -> None:
    """An authenticated read: 401 (unknown user or wrong password) and 403 become one-line errors."""
    if not is_http(uri):
        return
    resp = _get(uri, "/api/2.0/mlflow/experiments/search", {"max_results": 1})
    if resp.status_code == 200:
        return
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    who = f"user {user!r}" if user else "no user (MLFLOW_TRACKING_USERNAME is not set)"
    if resp.status_code == 401:
        raise MaxoutError(f"MLflow tracking server at {redact(uri)} rejected the login of {who} (HTTP 401): set "
                          f"MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD to an account on that server"
                          f"{container.hint(container.LOGIN)}")
    if resp.status_code == 403:
        raise MaxoutError(f"MLflow tracking server at {redact(uri)} denied {who} read access (HTTP 403): ask its "
                          f"admin for a permission on the experiment")
    raise MaxoutError(f"MLflow tracking server at {redact(uri)} answered HTTP {resp.status_code} to a search: "
                      f"{_server_message(resp)}")


def check_artifact_store(uri: str, artifact_location: Optional[str]) -> None:
    """The experiment's artifact root takes files: proxied through the server (it answers a listing), direct on S3
    (the bucket answers), or a local folder (this process may write there)."""
    scheme = urlparse(artifact_location or "").scheme
    if scheme == "mlflow-artifacts" and is_http(uri):
        _check_proxied(uri, artifact_location)
    elif scheme == "s3":
        _check_s3(artifact_location)
    elif artifact_location and scheme in ("", "file"):
        _check_local(artifact_location)


def _check_local(location: str) -> None:
    path = Path(urlparse(location).path if location.startswith("file:") else location)
    try:
        check_writable(path, "the experiment's artifact location")
    except ConfigError as err:
        raise ConfigError(f"{err}{container.hint(container.PROJECT)}") from None


def _check_proxied(uri: str, location: str) -> None:
    path = urlparse(location).path.lstrip("/")
    resp = _get(uri, _ARTIFACTS_API, {"path": path})
    if resp.status_code != 200:
        raise MaxoutError(f"the tracking server at {redact(uri)} cannot store artifacts for {location} "
                          f"(HTTP {resp.status_code}: {_server_message(resp)}); check the bucket of its "
                          f"--artifacts-destination and its S3 endpoint (make platform-up creates both)")


def s3_endpoint() -> Optional[str]:
    return os.environ.get("MLFLOW_S3_ENDPOINT_URL") or None


def _check_s3(location: str) -> None:
    """Direct mode: the client uploads with its own boto3 credentials, so the client checks the bucket."""
    import boto3  # lazy: only direct S3 uploads need boto3 (a local or proxied store never does; 0.3 s to import)
    from botocore.config import Config as BotoConfig  # lazy: with boto3
    from botocore.exceptions import (  # lazy: with boto3
        BotoCoreError, ClientError, EndpointConnectionError, NoCredentialsError)

    bucket = urlparse(location).netloc
    endpoint = s3_endpoint()
    where = endpoint or "AWS S3"
    client = boto3.client("s3", endpoint_url=endpoint,
                          config=BotoConfig(connect_timeout=5, read_timeout=PROBE_TIMEOUT_S,
                                            retries={"max_attempts": 2, "mode": "standard"}))
    try:
        client.head_bucket(Bucket=bucket)
    except NoCredentialsError:
        raise MaxoutError(f"no S3 credentials for direct artifact upload to {location}: set AWS_ACCESS_KEY_ID and "
                          f"AWS_SECRET_ACCESS_KEY, or use the server's proxied artifacts (mlflow-artifacts:)") from None
    except EndpointConnectionError:
        raise MaxoutError(f"S3 endpoint {where} is unreachable (artifact location {location}): check "
                          f"MLFLOW_S3_ENDPOINT_URL and that the object store is up (make platform-up)") from None
    except ClientError as err:
        code = str(err.response.get("Error", {}).get("Code", ""))
        if code in ("404", "NoSuchBucket"):
            raise MaxoutError(f"S3 bucket {bucket!r} does not exist at {where} (artifact location {location}): "
                              f"create it, or set tracking.artifact_location to an existing bucket") from None
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            raise MaxoutError(f"S3 at {where} refused access to bucket {bucket!r} (HTTP {code}): check "
                              f"AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY") from None
        raise MaxoutError(f"S3 at {where} answered {code} for bucket {bucket!r}: {err}") from None
    except BotoCoreError as err:
        raise MaxoutError(f"S3 at {where} failed for bucket {bucket!r} ({type(err).__name__}): {err}") from None

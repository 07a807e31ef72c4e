"""Checks made before a run starts: will the tracking server and the artifact store accept it?

Without them a platform mistake surfaces late and slowly: MLflow retries a failing request for minutes
(7 retries with exponential back-off), and a run that started before its artifact store turned out to be missing
ends FAILED with half its artifacts. Each check here costs one request, fails in seconds, names the bad value
and the fix in one line, and runs before any run exists:

- the server accepts the credentials (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD);
- the experiment's artifact store answers: for proxied artifacts (``mlflow-artifacts:``) the server lists the
  experiment's folder in its bucket; for direct S3 (``s3://``) the client asks the endpoint for the bucket.

Reachability itself is ``tracking.check_reachable``. Credentials never appear in a message: only the user name.
"""

from __future__ import annotations

import os
from typing import Any, Optional
from urllib.parse import urlparse

from .errors import MaxoutError

PROBE_TIMEOUT_S = 30
_ARTIFACTS_API = "/api/2.0/mlflow-artifacts/artifacts"


def _is_http(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def _get(uri: str, endpoint: str, params: dict) -> Any:
    """One GET with MLflow's own client credentials, no retries, and any status returned as it came (MLflow would
    retry a 500 for minutes)."""
    import requests
    from mlflow.exceptions import MlflowException
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    from .tracking import redact

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
    if not _is_http(uri):
        return
    from .tracking import redact

    resp = _get(uri, "/api/2.0/mlflow/experiments/search", {"max_results": 1})
    if resp.status_code == 200:
        return
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    who = f"user {user!r}" if user else "no user (MLFLOW_TRACKING_USERNAME is not set)"
    if resp.status_code == 401:
        raise MaxoutError(f"MLflow tracking server at {redact(uri)} rejected the login of {who} (HTTP 401): set "
                          f"MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD to an account on that server")
    if resp.status_code == 403:
        raise MaxoutError(f"MLflow tracking server at {redact(uri)} denied {who} read access (HTTP 403): ask its "
                          f"admin for a permission on the experiment")
    raise MaxoutError(f"MLflow tracking server at {redact(uri)} answered HTTP {resp.status_code} to a search: "
                      f"{_server_message(resp)}")


def check_artifact_store(uri: str, artifact_location: Optional[str]) -> None:
    """The experiment's artifact root answers a listing: proxied through the server, or direct on S3."""
    scheme = urlparse(artifact_location or "").scheme
    if scheme == "mlflow-artifacts" and _is_http(uri):
        _check_proxied(uri, artifact_location)
    elif scheme == "s3":
        _check_s3(artifact_location)


def _check_proxied(uri: str, location: str) -> None:
    from .tracking import redact

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
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError, NoCredentialsError

    bucket = urlparse(location).netloc
    endpoint = s3_endpoint()
    where = endpoint or "AWS S3"
    client = boto3.client("s3", endpoint_url=endpoint,
                          config=Config(connect_timeout=5, read_timeout=PROBE_TIMEOUT_S,
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

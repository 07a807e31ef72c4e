"""Trackers behind one small interface: MLflow, and a null tracker that records in memory only.

Step metrics are buffered and sent in batches (``log_batch``, from a sender thread), never one blocking call per
step: a synchronous ``log_metric`` to a server costs ~70 ms. Metrics, params and tags go through a local spool
(spool.py) first, so a tracking-server outage mid-run loses nothing. Anything that could carry a credential (a
URI with a password) is redacted before it becomes a param or tag.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Protocol

from . import spool as spool_mod
from .config import TrackingConfig, project_root
from .errors import MaxoutError

_URI_PASSWORD = re.compile(r"(://[^:/@\s]+:)[^@\s]+@")
RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")
log = logging.getLogger("maxout")


def redact(value: Any) -> str:
    """Mask the password of any ``scheme://user:password@host`` inside a value."""
    return _URI_PASSWORD.sub(r"\1***@", str(value))


class Tracker(Protocol):
    run_id: Optional[str]

    def log_params(self, params: Mapping[str, Any]) -> None: ...
    def log_metrics(self, metrics: Mapping[str, Optional[float]], step: Optional[int] = None) -> None: ...
    def set_tags(self, tags: Mapping[str, Any]) -> None: ...
    def log_dict(self, data: Any, artifact_file: str) -> None: ...
    def log_artifact(self, local_path: str, artifact_path: Optional[str] = None) -> None: ...
    def log_model(self, model_dir: str, signature_example: Any = None) -> Optional[str]: ...
    def flush(self) -> None: ...
    def close(self, status: str = "FINISHED", reason: str = "") -> None: ...


class NullTracker:
    """Logs nothing anywhere; keeps what it was given so tests and benchmarks can read it back."""

    run_id: Optional[str] = None

    def __init__(self) -> None:
        self.params: dict[str, str] = {}
        self.tags: dict[str, str] = {}
        self.metrics: dict[str, list[tuple[int, float]]] = {}
        self.status: Optional[str] = None

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.params.update({k: redact(v) for k, v in params.items()})

    def log_metrics(self, metrics: Mapping[str, Optional[float]], step: Optional[int] = None) -> None:
        for key, value in metrics.items():
            if value is not None:
                self.metrics.setdefault(key, []).append((step or 0, float(value)))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self.tags.update({k: redact(v) for k, v in tags.items()})

    def log_dict(self, data: Any, artifact_file: str) -> None:
        pass

    def log_artifact(self, local_path: str, artifact_path: Optional[str] = None) -> None:
        pass

    def log_model(self, model_dir: str, signature_example: Any = None) -> Optional[str]:
        return None

    def flush(self) -> None:
        pass

    def close(self, status: str = "FINISHED", reason: str = "") -> None:
        self.status = status

    def last(self, key: str) -> Optional[float]:
        return self.metrics[key][-1][1] if key in self.metrics else None


# ------------------------------------------------------------------------------------------------ MLflow


def local_store(root: Optional[Path] = None) -> tuple[str, str]:
    """The embedded store: (tracking URI, artifact root) under <project root>/mlruns/."""
    base = (root or project_root()) / "mlruns"
    base.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{base / 'mlflow.db'}", (base / "artifacts").as_uri()


def resolve_uri(cfg: TrackingConfig) -> tuple[str, Optional[str]]:
    """MLflow's own MLFLOW_TRACKING_URI wins over the config, as MLflow users expect."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or cfg.uri
    if uri:
        return uri, cfg.artifact_location
    uri, artifacts = local_store()
    return uri, cfg.artifact_location or artifacts


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast, with the URI and a hint, instead of MLflow's minutes of retries against a dead server."""
    if not uri.startswith(("http://", "https://")):
        return
    import requests

    try:
        requests.get(uri.rstrip("/") + "/health", timeout=timeout_s)
    except requests.RequestException as err:
        raise MaxoutError(f"MLflow tracking server unreachable at {redact(uri)} ({type(err).__name__}); "
                          f"start it (make platform-up) or use tracking=local") from None


class MLflowTracker:
    """One MLflow run. Metrics are buffered and flushed in batches from the training loop's sync points."""

    flush_every_s = 10.0
    max_buffer = 500

    def __init__(self, run_id: str, nested: bool = False, spool_dir: Optional[str] = None, resumed: bool = False):
        import mlflow

        self.client = mlflow.MlflowClient()
        self.run_id = run_id
        self.nested = nested
        self._buffer: list[Any] = []
        self._last_flush = time.monotonic()
        self._spool = spool_mod.Spool(spool_mod.path_for(run_id, spool_dir), run_id,
                                      redact(mlflow.get_tracking_uri()))
        self._sender = spool_mod.Sender(self.client, self._spool)
        self._sender.deliver()  # what a crashed earlier attempt of this run left undelivered goes first
        run = self.client.get_run(run_id)
        self.artifact_uri = run.info.artifact_uri
        self._params = dict(run.data.params)  # e.g. what `mlflow run` already logged
        # A resumed run replays steps after its last checkpoint: keep the values it already has for those steps.
        self._floor = {k: max(m.step for m in self.client.get_metric_history(run_id, k))
                       for k in run.data.metrics} if resumed else {}
        self._sender.start()

    @classmethod
    def start(cls, cfg: TrackingConfig, run_name: Optional[str] = None, tags: Optional[Mapping[str, Any]] = None,
              nested: bool = False, system_metrics: Optional[bool] = None,
              run_id: Optional[str] = None, checked: bool = False) -> "MLflowTracker":
        import mlflow

        from . import preflight

        uri, artifact_location = resolve_uri(cfg)
        if not checked:  # validation.check, run just before by train() and hpo, made these two requests already
            check_reachable(uri)
        if cfg.s3_endpoint_url:
            os.environ["MLFLOW_S3_ENDPOINT_URL"] = cfg.s3_endpoint_url
        if not (nested or checked):  # a nested run's parent already passed these
            preflight.check_credentials(uri)
        mlflow.set_tracking_uri(uri)
        parent = mlflow.active_run() if nested else None  # a nested run lives in its parent's experiment
        experiment_id = parent.info.experiment_id if parent else os.environ.get("MLFLOW_EXPERIMENT_ID")
        if run_id:  # resuming: the run's own experiment
            experiment_id = mlflow.get_run(run_id).info.experiment_id
        elif not experiment_id:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or cfg.experiment_name
            experiment_id = _experiment_id(name, artifact_location)
        if not nested:
            preflight.check_artifact_store(uri, mlflow.get_experiment(experiment_id).artifact_location)
        use_system = cfg.system_metrics if system_metrics is None else system_metrics
        if use_system:
            mlflow.set_system_metrics_sampling_interval(cfg.system_metrics_interval_s)
        run = mlflow.start_run(run_id=run_id, experiment_id=experiment_id, run_name=run_name or cfg.run_name,
                               nested=nested, log_system_metrics=use_system,
                               tags={k: redact(v) for k, v in {**cfg.tags, **(tags or {})}.items()})
        return cls(run.info.run_id, nested=nested, spool_dir=cfg.spool_dir, resumed=run_id is not None)

    # -- logging
    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        fresh = {}
        for key, value in params.items():
            value = redact(value)[:6000]
            if key in self._params:
                if self._params[key] != value:
                    raise MaxoutError(f"param {key!r} is already {self._params[key]!r} in run {self.run_id}; "
                                      f"MLflow refuses to change it to {value!r}")
                continue
            fresh[key] = value
        self._send(params=[Param(k, v) for k, v in fresh.items()])
        self._params.update(fresh)

    def log_metrics(self, metrics: Mapping[str, Optional[float]], step: Optional[int] = None) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), step or 0
        self._buffer.extend(Metric(k, float(v), now, step) for k, v in metrics.items()
                            if v is not None and step > self._floor.get(k, -1))
        if len(self._buffer) >= self.max_buffer or time.monotonic() - self._last_flush > self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        """Journal the buffered metrics and hand them to the sender thread (no network wait here)."""
        self._send(metrics=self._buffer)
        self._buffer = []
        self._last_flush = time.monotonic()

    def _send(self, **batch: Any) -> None:
        if self._sender.error is not None:
            raise MaxoutError(f"MLflow refused a write to run {self.run_id}: {self._sender.error}")
        self._spool.append(**batch)
        self._sender.wake()

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self._send(tags=[_tag(k, v) for k, v in tags.items()])

    def log_dict(self, data: Any, artifact_file: str) -> None:
        with _storing(self):
            self.client.log_dict(self.run_id, data, artifact_file)

    def log_artifact(self, local_path: str, artifact_path: Optional[str] = None) -> None:
        with _storing(self):
            self.client.log_artifact(self.run_id, local_path, artifact_path)

    def log_model(self, model_dir: str, signature_example: Any = None) -> Optional[str]:
        from . import pyfunc

        with _active(self.run_id), _storing(self):
            info = pyfunc.log_model(model_dir, signature_example)
        self.set_tags({"maxout.model_uri": info.model_uri})
        return info.model_uri

    def close(self, status: str = "FINISHED", reason: str = "") -> None:
        import mlflow

        delivered = False
        try:
            if reason:
                self._spool.append(tags=[_tag("maxout.status_reason", reason)])
            self.flush()
            delivered = self._sender.close()
        finally:
            if not delivered:  # the server is away: the end of the run waits in the spool with the rest
                self._spool.append(end=(status, int(time.time() * 1000)))
                log.warning("maxout: %d tracking records of run %s could not be delivered (%s); they are kept "
                            "in %s: run `maxout tracking replay %s` when the server is back",
                            len(self._spool.pending()), self.run_id, self._sender.error or "server unreachable",
                            self._spool.path, self._spool.path)
            active = mlflow.active_run()
            with contextlib.nullcontext() if delivered else _best_effort():
                if active is not None and active.info.run_id == self.run_id:
                    mlflow.end_run(status=status)  # pops the fluent run before it calls the server
                elif delivered:
                    self.client.set_terminated(self.run_id, status=status)
            if delivered:
                self._spool.remove()


def _tag(key: str, value: Any) -> Any:
    from mlflow.entities import RunTag

    return RunTag(key, redact(value)[:5000])


@contextlib.contextmanager
def _best_effort() -> Iterator[None]:
    """Ending a run whose server is away: its end is in the spool, so one quick try is enough."""
    try:
        with spool_mod.fail_fast_http():
            yield
    except Exception as err:  # noqa: BLE001 - recorded in the spool already
        log.debug("ending the run locally only: %s", err)


def _experiment_id(name: str, artifact_location: Optional[str]) -> str:
    import mlflow
    from mlflow.exceptions import MlflowException

    experiment = mlflow.get_experiment_by_name(name)
    if experiment:
        return experiment.experiment_id
    try:
        return mlflow.create_experiment(name, artifact_location=artifact_location)
    except MlflowException:  # created meanwhile by another process (parallel HPO workers start together)
        experiment = mlflow.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


@contextlib.contextmanager
def _storing(tracker: "MLflowTracker") -> Iterator[None]:
    """An artifact upload that fails mid-run (bucket gone, S3 endpoint down, server error) becomes one line
    naming the run and where its artifacts go; the run itself is then ended FAILED by closing()."""
    import requests
    from botocore.exceptions import BotoCoreError, ClientError
    from boto3.exceptions import Boto3Error
    from mlflow.exceptions import MlflowException

    try:
        yield
    except (MlflowException, Boto3Error, BotoCoreError, ClientError, requests.RequestException) as err:
        raise MaxoutError(f"storing artifacts of run {tracker.run_id} at {redact(tracker.artifact_uri)} failed: "
                          f"{redact(err)}"[:1000]) from err


@contextlib.contextmanager
def _active(run_id: str) -> Iterator[None]:
    """Make ``run_id`` the fluent active run for APIs that only log to it (log_model)."""
    import mlflow

    active = mlflow.active_run()
    if active is not None and active.info.run_id == run_id:
        yield
        return
    with mlflow.start_run(run_id=run_id, nested=active is not None):
        yield


def start(cfg: TrackingConfig, run_name: Optional[str] = None, tags: Optional[Mapping[str, Any]] = None,
          nested: bool = False, system_metrics: Optional[bool] = None, run_id: Optional[str] = None,
          checked: bool = False) -> Tracker:
    """A new run, or with ``run_id`` the continuation of that run (resume). ``checked``: the caller ran
    validation.check on this config, so the server's reachability and login need no second request."""
    if cfg.backend == "none":
        return NullTracker()
    return MLflowTracker.start(cfg, run_name=run_name, tags=tags, nested=nested, system_metrics=system_metrics,
                               run_id=run_id, checked=checked)


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM, so the run is closed as KILLED instead of left RUNNING."""


@contextlib.contextmanager
def closing(tracker: Tracker) -> Iterator[Tracker]:
    """End the run as FINISHED, FAILED (exception, with its message as a tag) or KILLED (Ctrl-C, SIGTERM)."""
    try:
        yield tracker
    except (KeyboardInterrupt, Terminated) as err:
        tracker.close("KILLED", reason=f"{type(err).__name__}: interrupted")
        raise
    except BaseException as err:
        tracker.close("FAILED", reason=f"{type(err).__name__}: {err}"[:2000])
        raise
    else:
        tracker.close("FINISHED")

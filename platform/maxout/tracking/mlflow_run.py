"""The MLflow tracker: one MLflow run behind the Tracker interface (tracker.py).

Step metrics are buffered and sent in batches (``log_batch``, from a sender thread), never one blocking call per
step: a synchronous ``log_metric`` to a server costs ~70 ms. Metrics, params and tags go through a local spool
(spool.py) first, so a tracking-server outage mid-run loses nothing; an artifact upload (config.yaml, the model)
retries a server that is away for ``tracking.upload_retry_s``. Anything that could carry a credential (a URI with
a password) is redacted before it becomes a param or tag. The model is logged as serving's pyfunc.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, TypeVar

import mlflow
import requests
from mlflow.entities import Dataset as DatasetEntity, DatasetInput, InputTag, LoggedModelStatus, Metric, Param, RunTag
from mlflow.data.meta_dataset import MetaDataset
from mlflow.data.sources import LocalArtifactDatasetSource
from mlflow.exceptions import MlflowException
from mlflow.types import ColSpec, DataType, Schema
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

from ..config import TrackingConfig
from ..errors import MaxoutError, first_line
from . import preflight, spool as spool_mod
from .datasets import DataInput, model_name
from .redact import redact
from .store import ensure_schema, resolve_uri, sqlite_file

log = logging.getLogger("maxout")
T = TypeVar("T")
# An upload retries on its own schedule (_store), so MLflow's own retries are off; its timeout stays: a large
# model's upload through the server's proxy may take the server longer than the spool's short timeout to answer.
UPLOAD_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}


class MLflowTracker:
    """One MLflow run. Metrics are buffered and flushed in batches from the training loop's sync points."""

    flush_every_s = 10.0
    max_buffer = 500

    def __init__(self, run_id: str, nested: bool = False, spool_dir: Optional[str] = None, resumed: bool = False,
                 upload_retry_s: float = 0.0):
        self.client = mlflow.MlflowClient()
        self.run_id = run_id
        self.nested = nested
        self.upload_retry_s = upload_retry_s
        self._away = False  # an upload already waited out upload_retry_s: the next ones try once, not again as long
        self._buffer: list[Any] = []
        self._last_flush = time.monotonic()
        self._spool = spool_mod.Spool(spool_mod.path_for(run_id, spool_dir), run_id,
                                      redact(mlflow.get_tracking_uri()))
        self._sender = spool_mod.Sender(self.client, self._spool)
        self._one_writer = sqlite_file(mlflow.get_tracking_uri()) is not None  # see _writing()
        if resumed:  # the run goes on: the end an earlier attempt could not deliver (server away) no longer applies
            self._spool.ack(*(r["seq"] for r in self._spool.pending() if "end" in r))
        self._sender.deliver()  # what a crashed earlier attempt of this run left undelivered goes first
        run = self.client.get_run(run_id)
        self.artifact_uri = run.info.artifact_uri
        self.run_name = run.info.run_name or ""  # the logged model's name (log_model)
        self._params = dict(run.data.params)  # e.g. what `mlflow run` already logged
        # The run's latest point of each key: a model's score that repeats it is sent as that same point
        # (log_metrics), so MLflow keeps it once in the run's history.
        self._latest: dict[str, Metric] = {}
        if resumed:  # what an earlier attempt logged, from the store
            self._latest = {k: max(self.client.get_metric_history(run_id, k), key=lambda m: (m.step, m.timestamp))
                            for k in run.data.metrics}
        # A resumed run replays steps after its last checkpoint: keep the values it already has for those steps.
        self._floor = {k: m.step for k, m in self._latest.items()}
        self._sender.start()

    @classmethod
    def start(cls, cfg: TrackingConfig, run_name: Optional[str] = None, tags: Optional[Mapping[str, Any]] = None,
              nested: bool = False, system_metrics: Optional[bool] = None,
              run_id: Optional[str] = None, under: Optional[str] = None) -> "MLflowTracker":
        """Start (or with ``run_id`` reopen) a run on the store ``cfg`` resolves to. The store itself was checked
        before (preflight.store_problems, which train/prepare.py runs): here only the experiment's artifact store
        is, once its experiment is known."""
        uri, artifact_location = _use_store(cfg)
        # A nested run lives in its parent's experiment: the active run's, or ``under``, a run of another process.
        parent = mlflow.get_run(under) if under else mlflow.active_run() if nested else None
        experiment_id = parent.info.experiment_id if parent else os.environ.get("MLFLOW_EXPERIMENT_ID")
        if run_id:  # resuming: the run's own experiment
            experiment_id = mlflow.get_run(run_id).info.experiment_id
        elif not experiment_id:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or cfg.experiment_name
            experiment_id = _experiment_id(name, artifact_location)
        if not (nested or under):
            preflight.check_artifact_store(uri, mlflow.get_experiment(experiment_id).artifact_location)
        use_system = cfg.system_metrics if system_metrics is None else system_metrics
        if use_system:
            mlflow.set_system_metrics_sampling_interval(cfg.system_metrics_interval_s)
        run = spool_mod.retry_busy(lambda: mlflow.start_run(
            run_id=run_id, experiment_id=experiment_id, run_name=run_name or cfg.run_name, nested=nested,
            parent_run_id=under, log_system_metrics=use_system,
            tags={k: redact(v) for k, v in {**cfg.tags, **(tags or {})}.items()}))
        return cls(run.info.run_id, nested=nested, spool_dir=cfg.spool_dir, resumed=run_id is not None,
                   upload_retry_s=cfg.upload_retry_s)

    @classmethod
    def start_detached(cls, cfg: TrackingConfig, run_name: Optional[str] = None,
                       tags: Optional[Mapping[str, Any]] = None) -> "MLflowTracker":
        """A top-level run created through the client, never this process's active run: a run that another process
        may end (the parent run the invocations of one study share, hpo.parent=shared; release() lets go of it)."""
        uri, artifact_location = _use_store(cfg)
        experiment_id = os.environ.get("MLFLOW_EXPERIMENT_ID") or _experiment_id(
            os.environ.get("MLFLOW_EXPERIMENT_NAME") or cfg.experiment_name, artifact_location)
        preflight.check_artifact_store(uri, mlflow.get_experiment(experiment_id).artifact_location)
        run = spool_mod.retry_busy(lambda: mlflow.MlflowClient().create_run(
            experiment_id, run_name=run_name or cfg.run_name,
            tags={k: redact(v) for k, v in {**cfg.tags, **(tags or {})}.items()}))
        return cls(run.info.run_id, spool_dir=cfg.spool_dir, upload_retry_s=cfg.upload_retry_s)

    @classmethod
    def start_child(cls, cfg: TrackingConfig, parent_run_id: str, run_name: Optional[str] = None,
                    tags: Optional[Mapping[str, Any]] = None) -> "MLflowTracker":
        """A child of ``parent_run_id``, created through the client: MLflow's fluent API nests only under the
        active run, and a run that is not the active one is ended through the client too (close())."""
        client = mlflow.MlflowClient()
        experiment_id = client.get_run(parent_run_id).info.experiment_id
        run = spool_mod.retry_busy(lambda: client.create_run(experiment_id, run_name=run_name, tags={
            **{k: redact(v) for k, v in {**cfg.tags, **(tags or {})}.items()}, "mlflow.parentRunId": parent_run_id}))
        return cls(run.info.run_id, nested=True, spool_dir=cfg.spool_dir)

    # -- logging
    def log_params(self, params: Mapping[str, Any]) -> None:
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

    def log_metrics(self, metrics: Mapping[str, Optional[float]], step: Optional[int] = None,
                    model_id: Optional[str] = None, dataset: Optional[DataInput] = None) -> None:
        """See Tracker.log_metrics. A model's scores go to the run too (MLflow's log_batch files a metric that
        carries a model_id under both); one that repeats the run's latest point of its key is that point again
        (same step, timestamp and value), which MLflow's run history keeps once."""
        now, step = int(time.time() * 1000), step or 0
        named = {"dataset_name": dataset.name, "dataset_digest": dataset.digest} if dataset else {}
        for key, value in metrics.items():
            if value is None:
                continue
            if model_id is not None:
                latest = self._latest.get(key)
                same = latest is not None and latest.value == float(value)
                at = (latest.timestamp, latest.step) if same else (now, step)
                self._buffer.append(Metric(key, float(value), *at, model_id=model_id, **named))
            elif step > self._floor.get(key, -1):
                self._buffer.append(Metric(key, float(value), now, step))
            else:
                continue
            self._latest[key] = self._buffer[-1]
        if len(self._buffer) >= self.max_buffer or time.monotonic() - self._last_flush > self.flush_every_s:
            self.flush()

    def log_inputs(self, inputs: Sequence[DataInput]) -> None:
        """The run's datasets (mlflow.data), journalled and sent like its metrics (spool.py)."""
        self._send(inputs=[dataset_input(i) for i in inputs])

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
        self._store(lambda: self.client.log_dict(self.run_id, data, artifact_file))

    def log_artifact(self, local_path: str, artifact_path: Optional[str] = None) -> None:
        self._store(lambda: self.client.log_artifact(self.run_id, local_path, artifact_path))

    def log_model(self, model_dir: str, input_example: Any = None, name: Optional[str] = None) -> Optional[str]:
        """Log the model, named after ``name`` (the run's name by default); it ends READY, or FAILED when anything
        stops the upload (the run then fails too)."""
        name = model_name(name or self.run_name)

        def upload() -> Any:
            with _active(self.run_id):
                from ..serving import pyfunc  # lazy: torch and transformers, which ending a run never needs

                return pyfunc.log_model(model_dir, input_example, name=name)

        try:
            info = self._store(upload)
        except BaseException:
            self._fail_unfinished_models()
            raise
        self._fail_unfinished_models(keep=info.model_id)  # e.g. left PENDING by a SIGKILLed attempt of this run
        self.set_tags({"maxout.model_uri": info.model_uri})
        return info.model_uri

    def _fail_unfinished_models(self, keep: Optional[str] = None) -> None:
        """A logged model of this run still PENDING is marked FAILED, so that it is never mistaken for a usable one.
        MLflow marks a model FAILED when its logging raises an Exception, but not on Ctrl-C or SIGTERM (which are
        not Exceptions), nor when the signal lands between creating the model and starting its upload.
        Best effort, with MLflow's retries cut short: after a failed upload the server is most likely away, and its
        default retries (two requests, about two minutes each) held the user's one-line error back for minutes."""
        try:
            with spool_mod.fail_fast_http(), self._writing():
                experiment_id = self.client.get_run(self.run_id).info.experiment_id
                # (Filtered here, not in the query: the SQL store keeps the status as a number, and
                # status = 'PENDING' finds nothing.)
                for model in self.client.search_logged_models([experiment_id],
                                                              filter_string=f"source_run_id = '{self.run_id}'"):
                    if model.status == LoggedModelStatus.PENDING and model.model_id != keep:
                        self.client.finalize_logged_model(model.model_id, LoggedModelStatus.FAILED)
        except Exception as err:  # noqa: BLE001 - the error that got us here matters more; predict refuses PENDING
            log.warning("maxout: could not mark the unfinished models of run %s FAILED: %s", self.run_id,
                        redact(first_line(err)))

    def _store(self, upload: Callable[[], T]) -> T:
        """An artifact upload. While the server (or its artifact store) is unreachable it is tried again every
        spool.Sender.retry_s seconds, as the spool retries metrics, for up to ``upload_retry_s``; after that, or on a
        refusal, it fails in one line naming the run and where its artifacts go (closing() then ends the run
        FAILED). Each try is one attempt per request, instead of MLflow's minutes of retries. Once an upload has
        waited out the whole window, the run's later uploads try once each until one gets through: a server that
        stayed away that long costs the run one window, not one per artifact."""
        deadline, tries = time.monotonic() + (0.0 if self._away else self.upload_retry_s), 0
        while True:
            tries += 1
            try:
                with spool_mod.fail_fast_http(UPLOAD_HTTP), self._writing():
                    result = upload()
                self._away = False
                return result
            except _storage_errors() as err:
                left = deadline - time.monotonic()
                if not _unreachable(err) or left <= 0:
                    retried = f" (tried {tries} times over {self.upload_retry_s:.0f} s)" if tries > 1 else ""
                    if _unreachable(err) and (self._away or tries > 1):
                        retried = retried or f" (away since an earlier upload waited {self.upload_retry_s:.0f} s)"
                        self._away = True
                    raise MaxoutError(f"storing artifacts of run {self.run_id} at {redact(self.artifact_uri)} failed"
                                      f"{retried}: {redact(first_line(err))[:800]}") from err
                if tries == 1:
                    log.warning("maxout: storing artifacts of run %s failed (%s); trying again every %.0f s for up "
                                "to %.0f s", self.run_id, type(err).__name__, spool_mod.Sender.retry_s,
                                self.upload_retry_s)
            time.sleep(min(spool_mod.Sender.retry_s, max(left, 0.0)))

    def _writing(self) -> contextlib.AbstractContextManager:
        """Around the main thread's own writes. SQLite takes one writer at a time, and two of this process's writes
        at once (the sender's batch of metrics, the model's upload finalizing its model) can deadlock, each having
        read before writing: SQLite then refuses one of them at once. On a SQLite store the sender waits."""
        return self._sender.held() if self._one_writer else contextlib.nullcontext()

    def close(self, status: str = "FINISHED", reason: str = "") -> None:
        delivered = False
        try:
            if reason:
                self._spool.append(tags=[_tag("maxout.status_reason", reason)])
            self.flush()
            delivered = self._sender.close()
        finally:
            if not delivered:  # the server is away: the end of the run waits in the spool with the rest
                self._spool.append(end=(status, int(time.time() * 1000)))
                why = self._sender.error or "server unreachable"
                if self._spool.unwritable is None:
                    log.warning("maxout: %d tracking records of run %s could not be delivered (%s); they are kept "
                                "in %s: run `maxout tracking replay %s` when the server is back",
                                len(self._spool.pending()), self.run_id, why, self._spool.path, self._spool.path)
                else:
                    log.warning("maxout: %d tracking records of run %s could not be delivered (%s), and the spool "
                                "could not keep them (%s): they are lost", len(self._spool.pending()), self.run_id,
                                why, self._spool.unwritable.strerror or self._spool.unwritable)
            active = mlflow.active_run()
            with contextlib.nullcontext() if delivered else _best_effort():
                if active is not None and active.info.run_id == self.run_id:
                    self._end_fluent(status)
                elif delivered:
                    spool_mod.retry_busy(lambda: self.client.set_terminated(self.run_id, status=status))
            if delivered:
                self._spool.remove()

    def release(self) -> None:
        """Deliver what was logged and let go of the run, RUNNING: another process ends it (start_detached)."""
        self.flush()
        if self._sender.close():
            self._spool.remove()
        else:  # the server is away: what is left waits in the spool, as close() keeps it
            log.warning("maxout: %d tracking records of run %s could not be delivered; they are kept in %s: run "
                        "`maxout tracking replay %s` when the server is back", len(self._spool.pending()),
                        self.run_id, self._spool.path, self._spool.path)

    def _end_fluent(self, status: str) -> None:
        """mlflow.end_run pops the fluent run before it writes the end: a busy store's refusal is retried through
        the client, so the run never stays RUNNING."""
        try:
            mlflow.end_run(status=status)
        except Exception as err:
            if not spool_mod.store_busy(err):
                raise
            spool_mod.retry_busy(lambda: self.client.set_terminated(self.run_id, status=status))


def _use_store(cfg: TrackingConfig) -> tuple[str, Optional[str]]:
    """Point MLflow at the store ``cfg`` resolves to (its schema made, S3's endpoint set): its URI and artifact
    location."""
    uri, artifact_location = resolve_uri(cfg)
    if cfg.s3_endpoint_url:
        os.environ["MLFLOW_S3_ENDPOINT_URL"] = cfg.s3_endpoint_url
    mlflow.set_tracking_uri(uri)
    ensure_schema(uri)  # several jobs may start together on a new SQLite store
    return uri, artifact_location


def fail_if_running(cfg: TrackingConfig, run_id: str, reason: str) -> None:
    """See tracker.fail_if_running. A run this store does not have (tracking changed since) is left alone."""
    client = mlflow.MlflowClient(tracking_uri=resolve_uri(cfg)[0])
    try:
        if client.get_run(run_id).info.status != "RUNNING":
            return
    except MlflowException:
        return
    spool_mod.retry_busy(lambda: client.set_tag(run_id, "maxout.status_reason", redact(reason)[:5000]))
    spool_mod.retry_busy(lambda: client.set_terminated(run_id, "FAILED"))


def end_running(cfg: TrackingConfig, tag: str, value: str, status: str, reason: str) -> list[str]:
    """End every RUNNING run of the experiment whose ``tag`` is ``value`` with ``status``; returns their ids. For
    runs whose processes were killed before they could end them (a cancelled Slurm job's)."""
    client = mlflow.MlflowClient(tracking_uri=resolve_uri(cfg)[0])
    experiment = client.get_experiment_by_name(cfg.experiment_name)
    if experiment is None:
        return []
    runs = client.search_runs([experiment.experiment_id],
                              f"tags.`{tag}` = '{value}' and attributes.status = 'RUNNING'")
    for run in runs:
        spool_mod.retry_busy(lambda: client.set_tag(run.info.run_id, "maxout.status_reason", redact(reason)[:5000]))
        spool_mod.retry_busy(lambda: client.set_terminated(run.info.run_id, status))
    return [run.info.run_id for run in runs]


def dataset_input(data: DataInput) -> DatasetInput:
    """``data`` as an MLflow dataset input: an ``mlflow.data`` dataset that holds its metadata (the rows stay in
    their file), sourced from that file, with the fingerprint as its digest and its role as the input's context."""
    schema = Schema([ColSpec(DataType.string, c) for c in data.columns]) if data.columns else None
    dataset = MetaDataset(LocalArtifactDatasetSource(data.source), name=data.name, digest=data.digest, schema=schema)
    # What mlflow.log_input logs for it, plus a profile (a MetaDataset has none): its rows, which rows of the file.
    entity = DatasetEntity(**dataset.to_dict(), profile=json.dumps({"num_rows": data.rows, **data.profile}))
    return DatasetInput(entity, [InputTag(MLFLOW_DATASET_CONTEXT, data.context)])


def _tag(key: str, value: Any) -> RunTag:
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


def _storage_errors() -> tuple[type, ...]:
    """What a failed artifact upload raises. boto3's errors can only come from an S3 upload, which imported boto3
    first; a local or proxied store never needs it (and the GPU report's machine has none)."""
    errors: list[type] = [MlflowException, requests.RequestException]
    sql = sys.modules.get("sqlalchemy.exc")  # a SQL store's: a busy SQLite file is retried (spool.store_busy)
    errors += [sql.OperationalError] if sql is not None else []
    for module, names in (("boto3.exceptions", ("Boto3Error",)), ("botocore.exceptions", ("BotoCoreError",
                                                                                          "ClientError"))):
        loaded = sys.modules.get(module)
        errors += [getattr(loaded, name) for name in names] if loaded is not None else []
    return tuple(errors)


def _unreachable(err: BaseException) -> bool:
    """Worth another try: the server or the object store did not answer (as opposed to refusing the upload)."""
    botocore = sys.modules.get("botocore.exceptions")  # loaded by any S3 upload that could raise it
    return spool_mod.unreachable(err) or (botocore is not None
                                          and isinstance(err, botocore.EndpointConnectionError))


@contextlib.contextmanager
def _active(run_id: str) -> Iterator[None]:
    """Make ``run_id`` the fluent active run for APIs that only log to it (log_model)."""
    active = mlflow.active_run()
    if active is not None and active.info.run_id == run_id:
        yield
        return
    with mlflow.start_run(run_id=run_id, nested=active is not None):
        yield


def end_if_running(tracking_uri: str, run_id: str, status: str, reason: str) -> bool:
    """End ``run_id`` with ``status`` and ``reason`` if it is still RUNNING (a process that should have closed it
    died first); False when it was closed already."""
    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    if client.get_run(run_id).info.status != "RUNNING":
        return False
    client.set_tag(run_id, "maxout.status_reason", redact(reason)[:5000])
    client.set_terminated(run_id, status)
    return True

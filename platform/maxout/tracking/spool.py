"""A write-ahead journal of one run's tracking writes, so that a tracking-server outage loses nothing.

Every batch of metrics, params, tags and dataset inputs is appended to ``<spool dir>/<run id>.jsonl`` (and fsynced) BEFORE it is
sent; a sender thread delivers the records in order and appends ``{"ack": seq}`` for each one the server
accepted. While the server is unreachable the sender retries every ``retry_s`` seconds and training goes on.
Whatever is still unacknowledged when the run ends stays in the file for ``maxout tracking replay``.

Replay is idempotent: acknowledged records are skipped, and a record delivered twice (its acknowledgement lost
in a crash) repeats the same metric (key, step, timestamp, value), which MLflow's store de-duplicates, and the
same param and tag values, which MLflow accepts again. A damaged line (torn by a crash mid-write, or corrupt on
disk) is skipped, with a warning when it is not just the last line; the records around it are delivered.

A journal that cannot be written (a full or read-only disk) does not stop the run: the records are kept in
memory and the sender still delivers them (one warning names the folder and why); only a crash before they
reach the server would lose them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, TypeVar

import mlflow
import requests
from mlflow.entities import Dataset as DatasetEntity, DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.exceptions import MlflowException

from ..errors import USAGE, MaxoutError
from ..paths import state_dir
from .redact import redact

log = logging.getLogger("maxout")
T = TypeVar("T")
BUSY_TRIES = 5  # retry_busy: a writer SQLite refused to break a deadlock holds the file for milliseconds

# Format 2 adds what format 1 lacked, compatibly: a metric may carry the logged model it scores and the dataset it
# was measured on ([key, value, timestamp, step, model_id, dataset_name, dataset_digest]; format 1's four-item
# metrics still replay), and an "inputs" record holds the run's dataset inputs.
FORMAT = 2
# log_batch limits per request (MLflow REST API)
MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 100
# MLflow retries a failed request for minutes by default; the sender retries on its own schedule instead, so
# each of its requests fails fast. A user's own MLFLOW_HTTP_REQUEST_* settings win.
SENDER_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def default_dir() -> Path:
    return state_dir() / "spool"


def path_for(run_id: str, directory: Optional[str] = None) -> Path:
    return Path(directory).expanduser() / f"{run_id}.jsonl" if directory else default_dir() / f"{run_id}.jsonl"


class Spool:
    """The journal file of one run: records in order, minus those acknowledged."""

    def __init__(self, path: Path, run_id: Optional[str] = None, tracking_uri: str = ""):
        self.path = Path(path)
        self.run_id, self.tracking_uri = run_id, tracking_uri
        self._lock = threading.Lock()
        self._pending: list[dict] = []
        self._seq = 0
        self.unwritable: Optional[OSError] = None  # set when the disk refused a write (see _write)
        if self.path.exists():
            self._load()
        elif run_id is None:
            raise MaxoutError(f"spool file not found: {self.path}; list them with `ls {default_dir()}`")

    def _load(self) -> None:
        records, acked, damaged = [], set(), []
        lines = self.path.read_bytes().splitlines()
        for number, line in enumerate(lines, 1):
            item = _item(line)
            if item is None:  # torn by a crash mid-write (never sent), or damaged on disk: skip it
                damaged.append(number)
            elif "spool" in item:
                self.run_id = self.run_id or item["run_id"]
                self.tracking_uri = self.tracking_uri or item.get("tracking_uri", "")
            elif "ack" in item:
                acked.add(item["ack"])
            else:
                records.append(item)
        if damaged and damaged != [len(lines)]:  # more than the torn last line of a crash
            log.warning("maxout: spool %s has %d damaged lines (%s); skipped, the other records are kept", self.path,
                        len(damaged), ", ".join(map(str, damaged[:10])) + (" ..." if len(damaged) > 10 else ""))
        if self.run_id is None:
            raise MaxoutError(f"{self.path} is not a maxout spool file (no header line); pass a file from "
                              f"{default_dir()}", exit_code=USAGE)
        self._pending = [r for r in records if r["seq"] not in acked]
        self._seq = max((r["seq"] for r in records), default=0)

    def _write(self, items: Sequence[dict]) -> None:
        """Journal ``items``; a disk that refuses (full, read-only) is one warning, and the records live on in
        memory for the sender."""
        if self.unwritable is not None:
            return
        try:
            self._append_lines(items)
        except OSError as err:
            self.unwritable = err
            log.warning("maxout: tracking spool %s cannot be written (%s); its records are kept in memory and still "
                        "sent, but a crash before they reach the server would lose them: free space in %s or set "
                        "tracking.spool_dir", self.path, err.strerror or err, self.path.parent)

    def _append_lines(self, items: Sequence[dict]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists()
        with open(self.path, "a+", encoding="utf-8") as f:
            if new:
                f.write(json.dumps({"spool": FORMAT, "run_id": self.run_id, "tracking_uri": self.tracking_uri}) + "\n")
            elif f.tell() and not _ends_with_newline(self.path):  # after a torn line: start a fresh one
                f.write("\n")
            f.write("".join(json.dumps(item) + "\n" for item in items))
            f.flush()
            os.fsync(f.fileno())

    def append(self, metrics: Sequence[Any] = (), params: Sequence[Any] = (), tags: Sequence[Any] = (),
               end: Optional[tuple[str, int]] = None, inputs: Sequence[Any] = ()) -> None:
        """Journal MLflow Metric / Param / RunTag / DatasetInput objects (split to log_batch's limits), or the
        run's end."""
        metrics = [_metric_item(m) for m in metrics]
        params, tags = [[p.key, p.value] for p in params], [[t.key, t.value] for t in tags]
        chunks = [{"inputs": [_input_item(i) for i in inputs]}] if inputs else []
        chunks += [{"metrics": metrics[i:i + MAX_METRICS]} for i in range(0, len(metrics), MAX_METRICS)]
        chunks += [{"params": params[i:i + MAX_PARAMS]} for i in range(0, len(params), MAX_PARAMS)]
        chunks += [{"tags": tags[i:i + MAX_TAGS]} for i in range(0, len(tags), MAX_TAGS)]
        if end is not None:
            chunks.append({"end": {"status": end[0], "end_time": end[1]}})
        if not chunks:
            return
        with self._lock:
            records = []
            for chunk in chunks:
                self._seq += 1
                records.append({"seq": self._seq, **chunk})
            self._write(records)
            self._pending.extend(records)

    def ack(self, *seqs: int) -> None:
        """Mark records delivered: one journal write (and fsync) for all of them."""
        if not seqs:
            return
        with self._lock:
            self._write([{"ack": seq} for seq in seqs])
            done = set(seqs)
            self._pending = [r for r in self._pending if r["seq"] not in done]

    def pending(self) -> list[dict]:
        with self._lock:
            return list(self._pending)

    def remove(self) -> None:
        """Delete the file once everything in it was delivered (and the spool folder, if that left it empty)."""
        with self._lock:
            if not self._pending:
                with contextlib.suppress(OSError):  # a read-only disk keeps it: a replay re-sends, harmlessly
                    self.path.unlink(missing_ok=True)
                    self.path.parent.rmdir()


def _item(line: bytes) -> Optional[dict]:
    """A journal line as a dict: the header, an acknowledgement or a record MLflow can take; None when damaged."""
    try:
        item = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(item, dict):
        return None
    if "spool" in item:
        return item if isinstance(item.get("run_id"), str) else None
    if "ack" in item:
        return item if isinstance(item["ack"], int) else None
    if not isinstance(item.get("seq"), int):
        return None
    try:
        if "end" in item:
            str(item["end"]["status"]), int(item["end"]["end_time"])
        elif "inputs" in item:
            _inputs(item)
        else:
            _entities(item)
    except (KeyError, TypeError, ValueError, AttributeError, MlflowException):
        return None
    return item


def _metric_item(m: Any) -> list:
    item = [m.key, m.value, m.timestamp, m.step]
    if m.model_id or m.dataset_name:  # a model's score: format 2 (format 1's four items otherwise)
        item += [m.model_id, m.dataset_name, m.dataset_digest]
    return item


def _metric(item: Sequence[Any]) -> Metric:
    """A journal metric: [key, value, timestamp, step] (format 1), plus model_id, dataset name and digest."""
    if len(item) not in (4, 7):
        raise ValueError(f"a metric has 4 or 7 items, not {len(item)}")
    key, value, ts, step = item[:4]
    model_id, name, digest = (None if x is None else str(x) for x in item[4:]) if len(item) == 7 else (None,) * 3
    return Metric(str(key), float(value), int(ts), int(step), model_id=model_id, dataset_name=name,
                  dataset_digest=digest)


def _input_item(dataset_input: Any) -> dict:
    d = dataset_input.dataset
    return {"dataset": {"name": d.name, "digest": d.digest, "source_type": d.source_type, "source": d.source,
                        "schema": d.schema, "profile": d.profile},
            "tags": {t.key: t.value for t in dataset_input.tags}}


def _inputs(record: dict) -> list[DatasetInput]:
    return [DatasetInput(DatasetEntity(**{k: (None if v is None else str(v)) for k, v in item["dataset"].items()}),
                         [InputTag(str(k), str(v)) for k, v in item["tags"].items()])
            for item in record["inputs"]]


def _entities(record: dict) -> tuple[list, list, list]:
    """A record's MLflow metrics, params and tags (TypeError / ValueError when it is malformed)."""
    return ([_metric(item) for item in record.get("metrics", [])],
            [Param(str(k), str(v)) for k, v in record.get("params", [])],
            [RunTag(str(k), str(v)) for k, v in record.get("tags", [])])


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def send(client: Any, run_id: str, record: dict) -> None:
    if "end" in record:
        client.set_terminated(run_id, status=record["end"]["status"], end_time=record["end"]["end_time"])
        return
    if "inputs" in record:  # MLflow keeps one input per (dataset, run): a second delivery adds nothing
        datasets = _inputs(record)
        try:
            client.log_inputs(run_id, datasets=datasets)
        except MlflowException as err:
            if not dataset_raced(err):
                raise
            client.log_inputs(run_id, datasets=datasets)  # now it finds that dataset, and links it
        return
    metrics, params, tags = _entities(record)
    client.log_batch(run_id, metrics=metrics, params=params, tags=tags, synchronous=True)


def dataset_raced(err: BaseException) -> bool:
    """Another process inserted the same dataset (experiment, name, digest) between this write's read and its
    insert: MLflow's log_inputs reads the experiment's datasets, then inserts those it did not find, and the store's
    unique key refuses the later of two such inserts (SQLite: "UNIQUE constraint failed: datasets.", PostgreSQL:
    "duplicate key value violates unique constraint" on the datasets table). Two HPO workers starting their first
    trials together do it. The same write again finds the dataset."""
    text = str(err)
    return isinstance(err, MlflowException) and "datasets" in text and (
        "UNIQUE constraint failed" in text or "duplicate key value violates unique constraint" in text)


def unreachable(err: BaseException) -> bool:
    """A failure worth retrying later (no connection, timeout, 5xx, a busy SQLite store), as opposed to a request
    MLflow refuses."""
    if isinstance(err, (requests.RequestException, ConnectionError, TimeoutError)) or store_busy(err):
        return True
    return isinstance(err, MlflowException) and err.get_http_status_code() >= 500


def store_busy(err: BaseException) -> bool:
    """SQLite's "database is locked": another writer held the file past MLflow's busy timeout (20 s), or SQLite
    refused the write at once to break a deadlock between two transactions that each read before writing (MLflow's
    sessions do). The store itself is fine, and the same write goes through on a later try. SQLAlchemy raises it,
    so it can only come from a store that loaded SQLAlchemy."""
    errors = sys.modules.get("sqlalchemy.exc")
    return (errors is not None and isinstance(err, (errors.OperationalError, MlflowException))
            and "database is locked" in str(err))


def retry_busy(write: Callable[[], T]) -> T:
    """``write`` again, after a short wait, while the store is busy (store_busy): for the writes that cannot wait
    in the journal, such as a run's start and its end (several HPO workers start and end runs on one SQLite file)."""
    for attempt in range(1, BUSY_TRIES + 1):
        try:
            return write()
        except Exception as err:
            if attempt == BUSY_TRIES or not store_busy(err):
                raise
            log.debug("tracking store busy (try %d of %d): %s", attempt, BUSY_TRIES, redact(str(err).split("\n")[0]))
            time.sleep(0.25 * attempt)
    raise AssertionError("unreachable")  # the last try returns or raises


_http_lock = threading.Lock()
_http_active: list[Mapping[str, str]] = []  # the settings of every fail_fast_http context now open, any thread
_http_user: dict[str, Optional[str]] = {}  # what the environment held before the first of them opened


@contextlib.contextmanager
def fail_fast_http(settings: Mapping[str, str] = SENDER_HTTP) -> Iterator[None]:
    """MLflow reads these per request. Process-wide while set: the sender's requests are short, and the main
    thread's requests during that moment merely get the same short timeout. The sender's thread and the main
    thread open these at once, so the environment is recomputed from all open contexts on each entry and exit
    (one closing must not take away a setting another still relies on); a value the user set is never touched."""
    with _http_lock:
        for key in settings:  # a key no open context has set yet still holds the user's value
            _http_user.setdefault(key, os.environ.get(key))
        _http_active.append(settings)
        _apply_http()
    try:
        yield
    finally:
        with _http_lock:
            _http_active.remove(settings)
            _apply_http()


def _apply_http() -> None:
    """The environment for the open contexts: each key at the first open context's value, or the user's."""
    for key, user in _http_user.items():
        value = user if user is not None else next((s[key] for s in _http_active if key in s), None)
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if not _http_active:
        _http_user.clear()


class Sender:
    """Delivers a spool's records in order on a daemon thread; while the server is away, retries every retry_s."""

    retry_s = 5.0

    def __init__(self, client: Any, spool: Spool):
        self.client, self.spool = client, spool
        self.offline_since: Optional[float] = None
        self.outages = 0
        self.error: Optional[BaseException] = None  # a refusal (4xx): not retried, raised by the tracker
        # One deliverer at a time (the thread, or close() at the end), and none while held() is.
        self._deliver_lock = threading.RLock()
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="maxout-spool-sender", daemon=True)

    def start(self) -> "Sender":
        self._thread.start()
        return self

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.retry_s if self.offline_since is not None else None)
            self._wake.clear()
            if not self._stop.is_set():
                self.deliver()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Nothing is delivered while the caller writes to the store itself (records wait in the journal)."""
        with self._deliver_lock:
            yield

    def deliver(self) -> bool:
        """Send everything pending, in order. True when nothing is left."""
        with self._deliver_lock:
            delivered: list[int] = []
            try:
                for record in self.spool.pending():
                    if self.error is not None:
                        return False
                    try:
                        with fail_fast_http():
                            send(self.client, self.spool.run_id, record)
                    except Exception as err:
                        if not unreachable(err):
                            self.error = err
                            return False
                        if self.offline_since is None:
                            self.offline_since, self.outages = time.monotonic(), self.outages + 1
                            why = ("tracking store busy (database is locked)" if store_busy(err) else
                                   f"tracking server unreachable ({type(err).__name__})")
                            log.warning("maxout: %s; keeping its records in %s until it is back", why,
                                        self.spool.path)
                        return False
                    delivered.append(record["seq"])
            finally:  # one acknowledgement write per pass (a crash before it re-sends: MLflow keeps each once)
                self.spool.ack(*delivered)
            if self.offline_since is not None:
                log.warning("maxout: tracking server back after %.0f s; spooled records delivered",
                            time.monotonic() - self.offline_since)
                self.offline_since = None
            return True

    def close(self) -> bool:
        """Stop the thread, then one last delivery attempt. True when everything reached the server."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
        return self.deliver()


def replay(path: Path, tracking_uri: Optional[str] = None) -> int:
    """Deliver a spool file left by a run whose server never came back; returns how many records were sent."""
    spool = Spool(path)
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or spool.tracking_uri
    if not uri or "***" in uri:
        raise MaxoutError(f"{path} does not say which tracking server to replay to (its URI is redacted); "
                          f"pass --tracking-uri URI or set MLFLOW_TRACKING_URI")
    before = len(spool.pending())
    sender = Sender(mlflow.MlflowClient(uri), spool)
    if not sender.deliver():
        reason = sender.error or "unreachable"
        raise MaxoutError(f"replay of {path} to {redact(uri)} stopped ({reason}); "
                          f"{len(spool.pending())} records kept, run `maxout tracking replay {path}` again")
    spool.remove()
    return before

"""Model registry: register a trained model, promote it only if it beats the champion, roll back.

MLflow 3 deprecates stages, so maxout uses aliases (``models:/NAME@champion``):

- every new version gets ``challenger`` (the alias always names the newest registered version);
- ``champion`` moves to the new version only if it beats the current champion on ``registry.metric``
  (direction-aware; ties keep the champion). Why it moved or not is written on the version and on the run
  (tag ``maxout.promotion``, e.g. ``champion: eval/macro_f1 0.81 > 0.78 (was v3)`` or ``kept v3: ...``);
- the registered model's tag ``maxout.champion_history`` lists the champions in order, so ``rollback`` knows
  which version was champion before.

Aliases are last-writer-wins: two promoters that each read "champion = v3, I beat it" would both write, and the
worse one can win. Every alias change therefore runs under :class:`PromotionLock`, a mutex kept in the registry
itself, so it serializes promoters across processes and machines on any backend (SQLite, PostgreSQL, a tracking
server). It is a ticket queue (Lamport's bakery): a promoter takes a ticket by creating a version of the
registered model ``NAME.lock``; the store numbers versions with max+1 in one transaction and never reuses a
number (deleted versions stay as tombstones), so tickets are unique and ordered, and the holder is the lowest
live ticket. Release deletes the ticket. A crashed holder's ticket goes stale: waiters refresh their own ticket
(``last_updated_timestamp``, written by the store) and delete a ticket ahead of them that nobody refreshed for
``registry.lock_ttl_s``. Deleting one exact version is what makes breaking safe: the simpler lock, "create
registered model NAME.lock, delete it to release" (a second creator gets RESOURCE_ALREADY_EXISTS), cannot be
broken safely, because two waiters that both see it stale can delete the lock the first of them just re-created,
and then both hold it.

Registration is all-or-nothing: a version is created with all its tags in one call (one store transaction), and
if promotion fails afterwards (lock timeout, a store error) the aliases and history are restored and the new
version is deleted, so no version is left without its promotion and no lock ticket is left behind.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional

from .errors import ConfigError, MaxoutError

if TYPE_CHECKING:  # mlflow is imported lazily: `maxout --help` should not pay for it
    from mlflow import MlflowClient

    from .config import Config

CHAMPION, CHALLENGER = "champion", "challenger"
LOCK_SUFFIX = ".lock"
LOCK_SOURCE = "maxout-lock:///"  # a ticket's version source: points at no artifacts; absolute, as servers require
HISTORY_TAG = "maxout.champion_history"
HISTORY_KEEP = 100
PROMOTION_TAG = "maxout.promotion"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,199}$")
LOGGED_MODEL_URI = re.compile(r"^models:/(m-[0-9a-f]+)$")  # what log_model returns in MLflow 3


@dataclass
class Outcome:
    """What registration and promotion did."""

    name: str
    version: int
    champion_version: Optional[int]  # who holds champion now
    previous_champion: Optional[int]
    reason: str  # also the ``maxout.promotion`` tag of the version and the run

    @property
    def promoted(self) -> bool:
        return self.champion_version == self.version

    def summary(self) -> str:
        return f"registered {self.name} v{self.version}; {self.reason}"


# ------------------------------------------------------------------------------------------------ helpers


def check_name(name: str) -> None:
    """Registry names end up in ``models:/NAME@alias`` URIs: keep them to letters, digits, ``_ . -``."""
    if not NAME_PATTERN.match(name or ""):
        raise ConfigError(f"registry.name={name!r} is invalid: use 1-200 letters, digits, '_', '.' or '-', "
                          f"starting with a letter or digit")
    if name.endswith(LOCK_SUFFIX):
        raise ConfigError(f"registry.name={name!r} is invalid: names ending in {LOCK_SUFFIX!r} are maxout's "
                          f"promotion locks")


def connect(uri: str) -> "MlflowClient":
    """A client for the registry at ``uri`` (the tracking URI). The global tracking URI is set too: MLflow's SQL
    registry resolves a ``models:/<model_id>`` source through the global client."""
    import mlflow

    from .tracking import check_reachable

    check_reachable(uri)
    mlflow.set_tracking_uri(uri)
    return mlflow.MlflowClient(tracking_uri=uri)


def client_for(cfg: "Config") -> "MlflowClient":
    from .tracking import resolve_uri

    return connect(resolve_uri(cfg.tracking)[0])


def _code(err: Exception) -> str:
    return getattr(err, "error_code", "")


def _missing(err: Exception) -> bool:
    return _code(err) in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND")


def _ensure_registered_model(client: "MlflowClient", name: str, description: str = "",
                             tags: Optional[dict] = None) -> bool:
    """Create ``name`` unless it exists; True when this call created it. Safe against a concurrent creator."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
        return False
    except MlflowException as err:
        if not _missing(err):
            raise
    try:
        client.create_registered_model(name, tags=tags, description=description or None)
        return True
    except MlflowException as err:
        if _code(err) in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
            return False
        raise


def registered_model(client: "MlflowClient", name: str) -> Any:
    """The registered model, or a one-line error naming the models that do exist."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_registered_model(name)
    except MlflowException as err:
        if not _missing(err):
            raise
    names = [m.name for m in client.search_registered_models(max_results=1000) if not _is_lock(m)]
    raise MaxoutError(f"no registered model {name!r} in the registry (registered: {', '.join(names) or 'none'})")


def model_version(client: "MlflowClient", name: str, ref: str) -> Any:
    """Version ``ref`` (a number or an alias) of ``name``, or a one-line error listing what exists."""
    from mlflow.exceptions import MlflowException

    model = registered_model(client, name)
    number = str(ref) if str(ref).isdigit() else model.aliases.get(ref)  # an unknown alias is not an error code
    if number is not None:                                                 # MLflow keeps stable across stores
        try:
            return client.get_model_version(name, str(number))
        except MlflowException as err:
            if not _missing(err):
                raise
    versions = sorted(int(v.version) for v in _versions(client, name))
    aliases = ", ".join(f"{a} (v{v})" for a, v in sorted(model.aliases.items())) or "none"
    what = f"no version {ref}" if str(ref).isdigit() else f"no alias {ref!r}"
    raise MaxoutError(f"registered model {name!r} has {what} (aliases: {aliases}; versions: "
                      f"{', '.join(map(str, versions)) or 'none'})")


def _versions(client: "MlflowClient", name: str) -> list:
    out, token = [], None
    while True:
        page = client.search_model_versions(f"name='{name}'", max_results=1000, page_token=token)
        out += list(page)
        token = page.token
        if not token:
            return out


def _is_lock(model: Any) -> bool:
    return model.name.endswith(LOCK_SUFFIX) and "maxout.lock_for" in (model.tags or {})


def _history(model: Any) -> list[int]:
    try:
        return [int(v) for v in json.loads(model.tags.get(HISTORY_TAG, "[]"))]
    except (ValueError, TypeError):
        return []


def _alias(model: Any, alias: str) -> Optional[int]:
    version = model.aliases.get(alias)
    return int(version) if version is not None else None


# ------------------------------------------------------------------------------------------------ the lock


class PromotionLock:
    """A mutex over ``NAME``'s aliases, kept in the registry (see the module docstring for why tickets).

    ``with PromotionLock(client, name): ...`` waits up to ``timeout_s`` for the lock. A ticket that its owner has
    not refreshed for ``ttl_s`` (its process died) is deleted by the next waiter. Ages are measured on the
    store's clock (``last_updated_timestamp``), never compared with this machine's wall clock.
    """

    def __init__(self, client: "MlflowClient", name: str, ttl_s: float = 120.0, timeout_s: float = 300.0,
                 poll_s: float = 0.2):
        self.client, self.name, self.lock_name = client, name, name + LOCK_SUFFIX
        self.ttl_ms, self.timeout_s, self.poll_s = ttl_s * 1000.0, timeout_s, poll_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.ticket: Optional[int] = None
        self._store_ms = 0.0  # the store's clock at our last refresh...
        self._local_s = 0.0  # ...and our monotonic clock at the same moment

    def __enter__(self) -> "PromotionLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def _store_now(self) -> float:
        return self._store_ms + (time.monotonic() - self._local_s) * 1000.0

    def _touch(self, state: str) -> None:
        version = self.client.update_model_version(self.lock_name, str(self.ticket),
                                                   description=f"{state} by {self.owner}")
        self._store_ms, self._local_s = float(version.last_updated_timestamp), time.monotonic()

    def acquire(self) -> None:
        _ensure_registered_model(self.client, self.lock_name, tags={"maxout.lock_for": self.name},
                                 description=f"maxout's promotion lock for {self.name!r}: each live version is a "
                                             f"ticket (the lowest holds the lock). Safe to ignore.")
        version = self.client.create_model_version(self.lock_name, source=LOCK_SOURCE + self.name,
                                                   tags={"maxout.lock.owner": self.owner}, await_creation_for=0)
        self.ticket = int(version.version)
        self._store_ms, self._local_s = float(version.last_updated_timestamp), time.monotonic()
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                ahead = [v for v in _versions(self.client, self.lock_name) if int(v.version) < self.ticket]
                if not ahead:
                    self._touch("held")  # the holder's lease starts now, not when it queued
                    return
                if (self._store_now() - self._store_ms) > self.ttl_ms / 4:
                    self._touch("waiting")
                for ticket in ahead:
                    if self._store_now() - ticket.last_updated_timestamp > self.ttl_ms:
                        self._break(ticket)
                if time.monotonic() > deadline:
                    head = min(ahead, key=lambda v: int(v.version))
                    raise MaxoutError(
                        f"timed out after {self.timeout_s:g}s waiting for the promotion lock of {self.name!r}, "
                        f"held by {head.tags.get('maxout.lock.owner', '?')} (ticket {head.version} of "
                        f"{self.lock_name}); a dead holder's ticket is broken after registry.lock_ttl_s="
                        f"{self.ttl_ms / 1000:g}s")
                # Poll less the further back in the queue: the holder's own calls must not queue behind ours.
                time.sleep(min(self.poll_s * len(ahead), 2.0) * (0.5 + random.random()))
        except BaseException:
            self.release()
            raise

    def _break(self, ticket: Any) -> None:
        from mlflow.exceptions import MlflowException

        print(f"maxout: breaking the stale promotion lock ticket {ticket.version} of {self.lock_name} "
              f"(owner {ticket.tags.get('maxout.lock.owner', '?')}, not refreshed for "
              f"{(self._store_now() - ticket.last_updated_timestamp) / 1000:.0f}s)", file=sys.stderr)
        try:
            self.client.delete_model_version(self.lock_name, ticket.version)
        except MlflowException as err:
            if not _missing(err):  # another waiter broke it first
                raise

    def check(self) -> None:
        """Raise if our ticket was broken (we stalled past the TTL): another promoter may hold the lock now."""
        if not _exists(self.client, self.lock_name, self.ticket):
            raise MaxoutError(f"the promotion lock of {self.name!r} was broken while held (this process "
                              f"stalled longer than registry.lock_ttl_s={self.ttl_ms / 1000:g}s)")

    def release(self) -> None:
        """Never raises: a ticket that cannot be deleted (store unreachable) goes stale and is broken later,
        while raising here would turn a completed promotion into a failed one."""
        if self.ticket is None:
            return
        try:
            self.client.delete_model_version(self.lock_name, str(self.ticket))
        except Exception as err:  # noqa: BLE001
            if not _missing(err):
                print(f"maxout: warning: could not release promotion lock ticket {self.ticket} of "
                      f"{self.lock_name} ({type(err).__name__}); it is broken after registry.lock_ttl_s="
                      f"{self.ttl_ms / 1000:g}s", file=sys.stderr)
        self.ticket = None


# --------------------------------------------------------------------------------------- alias transactions


class _AliasTransaction:
    """Alias and history writes that are undone together if any of them (or anything after) fails.

    Used only under the promotion lock, so the snapshot taken at entry is still the state to go back to.
    ``with tx:`` around the writes undoes them when the block raises."""

    def __init__(self, client: "MlflowClient", name: str):
        self.client, self.name = client, name
        model = client.get_registered_model(name)
        self.before = {a: _alias(model, a) for a in (CHAMPION, CHALLENGER)}
        self.history = _history(model)
        self._history_written = False

    def set_alias(self, alias: str, version: int) -> None:
        self.client.set_registered_model_alias(self.name, alias, str(version))

    def set_champion(self, version: int) -> None:
        history = (self.history + [version])[-HISTORY_KEEP:]
        self.set_history(history)
        self.set_alias(CHAMPION, version)

    def set_history(self, history: list[int]) -> None:
        self._history_written = True
        self.client.set_registered_model_tag(self.name, HISTORY_TAG, json.dumps(history))

    def __enter__(self) -> "_AliasTransaction":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc_type is not None:
            self.undo()
        return False  # the error that got us here is the one reported

    def undo(self) -> None:
        """Put aliases and history back; never raises, so the error that got us here is the one reported."""
        try:
            for alias, version in self.before.items():
                if version is not None:
                    self.client.set_registered_model_alias(self.name, alias, str(version))
                else:
                    self._drop_alias(alias)
            if self._history_written:
                self.client.set_registered_model_tag(self.name, HISTORY_TAG, json.dumps(self.history))
        except Exception as err:  # noqa: BLE001
            print(f"maxout: warning: could not restore the aliases of {self.name} ({type(err).__name__}); they "
                  f"were {self.before}, champion history {self.history}", file=sys.stderr)

    def _drop_alias(self, alias: str) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.delete_registered_model_alias(self.name, alias)
        except MlflowException as err:
            if not _missing(err):
                raise


# -------------------------------------------------------------------------------------------- promotion


def metric_of(client: "MlflowClient", version: Any, metric: str) -> Optional[float]:
    """A version's value of ``metric``: its own tag when registered with that metric, else its run's metric."""
    from mlflow.exceptions import MlflowException

    if version.tags.get("maxout.metric") == metric and "maxout.metric_value" in version.tags:
        return float(version.tags["maxout.metric_value"])
    if version.run_id:
        try:
            return client.get_run(version.run_id).data.metrics.get(metric)
        except MlflowException:
            return None
    return None


def beats(new: float, old: float, direction: str) -> bool:
    """Strictly better: a tie keeps the champion."""
    return new > old if direction == "maximize" else new < old


def _decide(client: "MlflowClient", name: str, version: int, value: float, metric: str, direction: str,
            champion: Optional[int]) -> tuple[bool, str]:
    better, worse = (">", "<=") if direction == "maximize" else ("<", ">=")
    if not math.isfinite(value):
        return False, (f"kept v{champion}" if champion else "no champion") + f": {metric} is {value}"
    if champion is None:
        return True, f"champion: first champion ({metric} {value:.6g})"
    old = metric_of(client, client.get_model_version(name, str(champion)), metric)
    if old is None or not math.isfinite(old):
        return False, (f"kept v{champion}: the champion has no {metric} to compare with; promote by hand: "
                       f"maxout registry promote {name} {version}")
    if beats(value, old, direction):
        return True, f"champion: {metric} {value:.6g} {better} {old:.6g} (was v{champion})"
    return False, f"kept v{champion}: {metric} {value:.6g} {worse} {old:.6g}"


def promote_if_better(client: "MlflowClient", name: str, version: int, value: float, metric: str,
                      direction: str, lock: PromotionLock, run_id: Optional[str] = None) -> Outcome:
    """Under ``lock``: move ``challenger`` to ``version`` (if it is the newest) and ``champion`` if it beats the
    champion; tag the version (and its run) with the reason. All-or-nothing: a failure restores the aliases."""
    tx = _AliasTransaction(client, name)
    champion = tx.before[CHAMPION]
    with tx:
        wins, reason = _decide(client, name, version, value, metric, direction, champion)
        if tx.before[CHALLENGER] is None or version > tx.before[CHALLENGER]:
            tx.set_alias(CHALLENGER, version)
        client.set_model_version_tag(name, str(version), PROMOTION_TAG, reason)
        if wins:
            lock.check()  # the last moment to find out that a stall cost us the lock
            tx.set_champion(version)
        if run_id:
            _tag_run(client, run_id, name, version, reason)
    return Outcome(name, version, version if wins else champion, champion, reason)


def _tag_run(client: "MlflowClient", run_id: str, name: str, version: int, reason: str) -> None:
    from mlflow.entities import RunTag

    client.log_batch(run_id, tags=[RunTag("maxout.registry.model", name),
                                   RunTag("maxout.registry.version", str(version)), RunTag(PROMOTION_TAG, reason)])


def register(client: "MlflowClient", name: str, model_uri: str, run_id: Optional[str] = None,
             tags: Optional[dict] = None) -> int:
    """Create a version of ``name`` from a logged model's ``model_uri`` (``models:/m-...``) with ``tags``, in one
    store call (so never a version without its tags); returns the version number."""
    from mlflow.exceptions import MlflowException

    check_name(name)
    logged = LOGGED_MODEL_URI.match(model_uri)
    model_id = logged[1] if logged else None  # a tracking server wants it with a models:/<model_id> source
    if model_id:  # fail before creating anything when the logged model does not exist
        try:
            client.get_logged_model(model_id)
        except MlflowException as err:
            raise MaxoutError(f"cannot register {model_uri!r}: no such logged model in the tracking store "
                              f"({str(err).splitlines()[0][:200]})") from None
    created = _ensure_registered_model(client, name, description="Registered by maxout; aliases: champion "
                                                                 "(the best so far), challenger (the newest).")
    try:
        version = client.create_model_version(name, source=model_uri, run_id=run_id, tags=tags,
                                              model_id=model_id, await_creation_for=0)
    except BaseException:
        if created and not _versions(client, name):  # leave no empty model behind that we made
            client.delete_registered_model(name)
        raise
    return int(version.version)


def version_tags(run_id: str, metric: str, value: float, direction: str, dataset_fingerprint: str,
                 hardware_profile: str) -> dict[str, str]:
    return {"maxout.run_id": run_id, "maxout.data_fingerprint": dataset_fingerprint, "maxout.metric": metric,
            "maxout.metric_value": repr(float(value)), "maxout.direction": direction,
            "maxout.hardware_profile": hardware_profile}


def register_and_promote(run_id: str, model_uri: str, metric_value: float, cfg: "Config",
                         dataset_fingerprint: str, hardware_profile: str,
                         client: Optional["MlflowClient"] = None) -> Outcome:
    """Register a trained model under ``cfg.registry.name`` and promote it if it beats the champion.

    Args:
        run_id: the MLflow run that logged the model (tagged with the outcome: ``maxout.promotion``).
        model_uri: the logged model's URI, ``models:/m-...`` (``TrainResult.model_uri``, the run's tag
            ``maxout.model_uri``); not a ``runs:/`` path.
        metric_value: the model's value of ``cfg.registry.metric`` (e.g. ``TrainResult.metrics["eval/macro_f1"]``),
            compared with the champion's in the direction ``cfg.registry.direction``.
        cfg: the run's config: ``registry`` (name, metric, direction, lock settings) and ``tracking`` (the store).
        dataset_fingerprint: the run's param ``derived.data_fingerprint``.
        hardware_profile: the hardware profile the model was trained with (``cfg.hardware.name``).
        client: an MlflowClient for the store; default: the one ``cfg.tracking`` resolves to.

    Returns the :class:`Outcome`. On any failure nothing is left half-written: the new version is deleted, the
    aliases are as before, and the lock is released.
    """
    reg = cfg.registry
    if not reg.name:
        raise ConfigError("registry.name is not set: set registry.name=NAME to register models")
    client = client or client_for(cfg)
    tags = version_tags(run_id, reg.metric, metric_value, reg.direction, dataset_fingerprint, hardware_profile)
    version = register(client, reg.name, model_uri, run_id=run_id, tags=tags)
    try:
        with PromotionLock(client, reg.name, ttl_s=reg.lock_ttl_s, timeout_s=reg.lock_timeout_s) as lock:
            return promote_if_better(client, reg.name, version, float(metric_value), reg.metric, reg.direction,
                                     lock, run_id=run_id)
    except BaseException:
        _discard(client, reg.name, version)
        raise


def _discard(client: "MlflowClient", name: str, version: int) -> None:
    """Delete a version whose promotion failed; a failure here must not hide the error that got us here."""
    try:
        client.delete_model_version(name, str(version))
    except Exception as err:  # noqa: BLE001
        print(f"maxout: warning: could not delete {name} v{version} after its promotion failed "
              f"({type(err).__name__}: {str(err).splitlines()[0][:200]}); delete it by hand", file=sys.stderr)


def check_train(cfg: "Config", metrics: tuple[str, ...]) -> None:
    """Before training: registration needs a tracked, logged model and a metric the trainer reports."""
    check_name(cfg.registry.name)
    if cfg.tracking.backend != "mlflow" or not cfg.tracking.log_model:
        raise ConfigError(f"registry.name={cfg.registry.name!r} needs a logged model: use tracking=local or "
                          f"tracking=server with tracking.log_model=true (got tracking={cfg.tracking.name}, "
                          f"log_model={cfg.tracking.log_model})")
    if cfg.registry.metric not in metrics:
        raise ConfigError(f"registry.metric={cfg.registry.metric!r} is not a metric the trainer reports "
                          f"(valid: {', '.join(metrics)})")


def register_train_result(cfg: "Config", result: Any) -> Outcome:
    """``register_and_promote`` for a ``train()`` result (what ``maxout train registry.name=NAME`` does)."""
    if cfg.registry.metric not in result.metrics:
        raise MaxoutError(f"run {result.run_id} has no metric {cfg.registry.metric!r} to register with "
                          f"(has: {', '.join(sorted(k for k in result.metrics if k.startswith('eval/')))})")
    return register_and_promote(result.run_id, result.model_uri, result.metrics[cfg.registry.metric], cfg,
                                result.params.get("derived.data_fingerprint", ""), cfg.hardware.name)


# ------------------------------------------------------------------------------------ by-hand operations


def promote(client: "MlflowClient", name: str, version: int) -> Outcome:
    """Make ``version`` champion by hand (no metric comparison), recorded in the history like any promotion."""
    target = model_version(client, name, str(version))
    version = int(target.version)
    with PromotionLock(client, name) as lock:
        tx = _AliasTransaction(client, name)
        was = tx.before[CHAMPION]
        if was == version:
            return Outcome(name, version, version, was, f"v{version} already is {CHAMPION}")
        reason = f"champion: promoted by hand (was v{was})" if was else "champion: promoted by hand"
        with tx:
            client.set_model_version_tag(name, str(version), PROMOTION_TAG, reason)
            lock.check()
            tx.set_champion(version)
    return Outcome(name, version, version, was, reason)


def rollback(client: "MlflowClient", name: str) -> Outcome:
    """Move ``champion`` back to the champion before the current one (from ``maxout.champion_history``)."""
    registered_model(client, name)
    with PromotionLock(client, name) as lock:
        tx = _AliasTransaction(client, name)
        current = tx.before[CHAMPION]
        history = list(tx.history)
        while history and (history[-1] == current or not _exists(client, name, history[-1])):
            history.pop()  # the current champion, and versions deleted since they were champion
        if not history:
            raise MaxoutError(f"registered model {name!r} has no previous champion to roll back to "
                              f"(champion: {f'v{current}' if current else 'none'}; history: {tx.history})")
        target = history[-1]
        reason = f"champion: rolled back from v{current}" if current else "champion: rolled back"
        with tx:
            client.set_model_version_tag(name, str(target), PROMOTION_TAG, reason)
            lock.check()
            tx.set_history(history)
            tx.set_alias(CHAMPION, target)
    return Outcome(name, target, target, current, reason)


def _exists(client: "MlflowClient", name: str, version: int) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        client.get_model_version(name, str(version))
        return True
    except MlflowException as err:
        if _missing(err):
            return False
        raise


def rows(client: "MlflowClient", name: Optional[str] = None) -> Iterator[dict]:
    """What ``maxout registry list`` prints: registered models, or one model's versions (newest first)."""
    if name is None:
        for model in client.search_registered_models(max_results=1000):
            if not _is_lock(model):
                yield {"name": model.name, CHAMPION: _fmt(_alias(model, CHAMPION)),
                       CHALLENGER: _fmt(_alias(model, CHALLENGER)),
                       "versions": str(len(_versions(client, model.name)))}
        return
    aliases: dict[str, list[str]] = {}
    for alias, version in registered_model(client, name).aliases.items():
        aliases.setdefault(str(version), []).append(alias)
    for v in sorted(_versions(client, name), key=lambda v: -int(v.version)):
        tags = v.tags
        yield {"version": f"v{v.version}", "aliases": ",".join(sorted(aliases.get(str(v.version), []))) or "-",
               "metric": f"{tags.get('maxout.metric', '-')}={float(tags['maxout.metric_value']):.4g}"
               if "maxout.metric_value" in tags else "-",
               "run": v.run_id or "-", "data": tags.get("maxout.data_fingerprint", "-")[:12],
               "hardware": tags.get("maxout.hardware_profile", "-"), "promotion": tags.get(PROMOTION_TAG, "-")}


def _fmt(version: Optional[int]) -> str:
    return f"v{version}" if version is not None else "-"

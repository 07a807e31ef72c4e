"""Model registry: register a trained model, promote it only if it beats the champion, roll back.

MLflow 3 deprecates stages, so maxout uses aliases (``models:/NAME@champion``):

- every new version gets ``challenger`` (the alias always names the newest registered version);
- ``champion`` moves to the new version only if it beats the current champion on ``registry.metric``
  (direction-aware; ties keep the champion). Why it moved or not is written on the version and on the run
  (tag ``maxout.promotion``, e.g. ``champion: eval/macro_f1 0.81 > 0.78 (was v3)`` or ``kept v3: ...``);
- the registered model's tag ``maxout.champion_history`` lists the champions in order, so ``rollback`` knows
  which version was champion before.

Every alias change runs under the registry's promotion lock (lock/: taken from the store, leaving nothing in
the registry), so concurrent promoters never race.

Registration is all-or-nothing: a version is created with all its tags in one call (one store transaction), and
if promotion fails afterwards (lock timeout, a store error) the aliases and history are restored and the new
version is deleted, so no version is left without its promotion, and the lock is released. A tracking
server that stops answering during registration is one line that says how to register the run later
(``maxout registry register NAME RUN_ID``, ``register_run``): the run and its model are kept.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Optional

import requests
from mlflow import MlflowClient
from mlflow.entities import RunTag
from mlflow.exceptions import MlflowException

from ..config import EVAL_METRICS, Config, check_registry_name
from ..errors import ConfigError, MaxoutError, first_line
from ..tracking.spool import unreachable
from .client import (CHALLENGER, CHAMPION, LOGGED_MODEL_URI, PROMOTION_TAG, check_ready, client_for,
                     ensure_registered_model, exists, model_version, registered_model, all_versions)
from .lock import PromotionLock, promotion_lock
from .transaction import AliasTransaction



@dataclass
class Outcome:
    """What registration and promotion did."""

    name: str
    version: int
    champion_version: Optional[int]  # who holds champion now
    previous_champion: Optional[int]
    reason: str  # also the ``maxout.promotion`` tag of the version and the run
    registered: bool = True  # False: the run had a version already (register_run), nothing was done

    @property
    def promoted(self) -> bool:
        return self.registered and self.champion_version == self.version

    def summary(self) -> str:
        return f"registered {self.name} v{self.version}; {self.reason}" if self.registered else self.reason


def metric_of(client: MlflowClient, version: Any, metric: str) -> Optional[float]:
    """A version's value of ``metric``: its own tag when registered with that metric, else its run's metric."""
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


def _decide(client: MlflowClient, name: str, version: int, value: float, metric: str, direction: str,
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


def promote_if_better(client: MlflowClient, name: str, version: int, value: float, metric: str,
                      direction: str, lock: PromotionLock, run_id: Optional[str] = None) -> Outcome:
    """Under ``lock``: move ``challenger`` to ``version`` (if it is the newest) and ``champion`` if it beats the
    champion; tag the version (and its run) with the reason. All-or-nothing: a failure restores the aliases."""
    tx = AliasTransaction(client, name)
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


def _tag_run(client: MlflowClient, run_id: str, name: str, version: int, reason: str) -> None:
    client.log_batch(run_id, tags=[RunTag("maxout.registry.model", name),
                                   RunTag("maxout.registry.version", str(version)), RunTag(PROMOTION_TAG, reason)])


def register(client: MlflowClient, name: str, model_uri: str, run_id: Optional[str] = None,
             tags: Optional[dict] = None) -> int:
    """Create a version of ``name`` from a logged model's ``model_uri`` (``models:/m-...``) with ``tags``, in one
    store call (so never a version without its tags); returns the version number."""
    check_registry_name(name)
    logged = LOGGED_MODEL_URI.match(model_uri)
    model_id = logged[1] if logged else None  # a tracking server wants it with a models:/<model_id> source
    # Fail before creating anything when the logged model does not exist, or never finished logging.
    check_ready(client, model_id, f"cannot register {model_uri!r}")
    created = ensure_registered_model(client, name, description="Registered by maxout; aliases: champion "
                                                                 "(the best so far), challenger (the newest).")
    try:
        version = client.create_model_version(name, source=model_uri, run_id=run_id, tags=tags,
                                              model_id=model_id, await_creation_for=0)
    except BaseException:
        if created and not all_versions(client, name):  # leave no empty model behind that we made
            client.delete_registered_model(name)
        raise
    return int(version.version)


def version_tags(run_id: str, metric: str, value: float, direction: str, dataset_fingerprint: str,
                 hardware_profile: str) -> dict[str, str]:
    return {"maxout.run_id": run_id, "maxout.data_fingerprint": dataset_fingerprint, "maxout.metric": metric,
            "maxout.metric_value": repr(float(value)), "maxout.direction": direction,
            "maxout.hardware_profile": hardware_profile}


def register_and_promote(run_id: str, model_uri: str, metric_value: float, cfg: Config,
                         dataset_fingerprint: str, hardware_profile: str,
                         client: Optional[MlflowClient] = None) -> Outcome:
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
    tags = version_tags(run_id, reg.metric, metric_value, reg.direction, dataset_fingerprint, hardware_profile)
    try:
        client = client or client_for(cfg)
    except MaxoutError as err:  # the server does not answer (store.check_reachable)
        raise _not_registered(run_id, cfg, err) from None
    try:
        version = register(client, reg.name, model_uri, run_id=run_id, tags=tags)
        try:
            with promotion_lock(client, reg.name, ttl_s=reg.lock_ttl_s, timeout_s=reg.lock_timeout_s) as lock:
                return promote_if_better(client, reg.name, version, float(metric_value), reg.metric, reg.direction,
                                         lock, run_id=run_id)
        except BaseException:
            _discard(client, reg.name, version)
            raise
    except (MlflowException, requests.RequestException) as err:
        if not unreachable(err):
            raise
        raise _not_registered(run_id, cfg, err) from err


def _not_registered(run_id: str, cfg: Config, err: Exception) -> MaxoutError:
    """The server went away during registration: the run and its model are kept, one command registers it."""
    reg = cfg.registry
    return MaxoutError(f"registering the model of run {run_id} as {reg.name!r} failed, the tracking server did not "
                       f"answer ({first_line(err)[:300]}); run {run_id} is FINISHED with its model; register it when "
                       f"the server is back: maxout registry register {reg.name} {run_id} --metric {reg.metric} "
                       f"--direction {reg.direction}")


def register_run(cfg: Config, run_id: str, client: Optional[MlflowClient] = None) -> Outcome:
    """Register a finished run's logged model under ``cfg.registry`` (name, metric, direction) and promote it if it
    is better: ``maxout registry register NAME RUN_ID``, e.g. after the server was away when the run tried. A run
    that has a version of NAME already is not registered twice."""
    reg = cfg.registry
    client = client or client_for(cfg)
    try:
        run = client.get_run(run_id)
    except MlflowException as err:
        raise MaxoutError(f"run {run_id!r} is not in the tracking store ({first_line(err)[:200]}); give the id "
                          f"`maxout train` printed") from None
    model_uri = run.data.tags.get("maxout.model_uri")
    if not model_uri:
        raise MaxoutError(f"run {run_id} has no logged model to register (no maxout.model_uri tag; status "
                          f"{run.info.status}): only a finished run that logged its model can be registered")
    done = client.search_model_versions(f"name='{reg.name}' and run_id='{run_id}'")
    if done:
        version = int(done[0].version)
        return Outcome(reg.name, version, None, None, f"run {run_id} is registered already as {reg.name} v{version}",
                       registered=False)
    value = run.data.metrics.get(reg.metric)
    if value is None:
        raise MaxoutError(f"run {run_id} has no metric {reg.metric!r} (has: "
                          f"{', '.join(sorted(k for k in run.data.metrics if k.startswith('eval/')))}); pass --metric")
    return register_and_promote(run_id, model_uri, value, cfg, run.data.params.get("derived.data_fingerprint", ""),
                                run.data.tags.get("maxout.hardware_profile", ""), client=client)


def _discard(client: MlflowClient, name: str, version: int) -> None:
    """Delete a version whose promotion failed; a failure here must not hide the error that got us here."""
    try:
        client.delete_model_version(name, str(version))
    except Exception as err:  # noqa: BLE001
        print(f"maxout: warning: could not delete {name} v{version} after its promotion failed "
              f"({type(err).__name__}: {str(err).splitlines()[0][:200]}); delete it by hand", file=sys.stderr)


def check_train(cfg: Config) -> None:
    """Before training with ``registry.name`` set (a valid name: the typed config checked it): registration needs
    a tracked, logged model and a metric the trainer reports."""
    if cfg.tracking.backend != "mlflow" or not cfg.tracking.log_model:
        raise ConfigError(f"registry.name={cfg.registry.name!r} needs a logged model: use tracking=local or "
                          f"tracking=server with tracking.log_model=true (got tracking={cfg.tracking.name}, "
                          f"log_model={cfg.tracking.log_model})")
    if cfg.registry.metric not in EVAL_METRICS:
        raise ConfigError(f"registry.metric={cfg.registry.metric!r} is not a metric the trainer reports "
                          f"(valid: {', '.join(EVAL_METRICS)})")


def register_train_result(cfg: Config, result: Any) -> Outcome:
    """``register_and_promote`` for a ``train()`` result (what ``maxout train registry.name=NAME`` does)."""
    if cfg.registry.metric not in result.metrics:
        raise MaxoutError(f"run {result.run_id} has no metric {cfg.registry.metric!r} to register with "
                          f"(has: {', '.join(sorted(k for k in result.metrics if k.startswith('eval/')))})")
    return register_and_promote(result.run_id, result.model_uri, result.metrics[cfg.registry.metric], cfg,
                                result.params.get("derived.data_fingerprint", ""), cfg.hardware.name)


# ------------------------------------------------------------------------------------ by-hand operations


def promote(client: MlflowClient, name: str, version: int) -> Outcome:
    """Make ``version`` champion by hand (no metric comparison), recorded in the history like any promotion."""
    target = model_version(client, name, str(version))
    check_ready(client, getattr(target, "model_id", None), f"{name} v{target.version}")
    version = int(target.version)
    with promotion_lock(client, name) as lock:
        tx = AliasTransaction(client, name)
        was = tx.before[CHAMPION]
        if was == version:
            return Outcome(name, version, version, was, f"v{version} already is {CHAMPION}")
        reason = f"champion: promoted by hand (was v{was})" if was else "champion: promoted by hand"
        with tx:
            client.set_model_version_tag(name, str(version), PROMOTION_TAG, reason)
            lock.check()
            tx.set_champion(version)
    return Outcome(name, version, version, was, reason)


def rollback(client: MlflowClient, name: str) -> Outcome:
    """Move ``champion`` back to the champion before the current one (from ``maxout.champion_history``)."""
    registered_model(client, name)
    with promotion_lock(client, name) as lock:
        tx = AliasTransaction(client, name)
        current = tx.before[CHAMPION]
        history = list(tx.history)
        while history and (history[-1] == current or not exists(client, name, history[-1])):
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

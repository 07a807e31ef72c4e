"""The registry as maxout reads it: a client for a tracking URI, registered models and versions looked up with
one-line errors that list what does exist, the aliases and champion history kept on a model, and the table
``maxout registry list`` prints.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterator, Optional

import mlflow
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from ..config import Config
from ..errors import MaxoutError
from ..tracking.store import check_reachable, ensure_schema, resolve_uri

CHAMPION, CHALLENGER = "champion", "challenger"
LOGGED_MODEL_URI = re.compile(r"^models:/(m-[0-9a-f]+)$")  # what log_model returns in MLflow 3
HISTORY_TAG = "maxout.champion_history"
PROMOTION_TAG = "maxout.promotion"
LEGACY_LOCK_SUFFIX = ".lock"  # older releases kept the promotion lock of NAME in a registered model NAME.lock


def connect(uri: str) -> MlflowClient:
    """A client for the registry at ``uri`` (the tracking URI). The global tracking URI is set too: MLflow's SQL
    registry resolves a ``models:/<model_id>`` source through the global client."""
    check_reachable(uri)
    ensure_schema(uri)  # registry commands may start together with training jobs on a new SQLite store
    mlflow.set_tracking_uri(uri)
    return mlflow.MlflowClient(tracking_uri=uri)


def client_for(cfg: Config) -> MlflowClient:
    return connect(resolve_uri(cfg.tracking)[0])


def error_code(err: Exception) -> str:
    return getattr(err, "error_code", "")


def missing(err: Exception) -> bool:
    return error_code(err) in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND")


def ensure_registered_model(client: MlflowClient, name: str, description: str = "",
                             tags: Optional[dict] = None) -> bool:
    """Create ``name`` unless it exists; True when this call created it. Safe against a concurrent creator."""
    try:
        client.get_registered_model(name)
        return False
    except MlflowException as err:
        if not missing(err):
            raise
    try:
        client.create_registered_model(name, tags=tags, description=description or None)
        return True
    except MlflowException as err:
        if error_code(err) in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
            return False
        raise


def registered_model(client: MlflowClient, name: str) -> Any:
    """The registered model, or a one-line error naming the models that do exist."""
    try:
        return client.get_registered_model(name)
    except MlflowException as err:
        if not missing(err):
            raise
    names = [m.name for m in client.search_registered_models(max_results=1000) if not is_lock(m)]
    raise MaxoutError(f"no registered model {name!r} in the registry (registered: {', '.join(names) or 'none'})")


def model_version(client: MlflowClient, name: str, ref: str) -> Any:
    """Version ``ref`` (a number or an alias) of ``name``, or a one-line error listing what exists."""
    model = registered_model(client, name)
    number = str(ref) if str(ref).isdigit() else model.aliases.get(ref)  # an unknown alias is not an error code
    if number is not None:                                                 # MLflow keeps stable across stores
        try:
            return client.get_model_version(name, str(number))
        except MlflowException as err:
            if not missing(err):
                raise
    versions = sorted(int(v.version) for v in all_versions(client, name))
    aliases = ", ".join(f"{a} (v{v})" for a, v in sorted(model.aliases.items())) or "none"
    what = f"no version {ref}" if str(ref).isdigit() else f"no alias {ref!r}"
    raise MaxoutError(f"registered model {name!r} has {what} (aliases: {aliases}; versions: "
                      f"{', '.join(map(str, versions)) or 'none'})")


def check_ready(client: MlflowClient, model_id: Optional[str], what: str) -> None:
    """Only a logged model whose logging finished (status READY) may be predicted with, registered or promoted:
    PENDING is one still being logged or cut off (a SIGKILL), FAILED one whose logging failed or was interrupted.
    ``model_id`` None (a version registered from a ``runs:/`` path) has no such status to check."""
    if not model_id:
        return
    try:
        status = str(client.get_logged_model(model_id).status)
    except MlflowException as err:
        if not missing(err):
            raise
        raise MaxoutError(f"{what}: no such logged model {model_id} in the tracking store") from None
    if status != "READY":
        why = ("its logging failed or was interrupted" if status == "FAILED" else
               "its logging has not finished: still under way, or cut off")
        raise MaxoutError(f"{what} is not usable: its logged model {model_id} is {status} ({why}); use a model "
                          f"that finished logging, or train again (resume=auto logs the model of an interrupted run)")


def all_versions(client: MlflowClient, name: str) -> list:
    out, token = [], None
    while True:
        page = client.search_model_versions(f"name='{name}'", max_results=1000, page_token=token)
        out += list(page)
        token = page.token
        if not token:
            return out


def is_lock(model: Any) -> bool:
    """An old-style lock model (lock.remove_legacy_lock deletes them); a user's own NAME.lock has no such tag."""
    return model.name.endswith(LEGACY_LOCK_SUFFIX) and "maxout.lock_for" in (model.tags or {})


def champion_history(model: Any) -> list[int]:
    try:
        return [int(v) for v in json.loads(model.tags.get(HISTORY_TAG, "[]"))]
    except (ValueError, TypeError):
        return []


def alias_version(model: Any, alias: str) -> Optional[int]:
    version = model.aliases.get(alias)
    return int(version) if version is not None else None


def exists(client: MlflowClient, name: str, version: int) -> bool:
    try:
        client.get_model_version(name, str(version))
        return True
    except MlflowException as err:
        if missing(err):
            return False
        raise


def rows(client: MlflowClient, name: Optional[str] = None) -> Iterator[dict]:
    """What ``maxout registry list`` prints: registered models, or one model's versions (newest first)."""
    if name is None:
        for model in client.search_registered_models(max_results=1000):
            if not is_lock(model):
                yield {"name": model.name, CHAMPION: _fmt(alias_version(model, CHAMPION)),
                       CHALLENGER: _fmt(alias_version(model, CHALLENGER)),
                       "versions": str(len(all_versions(client, model.name)))}
        return
    aliases: dict[str, list[str]] = {}
    for alias, version in registered_model(client, name).aliases.items():
        aliases.setdefault(str(version), []).append(alias)
    for v in sorted(all_versions(client, name), key=lambda v: -int(v.version)):
        tags = v.tags
        yield {"version": f"v{v.version}", "aliases": ",".join(sorted(aliases.get(str(v.version), []))) or "-",
               "metric": f"{tags.get('maxout.metric', '-')}={float(tags['maxout.metric_value']):.4g}"
               if "maxout.metric_value" in tags else "-",
               "run": v.run_id or "-", "data": tags.get("maxout.data_fingerprint", "-")[:12],
               "hardware": tags.get("maxout.hardware_profile", "-"), "promotion": tags.get(PROMOTION_TAG, "-")}


def _fmt(version: Optional[int]) -> str:
    return f"v{version}" if version is not None else "-"


def registry_uri(client: MlflowClient) -> str:
    """The URI of ``client``'s registry (MlflowClient keeps it as ``_registry_uri``; it defaults to the tracking
    URI, which is what maxout's clients use: registry.client.connect)."""
    return str(getattr(client, "_registry_uri", None) or client.tracking_uri)

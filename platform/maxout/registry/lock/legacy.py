"""The old lock's registered models (``NAME.lock``): deleted on first use, or all at once by a command."""

from __future__ import annotations

import sys

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from ..client import LEGACY_LOCK_SUFFIX, is_lock, missing, registry_uri


def remove_legacy_lock(client: MlflowClient, name: str) -> bool:
    """Delete ``NAME.lock``, the registered model the old lock kept its tickets in (tagged ``maxout.lock_for``);
    True if there was one. Called under the new lock on first use. A promoter of the old code still queued there
    finds its ticket gone and stops with "broken while held", writing nothing; old and new code never shared a
    lock, so upgrade every promoter of a registry together."""
    try:
        model = client.get_registered_model(name + LEGACY_LOCK_SUFFIX)
    except MlflowException as err:
        if missing(err):
            return False
        raise
    if not is_lock(model):
        return False  # a user's own model that happens to end in .lock
    try:
        client.delete_registered_model(model.name)  # its versions go with it
    except MlflowException as err:
        if not missing(err):
            raise
    return True


_legacy_checked: set[tuple[str, str]] = set()


def remove_legacy_lock_once(client: MlflowClient, name: str) -> None:
    """On a registry's first promotion of ``name`` in this process: delete its old-style lock model. A failure
    here is a warning: the new lock is held and the promotion goes on."""
    key = (registry_uri(client), name)
    if key in _legacy_checked:
        return
    try:
        if remove_legacy_lock(client, name):
            print(f"maxout: deleted {name}{LEGACY_LOCK_SUFFIX}, the registered model older maxout releases kept "
                  f"their promotion lock in", file=sys.stderr)
        _legacy_checked.add(key)
    except Exception as err:  # noqa: BLE001
        print(f"maxout: warning: could not delete the old lock model {name}{LEGACY_LOCK_SUFFIX} "
              f"({type(err).__name__}); maxout registry cleanup-locks deletes it", file=sys.stderr)


def cleanup_legacy_locks(client: MlflowClient) -> list[str]:
    """``maxout registry cleanup-locks``: delete every old-style lock model; returns their names."""
    found, token = [], None
    while True:
        page = client.search_registered_models(max_results=1000, page_token=token)
        found += [m.name for m in page if is_lock(m)]
        token = page.token
        if not token:
            break
    for name in found:
        remove_legacy_lock(client, name[:-len(LEGACY_LOCK_SUFFIX)])
    return found

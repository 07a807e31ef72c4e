"""The promotion lock: one mutex per registered model, taken from the store.

Aliases are last-writer-wins: two promoters that each read "champion = v3, I beat it" would both write, and the
worse one can win. Every alias change therefore runs under a promotion lock: a mutex per registered model that
serializes promoters across processes and machines. It is taken from the store where the store has one, and it
leaves nothing in the user's registry (:func:`promotion_lock` picks by the registry URI):

- PostgreSQL (``postgresql://``): :class:`AdvisoryLock`, ``pg_advisory_lock`` on a session of its own. The server
  frees it when that session ends, so a dead holder needs no TTL.
- SQLite (``sqlite:///``): :class:`FileRangeLock`, a kernel lock on a byte range of the database file itself. The
  kernel frees it when the holder dies.
- anything else, a tracking server above all (``http(s)://``): :class:`TagLock`, Lamport's bakery over tags of
  the registered model itself, with stale holders broken after ``registry.lock_ttl_s``.

Why the old lock went: it was a ticket queue of versions of a registered model ``NAME.lock``, a fake model in
every model list. :func:`remove_legacy_lock` deletes such a model on first use under the new lock;
``maxout registry cleanup-locks`` (:func:`cleanup_legacy_locks`) deletes them all.

One module per kind (advisory.py, file_range.py, tags.py; base.py is what they share, legacy.py the old lock's
clean-up). The alias writes that run under the lock are registry/transaction.py.
"""

from __future__ import annotations

import fcntl

from mlflow import MlflowClient

from ...tracking.store import sqlite_file
from ..client import registry_uri
from .advisory import AdvisoryLock, advisory_key
from .base import PromotionLock
from .file_range import FileRangeLock
from .legacy import cleanup_legacy_locks, remove_legacy_lock
from .tags import TAG_PREFIX, TagLock


__all__ = ["AdvisoryLock", "FileRangeLock", "PromotionLock", "TAG_PREFIX", "TagLock", "advisory_key",
           "cleanup_legacy_locks", "promotion_lock", "registry_uri", "remove_legacy_lock"]


def promotion_lock(client: MlflowClient, name: str, ttl_s: float = 120.0, timeout_s: float = 300.0,
                   poll_s: float = 0.2) -> PromotionLock:
    """The promotion lock of registered model ``name``, from the store ``client`` writes to (module docstring)."""
    uri = registry_uri(client)
    if uri.startswith(("postgresql://", "postgresql+psycopg2://", "postgres://")):
        return AdvisoryLock(client, uri, name, ttl_s, timeout_s, poll_s)
    database = sqlite_file(uri)
    if database is not None and hasattr(fcntl, "F_OFD_SETLK"):
        return FileRangeLock(client, database, name, ttl_s, timeout_s, poll_s)
    return TagLock(client, name, ttl_s, timeout_s, poll_s)

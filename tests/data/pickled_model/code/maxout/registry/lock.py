"""The promotion lock, and the alias transaction that runs under it.

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

:class:`AliasTransaction` groups the alias and history writes of one promotion: if any of them (or anything after)
fails, all are undone.
"""

from __future__ import annotations

import json
import os
import random
import socket
import sys
import time
import uuid
from typing import Any, Optional

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from ..config import LOCK_SUFFIX
from ..errors import MaxoutError
from .client import (CHALLENGER, CHAMPION, HISTORY_TAG, alias_version, all_versions, champion_history,
                     ensure_registered_model, exists, missing)

LOCK_SOURCE = "maxout-lock:///"  # a ticket's version source: points at no artifacts; absolute, as servers require
HISTORY_KEEP = 100


class PromotionLock:
    """A mutex over ``NAME``'s aliases, kept in the registry (see the module docstring for why tickets).

    ``with PromotionLock(client, name): ...`` waits up to ``timeout_s`` for the lock. A ticket that its owner has
    not refreshed for ``ttl_s`` (its process died) is deleted by the next waiter. Ages are measured on the
    store's clock (``last_updated_timestamp``), never compared with this machine's wall clock.
    """

    def __init__(self, client: MlflowClient, name: str, ttl_s: float = 120.0, timeout_s: float = 300.0,
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
        ensure_registered_model(self.client, self.lock_name, tags={"maxout.lock_for": self.name},
                                 description=f"maxout's promotion lock for {self.name!r}: each live version is a "
                                             f"ticket (the lowest holds the lock). Safe to ignore.")
        version = self.client.create_model_version(self.lock_name, source=LOCK_SOURCE + self.name,
                                                   tags={"maxout.lock.owner": self.owner}, await_creation_for=0)
        self.ticket = int(version.version)
        self._store_ms, self._local_s = float(version.last_updated_timestamp), time.monotonic()
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                ahead = [v for v in all_versions(self.client, self.lock_name) if int(v.version) < self.ticket]
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
        print(f"maxout: breaking the stale promotion lock ticket {ticket.version} of {self.lock_name} "
              f"(owner {ticket.tags.get('maxout.lock.owner', '?')}, not refreshed for "
              f"{(self._store_now() - ticket.last_updated_timestamp) / 1000:.0f}s)", file=sys.stderr)
        try:
            self.client.delete_model_version(self.lock_name, ticket.version)
        except MlflowException as err:
            if not missing(err):  # another waiter broke it first
                raise

    def check(self) -> None:
        """Raise if our ticket was broken (we stalled past the TTL): another promoter may hold the lock now."""
        if not exists(self.client, self.lock_name, self.ticket):
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
            if not missing(err):
                print(f"maxout: warning: could not release promotion lock ticket {self.ticket} of "
                      f"{self.lock_name} ({type(err).__name__}); it is broken after registry.lock_ttl_s="
                      f"{self.ttl_ms / 1000:g}s", file=sys.stderr)
        self.ticket = None


class AliasTransaction:
    """Alias and history writes that are undone together if any of them (or anything after) fails.

    Used only under the promotion lock, so the snapshot taken at entry is still the state to go back to.
    ``with tx:`` around the writes undoes them when the block raises."""

    def __init__(self, client: MlflowClient, name: str):
        self.client, self.name = client, name
        model = client.get_registered_model(name)
        self.before = {a: alias_version(model, a) for a in (CHAMPION, CHALLENGER)}
        self.history = champion_history(model)
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

    def __enter__(self) -> "AliasTransaction":
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
        try:
            self.client.delete_registered_model_alias(self.name, alias)
        except MlflowException as err:
            if not missing(err):
                raise



"""The promotion lock, and the alias transaction that runs under it.

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

:class:`AliasTransaction` groups the alias and history writes of one promotion: if any of them (or anything after)
fails, all are undone.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import random
import re
import socket
import struct
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from ..errors import MaxoutError
from ..tracking.redact import redact
from ..tracking.store import sqlite_file
from .client import (CHALLENGER, CHAMPION, HISTORY_TAG, LEGACY_LOCK_SUFFIX, alias_version, champion_history,
                     is_lock, missing)

HISTORY_KEEP = 100


def _owner() -> str:
    """Who holds or waits: host, pid and a random part, so that two incarnations never share a name."""
    host = re.sub(r"[^\w.\-]", "-", socket.gethostname()) or "host"
    return f"{host}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


class PromotionLock:
    """A mutex over ``NAME``'s aliases: ``with promotion_lock(client, name): ...``.

    ``acquire`` waits up to ``timeout_s`` and raises a one-line :class:`MaxoutError` on timeout; ``check``
    raises if the lock was lost while held (call it right before the write it guards); ``release`` never raises.
    """

    kind = "lock"

    def __init__(self, client: MlflowClient, name: str, ttl_s: float, timeout_s: float, poll_s: float):
        self.client, self.name, self.ttl_s, self.timeout_s, self.poll_s = client, name, ttl_s, timeout_s, poll_s
        self.owner = _owner()
        self.held = False

    def __enter__(self) -> "PromotionLock":
        self.acquire()
        _remove_legacy_lock_once(self.client, self.name)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def acquire(self) -> None:
        raise NotImplementedError

    def check(self) -> None:
        """Raise if the lock was lost while held; the default: a lock that cannot be lost while its holder lives."""
        if not self.held:
            raise MaxoutError(f"the promotion lock of {self.name!r} is not held")

    def release(self) -> None:
        raise NotImplementedError

    def _timed_out(self, holder: str) -> MaxoutError:
        return MaxoutError(f"timed out after {self.timeout_s:g}s waiting for the promotion lock of {self.name!r} "
                           f"({self.kind}), held by {holder}")

    def _sleep(self, queue: int = 1) -> None:
        # Poll less the further back in the queue: the holder's own store calls must not queue behind ours.
        time.sleep(min(self.poll_s * max(queue, 1), 2.0) * (0.5 + random.random()))


def registry_uri(client: MlflowClient) -> str:
    """The URI of ``client``'s registry (MlflowClient keeps it as ``_registry_uri``; it defaults to the tracking
    URI, which is what maxout's clients use: registry.client.connect)."""
    return str(getattr(client, "_registry_uri", None) or client.tracking_uri)


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


# ------------------------------------------------------------------------------------------------ PostgreSQL


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def advisory_key(name: str) -> int:
    """A stable signed 64-bit key for ``name`` (the same in every process and release: not Python's hash())."""
    digest = hashlib.blake2b(f"maxout.promotion:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


class AdvisoryLock(PromotionLock):
    """``pg_advisory_lock(key)`` on a connection of its own, held (idle) until release.

    The server frees the lock when the session ends: a holder that dies, or whose machine vanishes (TCP
    keepalives, set on the session, find that within about a minute), needs no TTL. ``lock_timeout`` bounds the
    wait (``registry.lock_timeout_s``). ``idle_session_timeout`` = ``registry.lock_ttl_s`` (PostgreSQL 14+)
    ends the session of a holder that stalls longer than that, as the other locks break a stalled holder; the
    holder's ``check`` then finds its session gone and writes nothing. The session's ``application_name`` is the
    owner, so a waiter that times out names the holder (from ``pg_locks`` / ``pg_stat_activity``).
    """

    kind = "PostgreSQL advisory lock"

    def __init__(self, client: MlflowClient, uri: str, name: str, ttl_s: float, timeout_s: float, poll_s: float):
        super().__init__(client, name, ttl_s, timeout_s, poll_s)
        self.uri, self.key = uri, advisory_key(name)
        self.conn: Any = None

    def _dsn(self) -> str:
        from sqlalchemy.engine import make_url  # lazy: only PostgreSQL stores; MLflow's own parser for store URIs

        return make_url(self.uri).set(drivername="postgresql").render_as_string(hide_password=False)

    def acquire(self) -> None:
        import psycopg2  # lazy: only PostgreSQL stores need the driver
        from psycopg2 import errors

        try:
            self.conn = psycopg2.connect(self._dsn(), application_name=f"maxout promotion lock {self.owner}"[:63],
                                         connect_timeout=10)
        except psycopg2.Error as err:
            raise MaxoutError(f"cannot open the promotion lock of {self.name!r} on {redact(self.uri)}: "
                              f"{str(err).strip().splitlines()[0][:200]}") from None
        self.conn.autocommit = True  # a session-level lock, outside any transaction
        try:
            with self.conn.cursor() as cur:
                for setting, value in (("tcp_keepalives_idle", 30), ("tcp_keepalives_interval", 10),
                                       ("tcp_keepalives_count", 3), ("idle_session_timeout", _ms(self.ttl_s))):
                    try:
                        cur.execute("SELECT set_config(%s, %s, false)", (setting, str(value)))
                    except psycopg2.Error:  # an older server (idle_session_timeout is 14+): dead holders still free it
                        pass
                cur.execute("SELECT set_config('lock_timeout', %s, false)", (str(_ms(self.timeout_s)),))
                try:
                    cur.execute("SELECT pg_advisory_lock(%s)", (self.key,))
                except errors.LockNotAvailable:
                    raise self._timed_out(self._holder()) from None
                cur.execute("SELECT set_config('lock_timeout', '0', false)")
            self.held = True
        except BaseException:
            self.release()
            raise

    def _holder(self) -> str:
        classid, objid = (self.key >> 32) & 0xFFFFFFFF, self.key & 0xFFFFFFFF
        try:
            with self.conn.cursor() as cur:
                cur.execute("SELECT a.application_name, l.pid FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
                            "WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s AND l.objid = %s "
                            "AND l.objsubid = 1", (classid, objid))
                row = cur.fetchone()
        except Exception:  # noqa: BLE001  (only for the message)
            row = None
        return f"{row[0] or 'a session'} (server pid {row[1]})" if row else "another session"

    def check(self) -> None:
        super().check()
        try:
            with self.conn.cursor() as cur:
                cur.execute("SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory' "
                            "AND granted AND classid = %s AND objid = %s AND objsubid = 1",
                            ((self.key >> 32) & 0xFFFFFFFF, self.key & 0xFFFFFFFF))
                held = cur.fetchone()[0] == 1
        except Exception:  # noqa: BLE001  (a closed or broken session holds nothing)
            held = False
        if not held:
            raise MaxoutError(f"the promotion lock of {self.name!r} was lost while held: its PostgreSQL session "
                              f"ended (this process stalled longer than registry.lock_ttl_s={self.ttl_s:g}s, or the "
                              f"connection broke)")

    def release(self) -> None:
        """Never raises: closing the session frees the lock whatever the unlock did."""
        conn, self.conn, self.held = self.conn, None, False
        if conn is None:
            return
        try:
            if not conn.closed:
                with conn.cursor() as cur:
                    cur.execute("SELECT pg_advisory_unlock(%s)", (self.key,))
        except Exception:  # noqa: BLE001
            pass
        try:
            conn.close()
        except Exception:  # noqa: BLE001
            pass


# ------------------------------------------------------------------------------------------------ SQLite

# SQLite's own locks are POSIX locks on bytes [PENDING_BYTE, PENDING_BYTE + 512) = [1 GiB, 1 GiB + 512) of the
# database file (sqlite3 os_unix.c). Ours is far above them, so SQLite never meets it; a lock past the end of a
# file is allowed and the file is never written there (advisory locks do not touch data).
LOCK_RANGE_BASE = 1 << 60
LOCK_RANGE_SPAN = 1 << 40
_FLOCK = struct.Struct("hhqqi4x")  # struct flock on 64-bit Linux: l_type, l_whence, l_start, l_len, l_pid (+ pad)
_descriptors: dict[tuple[int, str], tuple[int, threading.Lock]] = {}
_descriptors_guard = threading.Lock()


def _descriptor(database: Path) -> tuple[int, threading.Lock]:
    """One descriptor per database per process, never closed: closing any descriptor of a file drops every POSIX
    lock this process holds on it, SQLite's own included. Keyed by pid too: a forked child must not share the
    parent's open file description (their locks would not exclude each other)."""
    key = (os.getpid(), os.path.realpath(database))
    with _descriptors_guard:
        if key not in _descriptors:
            try:
                fd = os.open(database, os.O_RDWR | os.O_CLOEXEC)
            except OSError as err:
                raise MaxoutError(f"cannot open the SQLite store {database} to take the promotion lock "
                                  f"({err.strerror}); the promoter must be able to write the store") from None
            _descriptors[key] = (fd, threading.Lock())
        return _descriptors[key]


class FileRangeLock(PromotionLock):
    """An open-file-description lock (``F_OFD_SETLK``, Linux) on a byte range of the SQLite database file,
    chosen by the model's name.

    Why the database file and not a lock file beside it: ``mlflow run`` mounts only the database file into its
    container (``/mlflow/tmp/mlruns``), so a file beside it inside a container is that container's own, and two
    jobs would not see each other's locks. The database file's inode is shared by every process that uses the
    store, on the host and in containers, whatever its uid: whoever can write the store (every promoter must) can
    lock it, so no lock file's mode can shut anyone out. It works wherever SQLite's own locking works.

    Why OFD and not ``lockf``/``flock``: a POSIX (``lockf``) lock belongs to the process, and SQLAlchemy closing a
    pooled SQLite connection would drop it; an OFD lock belongs to our descriptor, which is never closed
    (:func:`_descriptor`). Threads of one process share that descriptor, so a thread lock orders them first. The
    kernel frees the lock when the holder dies; a live holder is never broken (``registry.lock_ttl_s`` is unused
    here), and a waiter gives up after ``registry.lock_timeout_s``.
    """

    kind = "SQLite file lock"

    def __init__(self, client: MlflowClient, database: Path, name: str, ttl_s: float, timeout_s: float,
                 poll_s: float):
        super().__init__(client, name, ttl_s, timeout_s, poll_s)
        self.database = database
        digest = hashlib.blake2b(f"maxout.promotion:{name}".encode(), digest_size=8).digest()
        self.offset = LOCK_RANGE_BASE + int.from_bytes(digest, "big") % LOCK_RANGE_SPAN
        self._fd: Optional[int] = None
        self._thread_lock: Optional[threading.Lock] = None

    def _fcntl(self, kind: int) -> bool:
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, self.offset, 1, 0))
            return True
        except OSError as err:
            if err.errno in (errno.EAGAIN, errno.EACCES):  # held by another open file description
                return False
            raise

    def acquire(self) -> None:
        self._fd, self._thread_lock = _descriptor(self.database)
        deadline = time.monotonic() + self.timeout_s
        if not self._thread_lock.acquire(timeout=self.timeout_s):
            raise self._timed_out("another thread of this process")
        try:
            while not self._fcntl(fcntl.F_WRLCK):
                if time.monotonic() > deadline:
                    raise self._timed_out(f"another process using {self.database}")
                self._sleep()
            self.held = True
        except BaseException:
            self._thread_lock.release()
            raise

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        try:
            self._fcntl(fcntl.F_UNLCK)
        except OSError as err:  # cannot happen on a valid descriptor; the process's exit frees it anyway
            print(f"maxout: warning: could not unlock the promotion lock of {self.name!r} ({err})", file=sys.stderr)
        finally:
            self._thread_lock.release()


# ------------------------------------------------------------------------------------------------ any store

TAG_PREFIX = "maxout.lock."
BEAT = ".beat"
CHOOSING = "choosing"


class TagLock(PromotionLock):
    """Lamport's bakery over tags of the registered model ``NAME`` itself, for stores that offer no lock (a
    tracking server); the only store calls are tag writes, tag deletes and reading the model.

    Each participant (one entry attempt: a fresh owner name) writes only its own tag ``maxout.lock.<owner>``:
    ``choosing`` while it reads the others, then its number, 1 + the largest number it saw; it holds the lock when
    no other participant is choosing and none has a smaller (number, owner). Releasing deletes the tag. Tags are
    last-writer-wins and not ordered by the store, but the bakery needs neither: each register (tag) has one
    writer, and a read that overlaps a write returns the old or the new value, which is what the bakery's proof
    (Lamport 1974) assumes. A participant that appears later is one whose register was "0, not choosing" (no tag)
    before: it reads our number after we wrote it and takes a larger one. So at most one participant holds the
    lock, with no atomic operation at all, and nothing is left behind: no version, no model, and the tag is
    deleted on release (a crashed holder's tag stays on NAME until the next promoter breaks it).

    Stale holders: each participant also writes ``maxout.lock.<owner>.beat`` (a counter) every ``ttl/4`` while
    waiting, and once when it gets the lock. A waiter that sees another participant's (ticket, beat) unchanged for
    ``registry.lock_ttl_s`` on its own monotonic clock deletes that ticket: no two machines' clocks are compared.
    Breaking is safe where "delete NAME.lock" was not: a ticket is deleted by its owner's unique name, and an
    owner never writes its ticket again after choosing its number (beats go to the other tag; a beat left without
    its ticket is deleted on sight), so a breaker can never delete a ticket that was re-created, and a broken
    participant that wakes up starts over under a new name. The holder's lease ends ``lock_ttl_s`` after the
    start of its last write, on its own clock, which is no later than a breaker's view of it; ``check`` refuses
    once the lease has run out or the ticket is gone, so a holder that stalled writes no champion.
    """

    kind = "registered-model tags"

    def __init__(self, client: MlflowClient, name: str, ttl_s: float, timeout_s: float, poll_s: float):
        super().__init__(client, name, ttl_s, timeout_s, poll_s)
        self.number: Optional[int] = None
        self._beats = 0
        self._lease_from = 0.0  # our monotonic clock at the start of our last write

    @property
    def key(self) -> str:
        return TAG_PREFIX + self.owner

    def _write(self, key: str, value: str) -> None:
        self._lease_from = time.monotonic()
        self.client.set_registered_model_tag(self.name, key, value)

    def _beat(self) -> None:
        self._beats += 1
        self._write(self.key + BEAT, str(self._beats))

    def _entries(self) -> tuple[dict[str, str], dict[str, str]]:
        """(tickets, beats) by owner, from one read of the model."""
        tags = self.client.get_registered_model(self.name).tags or {}
        tickets, beats = {}, {}
        for key, value in tags.items():
            if key.startswith(TAG_PREFIX):
                owner = key[len(TAG_PREFIX):]
                if owner.endswith(BEAT):
                    beats[owner[:-len(BEAT)]] = value
                else:
                    tickets[owner] = value
        return tickets, beats

    def _lease_left(self) -> float:
        return self.ttl_s - (time.monotonic() - self._lease_from)

    def acquire(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        seen: dict[str, tuple[tuple[str, Optional[str]], float]] = {}  # owner -> (ticket, beat), first seen at
        try:
            while True:  # one entry attempt per turn; a broken attempt starts over under a new name
                if self._enter(deadline, seen):
                    return
                self._withdraw()
                self.owner = _owner()
                if time.monotonic() > deadline:
                    raise self._timed_out("others: this process kept stalling past registry.lock_ttl_s="
                                          f"{self.ttl_s:g}s and was broken each time")
        except BaseException:
            self.release()  # never raises: the error that got us here is the one reported
            raise

    def _enter(self, deadline: float, seen: dict) -> bool:
        self._beats, self.number = 0, None
        self._write(self.key, CHOOSING)
        tickets, _ = self._entries()
        number = 1 + max([int(v) for v in tickets.values() if v.isdigit()] or [0])
        if self._lease_left() < self.ttl_s / 2:
            return False  # we stalled while choosing: a waiter may have broken us; start over
        self._write(self.key, str(number))
        self.number = number
        while True:
            tickets, beats = self._entries()
            if self.owner not in tickets:
                return False  # broken while waiting (we stalled past the TTL): start over
            now = time.monotonic()
            for owner in [o for o in beats if o not in tickets and o != self.owner]:
                self._delete(TAG_PREFIX + owner + BEAT)  # a beat left without its ticket
            ahead = []
            for owner, value in tickets.items():
                if owner == self.owner:
                    continue
                state = (value, beats.get(owner))
                if owner not in seen or seen[owner][0] != state:
                    seen[owner] = (state, now)
                elif now - seen[owner][1] > self.ttl_s:
                    self._break(owner, value, now - seen[owner][1])
                    continue
                if value == CHOOSING or not value.isdigit() or (int(value), owner) < (number, self.owner):
                    ahead.append((value, owner))
            if not ahead:
                self._beat()  # the holder's lease starts now, not when it queued
                if self.owner not in self._entries()[0]:
                    return False  # broken between the read and the beat
                self.held = True
                return True
            if time.monotonic() > deadline:
                head = min(ahead, key=lambda t: (int(t[0]) if t[0].isdigit() else 0, t[1]))
                raise self._timed_out(f"{head[1]} (ticket {head[0]}); a dead holder's ticket is broken after "
                                      f"registry.lock_ttl_s={self.ttl_s:g}s")
            if self._lease_left() < self.ttl_s * 0.75:
                self._beat()
            self._sleep(len(ahead))

    def _sleep(self, queue: int = 1) -> None:
        # Never longer than a quarter of the TTL: a waiter must beat in time, or the others break it.
        time.sleep(min(self.poll_s * max(queue, 1), 2.0, self.ttl_s / 4) * (0.5 + random.random()))

    def _break(self, owner: str, ticket: str, age_s: float) -> None:
        print(f"maxout: breaking the stale promotion lock ticket {ticket} of {self.name} (owner {owner}, unchanged "
              f"for {age_s:.0f}s)", file=sys.stderr)
        self._delete(TAG_PREFIX + owner)
        self._delete(TAG_PREFIX + owner + BEAT)

    def _delete(self, key: str) -> None:
        try:
            self.client.delete_registered_model_tag(self.name, key)
        except MlflowException as err:
            if not missing(err):
                raise

    def check(self) -> None:
        super().check()
        if self._lease_left() <= 0 or self.owner not in self._entries()[0]:
            raise MaxoutError(f"the promotion lock of {self.name!r} was broken while held (this process stalled "
                              f"longer than registry.lock_ttl_s={self.ttl_s:g}s)")

    def _withdraw(self) -> None:
        self._delete(self.key)
        self._delete(self.key + BEAT)

    def release(self) -> None:
        """Never raises: a ticket that cannot be deleted (store unreachable) goes stale and is broken later,
        while raising here would turn a completed promotion into a failed one."""
        self.held = False
        try:
            self._withdraw()
        except Exception as err:  # noqa: BLE001
            print(f"maxout: warning: could not release the promotion lock of {self.name!r} "
                  f"({type(err).__name__}); its ticket is broken after registry.lock_ttl_s={self.ttl_s:g}s",
                  file=sys.stderr)


# ------------------------------------------------------------------------------------------------ the old lock


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


def _remove_legacy_lock_once(client: MlflowClient, name: str) -> None:
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



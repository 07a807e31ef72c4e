"""SQLite: the promotion lock as a kernel lock on a byte range of the database file itself."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from mlflow import MlflowClient

from ...errors import MaxoutError
from .base import PromotionLock


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

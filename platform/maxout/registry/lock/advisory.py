"""PostgreSQL: the promotion lock as an advisory lock on a session of its own."""

from __future__ import annotations

import hashlib
from typing import Any

from mlflow import MlflowClient

from ...errors import MaxoutError
from ...tracking.redact import redact
from .base import PromotionLock


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def advisory_key(name: str, namespace: str = "maxout.promotion") -> int:
    """A stable signed 64-bit key for ``name`` (the same in every process and release: not Python's hash()); the
    ``namespace`` keeps one kind of lock apart from another (a model's promotions, a study's shared parent)."""
    digest = hashlib.blake2b(f"{namespace}:{name}".encode(), digest_size=8).digest()
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

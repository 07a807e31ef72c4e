"""Any store (a tracking server above all): the promotion lock as Lamport's bakery over tags of the model."""

from __future__ import annotations

import random
import sys
import time
from typing import Optional

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from ...errors import MaxoutError
from ..client import missing
from .base import PromotionLock, new_owner


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
                self.owner = new_owner()
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

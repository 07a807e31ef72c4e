"""What every promotion lock is: acquire, check, release; its owner's name; the store it locks."""

from __future__ import annotations

import os
import random
import re
import socket
import time
import uuid
from typing import Any

from mlflow import MlflowClient

from ...errors import MaxoutError
from .legacy import remove_legacy_lock_once


def new_owner() -> str:
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
        self.owner = new_owner()
        self.held = False

    def __enter__(self) -> "PromotionLock":
        self.acquire()
        remove_legacy_lock_once(self.client, self.name)
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

"""Hold a promotion lock in a process of its own: ``python -m tests.lock_holder URI NAME``.

Prints ``held OWNER`` once it holds the store's lock, then holds it until its stdin closes (release), or until it
is killed (a dead holder)."""

from __future__ import annotations

import sys

from maxout.registry import client as registry_client
from maxout.registry import lock as registry_lock

if __name__ == "__main__":
    uri, name = sys.argv[1], sys.argv[2]
    client = registry_client.connect(uri)
    lock = registry_lock.promotion_lock(client, name, ttl_s=600, timeout_s=60)
    with lock:
        print("held", lock.owner, flush=True)
        sys.stdin.read()

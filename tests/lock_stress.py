"""Mutual exclusion, observed directly: ``python -m tests.lock_stress URI NAME PROCESSES ROUNDS DIR``.

Each of PROCESSES forked workers takes the tag lock (TagLock, whatever the store) ROUNDS times and, holding it,
does a read-modify-write of a counter file with a pause in the middle and marks the critical section with a file
created exclusively (O_EXCL). Two holders at once show up as an existing marker or as a lost increment. Prints
one JSON line: the final counter and the overlaps seen."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import mlflow  # noqa: F401  (imported before forking, so no child pays for it)

from maxout.registry import client as registry_client
from maxout.registry import lock as registry_lock

LOCK = registry_lock.TagLock


def worker(uri: str, name: str, rounds: int, folder: str, barrier, results) -> None:
    client = registry_client.connect(uri)
    counter, marker, overlaps = Path(folder) / "counter", Path(folder) / "inside", 0
    barrier.wait()
    for _ in range(rounds):
        with LOCK(client, name, ttl_s=60, timeout_s=300, poll_s=0.05):
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                overlaps += 1
            text = counter.read_text()  # empty: read while another holder was writing it
            overlaps += not text.strip()
            value = int(text or 0)
            time.sleep(0.02)
            counter.write_text(str(value + 1))
            marker.unlink(missing_ok=True)
    results.put(overlaps)


if __name__ == "__main__":
    uri, name, processes, rounds, folder = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    (Path(folder) / "counter").write_text("0")
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(uri, name, rounds, folder, barrier, results)) for _ in range(processes)]
    for proc in procs:
        proc.start()
    overlaps = sum(results.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join()
    print(json.dumps({"counter": int((Path(folder) / "counter").read_text()), "overlaps": overlaps,
                      "exitcodes": [p.exitcode for p in procs]}))

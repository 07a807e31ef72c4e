"""N promoters racing on one registry: ``python -m tests.registry_race URI NAME CANDIDATES_JSON``.

CANDIDATES_JSON is a list of [run_id, model_uri, metric_value]. mlflow and maxout are imported once, then one
process is forked per candidate (separate processes with their own store connections, as separate machines would
have); each opens its client, waits at a barrier so they all start promoting at the same moment, and calls
``promotion.register_and_promote``. Prints one JSON line: each promoter's outcome (or error) and exit code.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys

import mlflow  # noqa: F401  (imported before forking, so no child pays for it)

from maxout.registry import client as registry_client
from maxout.registry import promotion as registry_promotion
from maxout.config import Config, RegistryConfig, TrackingConfig


def promoter(uri: str, name: str, run_id: str, model_uri: str, value: float, barrier, results) -> None:
    client = registry_client.connect(uri)
    client.search_registered_models(max_results=1)  # connect before the start line
    barrier.wait()
    cfg = Config(registry=RegistryConfig(name=name), tracking=TrackingConfig(uri=uri))
    try:
        out = registry_promotion.register_and_promote(run_id, model_uri, value, cfg, "race-fingerprint", "cpu",
                                                      client=client)
        results.put({"value": value, "version": out.version, "reason": out.reason})
    except Exception as err:  # noqa: BLE001  (reported to the test, which fails on it)
        results.put({"value": value, "error": f"{type(err).__name__}: {err}"})


def main(uri: str, name: str, candidates: list) -> dict:
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(len(candidates)), ctx.Queue()
    procs = [ctx.Process(target=promoter, args=(uri, name, run_id, model_uri, float(value), barrier, results))
             for run_id, model_uri, value in candidates]
    for proc in procs:
        proc.start()
    outcomes = [results.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
    return {"outcomes": outcomes, "exitcodes": [p.exitcode for p in procs], "pids": sorted({p.pid for p in procs})}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))))

"""What reliability costs: a checkpoint's size and save / restore time, and the tracker's flush on the training
thread (the spool's journal write vs MLflow's asynchronous log_batch it replaced).

    python benchmarks/bench_reliability.py              # MiniLM (the demo's model), CPU
    python benchmarks/bench_reliability.py --model tiny

Everything is measured in one process, interleaved (A B A B ...), and reported as medians with the ratio, because
the machine is noisy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def checkpoint_costs(model: str, repeats: int) -> dict:
    from maxout import loading
    from maxout.train import checkpointing
    from maxout.tracking.tracker import NullTracker
    from maxout.train import TrainState, train

    cfg = loading.load(["hardware=cpu", f"model={model}", "tracking=none", "train.max_steps=1",
                        "checkpoint.enabled=false"])
    setup = train(cfg, tracker=NullTracker(), progress=False, verbose=False).setup  # optimizer state exists
    state = TrainState(total_steps=setup.total_steps, step=1)
    saves, loads = [], []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / checkpointing.file_name(1)
        for _ in range(repeats):
            start = time.perf_counter()
            checkpointing.save_atomic(checkpointing.capture(setup, state, (0, 1), {}), path)
            saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            checkpointing.restore(setup, checkpointing.load(path))
            loads.append(time.perf_counter() - start)
        size = path.stat().st_size
    return {"params": sum(p.numel() for p in setup.model.parameters()), "size_mb": size / 2**20,
            "save_s": statistics.median(saves), "restore_s": statistics.median(loads)}


def flush_costs(repeats: int, metrics_per_flush: int) -> dict:
    """Per flush on the training thread: the journal append (fsync) + waking the sender, vs MLflow's async enqueue."""
    import mlflow
    from mlflow.entities import Metric

    from maxout.tracking import spool

    with tempfile.TemporaryDirectory() as tmp:
        mlflow.set_tracking_uri(f"sqlite:///{tmp}/store.db")  # flush_async_logging() uses the global store
        client = mlflow.MlflowClient()
        run_id = client.create_run(client.create_experiment("bench")).info.run_id
        journal = spool.Spool(Path(tmp) / "run.jsonl", run_id, "sqlite")
        sender = spool.Sender(client, journal).start()
        spooled, asynchronous = [], []
        for i in range(repeats):
            batch = [Metric(f"m{k}", 0.5, 1_700_000_000_000 + i, i) for k in range(metrics_per_flush)]
            start = time.perf_counter()
            journal.append(metrics=batch)
            sender.wake()
            spooled.append(time.perf_counter() - start)
            start = time.perf_counter()
            client.log_batch(run_id, metrics=batch, synchronous=False)
            asynchronous.append(time.perf_counter() - start)
        sender.close()
        mlflow.flush_async_logging()
    return {"spool_ms": statistics.median(spooled) * 1e3, "async_log_batch_ms": statistics.median(asynchronous) * 1e3}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    ckpt = checkpoint_costs(args.model, args.repeats)
    print(f"checkpoint ({args.model}, {ckpt['params']:,} params + AdamW state): {ckpt['size_mb']:.0f} MiB, "
          f"save {ckpt['save_s']:.2f} s (atomic, fsynced), restore {ckpt['restore_s']:.2f} s")
    flush = flush_costs(repeats=50, metrics_per_flush=60)
    ratio = flush["spool_ms"] / flush["async_log_batch_ms"]
    print(f"tracker flush of 60 metrics on the training thread: spool {flush['spool_ms']:.2f} ms vs MLflow async "
          f"log_batch {flush['async_log_batch_ms']:.2f} ms (ratio {ratio:.2f})")


if __name__ == "__main__":
    main(sys.argv[1:])

"""What reliability costs: a checkpoint's size and save / restore time (and what its SHA-256 adds to each), and the
tracker's flush on the training thread (the spool's journal write vs MLflow's asynchronous log_batch it replaced).

    python benchmarks/bench_reliability.py              # MiniLM (the demo's model), CPU
    python benchmarks/bench_reliability.py --model tiny

Everything is measured in one process, interleaved (A B A B ...), and reported as medians with the ratio, because
the machine is noisy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def checkpoint_costs(model: str, repeats: int) -> dict:
    """Save and restore, interleaved in both orders with the same save and load without the checksum (the save
    before checksums existed: torch.save straight to the file), so the checksum's share is a ratio of one run."""
    import torch

    from maxout import loading
    from maxout.train import checkpointing
    from maxout.tracking.tracker import NullTracker
    from maxout.train import TrainState, train

    cfg = loading.load(["hardware=cpu", f"model={model}", "tracking=none", "train.max_steps=1",
                        "checkpoint.enabled=false"])
    setup = train(cfg, tracker=NullTracker(), progress=False, verbose=False).setup  # optimizer state exists
    state = TrainState(total_steps=setup.total_steps, step=1)
    times: dict[str, list[float]] = {"save": [], "save_plain": [], "restore": [], "restore_unverified": []}

    def plain_save(payload: dict, path: Path) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    with tempfile.TemporaryDirectory() as tmp:
        path, plain = Path(tmp) / checkpointing.file_name(1), Path(tmp) / "plain.pt"
        steps = {"save": lambda: checkpointing.save_atomic(checkpointing.capture(setup, state, (0, 1), {}), path),
                 "save_plain": lambda: plain_save(checkpointing.capture(setup, state, (0, 1), {}), plain),
                 "restore": lambda: checkpointing.restore(setup, checkpointing.load_verified(path)),
                 "restore_unverified": lambda: checkpointing.restore(setup, checkpointing.load(plain))}
        for i in range(repeats):
            for pair in (("save", "save_plain"), ("restore", "restore_unverified")):
                for name in (pair if i % 2 == 0 else pair[::-1]):  # both orders
                    start = time.perf_counter()
                    steps[name]()
                    times[name].append(time.perf_counter() - start)
        size = path.stat().st_size
    out = {f"{k}_s": statistics.median(v) for k, v in times.items()}
    return {"params": sum(p.numel() for p in setup.model.parameters()), "size_mb": size / 2**20, **out}


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
          f"save {ckpt['save_s']:.2f} s (atomic, fsynced, SHA-256 while writing) vs {ckpt['save_plain_s']:.2f} s "
          f"without the checksum (ratio {ckpt['save_s'] / ckpt['save_plain_s']:.2f}); restore "
          f"{ckpt['restore_s']:.2f} s (checksum verified) vs {ckpt['restore_unverified_s']:.2f} s unverified "
          f"(ratio {ckpt['restore_s'] / ckpt['restore_unverified_s']:.2f})")
    flush = flush_costs(repeats=50, metrics_per_flush=60)
    ratio = flush["spool_ms"] / flush["async_log_batch_ms"]
    print(f"tracker flush of 60 metrics on the training thread: spool {flush['spool_ms']:.2f} ms vs MLflow async "
          f"log_batch {flush['async_log_batch_ms']:.2f} ms (ratio {ratio:.2f})")


if __name__ == "__main__":
    main(sys.argv[1:])

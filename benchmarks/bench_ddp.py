"""Data-parallel scaling: throughput of 1 vs N processes (torchrun, DDP), and how evenly length-bucketed batches
fall on the ranks.

    python benchmarks/bench_ddp.py                              # MiniLM, 1 vs 2 processes on this CPU (gloo)
    python benchmarks/bench_ddp.py --model tiny --steps 40 --rounds 3
    python benchmarks/bench_ddp.py --processes 1 8 --overrides hardware=auto model=bert_base model.path=/models/bert

Each job is a real ``torchrun --standalone --nproc-per-node=N -m maxout train`` logging to a throwaway SQLite
store; rank 0's run gives the steady-state samples/s and tokens/s summed over the ranks. The per-rank micro-batch
is the same for every process count (weak scaling: N processes take N x the samples per step), so the ideal is N x
the one-process throughput. The counts run interleaved, in alternating order (1 2 2 1 ...): medians, and the ratio
within each round. On a CPU, ``--threads`` adds a one-process job whose intra-op threads match one rank's
(torchrun gives each of several processes OMP_NUM_THREADS=1), to separate "more processes" from "fewer threads".

``scaling(...)`` and ``summarize(...)`` are the functions the GPU report (benchmarks/gpu_report.py) calls on a
multi-GPU machine for its 1-vs-N table; ``imbalance_table(...)`` needs no device at all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
METRICS = ("perf/steady_samples_per_s", "perf/steady_tokens_per_s", "perf/steady_it_per_s", "mem/peak_rss_gb",
           "mem/peak_allocated_gb", "perf/mfu", "gpu/utilization_mean", "time/train_window_s")


def job(processes: int, overrides: Sequence[str], workdir: Path, threads: Optional[int] = None) -> dict:
    """One torchrun job of ``processes`` processes; the metrics rank 0 logged, and its params of interest."""
    import mlflow

    store = workdir / f"p{processes}-{uuid.uuid4().hex[:8]}"
    store.mkdir()
    uri = f"sqlite:///{store / 'mlflow.db'}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
               "-m", "maxout", "train", *overrides, f"tracking.uri={uri}",
               f"tracking.artifact_location={(store / 'art').as_uri()}", "tracking.system_metrics=false",
               "tracking.log_model=false", "checkpoint.enabled=false", "--no-progress"]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{processes}-process job failed (rc {done.returncode}): {done.stderr[-2000:]}")
    client = mlflow.MlflowClient(uri)
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    out = {"processes": processes, "threads": str(threads) if threads else ("1" if processes > 1 else "all"),
           "job_s": time.perf_counter() - started, "run_id": run.info.run_id,
           "global_batch": int(run.data.params["dist.global_effective_batch"]),
           "token_imbalance": float(run.data.params["dist.token_imbalance"]),
           "strategy": run.data.params["opt.data_parallel.effective"], "device": run.data.params["device.name"]}
    out.update({k: run.data.metrics[k] for k in METRICS if k in run.data.metrics})
    return out


def scaling(process_counts: Sequence[int] = (1, 2), overrides: Sequence[str] = (), rounds: int = 2,
            one_process_threads: Optional[int] = None, workdir: Optional[Path] = None) -> list[dict]:
    """Interleaved rounds over ``process_counts`` (reversed every other round); one row per job. With
    ``one_process_threads`` each round also runs one process at that many intra-op threads."""
    contenders = [(n, None) for n in process_counts]
    if one_process_threads:
        contenders.insert(1, (1, one_process_threads))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-ddp-") as tmp:
        for r in range(rounds):
            for processes, threads in (contenders if r % 2 == 0 else contenders[::-1]):
                row = job(processes, overrides, Path(workdir or tmp), threads)
                rows.append({"round": r, **row})
                print(json.dumps({k: row[k] for k in ("processes", "threads", "perf/steady_samples_per_s",
                                                       "job_s") if k in row}), file=sys.stderr)
    return rows


def summarize(rows: Sequence[dict], key: str = "perf/steady_samples_per_s",
              baseline_of: tuple = (1, "all")) -> list[dict]:
    """Per contender: the median of ``key``, the speed-up over ``baseline_of`` (processes, threads; default: one
    process with all its threads) within each round, then the median, and scaling efficiency (speed-up /
    processes)."""
    baseline = {r["round"]: r[key] for r in rows if (r["processes"], str(r["threads"])) == baseline_of}
    out = []
    for contender in dict.fromkeys((r["processes"], str(r["threads"])) for r in rows):
        mine = [r for r in rows if (r["processes"], str(r["threads"])) == contender]
        speedups = [r[key] / baseline[r["round"]] for r in mine if r["round"] in baseline]
        median_speedup = statistics.median(speedups) if speedups else float("nan")
        out.append({"processes": contender[0], "threads": contender[1], key: statistics.median(r[key] for r in mine),
                    "speedup": median_speedup, "speedup_range": (min(speedups), max(speedups)) if speedups else None,
                    "efficiency": median_speedup / contender[0],
                    "peak_rss_gb": max(r.get("mem/peak_rss_gb", 0.0) for r in mine),
                    "global_batch": mine[0]["global_batch"], "token_imbalance": mine[0]["token_imbalance"]})
    return out


def imbalance_table(world_sizes: Sequence[int] = (2, 4, 8), micro_batch: int = 16, accumulation: int = 1,
                    max_length: int = 256) -> list[dict]:
    """On the demo data, epoch 0, with and without length bucketing (a pure function of the data, no device): token
    imbalance across ranks (the busiest rank's padded tokens over the mean, per optimizer step), padding efficiency
    (real / padded tokens) and compute efficiency (real tokens / what all ranks could process in the time the
    busiest one takes: padding and waiting together)."""
    from maxout import data, loading, modeling
    from maxout.optimizations import bucketing

    cfg = loading.load(["hardware=cpu", "model=minilm", "tracking=none", f"data.max_length={max_length}"])
    lengths = data.encode(modeling.load_tokenizer(cfg.model), data.load(cfg.data).train, max_length).lengths
    rows = []
    for world in world_sizes:
        for bucketed in (True, False):
            samplers = [bucketing.apply(lengths, micro_batch, cfg.train.seed, bucketed, rank=r, world_size=world)
                        for r in range(world)]
            per_rank = [sampler.batches() for sampler in samplers]
            work = [[sum(len(b) * max(lengths[i] for i in b) for b in batches[k:k + accumulation])
                     for batches in per_rank] for k in range(0, len(per_rank[0]), accumulation)]
            real = sum(lengths[i] for batches in per_rank for b in batches for i in b)
            rows.append({"world_size": world, "bucketing": bucketed,
                         "token_imbalance": bucketing.token_imbalance(samplers[0], accumulation),
                         "padding_efficiency": real / sum(map(sum, work)),
                         # real tokens over what the ranks could have processed while the slowest one worked
                         "compute_efficiency": real / (world * sum(map(max, work))),
                         "rows_per_rank": len(samplers[0].indices()), "rows": len(lengths)})
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per job (warm-up steps excluded)")
    parser.add_argument("--micro-batch", type=int, default=8, help="per rank (the same for every process count)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None,
                        help="also run one process with this many intra-op threads (CPU: 1, like one rank)")
    parser.add_argument("--overrides", nargs="*", default=["hardware=cpu"])
    args = parser.parse_args(argv)
    overrides = [f"model={args.model}", f"train.max_steps={args.steps}", "train.epochs=1",
                 f"train.batch_size={args.micro_batch}", "train.target_effective_batch=null",
                 "train.eval_interval=0", *args.overrides]
    rows = scaling(args.processes, overrides, args.rounds, args.threads)
    summary = {"vs_one_process": summarize(rows)}
    if args.threads:
        summary[f"vs_one_process_{args.threads}_threads"] = summarize(rows, baseline_of=(1, str(args.threads)))
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "overrides": overrides, "jobs": rows, "summary": summary,
                      "imbalance": imbalance_table(micro_batch=args.micro_batch)}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

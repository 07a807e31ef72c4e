"""An FSDP checkpoint's cost on rank 0, today's way against torch.distributed.checkpoint (issue 28 part 5).

    python benchmarks/bench_fsdp_checkpoint.py                       # 2 processes (torchrun), gloo, CPU
    python benchmarks/bench_fsdp_checkpoint.py --layers 2 --rounds 1 # smaller and quicker

The model is a BERT built from a config (hidden 768, 4 layers by default: 52M parameters, about 0.6 GB of weights
and AdamW state in fp32), sharded with fully_shard over 2 gloo processes, one training step taken so that the
optimizer state exists. Then the real Checkpointer (train/checkpointing.py) saves, interleaved in both orders
(A B C C B A, per round):

    full   checkpoint.sharded=false: the full model and optimizer state gathered on rank 0's CPU, one file written
           by rank 0 (the only way before)
    dcp    checkpoint.sharded=true: each rank writes its shard with dcp.save, rank 0 commits the manifest
    async  checkpoint.async_save=true: dcp.async_save; "blocked" is the time the training thread waits, "save" the
           time until the checkpoint is committed (wait() at once, so that rounds do not overlap)

Rank 0's peak memory is its resident set's high-water mark (VmHWM in /proc/self/status) over the save alone: it is
reset just before (writing 5 to /proc/self/clear_refs, Linux >= 4.0) after a gc and malloc_trim, and read after
every rank finished; "extra" is that peak minus the resident set before the save. Each save's time is rank 0's wall
time from a barrier before it to the checkpoint being complete (file renamed into place / folder committed).
Checkpoints go to a disk folder (not tmpfs), fsynced as the Checkpointer always does. Medians per way are printed,
with the ratios to ``full``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("full", "dcp", "async")


def _status(key: str) -> float:
    """A /proc/self/status figure in MiB (VmRSS, VmHWM)."""
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def _trim() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory back to the OS: the next save starts from a true floor


def rank_main(args: argparse.Namespace) -> None:
    import torch

    from maxout import data, hardware, loading, metrics, modeling
    from maxout.tracking.tracker import NullTracker
    from maxout.train import distributed, resume
    from maxout.train.callbacks import TrainState
    from maxout.train.loop import train_step
    from maxout.train.setup import build

    torch.set_num_threads(1)  # two ranks on two cores
    base = ["hardware=cpu", "model=tiny", "tracking=none", "distributed.strategy=fsdp", "hardware.precision=fp32",
            "train.batch_size=2", "train.target_effective_batch=4", "data.max_length=32", "train.max_steps=4",
            f"model.architecture.hidden_size={args.hidden}", f"model.architecture.num_hidden_layers={args.layers}",
            f"model.architecture.intermediate_size={4 * args.hidden}",
            f"model.architecture.num_attention_heads={args.hidden // 64}", f"checkpoint.dir={args.dir}",
            "checkpoint.keep_last=1", "distributed.timeout_s=1800"]
    device = hardware.detect()
    cfg = loading.load(base, device=device)
    with distributed.session(cfg.distributed, device) as world:
        setup = build(cfg, device, data.load(cfg.data), modeling.load_tokenizer(cfg.model), world=world)
        batches = iter(setup.train_loader)
        train_step(setup, [next(batches), next(batches)], metrics.Throughput("cpu"))  # AdamW's state exists
        params = sum(p.numel() for p in setup.model.parameters())  # DTensors: the global count
        savers = {}
        for way in WAYS:
            extra = {"full": ["checkpoint.sharded=false"], "dcp": [], "async": ["checkpoint.async_save=true"]}[way]
            plan = resume.Plan(loading.load([*base, *extra], device=device), way, "run")
            savers[way] = plan.checkpointer(setup, NullTracker())[0]
        order = [w for _ in range(args.rounds) for w in (*WAYS, *reversed(WAYS))]
        rows, step = [], 0
        for way in order:
            step += 1
            saver = savers[way]
            _trim()
            world.gather(None)
            before = _status("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS from here
            started = time.perf_counter()
            saver.save(TrainState(setup.total_steps, step=step), (0, 2))
            blocked = time.perf_counter() - started
            if saver.writer:
                saver.writer.wait()
            took = time.perf_counter() - started
            world.gather(None)
            peak = _status("VmHWM")
            rows.append({"way": way, "save_s": took, "blocked_s": blocked, "peak_mib": peak,
                         "extra_mib": peak - before, "rss_before_mib": before})
        if world.is_main:
            folders = list(Path(args.dir).glob("*/run/step-*"))
            size = sum(p.stat().st_size for f in folders for p in (f.rglob("*") if f.is_dir() else [f])
                       if p.is_file())
            print(json.dumps({"params": params, "rows": rows, "last_checkpoints_bytes": size}), flush=True)


def summary(result: dict) -> str:
    rows = result["rows"]
    med = {w: {k: statistics.median(r[k] for r in rows if r["way"] == w)
               for k in ("save_s", "blocked_s", "peak_mib", "extra_mib")} for w in WAYS}
    lines = [f"{result['params'] / 1e6:.1f}M parameters ({result['params'] * 12 / 2**20:.0f} MiB of fp32 weights + "
             f"AdamW state), 2 ranks, {sum(r['way'] == 'full' for r in rows)} saves per way",
             "| way | save s (median) | training blocked s | rank 0 peak RSS MiB | rank 0 extra MiB | save vs full | "
             "extra vs full |", "|---|---|---|---|---|---|---|"]
    for w in WAYS:
        m = med[w]
        lines.append(f"| {w} | {m['save_s']:.2f} | {m['blocked_s']:.2f} | {m['peak_mib']:.0f} | {m['extra_mib']:.0f} "
                     f"| {m['save_s'] / med['full']['save_s']:.2f}x "
                     f"| {m['extra_mib'] / med['full']['extra_mib']:.2f}x |")
    lines.append("every save (order, way, save s, blocked s, peak MiB, extra MiB): " + "; ".join(
        f"{r['way']} {r['save_s']:.2f} {r['blocked_s']:.2f} {r['peak_mib']:.0f} {r['extra_mib']:.0f}" for r in rows))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="A B C C B A rounds")
    parser.add_argument("--dir", default=None, help="checkpoint folder (default: a temporary one under ./)")
    args = parser.parse_args()
    if "RANK" in os.environ:
        rank_main(args)
        return
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=".bench-fsdp-ckpt-", dir=args.dir or ROOT) as tmp:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
                   "--hidden", str(args.hidden), "--layers", str(args.layers), "--rounds", str(args.rounds),
                   "--dir", tmp]
        out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    if out.returncode:
        sys.exit(f"the job failed:\n{out.stderr[-4000:]}")
    result = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    print(summary(result))
    print(f"run time {time.perf_counter() - started:.0f} s, load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()

"""6. The batch finder against real device memory: BERT-base at a fixed 128 tokens (compile off), the micro-batch the
finder picks and the largest batch its probes fitted, then real training runs at growing batch sizes until the first
one that runs out of memory (OOM recovery is what tells: it halves the rows on an OOM and logs the event), and the
margin between them.

Every figure is recorded the moment it exists: the finder's answer, each rung, and the margin line after each rung
(no out-of-memory up to the largest batch so far, until one runs out). A rung's run stops at the first
out-of-memory recovery: that is the answer, and the run's halved steps after it only took time (on 2026-11-26 the
section was cut at 50 s in those steps, before it wrote its margin line)."""

from __future__ import annotations

import math

from .. import workloads
from ..registry import Context, Section

LADDER = (1.0, 1.05, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0, 2.5, 3.0)  # x the finder's largest batch that fit


class RanOutOfMemory(Exception):
    """Raised by StopAtFirstOOM when out-of-memory recovery fires: the rung has its answer."""


def stop_at_first_oom():
    """A null tracker that ends the run when out-of-memory recovery reports its first event (train/oom.py tags
    ``maxout.oom_recovery`` once it has halved the rows), keeping the note."""
    from maxout.tracking.tracker import NullTracker  # lazy: imports mlflow's pieces

    class StopAtFirstOOM(NullTracker):
        def set_tags(self, tags) -> None:
            super().set_tags(tags)
            if "maxout.oom_recovery" in tags:
                raise RanOutOfMemory(tags["maxout.oom_recovery"])

    return StopAtFirstOOM()


def margin(found: dict, ladder: list[dict]) -> dict:
    """The margin line from the rungs measured so far: the first batch that ran out of memory over the finder's
    micro-batch and largest fitting batch, or the largest batch that ran without one."""
    first_oom = next((r["rows"] for r in ladder if r["oom"]), None)
    fitted = max((r["rows"] for r in ladder if not r["oom"]), default=None)
    return {"first_oom_over_micro_batch": first_oom / found["micro_batch"] if first_oom else None,
            "first_oom_over_max_batch": first_oom / found["max_batch"] if first_oom else None,
            "no_oom_up_to": None if first_oom else fitted}


def run(ctx: Context) -> None:
    import torch  # lazy: the parent process never imports torch for this

    from maxout import hardware, loading  # lazy: imports torch
    from maxout.train import batch_finder, prepare, train  # lazy: imports torch
    from maxout.train.oom import free_cached  # lazy: imports torch

    arch, target = ("bert_base", 4096) if ctx.full else ("tiny", 64)
    data = workloads.demo(ctx.work, copies=8) if ctx.full else workloads.demo(ctx.work, rows=64)
    base = [*workloads.model(arch), *data, "data.padding=max_length", "data.max_length=128", "data.bucketing=false",
            "tracking=none", "hardware.compile=false", "checkpoint.enabled=false", "batch_finder.cache=false"]
    device = hardware.detect()
    cfg = loading.load([*base, "train.batch_size=auto", f"train.target_effective_batch={target}",
                        f"batch_finder.max_batch={target}"], device=device)
    checked = prepare.check(cfg)
    found = batch_finder.find(cfg, device, checked.dataset, checked.tokenizer)
    finder = {"micro_batch": found.micro_batch, "max_batch": found.max_batch, "safe_batch": found.safe_batch,
              "capped": found.capped, "probes": found.probes, "sequence_length": found.sequence_length,
              "search_s": found.seconds}
    ctx.record("finder", finder)
    free_cached(device.torch_device)
    ladder: list[dict] = []
    sizes = sorted({found.micro_batch, *(math.ceil(found.max_batch * f) for f in LADDER)})
    for rows in sizes:
        tracker = stop_at_first_oom()
        overrides = [*base, f"train.batch_size={rows}", f"train.target_effective_batch={rows}", "train.max_steps=4",
                     "train.epochs=1000", "train.warmup_steps_excluded=1", "train.log_every=1"]
        peak, oom = None, True
        try:
            result = train(loading.load(overrides, device=device), tracker=tracker, progress=False, verbose=False)
            oom, peak = False, result.metrics.get("mem/peak_allocated_gb")
            del result
        except RanOutOfMemory:  # training's recovery halved the rows: the note is in the tracker's tags
            pass
        except torch.OutOfMemoryError as err:  # eval, or a single row that no longer fits
            tracker.tags["maxout.oom_recovery"] = str(err).splitlines()[0][:200]
        free_cached(device.torch_device)
        ladder.append({"rows": rows, "oom": oom, "peak_allocated_gb": peak,
                       "note": tracker.tags.get("maxout.oom_recovery", "")})
        ctx.record("ladder", ladder)
        ctx.record("first_real_oom", rows if oom else None)
        ctx.record("margin", margin(finder, ladder))
        if oom:
            break


def markdown(results: dict) -> str:
    f, gap = results.get("finder", {}), results.get("margin", {})
    fmt = lambda v, spec: "–" if v is None else format(v, spec)  # noqa: E731
    probes = " ".join(f"{rows}:{'ok' if ok else 'oom'}" for rows, ok in f.get("probes", []))
    lines = [f"Finder: micro-batch **{f.get('micro_batch')}**, largest batch its probes fitted {f.get('max_batch')}"
             f"{' (search cap)' if f.get('capped') else ''}, at {f.get('sequence_length')} tokens, "
             f"{len(f.get('probes', []))} probes in {fmt(f.get('search_s'), '.1f')} s (`{probes}`).",
             "", f"First batch that really ran out of memory in training: **{results.get('first_real_oom')}**; "
             f"margin over the micro-batch {fmt(gap.get('first_oom_over_micro_batch'), '.2f')}×, over the "
             f"finder's largest batch {fmt(gap.get('first_oom_over_max_batch'), '.2f')}×"
             + (f" (no OOM up to {gap['no_oom_up_to']} rows)" if gap.get("no_oom_up_to") else "") + ".", "",
             "| rows | out of memory | peak allocated GiB | note |", "|---|---|---|---|"]
    for r in results.get("ladder", []):
        lines.append(f"| {r['rows']} | {'yes' if r['oom'] else 'no'} | {fmt(r['peak_allocated_gb'], '.2f')} | "
                     f"{r['note'].replace('|', '/')} |")
    return "\n".join(lines)


SECTION = Section("batch_finder", "Batch finder against real memory", run, needs=("cuda",),
                  min_s={"full": 60, "smoke": 20}, max_s={"full": 180, "smoke": 120}, markdown=markdown,
                  why_cuda="needs a CUDA device: real device memory (the CPU budget meter is tested in "
                           "tests/test_batch_finder.py)")

"""6. The batch finder against real device memory: BERT-base at a fixed 128 tokens (compile off), the micro-batch the
finder picks and the largest batch its probes fitted, then real training runs at growing batch sizes until the first
one that runs out of memory (OOM recovery is what tells: it halves the rows on an OOM and logs the event), and the
margin between them."""

from __future__ import annotations

import math

from .. import workloads
from ..registry import Context, Section

LADDER = (1.0, 1.05, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0, 2.5, 3.0)  # x the finder's largest batch that fit


def run(ctx: Context) -> None:
    import torch  # lazy: the parent process never imports torch for this

    from maxout import hardware, loading  # lazy: imports torch
    from maxout.tracking.tracker import NullTracker  # lazy: imports mlflow's pieces
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
    ctx.record("finder", {"micro_batch": found.micro_batch, "max_batch": found.max_batch, "safe_batch":
                          found.safe_batch, "capped": found.capped, "probes": found.probes,
                          "sequence_length": found.sequence_length, "search_s": found.seconds})
    free_cached(device.torch_device)
    ladder, first_oom = [], None
    sizes = sorted({found.micro_batch, *(math.ceil(found.max_batch * f) for f in LADDER)})
    for rows in sizes:
        tracker = NullTracker()
        overrides = [*base, f"train.batch_size={rows}", f"train.target_effective_batch={rows}", "train.max_steps=4",
                     "train.epochs=1000", "train.warmup_steps_excluded=1", "train.log_every=1"]
        try:
            result = train(loading.load(overrides, device=device), tracker=tracker, progress=False, verbose=False)
            oom = "train/oom_events" in tracker.metrics
            peak = result.metrics.get("mem/peak_allocated_gb")
            del result
        except torch.OutOfMemoryError as err:  # eval, or a single row that no longer fits
            oom, peak = True, None
            tracker.tags["maxout.oom_recovery"] = str(err).splitlines()[0][:200]
        free_cached(device.torch_device)
        ladder.append({"rows": rows, "oom": oom, "peak_allocated_gb": peak,
                       "note": tracker.tags.get("maxout.oom_recovery", "")})
        ctx.record("ladder", ladder)
        if oom:
            first_oom = rows
            break
    ctx.record("first_real_oom", first_oom)
    ctx.record("margin", {"first_oom_over_micro_batch": first_oom / found.micro_batch if first_oom else None,
                          "first_oom_over_max_batch": first_oom / found.max_batch if first_oom else None,
                          "no_oom_up_to": None if first_oom else sizes[-1]})


def markdown(results: dict) -> str:
    f, margin = results.get("finder", {}), results.get("margin", {})
    fmt = lambda v, spec: "–" if v is None else format(v, spec)  # noqa: E731
    probes = " ".join(f"{rows}:{'ok' if ok else 'oom'}" for rows, ok in f.get("probes", []))
    lines = [f"Finder: micro-batch **{f.get('micro_batch')}**, largest batch its probes fitted {f.get('max_batch')}"
             f"{' (search cap)' if f.get('capped') else ''}, at {f.get('sequence_length')} tokens, "
             f"{len(f.get('probes', []))} probes in {fmt(f.get('search_s'), '.1f')} s (`{probes}`).",
             "", f"First batch that really ran out of memory in training: **{results.get('first_real_oom')}**; "
             f"margin over the micro-batch {fmt(margin.get('first_oom_over_micro_batch'), '.2f')}×, over the "
             f"finder's largest batch {fmt(margin.get('first_oom_over_max_batch'), '.2f')}×"
             + (f" (no OOM up to {margin['no_oom_up_to']})" if margin.get("no_oom_up_to") else "") + ".", "",
             "| rows | out of memory | peak allocated GiB | note |", "|---|---|---|---|"]
    for r in results.get("ladder", []):
        lines.append(f"| {r['rows']} | {'yes' if r['oom'] else 'no'} | {fmt(r['peak_allocated_gb'], '.2f')} | "
                     f"{r['note'].replace('|', '/')} |")
    return "\n".join(lines)


SECTION = Section("batch_finder", "Batch finder against real memory", run, needs=("cuda",),
                  min_s={"full": 60, "smoke": 20}, max_s={"full": 180, "smoke": 120}, markdown=markdown,
                  why_cuda="needs a CUDA device: real device memory (the CPU budget meter is tested in "
                           "tests/test_batch_finder.py)")

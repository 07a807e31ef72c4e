"""7. Tracking: NVML's GPU utilization, sampled inside the training window of a MiniLM-sized run (the default
model's size: short steps, the worst case for anything the loop does besides training), and what tracking
costs: steady samples/s with the MLflow tracker (an embedded SQLite store, MLflow's system-metrics sampler on, a
metrics batch every step: the worst case) against the null tracker, in one process, both orders
(benchmarks/tracking_overhead.py's ``measure``)."""

from __future__ import annotations

from .. import workloads
from ..registry import Context, Section


def run(ctx: Context) -> None:
    import torch  # lazy: the parent process never imports torch for this

    from benchmarks import tracking_overhead  # lazy: imports maxout and torch
    from maxout import loading  # lazy: imports torch
    from maxout.tracking.tracker import NullTracker  # lazy: imports mlflow's pieces
    from maxout.train import train  # lazy: imports torch

    cuda = torch.cuda.is_available()
    arch, batch, steps = ("minilm", 64, 60) if ctx.full else ("tiny", 16, 4)
    data = workloads.demo(ctx.work, copies=8) if ctx.full else workloads.demo(ctx.work, rows=64)
    base = [*workloads.model(arch), *data, "hardware.compile=false", "checkpoint.enabled=false",
            f"train.batch_size={batch}", f"train.target_effective_batch={batch}"]
    if cuda:
        result = train(loading.load([*base, "tracking=none", f"train.max_steps={steps}", "train.epochs=1000"]),
                       tracker=NullTracker(), progress=False, verbose=False)
        m = result.metrics
        ctx.record("utilization", {"mean": m.get("gpu/utilization_mean"), "max": m.get("gpu/utilization_max"),
                                   "samples_per_s": m.get("perf/steady_samples_per_s"), "steps": steps,
                                   "model": arch})
        del result
    else:
        ctx.record("utilization", {"skipped": "no CUDA device: NVML has no GPU to sample"})
    # Three repetitions (orders alternate) where the section has the time, two (both orders) in a short call; smoke:
    # one (the code path: each tracker's run and the ratio, not a figure)
    reps = (3 if ctx.left() > 100 else 2) if ctx.full else 1

    def record(out: dict) -> None:  # after every run: a section cut at its limit keeps the summary so far
        ctx.record("overhead", {"model": arch, "steps": steps, "reps": reps, "store": out["store"],
                                "summary": out["summary"], "rows": out["rows"],
                                "logging_path_ms": out["logging_path_ms"]})

    record(tracking_overhead.measure(base, reps=reps, steps=steps, modes=["none", "mlflow"],
                                     interval=2.0 if ctx.full else 0.5, store="sqlite", on_run=record))


def markdown(results: dict) -> str:
    u, o = results.get("utilization", {}), results.get("overhead", {})
    lines = [f"GPU utilization (NVML, every 100 ms, inside the training window): {u['skipped']}" if "skipped" in u
             else f"GPU utilization (NVML, every 100 ms, inside the training window of {u.get('steps')} steps of "
                  f"random {u.get('model')}): mean {u.get('mean')}, max {u.get('max')}."]
    if o:
        path = o.get("logging_path_ms")
        whole = len(o["summary"].get("none", {}).get("ratios", []))
        lines += ["", f"Tracking overhead ({o['store']} store, {o['model']}, {o['steps']} steps per run, a metrics "
                      f"batch every step; {whole} of {o['reps']} repetitions; logging path "
                      + (f"{path:.3f} ms of main-thread CPU per step" if path is not None else "not measured") + "):",
                  "", "| tracker | median samples/s | ratio vs null (per repetition, orders alternate) |",
                  "|---|---|---|"]
        for mode, s in o["summary"].items():
            ratios = ", ".join(f"{r:.3f}" for r in s["ratios"])
            ratio = "–" if s["median_ratio"] is None else f"{s['median_ratio']:.3f}"
            lines.append(f"| {mode} | {s['median_samples_s']:.1f} | {ratio} ({ratios}) |")
        runs = [f"{mode} {r[mode]['samples_s']:.1f}" for r in o.get("rows", []) for mode in r]
        lines += ["", f"Runs in order (samples/s): {', '.join(runs) or '–'}."]
    return "\n".join(lines)


SECTION = Section("tracking", "Tracking: GPU utilization and overhead", run, needs=("mlflow",),
                  min_s={"full": 60, "smoke": 20}, max_s={"full": 150, "smoke": 150}, markdown=markdown)

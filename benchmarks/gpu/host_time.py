"""Where a training step's time goes on the host, for a set-up that has already trained (its graphs compiled, its
allocator warm): the question the H200's batch-64 runs left open.

At batch 64 on the demo mix maxout ran 34 ms a step (1860 samples/s) while NVML saw the GPU busy 33-41% of the time,
and compile saved only 4 ms a step over eager (2026-11-27). So most of the step is the host's, and the figures
cannot say whose: the kernel launches, the DataLoader, a hidden sync, the optimizer or Python around them. This
runs more steps of the trainer's own ``train_step`` and splits them three ways:

- timed (no instrument inside the steps): the wait for the next batch, the time ``train_step`` takes to return
  (the host queueing the step's work: launches, plus any wait on the device inside it) and the wall time per step
  with one sync at the end. Issue time near the wall time and kernel time well below it: the host sets the pace.
  Then the same again with the other way of loading: in the training process where the run's DataLoader has
  workers, with ``auto`` workers (cores - 2) where it has none (the GPU profiles since 2026-11-27: on the H200 the
  workers' hand-over, unpickling each batch and the pin-memory thread beside the launching one, cost 3.3-4.3 ms a
  step at batch 64).
- where asked (vs_trainer's maxout runs) and the compiled forward skips dynamo's guards for inputs already seen
  (hardware.skip_guards): the same timing with the guards at every call, then skipping again (A B A, one graph).
- counted (CUDA only): synchronizing operations per step, by torch's sync debug mode (insight/breakdown.py's
  counter; on a CPU tests/test_host_syncs.py counts them).
- profiled (torch.profiler, a few steps; ``profiled=0`` leaves it out): kernel time and kernels per step, the CPU
  time spent in kernel-launch calls, the CPU self time of all the ops the profiler sees (issue time beyond it is
  Python: the loop, module calls, dynamo's guards and wrappers; the profiler slows both, so compare within its own
  figures), the blocking CUDA runtime calls (syncs, and allocations and frees that sync) with the CPU time they
  waited, the host ops with the most CPU self time, and the launch calls per step by the outermost op that made
  each (``launch_sources``: the work outside CUDA graphs' replays). CUPTI is torn down when the profile ends
  (``TEARDOWN_CUPTI=1`` unless set): left subscribed, it slows every later kernel launch in the process
  (pytorch/pytorch#144455), and runs of the comparison may follow.
"""

from __future__ import annotations

import os
import re
import time
from contextlib import closing
from typing import Any, Iterator

LAUNCH = re.compile(r"^(cudaLaunch|cuLaunch|cudaGraphLaunch|cudaMemcpyAsync|cudaMemsetAsync)")
# CUDA runtime calls that block the host until the device catches up: the explicit syncs, and those that sync
# implicitly (a synchronous copy, freeing device or pinned memory, allocating either). The sync debug mode counts only
# the syncs torch itself asks for (.item(), nonzero, ...): these are what the profiler sees of all of them.
BLOCKING = re.compile(r"^(cuda\w*Synchronize|cudaMemcpy$|cudaMemcpy2D$|cudaMalloc|cudaFree|cudaHostAlloc|"
                      r"cudaMallocHost|cudaFreeHost|cuMemAlloc|cuMemFree|cuStreamSynchronize|cuCtxSynchronize)")


def _steps(setup: Any, loader: Any = None) -> Iterator[list]:
    """The set-up's optimizer-step groups (from ``loader``, default its own), epoch after epoch."""
    from maxout.train.loop import accumulation_groups  # lazy: imports torch

    while True:
        yield from accumulation_groups(setup.train_loader if loader is None else loader, setup.accum_steps)


def teardown_cupti() -> None:
    """Every torch.profiler session in this process tears CUPTI down at its end (kineto reads ``TEARDOWN_CUPTI``):
    call before each profile. Left subscribed, CUPTI slows every later launch (pytorch/pytorch#144455); and when only
    some sessions tore it down, the first one that did caught no kernels on the H200 (0 kernels in the host split
    that followed the mfu section's first kernel profile, runs 6 and 7, 2026-11-27/28), while sessions that all began
    after a teardown caught them."""
    os.environ.setdefault("TEARDOWN_CUPTI", "1")


WARM_STEPS = 3  # steps a newly built loader runs before its timed ones


def _timed(setup: Any, groups: Iterator[list], steps: int, meter: Any) -> dict:
    """Wall, data-wait and issue milliseconds per step over ``steps`` steps, one sync at each end."""
    from maxout.metrics import sync  # lazy: imports torch
    from maxout.train.loop import train_step  # lazy: imports torch

    device = setup.device.torch_device
    data_s = issue_s = 0.0
    sync(device)
    began = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        group = next(groups)
        t1 = time.perf_counter()
        train_step(setup, group, meter)
        data_s, issue_s = data_s + t1 - t0, issue_s + time.perf_counter() - t1
    sync(device)
    wall_s = time.perf_counter() - began
    return {"wall_ms": 1e3 * wall_s / steps, "data_ms": 1e3 * data_s / steps, "issue_ms": 1e3 * issue_s / steps}


def other_workers(loader: Any) -> int:
    """The worker count to compare the run's with: none where it has workers, else auto's (0 on a 2-core machine:
    nothing to compare)."""
    from maxout.optimizations.dataloader import auto_workers  # lazy: imports torch

    return 0 if loader.num_workers > 0 else auto_workers(os.cpu_count() or 1)


def other_loader(loader: Any, workers: int) -> Any:
    """The same batches with ``workers`` worker processes (0: collated in the training process, no worker's batch
    to unpickle, no pin-memory thread beside the one that launches kernels), built as the trainer builds its own
    (optimizations/dataloader.py); its workers end with the comparison."""
    from maxout.optimizations.dataloader import LoaderSettings, apply  # lazy: imports torch

    settings = LoaderSettings(workers, loader.pin_memory, persistent_workers=False,
                              prefetch_factor=(loader.prefetch_factor or 2) if workers else None)
    return apply(loader.dataset, loader.batch_sampler, loader.collate_fn, settings)


def split(setup: Any, steps: int = 10, counted: int = 5, profiled: int = 3, top: int = 10,
          guards_every_call: bool = False) -> dict:
    """Per-step host figures over ``steps`` timed steps, ``counted`` ones (CUDA) and ``profiled`` profiled ones;
    milliseconds per optimizer step. ``guards_every_call``: where the compiled forward skips dynamo's guards for
    inputs already seen (hardware.skip_guards), also time the same steps with the guards at every call."""
    from maxout.metrics import Throughput  # lazy: imports torch
    from maxout.optimizations import skip_guards  # lazy: imports torch

    meter, workers = Throughput(setup.device.torch_device), setup.train_loader.num_workers
    # Each generator is closed when done: a DataLoader iterator left suspended mid-epoch keeps its worker processes,
    # which ignore SIGTERM (dataloader.py), so the interpreter's exit would wait on them for ever
    with closing(_steps(setup)) as groups:
        other = other_workers(setup.train_loader)
        out: dict[str, Any] = {"steps": steps, **_timed(setup, groups, steps, meter), "num_workers": workers,
                               "other_workers": other if other != workers else None, "other_loader": None}
        if other != workers:  # the same steps with the batches loaded the other way
            with closing(_steps(setup, other_loader(setup.train_loader, other))) as loaded:
                # untimed first: a new loader's workers start (spawn, imports) on its first batch, which the run's own
                # loader had long done (on the H200 that start-up read as ~50 ms of data wait a step over 10 steps)
                _timed(setup, loaded, WARM_STEPS, meter)
                out["other_loader"] = _timed(setup, loaded, steps, meter)
        if guards_every_call and isinstance(setup.forward, skip_guards.GuardSkippingForward):
            out["guards_every_call"] = _guards_every_call(setup, groups, steps, meter)
        out["syncs_per_step"] = _syncs(setup, groups, counted, meter) if setup.device.is_cuda else None
        out.update(_profiled(setup, groups, profiled, meter, top))
    return out


def _guards_every_call(setup: Any, groups: Iterator[list], steps: int, meter: Any) -> dict:
    """The same graph and batches with dynamo's guards evaluated at every call (the compiled forward itself, as
    hardware.skip_guards=false runs it), then with the skipping forward again: with the first timing, A B A. At batch 64
    under CUDA graphs the host sets the pace, and dynamo's cache lookup was 1.81 ms of its 13.7 ms a step (run 7)."""
    skipping = setup.forward
    setup.forward = skipping.__wrapped__
    try:
        guarded = _timed(setup, groups, steps, meter)
    finally:
        setup.forward = skipping
    return {**guarded, "skipping_again": _timed(setup, groups, steps, meter)}


def _syncs(setup: Any, groups: Iterator[list], steps: int, meter: Any) -> float:
    """Synchronizing operations per step over ``steps`` steps, by CUDA's sync debug mode."""
    from maxout.insight.breakdown import SyncCounter  # lazy: imports torch
    from maxout.train.loop import train_step  # lazy: imports torch

    counter = SyncCounter(setup.device.torch_device, setup.optimizer)
    counter.open()
    try:
        for _ in range(steps):
            train_step(setup, next(groups), meter)
    finally:
        counter.close()
    return counter.count / steps


def _profiled(setup: Any, groups: Iterator[list], steps: int, meter: Any, top: int) -> dict:
    """Kernel time, launch calls and the busiest host ops per step over ``steps`` profiled steps (none: all None)."""
    out: dict[str, Any] = {"profiled_steps": steps, "kernel_ms": None, "kernels_per_step": None, "launch_ms": None,
                           "launches_per_step": None, "host_ops_ms": None, "top_host": [], "blocking": None}
    if not steps:
        return out
    import torch  # lazy: the report's parent process never imports torch
    from torch.profiler import ProfilerActivity, profile

    from maxout.metrics import sync  # lazy: imports torch
    from maxout.train.loop import train_step  # lazy: imports torch

    cuda = setup.device.is_cuda
    teardown_cupti()
    for attempt in (1, 2):  # a second session where the first caught no kernel (CUPTI's state, see teardown_cupti)
        with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
            for _ in range(steps):
                train_step(setup, next(groups), meter)
            sync(setup.device.torch_device)
        averages = prof.key_averages()
        if not cuda or any(e.device_type == torch.autograd.DeviceType.CUDA for e in averages):
            break
    out["profile_attempts"] = attempt
    out["launch_sources"] = launch_sources(prof.events(), steps)
    kernel_ms = kernels = launch_ms = launches = 0.0
    host: dict[str, float] = {}
    blocking: dict[str, dict] = {}
    for event in averages:
        if cuda and event.device_type == torch.autograd.DeviceType.CUDA:
            kernel_ms += event.self_device_time_total / 1e3
            kernels += event.count
        elif event.device_type == torch.autograd.DeviceType.CPU:
            if LAUNCH.match(event.key):
                launch_ms, launches = launch_ms + event.self_cpu_time_total / 1e3, launches + event.count
            if BLOCKING.match(event.key):
                b = blocking.setdefault(event.key, {"calls_per_step": 0.0, "ms_per_step": 0.0})
                b["calls_per_step"] += event.count / steps
                b["ms_per_step"] += event.self_cpu_time_total / 1e3 / steps
            host[event.key] = host.get(event.key, 0.0) + event.self_cpu_time_total / 1e3
    ranked = sorted(host.items(), key=lambda kv: -kv[1])[:top]
    out.update({"kernel_ms": kernel_ms / steps if cuda else None, "kernels_per_step": kernels / steps if cuda else None,
                "launch_ms": launch_ms / steps, "launches_per_step": launches / steps,
                "host_ops_ms": sum(host.values()) / steps,
                "top_host": [{"op": name[:100], "ms_per_step": ms / steps} for name, ms in ranked],
                "blocking": dict(sorted(blocking.items(), key=lambda kv: -kv[1]["ms_per_step"]))})
    return out


def launch_sources(events: Any, steps: int, top: int = 8) -> list[dict]:
    """Launch calls per step by the outermost op above each one on its thread: the optimizer's step, an autograd
    node, a compiled graph's call, a copy. With CUDA graphs the H200's batch-64 step still made 272 launch calls
    (run 7): this says which work runs outside the recorded graphs."""
    counts: dict[str, int] = {}
    for event in events:
        if LAUNCH.match(event.name):
            outer = event
            while outer.cpu_parent is not None:
                outer = outer.cpu_parent
            counts[outer.name] = counts.get(outer.name, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
    return [{"op": name[:100], "per_step": count / steps} for name, count in ranked]


def markdown(rows: dict[str, dict]) -> list[str]:
    """A table of ``split`` results, one row per run name, then each run's busiest host ops."""
    if not rows:
        return []
    fmt = lambda v, spec: "–" if v is None else format(v, spec)  # noqa: E731
    lines = ["| run | wall ms/step | data wait ms | issue ms (train_step returns) | kernel ms | kernels | "
             "launch calls (CPU ms) | ops' CPU self ms (profiled) | syncs/step | blocking CUDA calls (CPU ms) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        launches = "–" if r["launch_ms"] is None else f"{r['launches_per_step']:.0f} ({r['launch_ms']:.2f})"
        blocking = r.get("blocking")
        waits = "–" if blocking is None else ", ".join(
            f"{n} {b['calls_per_step']:.1f} ({b['ms_per_step']:.2f})" for n, b in blocking.items()) or "none"
        lines.append(f"| {name} | {r['wall_ms']:.2f} | {r['data_ms']:.2f} | {r['issue_ms']:.2f} | "
                     f"{fmt(r['kernel_ms'], '.2f')} | {fmt(r['kernels_per_step'], '.0f')} | {launches} | "
                     f"{fmt(r['host_ops_ms'], '.2f')} | {fmt(r['syncs_per_step'], '.1f')} | {waits} |")
        if r.get("other_loader"):
            m, other = r["other_loader"], r["other_workers"]
            plural = "es" if other > 1 else ""
            how = "collated in the training process" if other == 0 else f"from {other} worker process{plural}"
            lines.append(f"| {name}, batches {how} (num_workers={other}, not {r['num_workers']}) | "
                         f"{m['wall_ms']:.2f} | {m['data_ms']:.2f} | {m['issue_ms']:.2f} | – | – | – | – | – | – |")
        if r.get("guards_every_call"):
            g = r["guards_every_call"]
            for how, m in (("dynamo's guards at every call (hardware.skip_guards=false)", g),
                           ("guards skipped again for inputs already seen", g["skipping_again"])):
                lines.append(f"| {name}, {how} | {m['wall_ms']:.2f} | {m['data_ms']:.2f} | {m['issue_ms']:.2f} | "
                             f"– | – | – | – | – | – |")
    for name, r in [(n, r) for n, r in rows.items() if r["top_host"]]:
        ops = ", ".join(f"`{o['op'][:60]}` {o['ms_per_step']:.2f}" for o in r["top_host"][:6])
        again = " (a second profile: the first caught no kernel)" if r.get("profile_attempts") == 2 else ""
        lines.append(f"\n{name}, host ops with the most CPU self time (ms per step){again}: {ops}.")
        if r.get("launch_sources"):
            made = ", ".join(f"`{o['op'][:60]}` {round(o['per_step'], 1):g}" for o in r["launch_sources"])
            lines.append(f"\n{name}, launch calls per step by the outermost op that made them: {made}.")
    return lines

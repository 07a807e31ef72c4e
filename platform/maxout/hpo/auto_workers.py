"""``hpo.workers``: the number of worker processes, measured for ``auto``, checked against the device otherwise.

``auto`` measures, it does not guess: N = 1, 2, 4, ... probe processes (probe.py) train the study's own config at
once, each in the share of the device a worker would get (placement.py), and their summed steady throughput is
compared. Doubling stops when it gains less than ``MIN_GAIN`` (or the device's capacity is reached), and the
fastest N wins. Whether a second worker pays depends on what one leaves idle: a small model on a big GPU, or a CPU
whose cores one process does not keep busy (torch's threads scale badly at small batches). The figures go to the
parent run (``hpo.workers_reason``) and to a cache beside the study (``hpo_workers.json``), keyed by what changes
them, so the next study on the same device, model and batch reuses them.

On a GPU the one-worker probe also measures the memory a worker's training needs; more workers than a GPU's memory
holds are refused with the number that fits (placement.check_memory), for ``auto`` and for a given number alike.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..config import Config
from ..errors import MaxoutError, first_line
from ..hardware import DeviceInfo
from . import placement

MIN_GAIN = 0.10  # a doubling that adds less than 10% throughput is not worth the memory and the noisier trials
PROBE_STEPS = {"cpu": 12, "cuda": 40}  # optimizer steps per probe: a few seconds either way, after 3 warm-up steps
PROBE_TIMEOUT_S = 600


@dataclass
class Choice:
    workers: int
    reason: str
    rates: dict = field(default_factory=dict)  # workers -> summed steady samples/s
    need_gb: Optional[float] = None  # GPU: one worker's peak reserved memory
    cached: bool = False


# A probe round: (overrides, slots, steps) -> one result dict per slot (probe.measure's).
Prober = Callable[[Sequence[str], list, int], list]


def run_probes(overrides: Sequence[str], slots: list, steps: int) -> list[dict]:
    """Start one probe process per slot at once; their results, or a one-line error with the first failure."""
    args = json.dumps({"overrides": list(overrides), "steps": steps})
    procs = []
    for slot in slots:
        log = tempfile.TemporaryFile(mode="w+")
        procs.append((subprocess.Popen([sys.executable, "-m", "maxout.hpo.probe", args],
                                       env={**os.environ, **slot.env()}, stdout=log, stderr=subprocess.STDOUT),
                      log))
    results = []
    try:
        for proc, log in procs:
            code = proc.wait(PROBE_TIMEOUT_S)
            log.seek(0)
            out = log.read()
            found = [line for line in out.splitlines() if line.startswith("MAXOUT_PROBE ")]
            if code != 0 or not found:
                last = next((line for line in reversed(out.splitlines()) if line.strip()), f"exit {code}")
                raise MaxoutError(f"hpo.workers=auto: the throughput probe with {len(slots)} worker(s) failed "
                                  f"({first_line(last)}); set hpo.workers to a number")
            results.append(json.loads(found[-1][len("MAXOUT_PROBE "):]))
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return results


def cache_key(cfg: Config, device: DeviceInfo) -> str:
    """What changes the throughput of N workers: the device, the model, the batch, the length, the precision."""
    hw, mc = cfg.hardware, cfg.model
    where = (f"{device.count}x {device.name} {device.total_memory_gb} GiB" if device.is_cuda
             else f"cpu {device.name} x{device.cpu_count}")
    return " | ".join([where, f"model {mc.name} ({mc.path or mc.name_or_path})", f"adapter {mc.adapter}",
                       f"length {cfg.data.max_length}", f"padding {cfg.data.padding}", f"batch {cfg.batch_size}",
                       f"target {cfg.train.target_effective_batch}", f"precision {hw.precision}",
                       f"compile {hw.compile}", f"checkpointing {hw.gradient_checkpointing}",
                       f"torch {device.torch_version}"])


def _read(path: Path) -> dict:
    try:
        table = json.loads(path.read_text())
        return table if isinstance(table, dict) else {}
    except (OSError, ValueError):
        return {}  # missing or damaged: measured again


def _store(path: Path, key: str, choice: Choice) -> None:
    table = _read(path)
    entry = table.get(key, {})
    if choice.rates:  # an auto measurement (a memory check alone keeps an earlier one's rates)
        entry["rates"] = {str(k): v for k, v in choice.rates.items()}
    if choice.need_gb is not None:
        entry["need_gb"] = choice.need_gb
    entry["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    table[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
    os.replace(tmp, path)


def pick(rates: dict[int, float]) -> int:
    """The fewest workers within MIN_GAIN of the fastest: more workers only where they pay."""
    best = max(rates.values())
    return min(n for n, r in rates.items() if r * (1 + MIN_GAIN) >= best)


def describe(rates: dict[int, float], chosen: int, device: DeviceInfo) -> str:
    steps = ", ".join(f"{n} -> {r:.1f}" for n, r in sorted(rates.items()))
    on = f"{device.count} GPU(s)" if device.is_cuda else f"{device.cpu_count} CPU cores"
    return (f"auto: {chosen} worker(s); summed steady samples/s of N probe workers at once on {on}: {steps} "
            f"(more workers only for >= {MIN_GAIN:.0%} more)")


def measure(overrides: Sequence[str], cfg: Config, device: DeviceInfo, most: int,
            prober: Prober = run_probes) -> Choice:
    """Double N from 1 while throughput grows by MIN_GAIN and N fits (``most``, and on a GPU its memory)."""
    steps = PROBE_STEPS[device.torch_device]
    rates: dict[int, float] = {}
    need_gb: Optional[float] = None
    n = 1
    while True:
        results = prober(overrides, placement.slots(n, device), steps)
        # n x the slowest worker: the fastest may have finished its steps alone, which flatters the sum
        rates[n] = n * min(r["samples_per_s"] for r in results)
        if n == 1 and device.is_cuda:
            need_gb = max(r["peak_reserved_gb"] for r in results)
            most = min(most, max(1, placement.fits_per_gpu(need_gb, device) * device.count))
        if n > 1 and rates[n] < (1 + MIN_GAIN) * max(v for k, v in rates.items() if k < n):
            break
        if n >= most:
            break
        n = min(n * 2, most)
    chosen = pick(rates)
    return Choice(chosen, describe(rates, chosen, device), rates, need_gb)


def resolve(requested: object, overrides: Sequence[str], cfg: Config, device: DeviceInfo, cache_path: Path,
            prober: Prober = run_probes, left: Optional[int] = None) -> Choice:
    """The number of workers for ``hpo.workers=requested`` (an int or auto), checked against the device; never more
    than the ``left`` trials the study still has to run (None: no limit), and no measurement for one or none."""
    if requested == "auto" and left is not None and left <= 1:  # nothing to share
        return Choice(1, f"auto: {max(left, 0)} trial(s) left to run, so one worker, in this process")
    choice = _resolve(requested, overrides, cfg, device, cache_path, prober)
    if choice.workers > 1 and left is not None and 0 < left < choice.workers:
        choice.reason = f"{choice.reason}; {left} trial(s) left to run, so {left} worker(s)"
        choice.workers = left
    return choice


def _resolve(requested: object, overrides: Sequence[str], cfg: Config, device: DeviceInfo, cache_path: Path,
             prober: Prober) -> Choice:
    most = placement.capacity(device)
    if requested != "auto":
        workers = int(requested)  # type: ignore[call-overload]
        placement.check_count(workers, device)
        if workers > 1 and device.is_cuda:  # does each worker's share of the GPU hold its training?
            need = _need_gb(overrides, cfg, device, cache_path, prober)
            placement.check_memory(workers, device, need)
        return Choice(workers, "given" if workers > 1 else "given: one worker, in this process")
    key = cache_key(cfg, device)
    entry = _read(cache_path).get(key) if cfg.batch_finder.cache else None
    if entry and entry.get("rates"):
        rates = {int(k): float(v) for k, v in entry["rates"].items()}
        chosen = pick(rates)
        return Choice(chosen, describe(rates, chosen, device) + f" (measured {entry.get('measured_at')}, cached in "
                      f"{cache_path})", rates, entry.get("need_gb"), cached=True)
    choice = measure(overrides, cfg, device, most, prober)
    _store(cache_path, key, choice)
    return choice


def _need_gb(overrides: Sequence[str], cfg: Config, device: DeviceInfo, cache_path: Path, prober: Prober) -> float:
    """One worker's peak reserved GPU memory: from the cache, else one probe (and cached)."""
    key = cache_key(cfg, device)
    table = _read(cache_path)
    if cfg.batch_finder.cache and table.get(key, {}).get("need_gb") is not None:
        return float(table[key]["need_gb"])
    result = prober(overrides, placement.slots(1, device), PROBE_STEPS[device.torch_device])[0]
    need = float(result["peak_reserved_gb"])
    _store(cache_path, key, Choice(1, "", {}, need))
    return need

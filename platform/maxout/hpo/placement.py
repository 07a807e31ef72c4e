"""Where each of ``hpo.workers`` worker processes runs, and what share of the device it gets (pure: no processes).

- CPU: the cores are split between the workers (``OMP_NUM_THREADS``: torch's intra-op threads). A worker gets at
  least one core, so more workers than cores is refused: they would only take turns.
- GPU: workers go round-robin over the visible GPUs (``CUDA_VISIBLE_DEVICES`` per worker, the physical index when
  the supervisor itself was given a list), and the k workers on one GPU get 1/k of its memory each
  (``MAXOUT_DEVICE_SHARE``: hardware.apply_device_share holds the allocator to it, and the batch finder searches
  within it). A GPU holds as many workers as the memory of one worker's training fits; that is measured
  (auto_workers.py), and a share below it is refused (``check_memory``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError
from ..hardware import DEVICE_SHARE_VAR, DeviceInfo

# The most workers a GPU is asked to hold, whatever its memory: beyond that the kernels of small trials already
# overlap, and each CUDA context costs ~0.5 GiB.
MAX_PER_GPU = 8
# What a CUDA context and the allocator's fragmentation take beyond a worker's measured peak of reserved memory.
CUDA_CONTEXT_GB = 0.75


@dataclass(frozen=True)
class Slot:
    """One worker's place: its index, torch threads (CPU), GPU and share of that GPU's memory."""

    index: int
    threads: Optional[int] = None
    gpu: Optional[str] = None
    memory_share: float = 1.0

    def env(self) -> dict[str, str]:
        out = {DEVICE_SHARE_VAR: f"{self.memory_share:.6g}"}
        if self.threads is not None:  # both BLAS pools: MKL reads its own variable first
            out.update({"OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads)})
        if self.gpu is not None:
            out["CUDA_VISIBLE_DEVICES"] = self.gpu
        return out

    def describe(self) -> str:
        if self.gpu is not None:
            return f"GPU {self.gpu} ({self.memory_share:.0%} of its memory)"
        return f"{self.threads} CPU thread{'s' if self.threads != 1 else ''}"


def capacity(device: DeviceInfo) -> int:
    """The most workers this device can run at once (before memory is measured, on a GPU)."""
    return device.count * MAX_PER_GPU if device.is_cuda else device.cpu_count


def visible_gpus(device: DeviceInfo, visible: Optional[str] = None) -> list[str]:
    """The GPUs' ids as CUDA_VISIBLE_DEVICES names them: the supervisor's own list when it was given one."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    names = [v.strip() for v in given.split(",") if v.strip()] if given else []
    return names[:device.count] if names else [str(i) for i in range(device.count)]


def check_count(workers: int, device: DeviceInfo) -> None:
    """More workers than the device can run at once is a one-line error."""
    most = capacity(device)
    if workers <= most:
        return
    if device.is_cuda:
        raise ConfigError(f"hpo.workers={workers} is more than {device.count} GPU(s) can hold ({MAX_PER_GPU} workers "
                          f"per GPU at most): use hpo.workers<={most}, or auto to measure the best number")
    raise ConfigError(f"hpo.workers={workers} is more than this CPU's {device.cpu_count} cores can hold (a worker "
                      f"needs a core of its own): use hpo.workers<={most}, or auto to measure the best number")


def slots(workers: int, device: DeviceInfo, visible: Optional[str] = None) -> list[Slot]:
    """Each worker's place (check_count first). CPU: the cores split as evenly as they go (the first workers get
    the remainder). GPU: round-robin over the GPUs, each worker 1/k of its GPU's memory for its GPU's k workers."""
    check_count(workers, device)
    if not device.is_cuda:
        base, extra = divmod(device.cpu_count, workers)
        return [Slot(i, threads=base + (1 if i < extra else 0)) for i in range(workers)]
    gpus = visible_gpus(device, visible)
    on = [sum(1 for j in range(workers) if j % len(gpus) == g) for g in range(len(gpus))]
    return [Slot(i, gpu=gpus[i % len(gpus)], memory_share=1.0 / on[i % len(gpus)]) for i in range(workers)]


def per_gpu(workers: int, device: DeviceInfo) -> int:
    """The most workers that share one GPU (round-robin placement)."""
    return -(-workers // max(1, device.count)) if device.is_cuda else 1


def fits_per_gpu(need_gb: float, device: DeviceInfo) -> int:
    """How many workers, each needing ``need_gb`` of reserved memory plus a CUDA context, one GPU holds."""
    return max(0, min(MAX_PER_GPU, int(device.total_memory_gb // (need_gb + CUDA_CONTEXT_GB))))


def check_memory(workers: int, device: DeviceInfo, need_gb: float) -> None:
    """A GPU share smaller than one worker's measured need (``need_gb``: peak reserved memory of a training step at
    the study's batch) is a one-line error naming the number that fits."""
    if not device.is_cuda:
        return
    k, most = per_gpu(workers, device), fits_per_gpu(need_gb, device)
    if k > most:
        raise ConfigError(f"hpo.workers={workers} puts {k} workers on one {device.name} ({device.total_memory_gb:g} "
                          f"GiB), which holds {most}: one worker's training measured {need_gb:.1f} GiB, plus "
                          f"~{CUDA_CONTEXT_GB:g} GiB for its CUDA context; use hpo.workers<={most * device.count}, "
                          f"or auto")

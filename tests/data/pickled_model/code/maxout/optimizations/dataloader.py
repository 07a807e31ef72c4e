"""DataLoader knobs: workers (auto = cores - 2, at least 0; the processes of a data-parallel job on one node share
the cores), pinned memory, persistent workers, prefetch."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

from .base import Decision, decide


@dataclass
class LoaderSettings:
    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: Optional[int]


def auto_workers(cpu_count: int) -> int:
    return max(0, cpu_count - 2)


def supported_pin_memory(device: Any) -> tuple[bool, str]:
    return (True, "") if device.is_cuda else (False, "no CUDA device: pinned memory only speeds host-to-GPU copies")


def supported_worker_feature(num_workers: int) -> tuple[bool, str]:
    return (True, "") if num_workers > 0 else (False, "num_workers=0: data loads in the main process")


def resolve(hw: Any, device: Any, processes: int = 1) -> tuple[LoaderSettings, list[Decision]]:
    """``processes``: how many processes of the job run on this node (torchrun's LOCAL_WORLD_SIZE)."""
    if hw.num_workers == "auto":
        cores = device.cpu_count // max(1, processes)
        workers = auto_workers(cores)
        share = f"{device.cpu_count} cores / {processes} processes = {cores}" if processes > 1 else \
            f"{device.cpu_count} cores"
        d_workers = Decision("num_workers", "auto", workers, f"auto = max(0, {share} - 2)")
    else:
        workers = hw.num_workers
        d_workers = Decision("num_workers", workers, workers)
    d_pin = decide("pin_memory", hw.pin_memory, supported_pin_memory(device))
    d_persist = decide("persistent_workers", hw.persistent_workers, supported_worker_feature(workers))
    d_prefetch = decide("prefetch_factor", hw.prefetch_factor, supported_worker_feature(workers), off=None)
    settings = LoaderSettings(workers, d_pin.effective, d_persist.effective, d_prefetch.effective)
    return settings, [d_workers, d_pin, d_persist, d_prefetch]


def leave_sigterm_to_the_main_process(worker_id: int) -> None:
    """A worker's SIGTERM (a scheduler signals the whole process group) would otherwise kill it mid-batch, and
    the main process would fail with "DataLoader worker killed" while it closes the run as KILLED; the main
    process shuts its workers down itself."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def apply(dataset: Any, batches: Iterable[list[int]], collate: Callable, settings: LoaderSettings
          ) -> torch.utils.data.DataLoader:
    """``batches``: a batch sampler (or any iterable of index lists) deciding which rows form each batch."""
    extra = {}
    if settings.num_workers > 0:
        extra = {"persistent_workers": settings.persistent_workers, "prefetch_factor": settings.prefetch_factor,
                 "worker_init_fn": leave_sigterm_to_the_main_process}
    # Its own generator: each new iterator draws a worker seed, which must not come from the global RNG (dropout's):
    # a run resumed mid-epoch creates its iterator at another point of that stream and would drift.
    return torch.utils.data.DataLoader(dataset, batch_sampler=batches, collate_fn=collate,
                                       num_workers=settings.num_workers, pin_memory=settings.pin_memory,
                                       generator=torch.Generator(), **extra)

"""Where a training step's time goes, in the steady state: waiting for data, the optimizer step, the rest
(forward, backward, clipping), and how often the host waits for the device.

The probe runs the trainer's own loop (train/loop.fit) on the trainer's own set-up (train/setup.build) for the
config as it stands, with three instruments:

- the DataLoader's ``next()`` timed apart (the loader is wrapped; nothing else changes),
- the optimizer step timed by the optimizer's own step hooks (on CUDA with a device sync on both sides, so the
  kernels are charged to the step that launched them: those syncs make the probe's own throughput no figure to
  quote; the audit's throughput comes from uninstrumented runs),
- host syncs counted in a separate window after the timed one: on CUDA by torch's sync debug mode (every
  synchronizing operation warns), on a CPU, where nothing waits for a device, at the points that would:
  reads of a tensor's value on the host (``.item()``, ``.tolist()``, ``.cpu()``, ``bool()``, ...), counted by a
  torch function mode. That window spans a multiple of ``train.log_every`` steps, so the loop's once-per-interval
  loss read counts at its true rate.

The warm-up steps (``train.warmup_steps_excluded``: compile, allocator) come first and are left out.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

from .. import metrics
from ..config import Config
from .. import data as data_mod
from ..data import Dataset
from ..hardware import DeviceInfo
from ..tracking.tracker import NullTracker
from ..train.callbacks import Callback, TrainState
from ..train.loop import fit
from ..train.setup import Encode, build
from .levers import with_overrides

HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
              torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__}


@dataclass
class Breakdown:
    steps: int  # optimizer steps in the timed window
    window_s: float
    data_wait_s: float
    optimizer_s: float
    host_syncs: int
    sync_steps: int  # optimizer steps in the counting window
    sync_source: str

    def shares(self) -> dict[str, float]:
        window = max(self.window_s, 1e-9)
        rest = max(self.window_s - self.data_wait_s - self.optimizer_s, 0.0)
        return {"data_wait": self.data_wait_s / window, "optimizer": self.optimizer_s / window,
                "forward_backward": rest / window}

    @property
    def step_ms(self) -> float:
        return 1000 * self.window_s / max(self.steps, 1)

    @property
    def host_syncs_per_step(self) -> float:
        return self.host_syncs / max(self.sync_steps, 1)

    def metrics(self) -> dict[str, float]:
        shares = self.shares()
        return {"breakdown/data_wait_share": shares["data_wait"], "breakdown/optimizer_share": shares["optimizer"],
                "breakdown/forward_backward_share": shares["forward_backward"], "breakdown/step_ms": self.step_ms,
                "breakdown/host_syncs_per_step": self.host_syncs_per_step}


class TimedLoader:
    """The DataLoader with each ``next()`` timed: the time the training thread waits for a batch."""

    def __init__(self, loader: Any):
        self.loader, self.wait_s = loader, 0.0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator:
        batches = iter(self.loader)
        while True:
            began = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self.wait_s += time.perf_counter() - began
            yield batch


class OptimizerTimer:
    """Seconds inside ``optimizer.step()`` (GradScaler's step calls it too), from the optimizer's own hooks."""

    def __init__(self, optimizer: torch.optim.Optimizer, device_type: str):
        self.device_type, self.total_s, self.timing = device_type, 0.0, True
        self._began = 0.0
        self._hooks = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]

    def _pre(self, *args: Any) -> None:
        if self.timing:
            metrics.sync(self.device_type)  # what was queued before the step is not the step's
            self._began = time.perf_counter()

    def _post(self, *args: Any) -> None:
        if self.timing:
            metrics.sync(self.device_type)
            self.total_s += time.perf_counter() - self._began

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


class HostReads(TorchFunctionMode):
    """Counts host reads of tensor values: the points where a CUDA run would wait for its device. ``host_tensors``
    are read without a wait on any device: AdamW's step counters, which torch keeps on the host unless the
    optimizer is fused or capturable (and then it never reads them)."""

    def __init__(self, host_tensors: set) -> None:
        super().__init__()
        self.count, self.host_tensors = 0, host_tensors

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func in HOST_READS and not (args and id(args[0]) in self.host_tensors):
            self.count += 1
        return func(*args, **(kwargs or {}))


class SyncCounter:
    """Host syncs while open: CUDA's sync debug mode warnings, or host reads on a CPU."""

    def __init__(self, device_type: str, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.cuda = device_type == "cuda"
        self.source = ("torch.cuda.set_sync_debug_mode (synchronizing operations)" if self.cuda else
                       "host reads of tensor values (.item(), .tolist(), .cpu(), bool(), ...): where a GPU would sync")
        self.count, self._context = 0, None

    def open(self) -> None:
        if self.cuda:
            self._context = warnings.catch_warnings(record=True)
            self._records = self._context.__enter__()
            warnings.simplefilter("always")  # every occurrence, not once per line
            self._previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        else:
            steps = {id(state["step"]) for state in self.optimizer.state.values() if "step" in state}
            self._context = HostReads(steps)
            self._context.__enter__()

    def close(self) -> None:
        if self._context is None:
            return
        if self.cuda:
            torch.cuda.set_sync_debug_mode(self._previous)
            self.count = sum("synchroniz" in str(w.message) for w in self._records)
        else:
            self.count = self._context.count
        self._context.__exit__(None, None, None)
        self._context = None


class Windows(Callback):
    """Snapshots at the window edges: after the warm-up, after the timed window, after the counting window."""

    def __init__(self, warmup: int, timed: int, counted: int, loader: TimedLoader, optimizer: OptimizerTimer,
                 syncs: SyncCounter, device_type: str):
        self.edges = (warmup, warmup + timed, warmup + timed + counted)
        self.loader, self.optimizer, self.syncs, self.device_type = loader, optimizer, syncs, device_type
        self.marks: dict[int, tuple[float, float, float]] = {}

    def on_step_end(self, state: TrainState) -> None:
        if state.step not in self.edges:
            return
        metrics.sync(self.device_type)  # the window edges only: a step's kernels belong to that step
        self.marks[state.step] = (time.perf_counter(), self.loader.wait_s, self.optimizer.total_s)
        if state.step == self.edges[1]:
            self.optimizer.timing = False  # its syncs must not be counted
            self.syncs.open()
        elif state.step == self.edges[2]:
            self.syncs.close()


def sync_window(steps: int, log_every: int) -> int:
    """Steps to count syncs over: a multiple of ``log_every`` near ``steps`` (at most 4x it), so every interval's
    loss read is seen at its true rate."""
    whole = log_every * math.ceil(steps / log_every)
    return whole if whole <= 4 * steps else steps


def probe(cfg: Config, device: DeviceInfo, dataset: Dataset, tokenizer: Any, micro_batch: int,
          steps: int, encode: Encode = data_mod.encode) -> Breakdown:
    """Time ``steps`` steady optimizer steps of ``cfg`` apart, then count the host syncs over about as many.
    ``encode``: data.encode, or a warm start's cache of it (the audit's, whose runs tokenized the tables)."""
    warmup = max(1, cfg.train.warmup_steps_excluded)
    counted = sync_window(steps, cfg.train.log_every)
    # One step past the counting window: the loop also reads the loss at its last step, whatever log_every says.
    run_cfg = with_overrides(cfg, [f"train.max_steps={warmup + steps + counted + 1}", "train.eval_interval=0"])
    s = build(run_cfg, device, dataset, tokenizer, micro_batch=micro_batch, encode=encode)
    loader = TimedLoader(s.train_loader)
    s.train_loader = loader
    optimizer = OptimizerTimer(s.optimizer, device.torch_device)
    syncs = SyncCounter(device.torch_device, s.optimizer)
    windows = Windows(warmup, steps, counted, loader, optimizer, syncs, device.torch_device)
    try:
        fit(s, NullTracker(), [windows], progress=False)
    finally:
        syncs.close()  # if the run stopped inside the counting window
        optimizer.remove()
    (t0, data0, opt0), (t1, data1, opt1) = windows.marks[windows.edges[0]], windows.marks[windows.edges[1]]
    return Breakdown(steps=steps, window_s=t1 - t0, data_wait_s=data1 - data0, optimizer_s=opt1 - opt0,
                     host_syncs=syncs.count, sync_steps=counted, sync_source=syncs.source)

"""What a run measured about itself, over all its segments: a run resumed from a checkpoint goes on from the
figures saved with it, so its final ``perf/*`` and ``time/*`` describe all the training that happened, never only
the last process's share (which is 0 samples for a run resumed after its last step).

- throughput: the checkpoint's counters (samples, tokens, steps, training-window seconds) plus this segment's, so
  ``perf/samples_per_s`` = ``train/samples`` / ``time/train_window_s`` over the run. Steps redone after a crash
  count once: the counters are those of the checkpoint the run continued from.
- ``time/wall_s``, ``time/compile_s``, ``time/compile_graphs``, ``time/eval_s`` and ``time/checkpoint_s``: summed
  over the segments (up to each one's checkpoint).
- evaluations and checkpoint saves are outside the training window (``outside_window``): they are not training, and
  a checkpoint after the last step (BERT-base with AdamW: 1.3 GB copied off the device and written) had counted in
  ``perf/steady_*``, ~2 s of a 5 s window at batch 64 on an H200 (GPU report 2026-11-26, run 3).
- peak memory: the highest of the segments.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

from .. import metrics as m
from ..optimizations import compile as compile_opt


class Totals:
    """The run's figures so far: the earlier segments' (``measured``, from the checkpoint) and this one's."""

    def __init__(self, device_type: str, warmup_steps: int, measured: dict[str, Any]):
        self.device_type, self.earlier = device_type, measured
        self.meter = m.Throughput(device_type, warmup_steps=warmup_steps)
        if measured.get("meter"):
            self.meter.load_state_dict(measured["meter"])
        self.wall_start, self.compile_before = time.perf_counter(), compile_opt.compile_seconds()
        self.graphs_before = compile_opt.compiled_graphs()
        self.outside_s = {"eval": 0.0, "checkpoint": 0.0}  # this segment's seconds outside the window, by kind

    @contextlib.contextmanager
    def outside_window(self, kind: str) -> Iterator[None]:
        """A pause in training that is not training (``kind``: eval or checkpoint): out of the throughput window
        (and the GPU's steady window), its seconds counted as ``time/<kind>_s``. One sync each way."""
        running = self.meter.running  # inside another pause (or before the first step): leave the meter be
        if running:
            self.meter.pause()
        started = time.perf_counter()
        try:
            yield
        finally:
            self.outside_s[kind] += time.perf_counter() - started
            if running:
                self.meter.resume()

    def so_far(self) -> dict[str, Any]:
        """Everything measured up to now, earlier segments included: what a checkpoint saves."""
        earlier_peaks = self.earlier.get("peak_memory", {})
        peaks = {k: max(v, earlier_peaks.get(k, 0.0)) for k, v in m.peak_memory(self.device_type).items()}
        return {"meter": self.meter.state_dict(),
                "wall_s": self.earlier.get("wall_s", 0.0) + time.perf_counter() - self.wall_start,
                "compile_s": self.earlier.get("compile_s", 0.0) + compile_opt.compile_seconds() - self.compile_before,
                "compile_graphs": (self.earlier.get("compile_graphs", 0) + compile_opt.compiled_graphs()
                                   - self.graphs_before),
                **{f"{k}_s": self.earlier.get(f"{k}_s", 0.0) + v for k, v in self.outside_s.items()},
                "peak_memory": peaks}

    def summary(self) -> dict[str, float]:
        """The run's throughput, time and memory metrics, over all its segments."""
        now = self.so_far()
        return {**self.meter.summary(), **now["peak_memory"], "time/wall_s": now["wall_s"],
                "time/compile_s": now["compile_s"], "time/compile_graphs": now["compile_graphs"],
                **{f"time/{k}_s": now[f"{k}_s"] for k in self.outside_s}}

"""What a run measured about itself, over all its segments: a run resumed from a checkpoint goes on from the
figures saved with it, so its final ``perf/*`` and ``time/*`` describe all the training that happened, never only
the last process's share (which is 0 samples for a run resumed after its last step).

- throughput: the checkpoint's counters (samples, tokens, steps, training-window seconds) plus this segment's, so
  ``perf/samples_per_s`` = ``train/samples`` / ``time/train_window_s`` over the run. Steps redone after a crash
  count once: the counters are those of the checkpoint the run continued from.
- ``time/wall_s``, ``time/compile_s`` and ``time/eval_s``: summed over the segments (up to each one's checkpoint).
- peak memory: the highest of the segments.
"""

from __future__ import annotations

import time
from typing import Any

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
        self.eval_s = 0.0  # this segment's evaluation seconds, added by the loop

    def so_far(self) -> dict[str, Any]:
        """Everything measured up to now, earlier segments included: what a checkpoint saves."""
        earlier_peaks = self.earlier.get("peak_memory", {})
        peaks = {k: max(v, earlier_peaks.get(k, 0.0)) for k, v in m.peak_memory(self.device_type).items()}
        return {"meter": self.meter.state_dict(),
                "wall_s": self.earlier.get("wall_s", 0.0) + time.perf_counter() - self.wall_start,
                "compile_s": self.earlier.get("compile_s", 0.0) + compile_opt.compile_seconds() - self.compile_before,
                "eval_s": self.earlier.get("eval_s", 0.0) + self.eval_s,
                "peak_memory": peaks}

    def summary(self) -> dict[str, float]:
        """The run's throughput, time and memory metrics, over all its segments."""
        now = self.so_far()
        return {**self.meter.summary(), **now["peak_memory"], "time/wall_s": now["wall_s"],
                "time/compile_s": now["compile_s"], "time/eval_s": now["eval_s"]}

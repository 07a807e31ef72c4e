"""Out-of-memory recovery: halve the rows per forward pass, double the accumulation, retry the same step.

The DataLoader keeps yielding the micro-batches it was built for; after k out-of-memory errors every loaded
micro-batch runs as 2**k row chunks, each chunk's loss weighted by its share of the rows. The gradient is the same
sum as before (the losses are per-row means), so the samples per optimizer step, the number of steps and the
schedule do not change: only the memory per forward pass does. Hugging Face's auto batch size instead shrinks the
batch the optimizer sees, which changes the training itself.
"""

from __future__ import annotations

import gc
import math
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..errors import OutOfMemory
from ..optimizations import bin_packing, packing
from ..tracking.tracker import Tracker

SPLIT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "labels")


@dataclass
class OOMRecovery:
    enabled: bool = True  # off for the batch finder's probes: there an out-of-memory error is the answer
    halvings: int = 0
    events: list = field(default_factory=list)  # one dict per recovered out-of-memory error
    tracker: Optional[Tracker] = None  # where events are logged as they happen (attach() it before training)

    def attach(self, tracker: Tracker) -> None:
        self.tracker = tracker

    def rows_per_forward(self, rows: int) -> int:
        return math.ceil(rows / 2**self.halvings)

    def split(self, batch: dict) -> list[tuple[dict, float]]:
        """``batch`` as row chunks, each with its share of the rows (the weight of its mean loss)."""
        rows = len(batch["labels"])
        size = self.rows_per_forward(rows)
        if size >= rows:
            return [(batch, 1.0)]
        if isinstance(batch.get("packing"), bin_packing.BinnedLayout):  # bins split into chunks of whole bins
            return bin_packing.split(batch, size)
        if "packing" in batch:  # a packed row splits into packed chunks of whole samples
            return packing.split(batch, size)
        return [({k: batch[k][i:i + size] for k in SPLIT_KEYS if k in batch}, min(size, rows - i) / rows)
                for i in range(0, rows, size)]

    def halve(self, message: str, micro_batches: list, step: int, device_type: str) -> None:
        """Record an out-of-memory error at ``step`` and split finer, or give up when one row did not fit."""
        rows = max(len(b["labels"]) for b in micro_batches)
        length = max(b["input_ids"].shape[1] for b in micro_batches)
        free_cached(device_type)
        if self.rows_per_forward(rows) <= 1:
            raise OutOfMemory(
                f"out of memory at step {step} with a single row per forward pass (sequence length {length}): "
                f"the model does not fit at this length; lower data.max_length, set "
                f"hardware.gradient_checkpointing=true, use model.adapter=lora, or pick a smaller model ({message})")
        before = self.rows_per_forward(rows)
        self.halvings += 1
        event = {"step": step, "rows_before": before, "rows_after": self.rows_per_forward(rows),
                 "chunks": 2**self.halvings, "sequence_length": length}
        self.events.append(event)
        note = (f"out of memory at step {step} (sequence length {length}): {before} -> {event['rows_after']} rows "
                f"per forward pass, accumulation x{event['chunks']}; the effective batch is unchanged")
        print(f"maxout: {note}", file=sys.stderr)
        if self.tracker is not None:
            self.tracker.log_metrics({"train/oom_events": float(len(self.events)),
                                      "train/micro_batch": float(event["rows_after"])}, step=step)
            self.tracker.set_tags({"maxout.oom_recovery": note})


def free_cached(device_type: str) -> None:
    """Give the failed attempt's memory back to the device (call outside the except block: its traceback pins
    tensors). On a CPU reference counting already freed them."""
    if device_type == "cuda":
        gc.collect()  # reference cycles can hold activations
        torch.cuda.empty_cache()

"""Evaluation that accumulates on the device and syncs once, at the end; and when the loop evaluates. With several
processes each rank evaluates its share of the split and the counts are summed over the ranks before scoring, so
every rank gets the metrics of the whole split.

It runs the eager module even when training is compiled: a no-grad graph would be a second full compile
(~20-40 s), while evaluation is a small share of the run. It reuses the loaders built at set-up (the test split's
loader is built once, at the end) and keeps nothing but a confusion matrix on the device: accuracy, macro-F1 and
per-class precision / recall / F1 all follow from it on the host (metrics.classification_scores).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..metrics import classification_scores, confusion_matrix
from .setup import Setup


@dataclass
class Evaluation:
    """One pass over a split: its metrics (``<split>/loss``, ``/accuracy``, ``/macro_f1``, per class
    ``/<score>/<label>``) and the confusion matrix they come from (rows: true label, columns: predicted)."""

    metrics: dict[str, float]
    confusion: list[list[int]] = field(default_factory=list)


@torch.no_grad()
def evaluate(s: Setup, loader: Optional[Any] = None, split: str = "eval") -> Evaluation:
    """The validation set (or ``loader``'s split) scored by the model as it is now."""
    device, k = s.device.torch_device, s.dataset.num_labels
    s.model.eval()
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    counts = torch.zeros(k * k, device=device, dtype=torch.long)
    for batch in loader if loader is not None else s.eval_loader:
        inputs = s.model_inputs(batch)  # eager: the attention mask prepared where prepared_mask is on
        with s.precision.autocast():
            out = s.classifier(**inputs)
        loss_sum += out.loss.double() * inputs["labels"].numel()
        counts += confusion_matrix(out.logits.argmax(dim=-1), inputs["labels"], k).flatten()
    s.model.train()
    summed = s.world.all_reduce(torch.cat([loss_sum.view(1), counts.double()]))  # every rank's share (no-op alone)
    read = summed.tolist()  # the one host sync
    confusion = [[int(x) for x in read[1 + r * k:1 + (r + 1) * k]] for r in range(k)]
    total = sum(map(sum, confusion))
    metrics = {f"{split}/loss": read[0] / total if total else math.nan,
               **classification_scores(confusion, s.dataset.label_names, split)}
    return Evaluation(metrics, confusion)


def evaluation_steps(steps_per_epoch: int, total_steps: int, eval_interval: int, every_epochs: float) -> set[int]:
    """The optimizer steps after which the loop evaluates: every ``eval_interval`` steps, or (interval 0) every
    ``every_epochs`` of an epoch (rounded to a step; 1.0: each epoch end), and always after the last step."""
    if eval_interval:
        return set(range(eval_interval, total_steps + 1, eval_interval)) | {total_steps}
    span = every_epochs * steps_per_epoch
    count = math.ceil(total_steps / span - 1e-9)
    return {min(total_steps, max(1, math.floor(i * span + 0.5))) for i in range(1, count + 1)} | {total_steps}

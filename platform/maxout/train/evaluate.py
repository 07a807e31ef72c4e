"""Evaluation that accumulates on the device and syncs once, at the end. With several processes each rank
evaluates its share of the validation set and the counts are summed over the ranks before scoring, so every rank
gets the metrics of the whole set.

It runs the eager module even when training is compiled: a no-grad graph would be a second full compile
(~20-40 s), while evaluation is a small share of the run.
"""

from __future__ import annotations

import torch

from ..config import EVAL_METRICS
from ..data import MODEL_INPUTS
from ..metrics import classification_counts, scores_from_counts
from .setup import Setup


@torch.no_grad()
def evaluate(s: Setup) -> dict[str, float]:
    """``config.EVAL_METRICS`` on the validation set."""
    device = s.device.torch_device
    s.model.eval()
    loss_sum = torch.zeros((), device=device)
    preds, labels = [], []
    for batch in s.eval_loader:
        inputs = {k: batch[k].to(device, non_blocking=True) for k in MODEL_INPUTS if k in batch}
        with s.precision.autocast():
            out = s.model(**inputs)
        loss_sum += out.loss.float() * inputs["labels"].numel()
        preds.append(out.logits.argmax(dim=-1))
        labels.append(inputs["labels"])
    s.model.train()
    counts = torch.cat([loss_sum.reshape(1), classification_counts(torch.cat(preds), torch.cat(labels),
                                                                   s.dataset.num_labels)])
    counts = s.world.all_reduce(counts)  # every rank's share summed (a no-op in one process)
    scores = scores_from_counts(counts[1:], s.dataset.num_labels)
    values = torch.stack([counts[0] / counts[1], scores["accuracy"], scores["macro_f1"]]).tolist()  # one sync
    return dict(zip(EVAL_METRICS, values))

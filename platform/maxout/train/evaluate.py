"""Evaluation that accumulates on the device and syncs once, at the end.

It runs the eager module even when training is compiled: a no-grad graph would be a second full compile
(~20-40 s), while evaluation is a small share of the run.
"""

from __future__ import annotations

import torch

from ..config import EVAL_METRICS
from ..data import MODEL_INPUTS
from ..metrics import classification_metrics
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
            out = s.classifier(**inputs)
        loss_sum += out.loss.float() * inputs["labels"].numel()
        preds.append(out.logits.argmax(dim=-1))
        labels.append(inputs["labels"])
    s.model.train()
    preds_t, labels_t = torch.cat(preds), torch.cat(labels)
    scores = classification_metrics(preds_t, labels_t, s.dataset.num_labels)
    values = torch.stack([loss_sum / labels_t.numel(), scores["accuracy"], scores["macro_f1"]]).tolist()  # one sync
    return dict(zip(EVAL_METRICS, values))

"""Divergence: a non-finite loss or gradient norm ends the run FAILED, naming the step where it first appeared.

A diverged run must not finish: its weights are NaN, yet evaluation would still score them (argmax of NaN
logits is a class) and the run would log, register and promote that model. Checking each step on the host
would add a device sync per step, and the loop has exactly one per ``train.log_every`` steps. So the watch keeps,
on the device, the step number, loss and gradient norm of the first step where either was not finite
(``torch.where``, never ``.item()``), and reads that record only where the host waits for the device anyway: at
each log step, before each evaluation and checkpoint, and at the end of training. The run then fails before the
diverged model is evaluated, checkpointed or logged. The last update of all shows in no training loss: an
evaluation loss that is not finite fails the run the same way.

fp16's GradScaler expects the odd overflowing gradient: it skips that step and lowers the scale (its found_inf),
so under fp16 the gradient norm is left to it and only the loss is watched (a non-finite loss is the forward pass
itself, which no loss scale causes or cures).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch

from ..errors import Diverged
from ..tracking.tracker import Tracker

TAG = "maxout.diverged_at_step"


def total_norm(parameters: Iterable[torch.Tensor]) -> torch.Tensor:
    """The global gradient norm when clipping is off (clipping computes it anyway): one foreach pass, no sync."""
    grads = [p.grad for p in parameters if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads, foreach=True) if grads else torch.zeros(())


class DivergenceWatch:
    """The device-side record of the first non-finite step; ``check`` reads it at a sync point."""

    def __init__(self) -> None:
        self.first: Optional[torch.Tensor] = None  # [step, loss, grad norm] of the first bad step; step 0: none

    def record(self, step: int, loss: torch.Tensor, grad_norm: Optional[torch.Tensor],
               parameters: Iterable[torch.Tensor], scaler: Any) -> None:
        """After the step's backward pass; ``grad_norm`` is clipping's (None when clipping is off). No host sync."""
        if scaler.is_enabled():
            grad_norm = torch.zeros_like(loss)  # fp16: the GradScaler skips a step whose gradients overflowed
        elif grad_norm is None:
            grad_norm = total_norm(parameters)
        if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor (every rank records each step, so all take part)
            grad_norm = grad_norm.full_tensor()
        values = torch.stack((torch.full_like(loss, step, dtype=torch.float32), loss.float(),
                              grad_norm.to(loss.device, torch.float32)))
        if self.first is None:
            self.first = torch.zeros_like(values)
        new = self.first[0].eq(0) & ~torch.isfinite(values[1:]).all()
        self.first = torch.where(new, values, self.first)

    def check(self, setup: Any, tracker: Tracker, also: Optional[torch.Tensor] = None) -> Optional[float]:
        """Raise Diverged (and tag the run with the step) if a step was not finite. A host sync: call it only
        where the loop syncs anyway. ``also`` (a one-element tensor on the device, e.g. the summed training loss)
        comes back in the same transfer, so a log step reads the loss and the record in one sync."""
        if self.first is None:
            return None if also is None else also.item()
        values = self.first if also is None else torch.cat((self.first, also.reshape(1).to(self.first)))
        step, loss, norm, *extra = values.tolist()
        if step:
            fail(int(step), f"loss {loss:.4g}, gradient norm {norm:.4g}", setup, tracker)
        return extra[0] if extra else None

    def check_evaluation(self, metrics: dict, step: int, setup: Any, tracker: Tracker) -> None:
        """The last update can leave weights that no training step has run yet (``train.max_steps=1``): if they
        are not finite, evaluation's loss is NaN, and the model must not be scored, logged or registered."""
        loss = metrics.get("eval/loss")
        if loss is not None and not math.isfinite(loss):
            fail(step, f"the weights after it give an evaluation loss of {loss}", setup, tracker)


def fail(step: int, what: str, setup: Any, tracker: Tracker) -> None:
    """Tag the run with the step and raise the one-line error that ends it FAILED."""
    tracker.set_tags({TAG: step})
    raise Diverged(f"training diverged at step {step}: {what}; {usual_fixes(setup)}; the run ends FAILED and no "
                   f"model is logged", step=step)


def usual_fixes(setup: Any) -> str:
    """What usually helps, said with the run's own values."""
    cfg = setup.cfg
    fixes = [f"lower train.lr (now {cfg.train.lr:g})"]
    if setup.clip_norm:
        fixes.append(f"clip harder (train.max_grad_norm={setup.clip_norm:g} now)")
    else:
        fixes.append("clip gradients (train.max_grad_norm=1.0)")
    if setup.decision("precision").effective != "fp32":
        fixes.append("train in fp32 (hardware.precision=fp32)")
    return "try: " + ", ".join(fixes)

"""The loop's five hook points (see loop.py's docstring) and the state they see."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass
class TrainState:
    """Where training is. A checkpoint saves it; fit() continues from a restored one (resume)."""

    total_steps: int
    step: int = 0  # optimizer steps done
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches of this epoch consumed so far
    train_loss: float = float("nan")  # mean over the last log interval
    loss_sum: Any = 0.0  # loss summed since the last log step (a device tensor inside the loop)
    loss_steps: int = 0  # steps in loss_sum
    first_step_s: float = float("nan")
    eval_metrics: dict = field(default_factory=dict)
    measured: dict = field(default_factory=dict)  # throughput, time, memory up to the checkpoint resumed from
    totals: Any = None  # fit()'s running figures (totals.Totals); a checkpoint saves them as ``measured``
    eval_confusion: list = field(default_factory=list)  # the last evaluation's confusion matrix
    steps_per_epoch: int = 0  # set by fit()
    stop_reason: str = ""  # set by a callback (early stopping): the loop stops after this step


class Callback:
    """Override what you need. Hooks run in the loop's thread; on_step_end must not sync the device."""

    def on_train_start(self, state: TrainState) -> None: ...
    def on_step_end(self, state: TrainState) -> None: ...
    def on_evaluate(self, state: TrainState, metrics: dict) -> None: ...
    def on_epoch_end(self, state: TrainState) -> None: ...
    def on_train_end(self, state: TrainState) -> None: ...


class CallbackList(Callback):
    def __init__(self, callbacks: Sequence[Callback]):
        self.callbacks = list(callbacks)

    def on_train_start(self, state: TrainState) -> None:
        for c in self.callbacks:
            c.on_train_start(state)

    def on_step_end(self, state: TrainState) -> None:
        for c in self.callbacks:
            c.on_step_end(state)

    def on_evaluate(self, state: TrainState, metrics: dict) -> None:
        for c in self.callbacks:
            c.on_evaluate(state, metrics)

    def on_epoch_end(self, state: TrainState) -> None:
        for c in self.callbacks:
            c.on_epoch_end(state)

    def on_train_end(self, state: TrainState) -> None:
        for c in self.callbacks:
            c.on_train_end(state)

"""Model selection (``train.select_best``) and early stopping (``train.early_stopping``): one callback.

Every evaluation is compared with the best so far on ``train.select_best``'s metric (a loss goes down, a score
up; NaN never wins). An improvement snapshots the weights training changes: every trainable parameter, which is
the whole model when fine-tuning fully and only the adapter and the head under LoRA / DoRA (the frozen encoder
never changes, so it is never copied). ``finish()`` loads the best weights back into the model at the end, so the
model that is tested, logged and registered is the best evaluation's, and returns that evaluation: the run's final
``eval/*`` metrics and confusion matrix are its. ``select_best=last`` keeps the last evaluation's weights.

Where the snapshot waits (``train.keep_best_in``): in host memory (a copy into buffers allocated once) when it
takes at most a quarter of the available memory, else in ``best.pt`` in the run's checkpoint folder, written
atomically. Either way a checkpoint carries the best so far (its record, and its weights unless the best is the
checkpoint's own model), so ``resume=auto`` continues with the same best and the same patience count.

Early stopping: ``patience`` evaluations in a row without an improvement of more than ``min_delta`` set
``state.stop_reason``; the loop stops after that step.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import psutil
import torch

from ..config import SELECT_LAST, TrainConfig, metric_direction
from .callbacks import Callback, TrainState
from .checkpointing import save_atomic
from .evaluate import Evaluation

MEMORY_SHARE = 0.25  # keep_best_in=auto: in memory when the snapshot takes at most this share of available memory
FILE_NAME = "best.pt"

log = logging.getLogger("maxout")


@dataclass
class Selected:
    """The evaluation whose weights the run keeps."""

    step: int
    epoch: float  # epochs trained at that step (fractional when evaluating within epochs)
    metrics: dict = field(default_factory=dict)
    confusion: list = field(default_factory=list)

    def evaluation(self) -> Evaluation:
        return Evaluation(dict(self.metrics), [list(row) for row in self.confusion])


class ModelSelection(Callback):
    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, directory: Path, keep_in: Optional[str] = None):
        self.model, self.metric = model, cfg.select_best
        self.select = cfg.select_best != SELECT_LAST
        self.minimize = metric_direction(cfg.select_best) == "minimize"
        self.patience, self.min_delta = cfg.early_stopping.patience, cfg.early_stopping.min_delta
        self.names = [name for name, p in model.named_parameters() if p.requires_grad]
        self.path = directory / FILE_NAME
        self.nbytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if p.requires_grad)
        wanted = keep_in or cfg.keep_best_in
        fits = self.nbytes <= MEMORY_SHARE * psutil.virtual_memory().available
        self.keep_in = wanted if wanted != "auto" else ("memory" if fits else "disk")
        self.best: Optional[Selected] = None
        self.value = math.nan  # the best value of the metric
        self.evals_since = 0  # evaluations in a row without an improvement of more than min_delta
        self.last_step = 0  # the last evaluation's step
        self.stop_reason = ""  # set when early stopping ended the run
        self._snapshot: dict[str, torch.Tensor] = {}  # memory: buffers allocated at the first improvement
        self._saved = False  # disk: best.pt holds the best

    def describe(self) -> str:
        """Where the best weights wait, for the run's ``maxout.best_state`` tag."""
        size = f"{self.nbytes / 2**20:.1f} MiB of trainable weights"
        if not self.select:
            return f"no selection (train.select_best={SELECT_LAST}): the last evaluation's weights"
        return f"{self.keep_in} ({size}" + (f", {self.path})" if self.keep_in == "disk" else ")")

    # -- the hook
    def on_evaluate(self, state: TrainState, metrics: dict) -> None:
        self.last_step = state.step
        epoch = state.step / state.steps_per_epoch if state.steps_per_epoch else float(state.epoch + 1)
        value = metrics.get(self.metric, math.nan) if self.select else math.nan
        if not self.select or self.best is None or self._better(value, self.value):
            significant = self.best is None or self._better(value, self.value, self.min_delta)
            self.best, self.value = Selected(state.step, epoch, dict(metrics), state.eval_confusion), value
            if self.select and state.step < state.total_steps:  # at the last step the model itself is the best
                self._keep()
            self.evals_since = 0 if significant else self.evals_since + 1
        else:
            self.evals_since += 1
        if self.patience and self.evals_since >= self.patience and state.step < state.total_steps:
            state.stop_reason = self.stop_reason = (
                f"early stopping at step {state.step}: {self.metric} did not improve by more than "
                f"{self.min_delta:g} in {self.evals_since} evaluations (best {self.value:.4f} at "
                f"step {self.best.step}, epoch {self.best.epoch:.2f})")

    def _better(self, value: float, best: float, margin: float = 0.0) -> bool:
        if math.isnan(value):
            return False
        if math.isnan(best):
            return True
        return value < best - margin if self.minimize else value > best + margin

    def _keep(self) -> None:
        params = dict(self.model.named_parameters())
        if self.keep_in == "disk":
            try:
                save_atomic({name: params[name].detach().cpu() for name in self.names}, self.path)
                self._saved = True
                return
            except OSError as err:  # a full or read-only disk: the best waits in memory instead
                log.warning("maxout: the best weights cannot be written to %s (%s); they are kept in host memory",
                            self.path, err.strerror or err)
                self.keep_in, self._saved = "memory", False
        if not self._snapshot:  # pinned host buffers: the device-to-host copies run asynchronously
            pin = next(iter(params.values())).is_cuda
            self._snapshot = {name: torch.empty_like(params[name], device="cpu", pin_memory=pin)
                              for name in self.names}
        for name in self.names:
            self._snapshot[name].copy_(params[name].detach(), non_blocking=True)
        if params[self.names[0]].is_cuda:
            torch.cuda.synchronize()  # the copies are complete before training changes the weights again

    def _weights(self) -> dict[str, torch.Tensor]:
        if self.keep_in == "disk":
            return torch.load(self.path, map_location="cpu", weights_only=True, mmap=True) if self._saved else {}
        return self._snapshot

    # -- checkpoints (resume=auto continues with the same best)
    def checkpoint(self, state: TrainState) -> dict:
        """What a checkpoint at ``state`` carries: the record, and the weights unless they are the model's."""
        if self.best is None:
            return {}
        current = not self.select or self.best.step == state.step
        return {"best": asdict(self.best), "value": self.value, "evals_since": self.evals_since,
                "last_step": self.last_step, "weights": None if current else self._weights()}

    def restore(self, payload: dict) -> None:
        """From a checkpoint's payload (its ``selection`` entry, and its model for a best that was current)."""
        saved = payload.get("selection") or {}
        if not saved:
            return
        self.best, self.value = Selected(**saved["best"]), saved["value"]
        self.evals_since, self.last_step = saved["evals_since"], saved["last_step"]
        if not self.select:
            return
        weights = saved["weights"] if saved["weights"] is not None else payload["model"]
        best = {name: weights[name] for name in self.names}
        if self.keep_in == "disk":
            save_atomic({name: t.clone() for name, t in best.items()}, self.path)
            self._saved = True
        else:
            self._snapshot = {name: t.clone() for name, t in best.items()}

    # -- the end
    def finish(self) -> Optional[Selected]:
        """Load the best weights into the model (unless it has them) and return the selected evaluation."""
        if self.best is not None and self.select and self.best.step != self.last_step:
            unexpected = self.model.load_state_dict(self._weights(), strict=False).unexpected_keys
            if unexpected:  # the snapshot's names come from this model: anything else is a bug
                raise RuntimeError(f"best weights do not fit the model: {unexpected[:3]}")
        self.close()
        return self.best

    def close(self) -> None:
        """Remove best.pt (a checkpoint carries its own copy of the best)."""
        if self._saved:
            try:
                self.path.unlink(missing_ok=True)
            except OSError as err:  # a read-only disk: the file stays, the run's outcome matters more
                log.warning("maxout: %s not removed (%s)", self.path, err.strerror or err)
        self._saved = False

"""The training loop. Hook points, in order (each a method of the callbacks in ``callbacks.py``):

    on_train_start(state)
    for each epoch (from a restored state: the rest of its epoch, skipping the micro-batches it consumed):
        for each optimizer step (accum_steps micro-batches: forward, backward; then clip, step, zero_grad):
            every log_every steps:  read the loss and the divergence record (the one host sync), log metrics
            at each evaluation step (evaluate.evaluation_steps: every eval_interval steps or eval_every_epochs
            of an epoch, and after the last step):  check divergence, evaluate -> on_evaluate(state, metrics)
            on_step_end(state)                # every step, after its logging: no host sync here
            a callback set state.stop_reason (early stopping):  stop, without on_epoch_end
        on_epoch_end(state)
    on_train_end(state)

A callback stops training at once by raising (e.g. optuna.TrialPruned; the caller decides what that means), or
after this step by setting ``state.stop_reason`` (the run then ends normally).
A non-finite loss or gradient norm is recorded on the device each step and raises Diverged at the next sync
point (divergence.py), so a diverged model is never evaluated, checkpointed or logged.
"""

from __future__ import annotations

import math
import time
from typing import Iterable, Iterator, Optional, Sequence

import torch
from tqdm.auto import tqdm

from .. import metrics as m
from ..errors import first_line, raise_if_stop_requested
from ..optimizations import grad_clipping, skip_guards
from ..tracking.tracker import Tracker
from .callbacks import Callback, CallbackList, TrainState
from .evaluate import evaluate, evaluation_steps
from .setup import Setup
from .totals import Totals


def accumulation_groups(loader: Iterable, accum: int) -> Iterator[list]:
    """Micro-batches grouped per optimizer step; the epoch's last group may be shorter."""
    group: list = []
    for batch in loader:
        group.append(batch)
        if len(group) == accum:
            yield group
            group = []
    if group:
        yield group


def train_step(s: Setup, micro_batches: Sequence[dict], meter: m.Throughput) -> torch.Tensor:
    """One optimizer step over ``micro_batches``. Returns the mean loss as a device tensor (no sync).

    Out of memory: drop the partial gradients, run every micro-batch as twice as many row chunks from then on
    (``s.oom``, see oom.py), and retry the same step; the samples per optimizer step do not change."""
    scaler = s.precision.scaler
    meter.begin_step()
    while True:
        try:
            step_loss = _forward_backward(s, micro_batches)
            break
        except torch.OutOfMemoryError as err:
            if not s.oom.enabled:
                raise
            message = first_line(err)
        # Outside the handler, so the traceback no longer pins the failed attempt's activations.
        s.zero_grad()
        s.oom.halve(message, list(micro_batches), step=s.scheduler.last_epoch + 1, device_type=s.device.torch_device)
    for batch in micro_batches:
        meter.add(len(batch["labels"]), batch["num_real_tokens"], batch["num_tokens"])
    grad_norm = None
    if s.clip_norm:
        scaler.unscale_(s.optimizer)  # clip the true gradients, not the fp16-scaled ones
        grad_norm = grad_clipping.apply(s.model.parameters(), s.clip_norm)
    s.divergence.record(s.scheduler.last_epoch + 1, step_loss, grad_norm, s.model.parameters(), scaler)  # no sync
    scaler.step(s.optimizer)
    scaler.update()
    s.zero_grad()
    s.scheduler.step()
    return step_loss


def _forward_backward(s: Setup, micro_batches: Sequence[dict]) -> torch.Tensor:
    device, scaler = s.device.torch_device, s.precision.scaler
    step_loss = torch.zeros((), device=device)
    # one chunk (share 1.0) per micro-batch unless an out-of-memory error split it
    pieces = [(chunk, share) for batch in micro_batches for chunk, share in s.oom.split(batch)]
    if s.cuda_graphs and len(pieces) > 1:  # several backward passes add into buffers of their own (Setup)
        s.ensure_gradient_buffers()
    for i, (chunk, share) in enumerate(pieces):
        forward = s.forward_for(len(chunk["labels"]))
        inputs = s.model_inputs(chunk, compiled=s.compiled(forward))
        with s.gradient_sync(last=i == len(pieces) - 1):  # data parallel: all-reduce once per step, not per piece
            with s.precision.autocast():
                loss = forward(**inputs).loss * share / len(micro_batches)
            scaler.scale(loss).backward()
        step_loss += loss.detach()
    return step_loss


def fit(s: Setup, tracker: Tracker, callbacks: Sequence[Callback] = (), progress: bool = True,
        state: Optional[TrainState] = None) -> dict[str, float]:
    """Train from scratch, or from ``state`` restored from a checkpoint (model and optimizer restored too)."""
    tr, device = s.cfg.train, s.device.torch_device
    hooks, state = CallbackList(callbacks), state or TrainState(total_steps=s.total_steps)
    state.steps_per_epoch = s.steps_per_epoch
    eval_steps = evaluation_steps(s.steps_per_epoch, s.total_steps, tr.eval_interval, tr.eval_every_epochs)
    # A resumed run's figures go on from those saved with its checkpoint (totals.py): never only this segment's.
    state.totals = Totals(device, tr.warmup_steps_excluded, state.measured)
    meter = state.totals.meter
    if s.device.is_cuda:  # NVML utilization and CUDA-event busy time, over the steady window only
        meter.window = m.SteadyWindow(m.UtilizationSampler(s.world.nvml_index), m.DeviceBusy())
    wall_start, first_step = time.perf_counter(), state.step + 1
    state.loss_sum = torch.as_tensor(state.loss_sum, dtype=torch.float32, device=device)  # summed between syncs
    bar = tqdm(total=s.total_steps, initial=state.step, disable=not progress, desc="train", unit="step",
               dynamic_ncols=True)
    m.reset_peak_memory(device)
    s.model.train()
    hooks.on_train_start(state)
    meter.start()

    def run_eval() -> None:
        s.divergence.check(s, tracker)  # a diverged model is not worth scoring (evaluation syncs anyway)
        # Evaluation and model selection (which may copy the weights off the device) are not training time:
        # time/eval_s counts them.
        with state.totals.outside_window("eval"):
            result = evaluate(s)
            state.eval_metrics, state.eval_confusion = result.metrics, result.confusion
            s.divergence.check_evaluation(state.eval_metrics, state.step, s, tracker)
            tracker.log_metrics(state.eval_metrics, step=state.step)
            hooks.on_evaluate(state, state.eval_metrics)
        raise_if_stop_requested()  # a Ctrl-C or SIGTERM whose exception got dropped (errors.py) stops here

    for epoch in range(state.epoch, tr.epochs):
        if state.step >= s.total_steps:  # resumed from the checkpoint after the last step
            break
        state.epoch = epoch
        s.sampler.set_epoch(epoch, skip_batches=state.batches_in_epoch)
        for group in accumulation_groups(s.train_loader, s.accum_steps):
            state.loss_sum += train_step(s, group, meter)
            state.loss_steps += 1
            state.batches_in_epoch += len(group)
            state.step += 1
            if s.packed:  # a token budget packs a different number of samples into each step (buffered, no sync)
                tracker.log_metrics({"train/batch_samples": float(sum(len(b["labels"]) for b in group))},
                                    step=state.step)
            meter.step()
            bar.update()
            if state.step == first_step and math.isnan(state.first_step_s):  # the run's first step, not a resume's
                meter.mark()  # one sync: time to first step includes compile and allocator warm-up
                state.first_step_s = time.perf_counter() - wall_start
            if state.step % tr.log_every == 0 or state.step == s.total_steps:
                meter.mark()
                # The host sync, once per interval: the summed loss and the divergence record in one transfer
                # (then, with several processes, one small all-reduce of the loss and the window rates).
                loss_sum = s.divergence.check(s, tracker, also=state.loss_sum)
                state.train_loss, rates = s.world.log_point(loss_sum, state.loss_steps, meter.window_rates())
                state.loss_sum.zero_()
                state.loss_steps = 0
                tracker.log_metrics({"train/loss": state.train_loss, "train/lr": s.scheduler.get_last_lr()[0],
                                     "train/epoch": epoch + 1, **rates}, step=state.step)
                bar.set_postfix(loss=f"{state.train_loss:.4f}",
                                samples_s=f"{rates['perf/window_samples_per_s']:.1f}")
            if state.step in eval_steps:
                run_eval()
            hooks.on_step_end(state)  # after the step's logging: a checkpoint here resumes without a gap
            raise_if_stop_requested()
            if state.step >= s.total_steps or state.stop_reason:
                break
        if state.stop_reason:  # stopped early, maybe mid-epoch: the epoch did not end
            break
        done = state.step >= s.total_steps
        hooks.on_epoch_end(state)
        state.batches_in_epoch = 0
        if done:
            break

    meter.pause()  # the window ends with the last step's hooks: what follows (model logging) is not training
    bar.close()
    s.divergence.check(s, tracker)
    results = state.totals.summary()  # throughput, wall, compile and evaluation time, peak memory: every segment's
    if meter.window is not None:
        results.update(meter.window.stop(results.get("time/steady_window_s")))
    results.update(skip_guards.counts(s.forward))
    results.update(state.eval_metrics)
    results["time/first_step_s"] = state.first_step_s
    results["train/final_loss"] = state.train_loss
    hooks.on_train_end(state)
    return results

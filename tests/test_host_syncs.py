"""No host sync between log steps (issue 37): every training step but a log step runs without the host waiting
for the device, so a GPU is fed as fast as the host can launch.

Counted on CPU with a dispatch mode (metrics.HostSyncs: the aten ops that read a device value on the host, such
as ``.item()``, ``nonzero``, a copy to host memory) plus the loop's own synchronize calls (metrics.sync, a no-op on
a CPU, counted by replacing it), per step, over the GPU profiles' path: compile (dynamo's eager backend: the same
graph, traced once, without inductor's kernels), fused AdamW, clipping, bucketing.

Dynamo runs nothing compiled while a dispatch mode is active, so the mode is entered after step 1 (which compiles)
and set aside for each call of the compiled forward. Inside that graph dynamo itself is the counter: a host read
there (``.item()``, ``bool(tensor)``) breaks the graph, so the test also asserts one frame and no graph break.
Everything else (backward, clipping, AdamW, the divergence record, the scheduler, the loop) runs under the mode.
Step 1 syncs once by design (time to the first step, compile included), as does the last warm-up step (the steady
window's start); the log steps read the loss.

An eager run is counted too: transformers' own mask check (``padding_mask.all()`` in masking_utils) read the mask
on the host in every eager forward, one sync per micro-batch, which compile traces away; prepared masks
(optimizations/prepared_mask.py) leave it nothing to read, and the same run with them off still shows it.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import _disable_current_modes

from maxout import loading, metrics
from maxout.optimizations import compile as compile_opt
from maxout.tracking.tracker import NullTracker
from maxout.train import train
from maxout.train.callbacks import Callback
from maxout.train.setup import Setup

from .conftest import TINY


class SyncsPerStep(Callback):
    """Opens a HostSyncs mode at the end of step ``start`` and records the syncs of every later step."""

    def __init__(self, start: int = 1):
        self.start, self.mode, self.per_step = start, metrics.HostSyncs(), {}

    def on_step_end(self, state):
        if state.step == self.start:
            self.mode.__enter__()
            self.mode.mark()
        elif state.step > self.start:
            self.per_step[state.step] = self.mode.mark()

    def on_train_end(self, state):
        self.mode.__exit__(None, None, None)


@pytest.fixture
def synchronize_calls(monkeypatch):
    """The loop's explicit device synchronizations (Throughput.mark), counted into the mode's tally."""
    calls = []
    real = metrics.sync
    monkeypatch.setattr(metrics, "sync", lambda device_type: calls.append(device_type) or real(device_type))
    return calls


@pytest.fixture
def compiled(monkeypatch):
    """Compile with dynamo's eager backend; the compiled forward runs with the dispatch modes set aside."""
    counter = CompileCounterWithBackend("eager")
    monkeypatch.setattr(compile_opt, "apply", functools.partial(compile_opt.apply, backend=counter))
    forward_for = Setup.forward_for

    def without_modes(self, rows):
        chosen = forward_for(self, rows)
        if chosen is self.eager or self.eager is None:
            return chosen

        def call(*args, **kwargs):
            with _disable_current_modes():
                return chosen(*args, **kwargs)

        return call

    monkeypatch.setattr(Setup, "forward_for", without_modes)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield counter
    torch._dynamo.reset()


def syncs_per_step(overrides: list, synchronize_calls: list, device, steps: int = 14, log_every: int = 5,
                   warmup: int = 3) -> tuple:
    """Trains the tiny model ``steps`` steps with ``overrides`` (fused AdamW, clipping, bucketing), counting each
    step's syncs; returns the result, the quiet steps' counts (neither a log step nor the warm-up's last) and the
    counter."""
    cfg = loading.load([*TINY, f"train.max_steps={steps}", f"train.log_every={log_every}",
                        f"train.warmup_steps_excluded={warmup}", "hardware.fused_adamw=true",
                        "train.max_grad_norm=1.0", "data.bucketing=true", *overrides], device=device)
    watch = SyncsPerStep()
    count_sync = metrics.HostSyncs.mark

    def mark_with_synchronize(mode):  # the loop's synchronize calls count as syncs of the step they happen in
        ops = count_sync(mode)
        found, synchronize_calls[:] = len(synchronize_calls), []
        return ops + found

    watch.mode.mark = functools.partial(mark_with_synchronize, watch.mode)
    result = train(cfg, tracker=NullTracker(), callbacks=[watch], progress=False, device=device, verbose=False)
    assert result.metrics["train/optimizer_steps"] == steps
    log_steps = {s for s in range(1, steps + 1) if s % log_every == 0} | {steps}
    quiet = {s: n for s, n in watch.per_step.items() if s not in log_steps and s != warmup}
    assert len(quiet) == steps - 1 - len(log_steps) - 1
    assert watch.per_step[warmup] >= 1  # the steady window's start, once per run
    assert all(watch.per_step[s] >= 1 for s in log_steps)  # the counter sees the syncs that do happen
    return result, quiet, watch


def test_only_log_steps_sync_the_host(compiled, synchronize_calls, cpu_device, one_torch_thread):
    _, quiet, watch = syncs_per_step(["hardware.compile=true"], synchronize_calls, cpu_device)
    assert compiled.frame_count == 1 and not torch._dynamo.utils.counters["graph_break"]  # no sync in the graph
    assert quiet == dict.fromkeys(quiet, 0), quiet  # no step between two log steps waits for the device
    assert watch.per_step[3] == 1


def test_an_eager_run_syncs_only_at_log_steps_with_prepared_masks(synchronize_calls, cpu_device, one_torch_thread):
    """Eager, SDPA: with prepared masks no quiet step reads the device; without them (the figure before) every quiet
    step read each micro-batch's mask once, in transformers' check. Both runs train alike."""
    eager = ["hardware.compile=false", "hardware.attn_implementation=sdpa", "hardware.fast_dropout=false"]
    prepared, quiet, watch = syncs_per_step([*eager, "hardware.prepared_mask=true"], synchronize_calls, cpu_device)
    assert prepared.setup.decision("prepared_mask").effective is True
    assert quiet == dict.fromkeys(quiet, 0), quiet
    assert watch.per_step[3] == 1
    before, quiet, _ = syncs_per_step([*eager, "hardware.prepared_mask=false"], synchronize_calls, cpu_device)
    micro_batches = before.setup.accum_steps
    assert quiet == dict.fromkeys(quiet, micro_batches), quiet  # one read of the mask per forward
    assert prepared.metrics["train/final_loss"] == before.metrics["train/final_loss"]
    assert prepared.metrics["eval/accuracy"] == before.metrics["eval/accuracy"]


def test_the_counter_sees_what_syncs():
    x = torch.arange(6.0)
    with metrics.HostSyncs() as mode:
        x.sum().item()
        x.nonzero()
        bool(x.any())
        (x + 1).mul_(2)
    assert mode.counts == {"aten::_local_scalar_dense": 2, "aten::nonzero": 1}
    assert mode.mark() == 3 and mode.mark() == 0


@pytest.mark.parametrize("model,layout", [("tiny_qwen3", "bins"), ("tiny_qwen3", "mask"), ("tiny", "bins")])
def test_an_eager_packed_run_syncs_only_at_log_steps(model, layout, synchronize_calls, cpu_device, one_torch_thread):
    """Packed batches (bins, or one row with a block-diagonal mask) are handed masks built from the layout
    (serving/pooling.py): without them a decoder's transformers code found the samples from the position ids with a
    host read per mask kind, one or two syncs a forward (tests/test_packing.py has that figure); and the collators
    read none of their own tensors (they did, twice a batch, which in-process loading counts)."""
    packed = [f"model={model}", "hardware.compile=false", "data.padding=packed", f"data.packing_attention={layout}",
              "data.max_length=64", "data.max_tokens_per_batch=256"]
    result, quiet, _ = syncs_per_step(packed, synchronize_calls, cpu_device)
    assert result.setup.decision("packing").effective == layout
    assert quiet == dict.fromkeys(quiet, 0), quiet

"""Out-of-memory recovery: an OOM at step k halves the rows per forward pass and retries the same step; the
optimizer sees the same samples per step, the same number of steps and (dropout off) the same gradients."""

from __future__ import annotations

import pytest
import torch

from maxout import data, loading, modeling
from maxout.errors import MaxoutError
from maxout.tracking.tracker import NullTracker
from maxout.train import Callback, train
from maxout.train import run as run_mod
from maxout.train.loop import fit
from maxout.train.setup import build

from .conftest import TINY, runs_in

# Every batch 32 tokens wide, micro-batch 16 x accumulation 2 = 32 samples per step, no dropout: two runs that
# differ only in how the rows are chunked must end with the same weights.
OVERRIDES = [*TINY, "train.max_steps=6", "train.batch_size=16", "train.target_effective_batch=32",
             "data.padding=max_length", "data.max_length=32", "model.dropout=0.0", "hardware.precision=fp32"]


class TightMemory:
    """Stands in for the forward pass: from step ``from_step`` on, more than ``max_rows`` rows raise
    torch.OutOfMemoryError, as a device that has less memory free from then on would."""

    def __init__(self, setup, from_step: int, max_rows: int):
        self.setup, self.forward, self.from_step, self.max_rows = setup, setup.forward, from_step, max_rows
        self.pending, self.rows_per_step, self.attempts = 0, [], 0

    def __call__(self, **inputs):
        rows = len(inputs["labels"])
        step = self.setup.scheduler.last_epoch + 1
        if step >= self.from_step and rows > self.max_rows:
            self.attempts += 1
            self.pending = 0  # the step starts over
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected at step {step}, {rows} rows)")
        self.pending += rows
        return self.forward(**inputs)


class RowsPerStep(Callback):
    def __init__(self, tight: TightMemory):
        self.tight = tight

    def on_step_end(self, state):
        self.tight.rows_per_step.append(self.tight.pending)
        self.tight.pending = 0


@pytest.fixture(scope="module")
def demo():
    cfg = loading.load(OVERRIDES)
    return data.load(cfg.data), modeling.load_tokenizer(cfg.model)


def run(demo, cpu_device, from_step: int, max_rows: int, extra=()):
    setup = build(loading.load([*OVERRIDES, *extra]), cpu_device, *demo)
    tight = TightMemory(setup, from_step, max_rows)
    setup.forward = tight
    tracker = NullTracker()
    setup.oom.attach(tracker)
    metrics = fit(setup, tracker, [RowsPerStep(tight)], progress=False)
    return setup, tight, tracker, metrics


# Both attentions (tiny BERT): the row chunks' attention masks prepared from their host copies (prepared_mask.padded
# reads a chunk's mask, which has no token counts), the whole micro-batches' from the collator's counts
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_an_oom_at_step_k_halves_the_micro_batch_and_keeps_the_effective_batch(demo, cpu_device, attention):
    extra = [f"hardware.attn_implementation={attention}"]
    base, base_rows, _, base_metrics = run(demo, cpu_device, from_step=10**9, max_rows=16, extra=extra)
    setup, tight, tracker, metrics = run(demo, cpu_device, from_step=3, max_rows=8, extra=extra)
    assert setup.mask_preparer is not None and (setup.mask_preparer.norm is not None) is (attention == "eager")

    assert tight.attempts == 1  # one failure, then every forward pass fits
    assert setup.oom.events == [{"step": 3, "rows_before": 16, "rows_after": 8, "chunks": 2, "sequence_length": 32}]
    assert tracker.metrics["train/oom_events"] == [(3, 1.0)] and tracker.metrics["train/micro_batch"] == [(3, 8.0)]
    assert "out of memory at step 3" in tracker.tags["maxout.oom_recovery"]
    # The effective batch is unchanged: same samples in every optimizer step, same number of steps.
    assert tight.rows_per_step == base_rows.rows_per_step == [32] * 6
    assert metrics["train/optimizer_steps"] == base_metrics["train/optimizer_steps"] == 6
    assert metrics["train/samples"] == base_metrics["train/samples"] == 6 * 32
    # ... and the same gradients: the weights end where the unsplit run's ended.
    for (name, p), q in zip(setup.model.named_parameters(), base.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)


def test_repeated_ooms_keep_halving_down_to_a_single_row_then_give_up_clearly(demo, cpu_device):
    setup, tight, _, _ = run(demo, cpu_device, from_step=2, max_rows=3)
    assert [e["rows_after"] for e in setup.oom.events] == [8, 4, 2]
    assert tight.rows_per_step == [32] * 6
    with pytest.raises(MaxoutError, match="out of memory at step 2 with a single row per forward pass "
                                          r"\(sequence length 32\).*lower data\.max_length"):
        run(demo, cpu_device, from_step=2, max_rows=0)


def test_the_recovery_is_logged_to_the_mlflow_run(mlflow_store, monkeypatch, cpu_device):
    """Through train(): the metric and the tag land in the run, which finishes normally."""
    real_build = run_mod.build

    def build_with_tight_memory(*args, **kwargs):
        setup = real_build(*args, **kwargs)
        setup.forward = TightMemory(setup, from_step=2, max_rows=8)
        return setup

    monkeypatch.setattr(run_mod, "build", build_with_tight_memory)
    cfg = loading.load([*OVERRIDES, *mlflow_store["overrides"], "tracking.log_model=false"])
    result = train(cfg, progress=False, device=cpu_device, verbose=False)
    assert result.metrics["train/samples"] == 6 * 32
    (run,) = runs_in(mlflow_store["uri"])
    assert run.info.status == "FINISHED"
    assert run.data.metrics["train/oom_events"] == 1.0 and run.data.metrics["train/micro_batch"] == 8.0
    assert "16 -> 8 rows per forward pass" in run.data.tags["maxout.oom_recovery"]

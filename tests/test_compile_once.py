"""Compile once per run (issue 37): a run compiles one graph over all its epochs, and the batch finder none.

Graphs are counted by dynamo itself, with its eager backend standing in for inductor (the graphs dynamo captures
and its guards are the same; only the kernels are not generated), on the tiny model and the demo's real bucket
plan. Before the fix a run made 2 graphs (BERT writes config.problem_type on its first forward, and the guard on
it recompiled), and a 1-row batch (an epoch's remainder) made one more.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from maxout import loading
from maxout.optimizations import compile as compile_opt
from maxout.tracking.tracker import NullTracker
from maxout.train import train

from .conftest import TINY


@pytest.fixture
def graphs(monkeypatch):
    """Every graph dynamo compiles from here on, through compile.apply (the trainer's only way to compile)."""
    counter = CompileCounterWithBackend("eager")
    monkeypatch.setattr(compile_opt, "apply", functools.partial(compile_opt.apply, backend=counter))
    torch._dynamo.reset()
    yield counter
    torch._dynamo.reset()


def run(device, *overrides):
    cfg = loading.load([*TINY, "train.max_steps=-1", "train.epochs=2", "train.log_every=10", "hardware.compile=true",
                        "batch_finder.cache=false", *overrides], device=device)
    tracker = NullTracker()
    return train(cfg, tracker=tracker, progress=False, device=device, verbose=False), tracker


def test_two_epochs_of_the_bucket_plan_compile_one_graph(graphs, cpu_device, one_torch_thread):
    # 800 training rows in batches of 47: each epoch ends with a 1-row batch, which dynamo would specialize
    result, _ = run(cpu_device, "train.batch_size=47", "train.target_effective_batch=47")
    sampler = result.setup.sampler
    sizes = {len(batch) for epoch in (0, 1) for batch in _batches(sampler, epoch)}
    assert sizes == {47, 1}  # the plan really holds the full batches and the 1-row remainder
    assert len({batch_width(result.setup, b) for b in _batches(sampler, 0)}) > 3  # and many padded widths
    assert result.metrics["train/optimizer_steps"] == 2 * 18
    assert graphs.frame_count == 1
    assert result.metrics["time/compile_graphs"] == 1  # what every run logs: dynamo's own count, here the same


def test_the_batch_finder_compiles_nothing_and_the_run_one_graph(graphs, cpu_device, one_torch_thread):
    result, tracker = run(cpu_device, "train.batch_size=auto", "train.target_effective_batch=32")
    assert int(tracker.params["batch_finder.num_probes"]) >= 2  # the finder really probed
    assert tracker.params["opt.compile.effective"] == "true"
    assert graphs.frame_count == 1 and result.metrics["time/compile_graphs"] == 1


def _batches(sampler, epoch):
    sampler.set_epoch(epoch)
    return sampler.batches()


def batch_width(setup, rows):
    return max(setup.train_loader.dataset.lengths[i] for i in rows)

"""Compile once per run (issue 37): a run compiles one graph over all its epochs, and the batch finder none; with
symbolic shapes inductor is kept from guarding on the batch size (checked on a GPU).

Graphs are counted by dynamo itself, with its eager backend standing in for inductor (the graphs dynamo captures
and its guards are the same; only the kernels are not generated), on the tiny model and the demo's real bucket
plan. Before the fix a run made 2 graphs (BERT writes config.problem_type on its first forward, and the guard on
it recompiled), and a 1-row batch (an epoch's remainder) made one more; so did a packed batch of one sample.
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


def test_packed_batches_compile_one_graph_and_a_one_sample_batch_runs_eager(graphs, cpu_device, one_torch_thread):
    # a token budget of 512 tokens: the second epoch ends with a batch of one sample, whose labels dynamo would
    # specialize (before: a second graph, "2 <= labels.size()[0]")
    result, _ = run(cpu_device, "data.padding=packed", "data.max_tokens_per_batch=512", "train.batch_size=8")
    assert result.setup.packed
    samples = [len(batch) for epoch in (0, 1) for batch in _batches(result.setup.sampler, epoch)]
    assert samples.count(1) == 1 and len(set(samples)) > 3  # the plan really holds one, among packed batches
    assert graphs.frame_count == 1 and result.metrics["time/compile_graphs"] == 1


def _batches(sampler, epoch):
    sampler.set_epoch(epoch)
    return sampler.batches()


def batch_width(setup, rows):
    return max(setup.train_loader.dataset.lengths[i] for i in rows)


def test_with_symbolic_shapes_inductor_is_kept_from_guarding_on_the_batch_size(monkeypatch):
    """compile.apply turns inductor's size checks for fusing a LayerNorm backward's reductions, and its shape
    padding, off for dynamic shapes (each is a guard on the batch's size, and a recompile for the first batch across
    it), and leaves them on for static shapes, where they are decided once without a guard."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config.triton, "mix_order_reduction_non_strict_mode", False)
    monkeypatch.setattr(inductor_config, "shape_padding", True)
    monkeypatch.delenv("TORCHINDUCTOR_SHAPE_PADDING", raising=False)
    compile_opt.apply(torch.nn.Linear(2, 2), "default", dynamic=True)
    assert inductor_config.triton.mix_order_reduction_non_strict_mode is True
    assert inductor_config.shape_padding is False  # its compute-bound check guards on the rows (torch 2.11)
    compile_opt.apply(torch.nn.Linear(2, 2), "default", dynamic=None)
    assert inductor_config.triton.mix_order_reduction_non_strict_mode is False
    assert inductor_config.shape_padding is True
    monkeypatch.setenv("TORCHINDUCTOR_SHAPE_PADDING", "0")  # a user's own switch stays off
    compile_opt.apply(torch.nn.Linear(2, 2), "default", dynamic=None)
    assert inductor_config.shape_padding is False


@pytest.mark.gpu
@pytest.mark.parametrize("guarded", [False, True])
def test_on_a_gpu_a_layernorm_backward_compiles_once_across_the_size_thresholds(guarded, monkeypatch):
    """The pattern behind the guards: a LayerNorm forward and backward on [rows, 768] with rows symbolic, called at
    1,024 rows and then at 16,384 (across rows >= 4096 and rows x 768 >= 5 x 2**20). Through compile.apply: one graph.
    With the size checks left on (``guarded``), the count is printed, not asserted: it says whether this torch
    version's Triton code generation guards there at all."""
    import torch._inductor.config as inductor_config

    norm = torch.nn.LayerNorm(768).cuda()
    step = compile_opt.apply(lambda x: norm(x).float().square().mean(), "default", dynamic=True)
    if guarded:
        monkeypatch.setattr(inductor_config.triton, "mix_order_reduction_non_strict_mode", False)
    graphs = graphs_over(step, (1024, 16384, 2048), torch.float32)  # fp32: as autocast runs LayerNorm
    print(f"graphs with the size checks {'on' if guarded else 'off'}: {graphs}")
    if not guarded:
        assert graphs == 1


def graphs_over(step, rows: tuple, dtype) -> int:
    """Graphs dynamo compiles for ``step`` run forward and backward on [n, 768] inputs for each n of ``rows``."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    for n in rows:
        step(torch.randn(n, 768, device="cuda", dtype=dtype, requires_grad=True)).backward()
    graphs = counters["stats"]["unique_graphs"] - before
    torch._dynamo.reset()
    return graphs


@pytest.mark.gpu
@pytest.mark.parametrize("guarded", [False, True])
def test_on_a_gpu_a_partial_last_batch_reuses_the_graph_of_full_ones(guarded, monkeypatch):
    """The H200's second graph at micro-batch 1024 (2026-11-27): BERT's pooler, a bf16 [batch, 768] x [768, 768]
    matmul, at 1,024 rows and then at an epoch's partial last batch of 512, across shape padding's compute-bound
    guard (``769 <= batch`` there). Through compile.apply: one graph. With shape padding left on (``guarded``) the
    count is printed, not asserted: it says whether this torch version guards there."""
    import torch._inductor.config as inductor_config

    pooler = torch.nn.Linear(768, 768).cuda().to(torch.bfloat16)
    step = compile_opt.apply(lambda x: torch.tanh(pooler(x)).float().square().mean(), "default", dynamic=True)
    if guarded:
        monkeypatch.setattr(inductor_config, "shape_padding", True)
    graphs = graphs_over(step, (1024, 512, 2048), torch.bfloat16)
    print(f"graphs with shape padding {'on' if guarded else 'off'}: {graphs}")
    if not guarded:
        assert graphs == 1

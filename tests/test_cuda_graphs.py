"""CUDA graphs with bucketed dynamic padding (issue 37): the decisions on described GPUs, the widths dynamic
padding rounds to, and what a CUDA-graph step does differently (a step mark per forward, gradients in buffers of
their own), all on CPU; hardware=auto picks the H200's own profile. The Hopper profiles run CUDA graphs
(reduce-overhead over 8 widths): 2.14x default mode at batch 64 on an H200 (2026-11-27,
gpu/reports/2026-11-27-h200-run6); FSDP falls back."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from maxout import loading
from maxout.optimizations import compile as compile_opt, named, pad_widths
from maxout.tracking.tracker import NullTracker
from maxout.train import loop, train
from maxout.train.loop import train_step
from maxout.metrics import Throughput
from maxout.train.setup import plan_decisions
from maxout.train.distributed import World
from transformers import BertForSequenceClassification

from .conftest import TINY, fake_cuda

H100 = fake_cuda(name="NVIDIA H100 80GB HBM3", memory_gb=79.2, cc=(9, 0))
H200 = fake_cuda(name="NVIDIA H200", memory_gb=139.8, cc=(9, 0))


@pytest.fixture
def triton(monkeypatch):
    """A described GPU's compile needs triton, which this CPU machine may lack: say it is there."""
    monkeypatch.setattr(compile_opt, "has_triton", lambda: True)


@pytest.mark.parametrize("device, profile", [(H100, "h100"), (H200, "h200"),
                                             (fake_cuda(name="NVIDIA GH200 480GB", memory_gb=94.5, cc=(9, 0)), "h200")])
def test_the_hopper_profiles_run_cuda_graphs_over_eight_widths_and_default_mode_is_one_flag_away(
        device, profile, triton):
    """At batch 64 the H200's step was the host's: reduce-overhead over 8 widths ran 2.14x default mode (run 6), so
    the profiles record CUDA graphs, and default mode (each batch padded to its longest row) stays one flag away."""
    cfg = loading.load([], device=device)
    assert cfg.hardware.name == profile
    decisions = plan_decisions(cfg, device, BertForSequenceClassification)
    widths, mode = named(decisions, "pad_widths"), named(decisions, "compile_mode")
    assert (widths.requested, widths.effective, mode.effective) == ("auto", 8, "reduce-overhead")
    assert "one graph per padded width" in widths.reason
    assert cfg.hardware.batch_size == (256 if profile == "h200" else 128)  # the H200 holds twice the batch
    plain = plan_decisions(loading.load(["hardware.compile_mode=default"], device=device), device,
                           BertForSequenceClassification)
    widths, mode = named(plain, "pad_widths"), named(plain, "compile_mode")
    assert (widths.effective, mode.effective) == (None, "default")
    assert "only CUDA graphs" in widths.reason


@pytest.mark.parametrize("strategy, mode, widths", [("fsdp", "default", None), ("ddp", "reduce-overhead", 8)])
def test_under_fsdp_the_hopper_profile_falls_back_to_default_mode_without_widths(strategy, mode, widths, triton):
    """CUDA graphs cannot capture FSDP's all-gathers (pytorch/pytorch#127225): FSDP runs default mode, and its batches
    pad to their longest row (8 widths would only add padding); DDP keeps the graphs."""
    world = World(size=2, local_size=2, backend="nccl")
    cfg = loading.load([f"distributed.strategy={strategy}"], device=H100)
    decisions = plan_decisions(cfg, H100, BertForSequenceClassification, world)
    assert named(decisions, "data_parallel").effective == strategy
    d_mode, d_widths = named(decisions, "compile_mode"), named(decisions, "pad_widths")
    assert (d_mode.effective, d_widths.effective) == (mode, widths)
    if strategy == "fsdp":
        assert "pytorch/pytorch#127225" in d_mode.reason


@pytest.mark.parametrize("overrides, widths, mode, reason", [
    # dynamic padding without widths: CUDA graphs would record one graph per sequence length
    (["hardware.pad_widths=null"], None, "default", "round dynamic padding to a few widths"),
    (["data.padding=packed"], None, "default", "packed batches change length every step"),
    (["data.padding=max_length"], None, "reduce-overhead", "pads every batch to one width already"),
    (["hardware.compile_mode=default"], None, "default", "only CUDA graphs"),
    (["hardware.pad_widths=4"], 4, "reduce-overhead", ""),
    (["hardware.compile_mode=max-autotune"], 8, "max-autotune", "one graph per padded width"),
])
def test_cuda_graph_decisions_on_a_described_h100(overrides, widths, mode, reason, triton):
    cfg = loading.load(["hardware=h100", "model=tiny", "hardware.compile_mode=reduce-overhead", *overrides],
                       device=H100)
    decisions = plan_decisions(cfg, H100, BertForSequenceClassification)
    d_widths, d_mode = named(decisions, "pad_widths"), named(decisions, "compile_mode")
    assert (d_widths.effective, d_mode.effective) == (widths, mode)
    assert reason in d_widths.reason + d_mode.reason


def test_cuda_graphs_need_a_cuda_device(cpu_device):
    decision = compile_opt.resolve_mode("reduce-overhead", cpu_device, "dynamic", 8)
    assert (decision.effective, decision.reason) == ("default", "CUDA graphs need a CUDA device")
    assert pad_widths.resolve("auto", cpu_device, True, "reduce-overhead", "dynamic").effective is None


def test_the_widths_are_the_rows_length_quantiles_rounded_up():
    lengths = list(range(1, 101))  # 1..100 tokens
    assert pad_widths.ladder(lengths, 4, 8) == [32, 56, 80, 104]
    assert pad_widths.ladder(lengths, 4) == [25, 50, 75, 100]
    assert pad_widths.ladder([7] * 50 + [120], 8, 8) == [8, 120]  # equal quantiles collapse: fewer widths
    with pytest.raises(ValueError):
        pad_widths.ladder(lengths, 0)


def test_a_run_pads_to_its_widths_only(cpu_device):
    """hardware.pad_widths=4 on CPU (where it only rounds): every training batch takes one of the 4 widths."""
    tracker = NullTracker()
    result = train(loading.load([*TINY, "hardware.pad_widths=4", "data.bucketing=true"], device=cpu_device),
                   tracker=tracker, progress=False, device=cpu_device, verbose=False)
    widths = [int(w) for w in tracker.params["derived.pad_widths"].split()]
    assert len(widths) == 4 and tracker.params["opt.pad_widths.effective"] == "4"
    seen = {batch["input_ids"].shape[1] for batch in result.setup.train_loader}
    assert seen <= set(widths) and len(seen) > 1


def test_a_cuda_graph_step_marks_each_forward_and_keeps_gradient_buffers(monkeypatch, cpu_device, one_torch_thread):
    """Under CUDA graphs each micro-batch's forward starts a new cudagraph step, and .grad tensors stay the same
    buffers across steps (zeroed in place): a .grad left in the graphs' pool by a first backward would be
    overwritten by the next replay, before the optimizer reads it (accumulation)."""
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    result = train(loading.load([*TINY, "train.max_steps=1"], device=cpu_device), tracker=NullTracker(),
                   progress=False, device=cpu_device, verbose=False)
    s = dataclasses.replace(result.setup, forward=compile_opt.with_step_marks(result.setup.model), cuda_graphs=True,
                            accum_steps=2)
    assert s.gradients_in_buffers
    s.zero_grad()  # what setup does for a run that keeps gradients in buffers: one for every parameter
    buffers = {id(p): p.grad for p in s.model.parameters()}
    assert all(g is not None for g in buffers.values())
    batches = iter(s.train_loader)
    meter = Throughput("cpu")
    for _ in range(2):
        train_step(s, [next(batches), next(batches)], meter)  # two accumulated micro-batches per step
    assert len(marks) == 4
    assert all(p.grad is buffers[id(p)] for p in s.model.parameters())
    assert all(not p.grad.any() for p in s.model.parameters())  # zeroed in place after the optimizer step


def test_with_one_backward_a_step_cuda_graphs_take_gradients_as_written_and_a_split_step_gets_buffers_first(
        cpu_device, one_torch_thread):
    """One backward a step: no buffer to add into (each parameter's add kernel was a launch outside the graphs, 201
    of the 272 an H200 step made at batch 64, run 7), the gradients dropped after the step. A step that makes
    several backward passes anyway (two micro-batches here; out-of-memory recovery's chunks) gets a zeroed buffer for
    every parameter before its first pass, and sums into it: the same gradients as plain accumulation."""
    result = train(loading.load([*TINY, "train.max_steps=1"], device=cpu_device), tracker=NullTracker(),
                   progress=False, device=cpu_device, verbose=False)
    s = dataclasses.replace(result.setup, cuda_graphs=True, accum_steps=1)
    assert not s.gradients_in_buffers and s.oom.halvings == 0
    batches = iter(s.train_loader)
    meter = Throughput("cpu")
    train_step(s, [next(batches)], meter)
    assert all(p.grad is None for p in s.model.parameters())  # taken as written, dropped after the step
    seen = []
    forward = s.forward
    s = dataclasses.replace(s, forward=lambda **kw: seen.append(
        all(p.grad is not None for p in s.model.parameters() if p.requires_grad)) or forward(**kw))
    pair = [next(batches), next(batches)]
    plain = dataclasses.replace(s, cuda_graphs=False, forward=forward)
    plain.zero_grad()
    torch.manual_seed(0)  # the same dropout masks in both
    loop._forward_backward(plain, pair)
    expected = [p.grad.clone() for p in s.model.parameters()]
    plain.zero_grad()
    torch.manual_seed(0)
    loop._forward_backward(s, pair)
    assert seen == [True, True]  # buffers before the first pass
    for got, want in zip((p.grad for p in s.model.parameters()), expected):
        torch.testing.assert_close(got, want)
    s.oom.halvings = 1  # out-of-memory recovery split the rows: every step now makes several passes
    assert s.gradients_in_buffers
    s.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in s.model.parameters())


def test_under_cuda_graphs_only_full_micro_batches_reach_the_graphs(cpu_device, one_torch_thread):
    """cudagraph trees record a graph per distinct (rows, width): over two epochs of the real bucket plan, the graphed
    forward sees the full micro-batch at the run's pad widths only; the epoch's partial last batch (800 rows, 48 a
    batch: 32 left) runs eager. After an out-of-memory halving the graphs take the half micro-batch, and the odd
    last chunk runs eager."""
    result = train(loading.load([*TINY, "hardware.pad_widths=4", "data.bucketing=true", "train.batch_size=48",
                                 "train.target_effective_batch=48", "train.max_steps=1"], device=cpu_device),
                   tracker=NullTracker(), progress=False, device=cpu_device, verbose=False)
    seen: dict[str, set] = {"graphs": set(), "eager": set()}

    def recorded(path, module):
        def forward(**inputs):
            seen[path].add(tuple(inputs["input_ids"].shape))
            return module(**inputs)
        return forward

    model = result.setup.model
    s = dataclasses.replace(result.setup, forward=recorded("graphs", model), eager=recorded("eager", model),
                            cuda_graphs=True)
    widths = {int(w) for w in s.derived["pad_widths"].split()}
    meter = Throughput("cpu")
    for epoch in range(2):
        s.sampler.set_epoch(epoch)
        for batch in s.train_loader:
            train_step(s, [batch], meter)
    assert {rows for rows, _ in seen["graphs"]} == {48} and {w for _, w in seen["graphs"]} <= widths
    assert {rows for rows, _ in seen["eager"]} == {800 % 48}

    s.oom.halvings = 1  # what recovery leaves after an out-of-memory error: 24-row chunks
    assert s.forward_for(24) is s.forward and s.forward_for(7) is s.eager and s.forward_for(1) is s.eager
    plain = dataclasses.replace(s, cuda_graphs=False)  # default mode: one dynamic graph takes any row count but 1
    assert plain.forward_for(32) is plain.forward and plain.forward_for(1) is plain.eager

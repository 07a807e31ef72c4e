"""Fused kernels as measured flags (issue 37): Liger's kernels for decoders, inductor's coordinate-descent tuning and
its fused LayerNorm backward (mix-order reduction). All run only on a CUDA GPU; here, their decisions on described
devices and Liger's instance-only patching (with a stand-in for liger's own function)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from maxout import loading
from maxout.insight.grid import parse_grid
from maxout.optimizations import compile as compile_opt, inductor_tuning, liger_kernel, mix_order_reduction, named
from maxout.train.setup import apply_backend, plan_decisions
from transformers import BertForSequenceClassification, Qwen3ForSequenceClassification

from .conftest import fake_cuda

H100 = fake_cuda(name="NVIDIA H100 80GB HBM3", memory_gb=79.2, cc=(9, 0))


def test_liger_runs_only_on_a_gpu_with_kernels_for_the_model_type(cpu_device, monkeypatch):
    assert liger_kernel.supported(cpu_device, "qwen3") == (
        False, "Liger's kernels are Triton GPU kernels: no CUDA device")
    assert liger_kernel.supported(H100, "qwen3", kernels={"qwen3", "llama"}) == (True, "")
    ok, why = liger_kernel.supported(H100, "bert", kernels={"qwen3", "llama"})
    assert not ok and "no kernels for model type 'bert'" in why
    monkeypatch.setattr(liger_kernel, "has_triton", lambda: False)
    assert liger_kernel.supported(H100, "qwen3") == (False, "triton is not installed: Liger's kernels are Triton "
                                                           "kernels")


def test_liger_is_decided_per_model_type(monkeypatch):
    monkeypatch.setattr(compile_opt, "has_triton", lambda: True)
    monkeypatch.setattr(liger_kernel, "installed_kernels", lambda: ({"qwen3"}, ""))
    cfg = loading.load(["hardware=h100", "model=tiny", "hardware.liger_kernel=true"], device=H100)
    assert named(plan_decisions(cfg, H100, Qwen3ForSequenceClassification), "liger_kernel").effective is True
    bert = named(plan_decisions(cfg, H100, BertForSequenceClassification), "liger_kernel")
    assert bert.effective is False and "'bert'" in bert.reason


def test_liger_patches_the_instance_and_leaves_the_modeling_module_as_it_was():
    """liger's apply_liger_kernel_to_<type>(model=...) also rebinds names in transformers' modeling module; the
    next model of that type in the process (an HPO trial, an ablation cell with the flag off) must not get them."""
    module = types.ModuleType("fake_modeling_qwen")
    original_norm, original_rope = object(), object()
    module.Qwen3RMSNorm, module.apply_rotary_pos_emb = original_norm, original_rope
    sys.modules[module.__name__] = module
    Model = type("Model", (torch.nn.Module,), {"__module__": module.__name__})
    model = Model()
    model.norm = torch.nn.LayerNorm(4)
    seen = {}

    def liger_apply(model, **kwargs):  # what liger's functions do: module names and the instance's modules
        seen.update(kwargs)
        module.Qwen3RMSNorm, module.apply_rotary_pos_emb, module.LigerNew = "liger", "liger_rope", "added"
        model.norm.forward = lambda x: x * 0

    try:
        assert liger_kernel.apply(model, apply_fn=liger_apply) is model
    finally:
        del sys.modules[module.__name__]
    assert module.Qwen3RMSNorm is original_norm and module.apply_rotary_pos_emb is original_rope
    assert not hasattr(module, "LigerNew")
    assert torch.equal(model.norm(torch.ones(2, 4)), torch.zeros(2, 4))  # the instance keeps the kernel
    assert seen["rms_norm"] and seen["swiglu"] and not seen["rope"] and not seen["fused_linear_cross_entropy"]


def test_inductor_tuning_needs_compile_and_a_gpu(cpu_device):
    assert inductor_tuning.supported(H100, compiled=True) == (True, "")
    assert "compile is off" in inductor_tuning.supported(H100, compiled=False)[1]
    assert "no CUDA device" in inductor_tuning.supported(cpu_device, compiled=True)[1]
    before = inductor_tuning.enabled()
    try:
        inductor_tuning.apply(True)
        assert torch._inductor.config.coordinate_descent_tuning is True
        inductor_tuning.apply(False)
        assert inductor_tuning.enabled() is False
    finally:
        inductor_tuning.apply(before)


def test_mix_order_reduction_is_decided_with_compile_on_a_gpu_and_set_at_the_runs_start(cpu_device, monkeypatch):
    monkeypatch.setattr(compile_opt, "has_triton", lambda: True)  # the H100's compile decision, as its image has it
    assert mix_order_reduction.supported(H100, compiled=True) == (True, "")
    assert "compile is off" in mix_order_reduction.supported(H100, compiled=False)[1]
    assert "no CUDA device" in mix_order_reduction.supported(cpu_device, compiled=True)[1]
    on = loading.load(["hardware=h100", "model=tiny"], device=H100)
    assert on.hardware.mix_order_reduction is True  # inductor's own default, until a GPU measures it off
    decision = named(plan_decisions(on, H100, BertForSequenceClassification), "mix_order_reduction")
    assert (decision.requested, decision.effective) == (True, True)
    off = loading.load(["hardware=h100", "model=tiny", "hardware.mix_order_reduction=false"], device=H100)
    assert named(plan_decisions(off, H100, BertForSequenceClassification), "mix_order_reduction").effective is False
    # A run sets inductor's switch to its decision first (process-wide); one whose decision fell back (here: no CUDA
    # device) sets inductor's default back for whatever compiles next. (An H100's plan would also set TF32 and
    # cuDNN's switches for the rest of this process, so a CPU's plans stand in.)
    cpu = loading.load(["hardware=cpu", "model=tiny", "hardware.compile=true"], device=cpu_device)
    planned = plan_decisions(cpu, cpu_device, BertForSequenceClassification)
    assert named(planned, "mix_order_reduction").reason.endswith("no CUDA device")
    cpu_off = loading.load(["hardware=cpu", "model=tiny", "hardware.mix_order_reduction=false"], device=cpu_device)
    try:
        apply_backend(cpu_off, plan_decisions(cpu_off, cpu_device, BertForSequenceClassification))  # asked: off
        assert torch._inductor.config.triton.mix_order_reduction is False
        apply_backend(cpu, planned)
        assert mix_order_reduction.enabled() is mix_order_reduction.INDUCTOR_DEFAULT is True
    finally:
        mix_order_reduction.apply(None)


def test_both_are_ablation_axes():
    grid = parse_grid("liger_kernel=off,on inductor_tuning=off,on mix_order_reduction=on,off")
    assert grid == {"liger_kernel": (False, True), "inductor_tuning": (False, True),
                    "mix_order_reduction": (True, False)}


def test_the_ablation_skips_them_with_their_reason_on_a_cpu(cpu_device):
    from maxout.insight import benchmark
    from maxout.insight.grid import cells

    cfg = loading.load(["hardware=cpu", "model=tiny", "tracking=none", "hardware.compile=true"], device=cpu_device)
    reasons = {cell.name: benchmark.skip_reason(cell, cpu_device, cfg)
               for cell in cells(parse_grid("liger_kernel=off,on inductor_tuning=off,on"))}
    assert reasons["liger_kernel=off inductor_tuning=off"] == ""
    assert reasons["liger_kernel=on inductor_tuning=off"] == (
        "liger_kernel: Liger's kernels are Triton GPU kernels: no CUDA device")
    assert "inductor_tuning: coordinate-descent tuning" in reasons["liger_kernel=off inductor_tuning=on"]

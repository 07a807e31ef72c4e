"""GPU paths, run where a CUDA device is visible (marked `gpu`; skipped elsewhere by conftest)."""

from __future__ import annotations

import pytest
import torch

from maxout import hardware, loading
from maxout.optimizations import tf32
from maxout.tracking.tracker import NullTracker
from maxout.train import train

from .conftest import TINY

pytestmark = pytest.mark.gpu
GPU_TINY = [o for o in TINY if o != "hardware=cpu"] + ["hardware=auto"]


def run(*overrides):
    device = hardware.detect()
    cfg = loading.load([*GPU_TINY, *overrides], device=device)
    tracker = NullTracker()
    return train(cfg, tracker=tracker, progress=False, device=device, verbose=False), tracker


def test_auto_profile_turns_on_the_cuda_paths():
    result, tracker = run()
    device = result.setup.device
    assert device.is_cuda and result.setup.cfg.hardware.name != "cpu"
    assert tracker.params["opt.pin_memory.effective"] == "true" and result.setup.train_loader.pin_memory
    expected = "bf16" if device.bf16 else "fp16"
    assert tracker.params["opt.precision.effective"] == expected
    assert tracker.params["opt.tf32.effective"] == str(device.tf32).lower() and tf32.enabled() == device.tf32
    assert tracker.params["opt.fused_adamw.effective"] == "true"
    m = result.metrics
    assert m["mem/peak_allocated_gb"] > 0 and m["mem/peak_reserved_gb"] >= m["mem/peak_allocated_gb"]
    if hardware.peak_flops(device, expected, device.tf32):
        assert 0 < m["perf/mfu"] < 1


def test_fp16_uses_a_grad_scaler_and_trains():
    result, tracker = run("hardware.precision=fp16")
    assert tracker.params["opt.precision.effective"] == "fp16"
    assert result.setup.precision.scaler.is_enabled()
    assert torch.isfinite(torch.tensor(result.metrics["train/final_loss"]))


def test_gpu_utilization_is_sampled_inside_the_training_window():
    result, _ = run("train.max_steps=40", "train.epochs=1")
    assert 0 <= result.metrics["gpu/utilization_mean"] <= result.metrics["gpu/utilization_max"] <= 100


def test_cudagraph_compile_mode_with_static_shapes():
    result, tracker = run("hardware.compile=true", "hardware.compile_mode=reduce-overhead", "data.padding=max_length",
                          "data.max_length=128")
    assert tracker.params["opt.compile_mode.effective"] == "reduce-overhead"
    assert result.metrics["time/compile_s"] > 0


def test_bf16_and_fp32_agree_on_the_first_loss():
    """The mixed-precision path computes the same model: first-step losses agree closely."""
    losses = {}
    for precision in ("fp32", "bf16"):
        result, tracker = run(f"hardware.precision={precision}", "train.max_steps=1", "train.deterministic=true")
        losses[precision] = tracker.metrics["train/loss"][0][1]
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=2e-2)

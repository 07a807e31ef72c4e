"""The divergence watch: the first non-finite step is recorded on the device without a host sync, and reported
with its step at the next sync point; fp16 leaves overflowing gradients to its GradScaler. (End to end, a run with
lr=1e9 failing at step 2 with no model logged: test_bad_input_sweep.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from maxout.errors import Diverged
from maxout.tracking.tracker import NullTracker
from maxout.train.divergence import TAG, DivergenceWatch

# What reading a device value on the host dispatches to: .item(), float(), bool(), `if tensor:`.
HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default}


class NoHostRead(TorchDispatchMode):
    """Fails on any op that copies a tensor's value to the host (a device sync on a GPU)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            raise AssertionError(f"host read: {func}")
        return func(*args, **(kwargs or {}))


class Scaler:
    def __init__(self, enabled: bool):
        self.enabled = enabled

    def is_enabled(self) -> bool:
        return self.enabled


def setup(precision: str = "bf16", clip: float = 1.0) -> SimpleNamespace:
    cfg = SimpleNamespace(train=SimpleNamespace(lr=3e-4))
    return SimpleNamespace(cfg=cfg, clip_norm=clip, decision=lambda name: SimpleNamespace(effective=precision))


def steps(watch: DivergenceWatch, values: list[tuple[float, float]], fp16: bool = False) -> None:
    for step, (loss, norm) in enumerate(values, 1):
        watch.record(step, torch.tensor(loss), torch.tensor(norm), [], Scaler(fp16))


def test_recording_reads_nothing_on_the_host_and_the_spy_would_notice():
    watch = DivergenceWatch()
    with NoHostRead():
        steps(watch, [(0.7, 1.0), (float("nan"), 2.0), (0.5, float("inf"))])
        with pytest.raises(AssertionError, match="host read"):
            float(watch.first[0])  # the spy does catch a host read


def test_the_first_bad_step_is_reported_at_the_next_check_with_the_fixes():
    watch, tracker = DivergenceWatch(), NullTracker()
    steps(watch, [(0.7, 1.0), (0.6, 0.9)])
    watch.check(setup(), tracker)  # all finite: nothing happens
    steps(watch, [(0.7, 1.0), (0.6, 0.9), (0.5, float("inf")), (float("nan"), float("nan"))])
    with pytest.raises(Diverged) as caught:
        watch.check(setup(), tracker)
    assert caught.value.step == 3 and tracker.tags[TAG] == "3"
    assert str(caught.value).startswith("training diverged at step 3: loss 0.5, gradient norm inf; try: lower "
                                        "train.lr (now 0.0003), clip harder (train.max_grad_norm=1 now), train in "
                                        "fp32 (hardware.precision=fp32)")
    assert "\n" not in str(caught.value)


def test_without_clipping_the_watch_computes_the_gradient_norm_itself():
    layer = torch.nn.Linear(2, 1)
    layer(torch.ones(1, 2)).sum().backward()
    layer.weight.grad[0, 0] = float("inf")
    watch = DivergenceWatch()
    watch.record(1, torch.tensor(0.3), None, layer.parameters(), Scaler(False))
    with pytest.raises(Diverged, match="step 1: loss 0.3, gradient norm inf; try: lower train.lr .*, clip gradients "
                                       r"\(train.max_grad_norm=1.0\); the run ends FAILED"):
        watch.check(setup(precision="fp32", clip=0.0), NullTracker())


def test_fp16_leaves_an_overflowing_gradient_to_its_grad_scaler_but_not_a_nan_loss():
    watch = DivergenceWatch()
    steps(watch, [(0.7, float("inf")), (0.6, float("nan"))], fp16=True)  # GradScaler skips these steps
    watch.check(setup("fp16"), NullTracker())
    steps(watch, [(0.7, 1.0), (float("nan"), 1.0)], fp16=True)
    with pytest.raises(Diverged, match="at step 2: loss nan"):
        watch.check(setup("fp16"), NullTracker())


def test_an_evaluation_loss_that_is_not_finite_names_the_last_step():
    tracker = NullTracker()
    DivergenceWatch().check_evaluation({"eval/loss": 0.69}, 5, setup(), tracker)
    with pytest.raises(Diverged, match="at step 5: the weights after it give an evaluation loss of nan; try: "):
        DivergenceWatch().check_evaluation({"eval/loss": float("nan")}, 5, setup(), tracker)
    assert tracker.tags[TAG] == "5"


@pytest.mark.gpu
def test_on_cuda_recording_never_synchronizes():
    """torch's own sync detector: any device-to-host wait inside record() raises."""
    layer = torch.nn.Linear(8, 1).cuda()
    layer(torch.ones(4, 8, device="cuda")).sum().backward()
    losses = [torch.tensor(v, device="cuda") for v in (0.5, float("nan"), 0.4)]  # made before the detector
    watch = DivergenceWatch()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step, loss in enumerate(losses, 1):
            watch.record(step, loss, None, layer.parameters(), Scaler(False))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    with pytest.raises(Diverged, match="at step 2: loss nan"):
        watch.check(setup(), NullTracker())

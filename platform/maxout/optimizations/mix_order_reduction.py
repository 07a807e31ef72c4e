"""Inductor's mix-order reduction: one Triton kernel for both reductions of a LayerNorm's backward (each row's sums
for the input's gradient, each column's sums for the weight's and bias's), instead of one kernel for each.

Why a flag: the fused kernel was the slowest part of compiled BERT-base on an H200. In run 7 (2026-11-28,
gpu/reports/2026-11-28-h200, micro-batch 1024 at <= 128 tokens, compile in default mode) its two instances took
25.6% of the kernel time, 2.7x what eager's separate LayerNorm-backward and add kernels took for the same work, and
the compiled step (MFU 24.5%) lost to eager (26.2%). pytorch/pytorch#185814 reports that kernel's block size leaving
it at ~10% of memory bandwidth on some shapes. Off, inductor generates the two reductions as separate kernels. A
measured flag (``hardware.mix_order_reduction``, an ablation axis, and the GPU report's compiled MFU cases run it
off): on, inductor's own default, until a GPU says which is faster.

A process-wide inductor switch, set at every run's start to the run's decision (like TF32). A run that cannot use it
(compile off, no CUDA device) sets inductor's own default back, so that what compiles next in the process (a GPU test
after a compile-off run, the next HPO trial) is not left with another run's choice. With the fusion on and dynamic
shapes, compile.no_size_guards() also keeps inductor from guarding on the sizes that decide it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch._inductor.config as inductor_config

INDUCTOR_DEFAULT = bool(inductor_config.triton.mix_order_reduction)  # at import: on, unless the environment says
# otherwise (TORCHINDUCTOR_MIX_ORDER_REDUCTION=0)


def supported(device: Any, compiled: bool) -> tuple[bool, str]:
    if not compiled:
        return False, "compile is off: inductor generates no kernels"
    if not device.is_cuda:
        return False, "mix-order reduction is a choice of inductor's Triton (GPU) code generation: no CUDA device"
    return True, ""


def apply(enabled: Optional[bool]) -> None:
    """``enabled``: the decision's value; None: inductor's default (the run decided nothing)."""
    inductor_config.triton.mix_order_reduction = INDUCTOR_DEFAULT if enabled is None else bool(enabled)


def enabled() -> bool:
    return bool(inductor_config.triton.mix_order_reduction)

"""Inductor's coordinate-descent tuning: after picking a Triton kernel's launch configuration by heuristics,
inductor times its neighbours (block sizes, warps) and keeps the fastest.

Why: the memory-bound kernels inductor generates for an encoder (dropout + residual + LayerNorm, forward and
backward; GELU) took about a third of BERT-base's kernel time on an H200 (issue 37), and their heuristic block
sizes are where tuning finds time. It costs compile time (each kernel is benchmarked), so it is a measured flag
(``hardware.inductor_tuning``, an ablation axis), off by default. ``max-autotune-no-cudagraphs`` (a compile mode)
also autotunes the matmuls; it cannot be combined with CUDA graphs, which this keeps.

A process-wide inductor switch, set at every run's start to the run's decision (like TF32).
"""

from __future__ import annotations

from typing import Any

import torch._inductor.config as inductor_config


def supported(device: Any, compiled: bool) -> tuple[bool, str]:
    if not compiled:
        return False, "compile is off: there are no inductor kernels to tune"
    if not device.is_cuda:
        return False, "coordinate-descent tuning tunes inductor's Triton (GPU) kernels: no CUDA device"
    return True, ""


def apply(enabled: bool) -> None:
    inductor_config.coordinate_descent_tuning = bool(enabled)


def enabled() -> bool:
    return bool(inductor_config.coordinate_descent_tuning)

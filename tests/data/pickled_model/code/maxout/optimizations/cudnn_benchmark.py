"""cuDNN benchmark: time the candidate kernels once per input shape and keep the fastest.

Encoders run few cuDNN ops (matmuls go to cuBLAS), so expect a small effect; the ablation benchmark measures it.
It picks kernels non-deterministically, so deterministic mode turns it off.
"""

from __future__ import annotations

from typing import Any

import torch


def supported(device: Any, deterministic: bool = False) -> tuple[bool, str]:
    if not device.is_cuda:
        return False, "no CUDA device"
    if deterministic:
        return False, "train.deterministic=true: benchmark picks kernels non-deterministically"
    if not torch.backends.cudnn.is_available():
        return False, "cuDNN is not available in this torch build"
    return True, ""


def apply(enabled: bool) -> None:
    torch.backends.cudnn.benchmark = enabled

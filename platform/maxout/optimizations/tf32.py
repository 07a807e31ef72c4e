"""TF32: fp32 matmuls and convolutions on Ampere+ tensor cores (10-bit mantissa, fp32 range)."""

from __future__ import annotations

from typing import Any

import torch


def supported(device: Any) -> tuple[bool, str]:
    if not device.is_cuda:
        return False, "no CUDA device"
    if not device.tf32:
        cc = device.compute_capability
        return False, f"{device.name} (compute capability {cc[0]}.{cc[1]}) has no TF32 tensor cores; needs 8.0+"
    return True, ""


def apply(enabled: bool) -> None:
    # torch >= 2.9 has per-backend fp32_precision; older versions only the allow_tf32 flags.
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.cuda.matmul.fp32_precision = "tf32" if enabled else "ieee"
        torch.backends.cudnn.conv.fp32_precision = "tf32" if enabled else "ieee"
    else:  # pragma: no cover - older torch
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def enabled() -> bool:
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        return torch.backends.cuda.matmul.fp32_precision == "tf32"
    return torch.backends.cuda.matmul.allow_tf32  # pragma: no cover

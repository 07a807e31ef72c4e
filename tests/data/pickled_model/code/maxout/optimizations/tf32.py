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
    """Turn TF32 on or off with torch's legacy flags and its newer per-backend ``fp32_precision`` (torch >= 2.9) in
    agreement.

    torch >= 2.9 keeps both, and a legacy getter that finds them disagreeing raises "you have used mix of the legacy
    and new APIs". Setting only ``torch.backends.cuda.matmul.fp32_precision`` leaves the legacy matmul precision at
    "highest", and torch 2.11's inductor reads it (``torch.get_float32_matmul_precision()`` when max-autotune picks
    and caches its matmul kernels, ``matmul.allow_tf32`` for autotuning in a subprocess): every max-autotune compile
    would fail. ``set_float32_matmul_precision`` and ``cudnn.allow_tf32`` write the legacy value and the new
    per-backend ones together (cuDNN's: conv and RNN alike), on every torch version. The global default goes with
    them: transformers' Trainer (``tf32=True``) sets ``torch.backends.fp32_precision`` alone, and cuDNN's flags
    inherit it, so TF32 turned off after a Trainer ran in the same process would leave ``cudnn.allow_tf32`` raising.
    """
    if hasattr(torch.backends, "fp32_precision"):  # torch >= 2.9
        torch.backends.fp32_precision = "tf32" if enabled else "ieee"
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled


def enabled() -> bool:
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        return torch.backends.cuda.matmul.fp32_precision == "tf32"
    return torch.backends.cuda.matmul.allow_tf32  # pragma: no cover

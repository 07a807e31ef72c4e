"""Mixed precision: bf16 / fp16 autocast (+GradScaler for fp16) or plain fp32.

bf16 keeps fp32's exponent range, so it needs no loss scaling; fp16 does (GradScaler). Where the device has no
native bf16, bf16 falls back: to fp16 on a pre-Ampere GPU, to fp32 on a CPU without AVX512-BF16/AMX.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from . import PRECISIONS
from .base import Decision

DTYPES = dict(zip(PRECISIONS, (torch.bfloat16, torch.float16, torch.float32)))


def supported(precision: str, device: Any) -> tuple[bool, str]:
    if precision == "fp32":
        return True, ""
    if precision == "bf16" and not device.bf16:
        if device.is_cuda:
            cc = device.compute_capability
            return False, f"{device.name} (compute capability {cc[0]}.{cc[1]}) has no native bf16; needs 8.0+"
        return False, "this CPU has no native bf16 (AVX512-BF16/AMX): emulated bf16 is slower than fp32"
    if precision == "fp16" and not device.is_cuda:
        return False, "no CUDA device: fp16 autocast with loss scaling is a GPU technique"
    return True, ""


def resolve(requested: str, device: Any) -> Decision:
    ok, reason = supported(requested, device)
    if ok:
        return Decision("precision", requested, requested)
    if requested == "bf16" and device.is_cuda:
        return Decision("precision", requested, "fp16", reason + " -> fp16 with GradScaler")
    if requested == "fp16" and device.bf16:
        return Decision("precision", requested, "bf16", reason + " -> bf16 (native on this CPU)")
    return Decision("precision", requested, "fp32", reason + " -> fp32")


@dataclass
class Precision:
    name: str
    device_type: str
    scaler: torch.amp.GradScaler

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)


def apply(precision: str, device_type: str) -> Precision:
    """The autocast context factory and a GradScaler that is a no-op unless fp16."""
    return Precision(precision, device_type, torch.amp.GradScaler(device_type, enabled=precision == "fp16"))


"""AdamW with the fused kernel (one launch for all parameters) or, where unsupported, the foreach kernel.

With fp16 the fused kernel also takes GradScaler's inf check on the device, so the step needs no host sync.
"""

from __future__ import annotations

from typing import Any

import torch

NO_DECAY = ("bias", "LayerNorm.weight", "layer_norm.weight", "LayerNorm.bias", "norm.weight")


def _fused_devices() -> list[str]:
    try:  # lazy: a private torch API, missing from older versions (the except covers them)
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        return list(_get_fused_kernels_supported_devices())
    except ImportError:  # pragma: no cover - older torch
        return ["cuda"]


def supported(device: Any) -> tuple[bool, str]:
    devices = _fused_devices()
    if device.torch_device not in devices:
        return False, f"torch {torch.__version__} has no fused AdamW for {device.torch_device} (has: {devices})"
    return True, ""


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if any(k in name for k in NO_DECAY) or p.ndim < 2 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def apply(model: torch.nn.Module, lr: float, weight_decay: float, fused: bool) -> torch.optim.AdamW:
    groups = [g for g in param_groups(model, weight_decay) if g["params"]]
    if fused:
        return torch.optim.AdamW(groups, lr=lr, fused=True)
    return torch.optim.AdamW(groups, lr=lr, foreach=True)

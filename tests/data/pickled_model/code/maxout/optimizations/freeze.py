"""Freeze the encoder: train only the classification head (fast, little memory, lower ceiling)."""

from __future__ import annotations

import torch


def supported(model: torch.nn.Module, adapter: str = "none") -> tuple[bool, str]:
    if adapter != "none":
        return False, f"model.adapter={adapter} already freezes the encoder (only adapters and head train)"
    if getattr(model, "base_model", model) is model:
        return False, f"{type(model).__name__} has no separate encoder (base_model) to freeze"
    return True, ""


def apply(model: torch.nn.Module) -> int:
    """Freeze ``model.base_model``; returns the number of parameters left trainable."""
    for p in model.base_model.parameters():
        p.requires_grad_(False)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)

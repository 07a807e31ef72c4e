"""Gradient clipping by global norm. Returns the norm as a tensor: reading it would be a host sync."""

from __future__ import annotations

from typing import Iterable

import torch


def supported(max_norm: float) -> tuple[bool, str]:
    return (True, "") if max_norm > 0 else (False, "train.max_grad_norm=0")


def apply(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, foreach=True)

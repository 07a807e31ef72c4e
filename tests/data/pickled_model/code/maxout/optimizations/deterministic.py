"""Deterministic mode: the same seed gives the same weights, at some speed cost."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def supported(device: object = None) -> tuple[bool, str]:
    return True, ""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def apply(enabled: bool) -> None:
    if enabled:
        # cuBLAS needs a fixed workspace to be deterministic; it reads this when its handle is created.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic = enabled

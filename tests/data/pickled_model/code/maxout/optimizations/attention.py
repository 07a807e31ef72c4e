"""Attention implementation: flash_attention_2 (package flash_attn) > sdpa (PyTorch's fused kernels) > eager.

A request the model or device cannot honour falls back down that chain, with the reason.
"""

from __future__ import annotations

from typing import Any

from . import ATTENTION
from .base import Decision

CHAIN = ATTENTION  # the order requests fall back in


def supported(impl: str, model_class: type, device: Any, precision: str) -> tuple[bool, str]:
    if impl == "eager":
        return True, ""
    if impl == "sdpa":
        if not getattr(model_class, "_supports_sdpa", False):
            return False, f"{model_class.__name__} has no SDPA attention in this transformers version"
        return True, ""
    if impl == "flash_attention_2":
        if not getattr(model_class, "_supports_flash_attn", False):
            return False, f"{model_class.__name__} has no flash-attention 2 path"
        if not device.flash_attention:
            return False, device.flash_attention_reason
        if precision not in ("bf16", "fp16"):
            return False, "flash-attention 2 runs in fp16/bf16 only; precision is fp32"
        return True, ""
    return False, f"unknown attention implementation {impl!r}"


def resolve(requested: str, model_class: type, device: Any, precision: str) -> Decision:
    reasons = []
    for impl in CHAIN[CHAIN.index(requested):]:
        ok, why = supported(impl, model_class, device, precision)
        if ok:
            return Decision("attention", requested, impl, "; ".join(reasons))
        reasons.append(why)
    return Decision("attention", requested, "eager", "; ".join(reasons))  # pragma: no cover - eager always works


def apply(impl: str) -> dict:
    """Keyword arguments for ``from_pretrained`` / ``from_config``."""
    return {"attn_implementation": impl}

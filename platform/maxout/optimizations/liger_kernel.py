"""Liger Kernel's fused Triton kernels in a decoder classifier: RMSNorm and SwiGLU / GeGLU MLPs.

Why: on a GPU the memory-bound ops (norms, activations) took more kernel time than the matmuls did (issue 37's
H200 profile: 46% "other"); Liger (``pip install 'maxout[gpu]'``, liger-kernel on PyPI, pure Triton) fuses each
into one kernel with a hand-written backward. A measured flag (``hardware.liger_kernel``, an ablation axis), off
by default: under torch.compile inductor fuses the same ops itself, and which wins is the GPU report's question.

Scope: this model instance only. Liger's ``apply_liger_kernel_to_<type>(model=...)`` binds its kernels to the
instance's modules, and also rebinds names in transformers' modeling module (the RMSNorm and MLP classes, RoPE's
function), which would change every later model of that type in the process (the next HPO trial, the next
ablation cell with the flag off). ``apply`` puts those module names back at once, so only the instance keeps the
kernels. RoPE is therefore not applied: its Liger kernel replaces a module-level function, not a module of the
instance (and inductor fuses RoPE under compile). Cross-entropy neither: a classifier's loss is over a few labels
per row, not a vocabulary (and Liger's fused linear cross-entropy replaces a causal LM's forward, which a
classifier must keep).
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any, Callable, Optional

import torch
from torch.utils._triton import has_triton

# What liger's per-model functions take: the kernels above on, RoPE and both cross-entropies off (see the docstring)
KERNELS = {"rms_norm": True, "swiglu": True, "geglu": True, "rope": False, "cross_entropy": False,
           "fused_linear_cross_entropy": False}


def installed_kernels() -> tuple[Optional[set], str]:
    """The model types the installed liger-kernel patches, or None and why there are none."""
    if not has_triton():
        return None, "triton is not installed: Liger's kernels are Triton kernels"
    if importlib.util.find_spec("liger_kernel") is None:
        return None, "liger-kernel is not installed (pip install 'maxout[gpu]', or pip install liger-kernel)"
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN  # lazy: imports triton

    return set(MODEL_TYPE_TO_APPLY_LIGER_FN), ""


def supported(device: Any, model_type: str, kernels: Optional[set] = None) -> tuple[bool, str]:
    """``kernels``: the model types liger patches (default: the installed liger-kernel's)."""
    if not device.is_cuda:
        return False, "Liger's kernels are Triton GPU kernels: no CUDA device"
    if kernels is None:
        kernels, why = installed_kernels()
        if kernels is None:
            return False, why
    if model_type not in kernels:
        return False, (f"liger-kernel has no kernels for model type {model_type!r} (it covers decoders such as "
                       f"llama, qwen3, gemma3_text; encoders' LayerNorm and dropout are fused by compile)")
    return True, ""


def apply(model: torch.nn.Module, apply_fn: Optional[Callable] = None) -> torch.nn.Module:
    """Bind Liger's kernels to ``model``'s modules, leaving transformers' modeling module as it was.
    ``apply_fn``: liger's ``_apply_liger_kernel_to_instance`` (a stand-in in tests)."""
    if apply_fn is None:  # lazy: liger imports triton, which a CPU machine may lack
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance as apply_fn  # lazy: triton

    module = sys.modules[type(model).__module__]  # e.g. transformers.models.qwen3.modeling_qwen3
    saved = dict(vars(module))
    try:
        apply_fn(model=model, **KERNELS)
    finally:
        for name in [n for n in vars(module) if n not in saved]:
            delattr(module, name)
        for name, value in saved.items():
            if vars(module).get(name) is not value:
                setattr(module, name, value)
    return model

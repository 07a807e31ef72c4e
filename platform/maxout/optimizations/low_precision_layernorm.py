"""Low-precision LayerNorm: under autocast (CUDA or CPU), each ``torch.nn.LayerNorm`` of the model runs in the
autocast dtype (bf16 or fp16) instead of fp32.

Why: ``layer_norm`` is on CUDA autocast's fp32 list, so every LayerNorm hands back fp32, and in an encoder that
makes the whole residual stream fp32. Each residual add then reads a 16-bit sublayer output and an fp32 residual and
writes fp32, and each linear after a LayerNorm casts its fp32 input down again (Q, K and V each their own cast:
autocast caches the casts of weights, not of activations). On the H200 (2026-11-27, BERT-base at <= 128 tokens,
micro-batch 1024, compile off) those casts took 11% of the kernel time, the fp32 adds 10% and the fp32 LayerNorm
another 10%: memory traffic, not arithmetic. In 16 bits the LayerNorm kernel still accumulates its mean and variance
in fp32; only its input, weight, bias and output are 16-bit, and the weights themselves stay fp32 parameters (their
16-bit copies are made per forward, as autocast does for a linear's weight). MosaicML's Composer
(``LowPrecisionLayerNorm``) and its MPT models run LayerNorm this way. A measured flag
(``hardware.low_precision_layernorm``, an ablation axis, and a case of the GPU report's MFU section): on in the Hopper
profiles (1.13x tokens/s on the H200) and the CPU profile (below), off in the others until a GPU of theirs says what
it buys.

Scope: the model's ``torch.nn.LayerNorm`` modules (BERT, RoBERTa, ELECTRA, DeBERTa, MiniLM, ModernBERT). The
decoders' RMSNorm classes cast to fp32 inside their own forward (Liger's kernels are theirs: liger_kernel.py).
Outside autocast (fp32 training, an evaluation or a served model without autocast) the module is torch's LayerNorm
exactly, and parameters, ``state_dict`` and ``save_pretrained`` are unchanged.

On a CPU the same holds in effect: CPU autocast leaves ``layer_norm`` in its input's dtype, and a residual add of a
bf16 sublayer output to the fp32 residual is fp32, so BERT's stream is fp32 there too (tests/test_low_precision_
layernorm.py shows both devices). MiniLM on the demo, CPU profile, bf16, 2-core AVX-512 machine: 1.06x samples/s
(1.03-1.12 per round), 0.92x peak tensor memory (benchmarks/RESULTS.md, 2026-12-04).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F


class LowPrecisionLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm, run in the autocast dtype while autocast is on for the input's device."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        if not torch.is_autocast_enabled(device_type):
            return super().forward(x)
        dtype = torch.get_autocast_dtype(device_type)
        weight = None if self.weight is None else self.weight.to(dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        with torch.autocast(device_type, enabled=False):  # else autocast would send it back to fp32
            return F.layer_norm(x.to(dtype), self.normalized_shape, weight, bias, self.eps)


def layer_norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's LayerNorm modules (exactly torch's class, or already this one's)."""
    return [m for m in model.modules() if type(m) in (torch.nn.LayerNorm, LowPrecisionLayerNorm)]


def supported(device: Any, precision: str, model: Optional[torch.nn.Module] = None) -> tuple[bool, str]:
    """``precision``: the precision decision's effective value; ``model``: the built model (None: not checked).
    ``device``: any (under CUDA and CPU autocast alike an encoder's LayerNorms otherwise run in fp32); kept as every
    support check takes one."""
    if precision == "fp32":
        return False, "precision fp32: no autocast, LayerNorm already runs in the model's own dtype"
    if model is not None and not layer_norms(model):
        return False, "the model has no torch.nn.LayerNorm (decoders' RMSNorm: see liger_kernel)"
    return True, ""


def apply(model: torch.nn.Module) -> int:
    """Turn each of ``model``'s LayerNorms into a LowPrecisionLayerNorm in place (same parameters, same state);
    returns how many."""
    found = layer_norms(model)
    for module in found:
        module.__class__ = LowPrecisionLayerNorm
    return len(found)

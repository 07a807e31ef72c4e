"""torch.compile with a mode; compile time is taken from torch's own accounting, apart from steady-state speed.

CUDA-graph modes (reduce-overhead, max-autotune) replay fixed shapes: with dynamic padding every new sequence
length would re-record, so they are downgraded with a reason unless padding is static.
"""

from __future__ import annotations

from typing import Any

import torch
import torch._dynamo
from torch._dynamo.utils import calculate_time_spent
from torch.utils._triton import has_triton

from . import CUDAGRAPH_MODES
from .base import Decision


def supported(device: Any) -> tuple[bool, str]:
    if not torch._dynamo.is_dynamo_supported():
        return False, "torch.compile (dynamo) does not support this Python/platform"
    if device.is_cuda and not has_triton():
        return False, "triton is not installed: inductor cannot generate GPU kernels"
    if not device.compiler:  # CPU kernels are C++; on CUDA, triton builds its kernel launcher with it too
        return False, "no C compiler (cc/gcc) on PATH: inductor needs one (apt-get install gcc)"
    return True, ""


def resolve_mode(requested: str, device: Any, static_shapes: bool) -> Decision:
    if requested in CUDAGRAPH_MODES and not device.is_cuda:
        fallback = "default" if requested == "reduce-overhead" else "max-autotune-no-cudagraphs"
        return Decision("compile_mode", requested, fallback, "CUDA graphs need a CUDA device")
    if requested in CUDAGRAPH_MODES and not static_shapes:
        fallback = "default" if requested == "reduce-overhead" else "max-autotune-no-cudagraphs"
        return Decision("compile_mode", requested, fallback,
                        "CUDA graphs need static shapes: set data.padding=max_length to use them")
    return Decision("compile_mode", requested, requested)


def apply(model: torch.nn.Module, mode: str, dynamic: bool | None, backend: Any = "inductor") -> torch.nn.Module:
    """Compile lazily (the first forward compiles). ``dynamic=True`` marks shapes symbolic from the start,
    so dynamic padding compiles once instead of once per sequence length. ``backend``: inductor for runs; tests
    count graphs with dynamo's eager backends (a mode is inductor's, so it is passed to inductor only)."""
    if backend == "inductor":
        return torch.compile(model, mode=mode, dynamic=dynamic)
    return torch.compile(model, backend=backend, dynamic=dynamic)


def compile_seconds() -> float:
    """Cumulative wall time torch has spent compiling in this process (dynamo + AOT + inductor, fwd + bwd)."""
    return float(calculate_time_spent().get("total_wall_time", 0.0))

"""torch.compile with a mode; compile time is taken from torch's own accounting, apart from steady-state speed.

CUDA-graph modes (reduce-overhead, max-autotune) replay a recorded step with one launch: the lever for a step bound
by the host. cudagraph trees record one graph per input shape, so they run where the shapes are few: static padding
(data.padding=max_length), or dynamic padding rounded to a few widths (hardware.pad_widths, pad_widths.py). With
arbitrary widths or packed batches (a new length every step) they are downgraded with a reason.

Under CUDA graphs a step's outputs live in the graphs' memory pool until the next replay: each forward marks a new
step (``with_step_marks``), and where a step makes several backward passes, gradients keep buffers of their own
(``Setup.gradients_in_buffers``), since a .grad that a first backward left in the pool would be overwritten by the next
micro-batch's replay before the optimizer reads it.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import torch
import torch._dynamo
from torch._dynamo.utils import calculate_time_spent, counters
from torch.utils._triton import has_triton

from . import CUDAGRAPH_MODES, regional_compile
from .base import Decision


def supported(device: Any) -> tuple[bool, str]:
    if not torch._dynamo.is_dynamo_supported():
        return False, "torch.compile (dynamo) does not support this Python/platform"
    if device.is_cuda and not has_triton():
        return False, "triton is not installed: inductor cannot generate GPU kernels"
    if not device.compiler:  # CPU kernels are C++; on CUDA, triton builds its kernel launcher with it too
        return False, "no C compiler (cc/gcc) on PATH: inductor needs one (apt-get install gcc)"
    return True, ""


def cuda_graphs_refused(device: Any, parallel: str = "none") -> str:
    """Why CUDA graphs cannot run on this device and job, whatever the batches' shapes ("" when they can); pad_widths
    asks it too, since its widths are only for CUDA graphs. ``parallel``: the data_parallel decision's value."""
    if not device.is_cuda:
        return "CUDA graphs need a CUDA device"
    if parallel == "fsdp":  # FSDP's all-gathers allocate pinned host memory and run hooks a capture cannot hold
        return "CUDA graphs cannot capture FSDP's all-gathers (pytorch/pytorch#127225); DDP can run them"
    return ""


def resolve_mode(requested: str, device: Any, padding: str, widths: Any = None, parallel: str = "none") -> Decision:
    """``padding``: data.padding; ``widths``: the pad_widths decision's effective value (None: none); ``parallel``:
    the data_parallel decision's effective value."""
    if requested not in CUDAGRAPH_MODES:
        return Decision("compile_mode", requested, requested)
    fallback = "default" if requested == "reduce-overhead" else "max-autotune-no-cudagraphs"
    refused = cuda_graphs_refused(device, parallel)
    if refused:
        return Decision("compile_mode", requested, fallback, refused)
    if padding == "packed":
        return Decision("compile_mode", requested, fallback, "CUDA graphs record one graph per shape, and packed "
                                                             "batches change length every step")
    if padding == "dynamic" and not widths:
        return Decision("compile_mode", requested, fallback,
                        "CUDA graphs record one graph per shape: round dynamic padding to a few widths "
                        "(hardware.pad_widths=auto or 8) or set data.padding=max_length")
    return Decision("compile_mode", requested, requested)


def records_graphs(mode: str) -> bool:
    return mode in CUDAGRAPH_MODES


def with_step_marks(forward: Callable) -> Callable:
    """``forward`` that first tells cudagraph trees a new step begins, so the previous replay's outputs may be
    reused (torch's own guess, "a forward after the pending backward ran", fails with accumulation or
    out-of-memory chunks)."""

    @functools.wraps(forward)
    def forward_in_new_step(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        return forward(*args, **kwargs)

    return forward_in_new_step


def apply(model: torch.nn.Module, mode: str, dynamic: bool | None, backend: Any = "inductor",
          scope: str = "model") -> torch.nn.Module:
    """Compile lazily (the first forward compiles). ``dynamic=True`` marks shapes symbolic from the start,
    so dynamic padding compiles once instead of once per sequence length. ``backend``: inductor for runs; tests
    count graphs with dynamo's eager backends (a mode is inductor's, so it is passed to inductor only). ``scope``:
    the compile_scope decision: the whole model, or its repeated blocks one by one (``layers``: regional_compile.py).

    Each call starts from an empty dynamo cache: a run compiles its own model. Dynamo keys its cache on the forward's
    code, which every run's model shares, and a new model instance is one more entry: the ninth run in a process
    (an HPO worker's ninth trial, a k-fold's ninth fold) hit dynamo's recompile limit (8) and ran eager while the
    run logged compile on. The earlier runs' models are gone by then; inductor's FX-graph cache on disk still
    serves a graph compiled before (HPO shares it between trials and workers)."""
    torch._dynamo.reset()
    constant_floats()
    if backend == "inductor":
        no_size_guards(bool(dynamic))
        compile_one = functools.partial(torch.compile, mode=mode, dynamic=dynamic)
    else:
        compile_one = functools.partial(torch.compile, backend=backend, dynamic=dynamic)
    return compile_one(model) if scope == "model" else regional_compile.apply(model, compile_one)


def constant_floats() -> None:
    """Compile the model's float attributes as constants (a process-wide dynamo switch, set for each compile).

    With ``dynamic=True`` dynamo makes every float it reads a graph input: each module's LayerNorm eps, attention
    scaling, dropout p and embedding norm_type. Those that an op needs as a Python float cannot be turned into
    tensors, so dynamo throws the whole trace away and traces the forward again (TensorifyScalarRestartAnalysis):
    two traces on every compile (tiny BERT on this CPU: a 213-node graph thrown away, then 181 nodes), and the
    attention scaling still reached the graph as a tensor input. A classifier's floats never change between steps,
    so a constant costs no recompile."""
    torch._dynamo.config.specialize_float = True


def no_size_guards(dynamic: bool) -> None:
    """With symbolic shapes, keep inductor from guarding on the batch's size (process-wide switches, set for each
    compile, like TF32). Each such guard compiles a whole second graph for the first batch on its other side, in the
    middle of the run. Static shapes keep inductor's defaults: there each check is decided once, with no guard.

    - Triton code generation: deciding whether to fuse a LayerNorm backward's two reductions (a "mix-order
      reduction"), inductor checks ``rows >= 4096``, ``rows >= 2 * hidden`` and ``rows * hidden >= 5 * 2**20``,
      rows being batch x sequence. Bucketed batches of 64 on the demo mix (1k-14k rows) crossed all three within an
      epoch: 98.1 s of compile for maxout's first run on the H200 (2026-11-27, a1d7f67); with the checks skipped
      (``mix_order_reduction_non_strict_mode``, inductor's switch "helpful to avoid recompilations") one graph,
      50.0 s (2026-11-27, 13a3e98). The fusion is then chosen from the graph alone, for every size.
    - Shape padding (``shape_padding``, fx_passes/pad_mm.py): asking whether a matmul is compute-bound enough to pad
      its dimensions, torch 2.11 guards on the rows (``769 <= batch`` for BERT-base's pooler on the H200). An
      epoch's partial last batch then fell below it: a second graph, 110.3 s of compile instead of ~55 at
      micro-batch 1024 (2026-11-27, 13a3e98, its recompile reason in the log). It only pads static dimensions, and
      those of the encoders and decoders maxout trains are multiples of 8 already (hidden 768-4096, heads of 64)."""
    import torch._inductor.config as inductor_config  # lazy: inductor's config module imports more of inductor

    inductor_config.triton.mix_order_reduction_non_strict_mode = dynamic
    inductor_config.shape_padding = not dynamic and os.environ.get("TORCHINDUCTOR_SHAPE_PADDING", "1") == "1"


def compile_seconds() -> float:
    """Cumulative wall time torch has spent compiling in this process (dynamo + AOT + inductor, fwd + bwd)."""
    return float(calculate_time_spent().get("total_wall_time", 0.0))


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process, each recompile one more. A run should add one: guards that a
    backend adds while it generates code recompile on the first batch across the threshold, which an eager-backend
    count cannot see. On GPUs no_size_guards() turns the Triton side's off; the CPU's C++ code generation keeps one
    (``batch * seq > 4096``: a cascade sum for an fp32 reduction's precision)."""
    return int(counters["stats"]["unique_graphs"])

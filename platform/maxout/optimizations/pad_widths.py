"""Pad widths: dynamic padding rounds each batch's width up to one of a few widths, so CUDA graphs record a few
shapes instead of one per sequence length.

Why: at small batches a GPU step is bound by the host (Python and one kernel launch per op); CUDA graphs
(compile_mode=reduce-overhead) replay a whole recorded step with one launch. cudagraph trees record one graph per
distinct input shape, so with plain dynamic padding (up to max_length / 8 widths) most steps would record instead
of replay. With ``hardware.pad_widths=N`` a batch pads to the first of N widths that holds its longest row: the
training rows' length quantiles (1/N, 2/N, ..., the longest), rounded up to data.pad_to_multiple_of. Quantiles put
the widths where the rows are, so the padding they add is small where most batches fall (the run logs the widths
as ``derived.pad_widths`` and the padding efficiency as ``perf/padding_efficiency``).

``auto``: N = 8 where CUDA graphs are asked for and can run (a CUDA device, compile on, a CUDA-graph mode, no FSDP),
else off: without CUDA graphs every extra padded token is waste.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from . import CUDAGRAPH_MODES
from .base import Decision
from .compile import cuda_graphs_refused

AUTO_WIDTHS = 8  # cudagraph trees warn past 8 recorded shapes per graph (inductor's cudagraph_dynamic_shape_warn_limit)


def resolve(requested: Any, device: Any, compiled: bool, compile_mode: str, padding: str,
            parallel: str = "none") -> Decision:
    """``requested``: an int, ``auto`` or None (off); ``compiled``: the compile decision's effective value;
    ``parallel``: the data_parallel decision's (FSDP runs no CUDA graphs: compile.cuda_graphs_refused)."""
    if requested is None:
        return Decision("pad_widths", None, None)
    if padding != "dynamic":
        why = ("data.padding=packed packs rows by a token budget: there is no padded width to round" if padding ==
               "packed" else "data.padding=max_length pads every batch to one width already")
        return Decision("pad_widths", requested, None, why)
    if requested != "auto":
        return Decision("pad_widths", requested, requested)
    graphs = compiled and compile_mode in CUDAGRAPH_MODES and not cuda_graphs_refused(device, parallel)
    if graphs:
        return Decision("pad_widths", "auto", AUTO_WIDTHS,
                        f"auto: CUDA graphs ({compile_mode}) record one graph per padded width: {AUTO_WIDTHS} widths")
    return Decision("pad_widths", "auto", None, "auto: only CUDA graphs (compile_mode=reduce-overhead or max-autotune, "
                                                "compile on, a CUDA device) need few widths; batches pad to their "
                                                "longest row")


def ladder(lengths: Sequence[int], count: int, multiple: Optional[int] = None) -> list[int]:
    """At most ``count`` widths, ascending: the rows' length quantiles 1/count, ..., 1 rounded up to ``multiple``.
    The last one holds the longest row."""
    if count < 1 or not lengths:
        raise ValueError(f"count={count} must be >= 1 and lengths non-empty")
    ordered, step = sorted(lengths), multiple or 1
    picks = (ordered[max(0, math.ceil(len(ordered) * k / count) - 1)] for k in range(1, count + 1))
    return sorted({-(-width // step) * step for width in picks})

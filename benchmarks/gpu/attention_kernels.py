"""Attention kernels alone, at the shape BERT-base trains at in the mfu section: one layer's attention forward and
backward through each of torch's kernels, timed apart from the model, priced a step (x layers) and in TFLOP/s.

Why: in run 7 (2026-11-28, the H200, BERT-base at micro-batch 1024, <= 128 tokens, compile off) attention took
~16 ms of the 128 ms step, the real work at ~27 TFLOP/s, a thirtieth of the matmuls' ~710. Bucketed batches ran
cuDNN's SDPA kernel (the padding mask rules flash out), packed ones torch's varlen flash kernel, and the two were
within 8% of each other. At ~64 tokens a row a kernel's 128-token tiles are mostly empty, and a mask and dropout
add their own costs; the model's profile cannot say which kernel, mask or dropout would be cheaper, because it
runs only the one its inputs select. This measures each on the same rows:

- cuDNN with transformers' own padding mask (``prepared_mask``'s builder) and BERT's attention dropout (0.1): what
  bucketed training runs; the same without dropout prices the dropout;
- memory-efficient attention with the same mask and dropout: the kernel that would run were cuDNN's not there;
- flash on rows without padding (no mask: every row as long as the batch's width): the floor a mask-free kernel
  sets at this width, with more tokens than the others;
- torch's varlen flash kernel on the same rows packed (no mask, no dropout: it has none), as packed training runs;
- math (the composite path) with the mask and dropout: the reference;
- cuDNN, and math, on the same rows placed first-fit into bins of 128 tokens (``data.packing_attention=bins``,
  bin_packing.py) with a block-diagonal mask per bin and dropout: whether samples sharing a bin's tiles cost less
  than each in a row of its own. At these lengths (54-72 tokens) nearly every row shares a bin with another (522
  bins of 128 for the 1024 rows, 97% real): this prices a bucket of rows just over 64 tokens, where bins should gain
  most; the mfu case prices bins over the whole mix, rows of 64 or fewer included.

FLOPs are the model's (``metrics.count_flops``' convention: 4 x width x length^2 a row forward, three times that
with the backward) on the real tokens, so every kernel is priced for the same work. A kernel that cannot run these
inputs here (no CUDA, no cuDNN attention, a torch without varlen) is recorded with the error's first line.
"""

from __future__ import annotations

import re
import time
import warnings
from typing import Any, Optional

# (name, SDPA backend or "varlen", the inputs: "mask" padded rows with transformers' mask, "full" rows without
# padding, "packed" the rows one after another; attention dropout)
CASES = (
    ("cuDNN, padding mask, dropout 0.1", "CUDNN_ATTENTION", "mask", 0.1),
    ("cuDNN, padding mask, no dropout", "CUDNN_ATTENTION", "mask", 0.0),
    ("memory-efficient, padding mask, dropout 0.1", "EFFICIENT_ATTENTION", "mask", 0.1),
    ("flash, rows without padding, dropout 0.1", "FLASH_ATTENTION", "full", 0.1),
    ("varlen flash, packed, no dropout", "varlen", "packed", 0.0),
    ("math, padding mask, dropout 0.1", "MATH", "mask", 0.1),
    ("cuDNN, the rows in bins of 128, block-diagonal mask, dropout 0.1", "CUDNN_ATTENTION", "bins", 0.1),
    ("math, the rows in bins of 128, block-diagonal mask, dropout 0.1", "MATH", "bins", 0.1),
)
BIN_WIDTH = 128  # the mfu cases' data.max_length: the bins' width


def lengths(rows: int, width: int, seed: int = 0) -> list[int]:
    """Row lengths spread evenly over [3/4 width, width]: ~87% real tokens, as bucketed batches of the demo mix at
    <= 128 tokens were (85%, runs 6 and 7)."""
    import torch  # lazy: the parent process never imports torch for this

    low = max(1, (3 * width) // 4)
    return torch.randint(low, width + 1, (rows,), generator=torch.Generator().manual_seed(seed)).tolist()


def measure(device: str = "cuda", rows: int = 1024, width: int = 72, heads: int = 12, head_dim: int = 64,
            layers: int = 12, reps: int = 10, cases: tuple = CASES) -> dict[str, Any]:
    """Each case's forward and backward, ``reps`` times after two warm-ups (cuDNN builds its plan on the first), on
    bf16 inputs laid out as transformers' BERT hands them to attention ([rows, heads, width, head_dim] views of
    [rows, width, heads, head_dim] projections)."""
    import torch  # lazy: see lengths

    sizes = lengths(rows, width)
    real_pairs = sum(n * n for n in sizes)
    flops = 3 * 4 * heads * head_dim * real_pairs  # a layer's, forward and backward, on the real tokens
    from maxout.optimizations.bin_packing import first_fit  # lazy: imports torch

    out: dict[str, Any] = {"rows": rows, "width": width, "heads": heads, "head_dim": head_dim, "layers": layers,
                           "real_tokens": sum(sizes), "padded_tokens": rows * width,
                           "bins": max(first_fit(sizes, BIN_WIDTH)[0]) + 1, "bin_width": BIN_WIDTH,
                           "flops_per_layer": float(flops), "cases": {}}
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for name, backend, inputs, dropout in cases:
        with warnings.catch_warnings(record=True) as told:  # SDPA says why a kernel refused the inputs in warnings
            warnings.simplefilter("always")
            try:
                call = _call(backend, inputs, dropout, sizes, width, heads, head_dim, device, dtype)
                seconds = _timed(call, reps, device)
            except Exception as error:  # noqa: BLE001 - a kernel that cannot run here is a finding, not a failure
                why = [_first_line(str(w.message)) for w in told] or [_first_line(str(error)) or type(error).__name__]
                out["cases"][name] = {"error": "; ".join(dict.fromkeys(why))[:300]}
                continue
        out["cases"][name] = {"ms_per_layer": seconds * 1e3, "ms_per_step": seconds * 1e3 * layers,
                              "tflops": flops / seconds / 1e12}
    return out


def _first_line(text: str) -> str:
    """A message's first line without torch's source location."""
    return re.sub(r"\s*\(Triggered internally at [^)]*\)\.?", "", (text.strip().splitlines() or [""])[0]).strip()


def _call(backend: str, inputs: str, dropout: float, sizes: list[int], width: int, heads: int, head_dim: int,
          device: str, dtype: Any):
    """A closure running one forward and backward of the case, its inputs made once."""
    import torch
    import torch.nn.functional as F

    if inputs == "packed":
        from torch.nn.attention.varlen import varlen_attn  # lazy: torch >= 2.10

        tokens = sum(sizes)
        q, k, v = (torch.randn(tokens, heads, head_dim, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        bounds = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32, device=device)
        grad = torch.randn_like(q)

        def packed() -> None:
            varlen_attn(q, k, v, bounds, bounds, width, width).backward(grad)
        return packed
    rows = len(sizes)
    mask = _padding_mask(sizes, width, dtype, device) if inputs == "mask" else None
    if inputs == "bins":  # the same rows, first-fit into bins of BIN_WIDTH: fewer, wider rows, one mask each
        mask = _bins_mask(sizes, device)
        rows, width = mask.shape[0], BIN_WIDTH
    # as BERT's projections give them: [rows, width, heads, head_dim], seen as [rows, heads, width, head_dim]
    q, k, v = (torch.randn(rows, width, heads, head_dim, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(rows, heads, width, head_dim, device=device, dtype=dtype)
    chosen = getattr(torch.nn.attention.SDPBackend, backend)

    def padded() -> None:
        with torch.nn.attention.sdpa_kernel([chosen]):
            F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask,
                                           dropout_p=dropout).backward(grad)
    return padded


def _padding_mask(sizes: list[int], width: int, dtype: Any, device: str):
    """The mask a bucketed batch's eager forward gets: transformers' own bidirectional SDPA mask for BERT, built as
    prepared_mask.py builds it."""
    import torch
    from transformers import BertConfig

    from maxout.optimizations.prepared_mask import BIDIRECTIONAL  # lazy: imports transformers

    two_d = (torch.arange(width)[None, :] < torch.tensor(sizes)[:, None]).to(torch.long).to(device)
    embeddings = torch.empty(len(sizes), width, 0, dtype=dtype, device=device)
    return BIDIRECTIONAL["full_attention"](BertConfig(attn_implementation="sdpa"), embeddings, two_d)


def _bins_mask(sizes: list[int], device: str):
    """[bins, 1, BIN_WIDTH, BIN_WIDTH] bool: each token attends the tokens of its own sample in its bin (a bin's free
    tail attends itself, so no softmax row is empty), as serving/pooling.py builds it for a binned batch."""
    from maxout.optimizations.bin_packing import BinnedCollator
    from maxout.optimizations.varlen import same_sample_mask

    rows = [{"input_ids": [1] * n, "labels": 0} for n in sizes]
    seq = BinnedCollator(BIN_WIDTH, 0)(rows)["packing"].seq_idx.to(device)
    return same_sample_mask(seq, causal=False, sliding_window=None)[:, None]


def _timed(call, reps: int, device: str) -> float:
    """Seconds a call, the mean of ``reps`` after two warm-ups, the device drained on both sides."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(2):
        call()
    sync()
    started = time.perf_counter()
    for _ in range(reps):
        call()
    sync()
    return (time.perf_counter() - started) / reps


def markdown(results: Optional[dict]) -> list[str]:
    """The table, best first, and what the best saves a step against what bucketed training runs (the first case)."""
    if not results or not results.get("cases"):
        return []
    real = results["real_tokens"] / results["padded_tokens"]
    shape = (f"{results['rows']} rows of <= {results['width']} tokens ({real:.0%} real), {results['heads']} heads of "
             f"{results['head_dim']}, {results['layers']} layers"
             + (f"; in bins: {results['bins']} of {results['bin_width']}" if results.get("bins") else ""))
    lines = [f"Attention kernels alone, forward and backward ({shape}; `gpu/attention_kernels.py`):", "",
             "| kernel | ms a step | TFLOP/s (real tokens) |", "|---|---|---|"]
    cases = results["cases"]
    timed = sorted((c["ms_per_step"], name) for name, c in cases.items() if "ms_per_step" in c)
    lines += [f"| {name} | {ms:.1f} | {cases[name]['tflops']:.3g} |" for ms, name in timed]
    lines += [f"| {name} | – | – ({c['error']}) |" for name, c in cases.items() if "error" in c]
    first = next(iter(cases))
    if timed and "ms_per_step" in cases[first] and timed[0][1] != first:
        lines += ["", f"Fastest: {timed[0][1]}, {cases[first]['ms_per_step'] - timed[0][0]:.1f} ms a step less than "
                      f"{first} (what bucketed training runs)."]
    return lines

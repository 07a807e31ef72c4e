"""SDPA alone, forward and backward, as a decoder's attention runs it with and without a padding mask
(platform/maxout/optimizations/unmasked_causal.py): transformers' masked call (K and V copied to every query head, the
causal-and-padding mask) against the unmasked one (``is_causal``, ``enable_gqa``), on the same right-padded rows,
interleaved in both orders. Qwen3-0.6B's heads by default.

    python benchmarks/unmasked_causal.py [--device cuda] [--rows 64] [--length 128] [--rounds 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def cases(rows: int, heads: int, kv_heads: int, length: int, head_dim: int, dtype: torch.dtype, device: str):
    torch.manual_seed(0)
    q = torch.randn(rows, heads, length, head_dim, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(rows, kv_heads, length, head_dim, dtype=dtype, device=device, requires_grad=True)
            for _ in range(2))
    real = torch.arange(length, device=device) < torch.randint(length // 3, length + 1, (rows, 1), device=device)
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    mask = (causal[None] & real[:, None, :])[:, None]  # what transformers builds for a padded batch

    def masked():
        return F.scaled_dot_product_attention(q, *(t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v)),
                                              attn_mask=mask)

    def unmasked():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    # the real tokens' outputs agree; the pads' differ (they see the pads before them), and no loss reads them
    with torch.no_grad():
        agree = (masked() - unmasked())[real[:, None, :, None].expand(rows, heads, length, head_dim)].abs().max()
    return {"masked": masked, "unmasked": unmasked}, agree.item()


def timed(fn, steps: int, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn().float().sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    for dtype in (torch.float32, torch.bfloat16):
        fns, agree = cases(args.rows, args.heads, args.kv_heads, args.length, args.head_dim, dtype, args.device)
        for fn in fns.values():
            timed(fn, 1, args.device)  # warm-up
        times = {name: [] for name in fns}
        for round_ in range(args.rounds):
            for name in (list(fns) if round_ % 2 == 0 else list(fns)[::-1]):
                times[name].append(timed(fns[name], args.steps, args.device))
        masked, unmasked = (statistics.median(times[n]) for n in fns)
        ratios = [m / u for m, u in zip(times["masked"], times["unmasked"])]
        print(f"{args.device} {str(dtype).removeprefix('torch.')}: masked {masked * 1e3:.1f} ms, unmasked "
              f"{unmasked * 1e3:.1f} ms a forward and backward; unmasked {masked / unmasked:.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f} per round); real tokens' outputs agree to {agree:.1e}")


if __name__ == "__main__":
    main()

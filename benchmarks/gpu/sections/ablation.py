"""5. The ablation on a GPU, through ``maxout benchmark``'s machinery (insight/benchmark.py, insight/grid.py): one
grid per question, each against its own baseline cell, in order of value. First the question the H200 run of
2026-11-26 left open: compile mode default vs reduce-overhead (CUDA graphs) on bucketed dynamic padding rounded to 8
widths, both cells at the same widths so only the mode differs (in vs_trainer reduce-overhead ran at 0.53x the
Trainer, default at 0.79x in an earlier run: not one comparison). Its cells run more steps and leave more out of the
timing: a width's first batch records its graphs, and all 8 widths must have come by before the window opens. Then
the fused-kernel flags: Liger's kernels in a decoder (a random Qwen3-0.6B, eager) and LayerNorm in bf16 (eager, then
compiled); precision (fp32, TF32, fp16, bf16), attention (eager, SDPA, flash-attention 2 where its package is
installed), fused AdamW, length bucketing, how rows become batches (padded, length-bucketed, packed by a token
budget) on the 128-512-token mix where padding costs most, inductor's coordinate-descent tuning (compiled BERT-base),
compile (off, default), and the compile mode (default, max-autotune, on static shapes so CUDA graphs can run).
Speed-up, padding efficiency, memory ratio and compile seconds per cell. A grid that no longer fits the section's
time is left out, and says so.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from .. import workloads
from ..registry import Context, Section

STATIC = ["data.padding=max_length", "data.max_length=128", "data.bucketing=false"]
# Both cells pad to the same 8 widths (pad_widths=auto would give the default-mode cell none); a bucketed epoch of
# the demo x8 at batch 64 is 100 batches, so after 40 untimed steps a width is still unseen with odds of about
# (7/8)^40 = 0.5%, and 60 timed steps follow.
BUCKETED_8 = ["hardware.compile=true", "data.padding=dynamic", "data.bucketing=true", "hardware.pad_widths=8",
              "train.warmup_steps_excluded=40"]
DEFAULT_STEPS = 60


def grids(ctx: Context, cuda: bool) -> list[tuple[str, str, list[str], float, int]]:
    """(name, grid, extra overrides, seconds it is expected to need, optimizer steps per cell) in order of value."""
    if not ctx.full:  # smoke: the code path, not a figure
        return [("fused AdamW", "fused_adamw=off,on", [], 10, 4)]
    compiled = ["hardware.compile=true"]
    long_rows = workloads.long_mix(ctx.work, rows=2048)
    # 130 s: the default cell's compile ~50 s at batch 64 on the H200 (one graph since 2026-11-27; less where
    # inductor's cache has it), reduce-overhead's own ~50 s and 8 widths recorded, 100 steps of ~30 ms each
    grid = [("compile mode (bucketed, 8 widths)", "compile_mode=default,reduce-overhead", BUCKETED_8, 130, 100),
            # the fused-kernel flags (issue 37): Liger's RMSNorm and SwiGLU against eager in a decoder classifier
            ("Liger kernels (random Qwen3-0.6B)", "liger_kernel=off,on", workloads.model("qwen3_0_6b"), 60),
            # and the same decoder's full-attention layers handed no padding mask (unmasked_causal.py): SDPA's causal
            # kernel on grouped K/V heads, against a masked kernel on K/V copied to every head
            ("unmasked causal attention (random Qwen3-0.6B)", "unmasked_causal=off,on",
             workloads.model("qwen3_0_6b"), 60),
            # and LayerNorm in bf16 in the encoder (a 16-bit residual stream), eager and compiled
            ("low-precision LayerNorm", "low_precision_layernorm=off,on", [], 30),
            ("low-precision LayerNorm (compiled)", "low_precision_layernorm=off,on", compiled, 200),
            # and eager forwards' attention masks prepared from the host (prepared_mask.py): at batch 64 the step is the
            # host's, and without them transformers reads each batch's mask on the host, one sync a step
            ("prepared masks", "prepared_mask=off,on", [], 30),
            ("precision", "precision=fp32,fp16,bf16 tf32=off,on", [], 60),
            ("attention", "attention=eager,sdpa,flash_attention_2", [], 30),
            ("fused AdamW", "fused_adamw=off,on", [], 20),
            ("bucketing", "bucketing=off,on", [], 20),
            ("padding (128-512 tokens)", "padding=dynamic,bucketed,packed", long_rows, 60),
            # and inductor's coordinate-descent tuning of its own kernels (two compiles, each cell tuning its own)
            ("inductor tuning (compiled)", "inductor_tuning=off,on", compiled, 240),
            # and inductor's fused LayerNorm backward against two kernels (run 7: the fused one 25.6% of the kernels)
            ("mix-order reduction (compiled)", "mix_order_reduction=on,off", compiled, 240),
            ("compile", "compile=off,on", [], 90),
            ("compile mode (static shapes)", "compile_mode=default,max-autotune", compiled + STATIC, 300)]
    return [g if len(g) == 5 else (*g, DEFAULT_STEPS) for g in grid]


def merged(base: list[str], extra: list[str]) -> list[str]:
    """``base`` with ``extra`` appended, a key that ``extra`` sets dropped from ``base`` (one value per key)."""
    keys = {o.partition("=")[0] for o in extra}
    return [o for o in base if o.partition("=")[0] not in keys] + list(extra)


def base_overrides(ctx: Context) -> list[str]:
    """What every cell trains: random BERT-base on the demo x8 at batch 64 (smoke: tiny, 64 rows), compile off."""
    arch = "bert_base" if ctx.full else "tiny"
    data = workloads.demo(ctx.work, copies=8) if ctx.full else workloads.demo(ctx.work, rows=64)
    return [*workloads.model(arch), *data, "tracking=none", "hardware.compile=false", "checkpoint.enabled=false",
            f"train.batch_size={64 if ctx.full else 16}", f"train.target_effective_batch={64 if ctx.full else 16}",
            f"train.warmup_steps_excluded={10 if ctx.full else 1}"]


def run(ctx: Context, first: int | None = None, rounds: int = 1) -> None:
    """Each grid in turn (``first``: only that many), in ``rounds`` rounds recorded one by one (a cut section keeps
    the rounds it finished); a later round reuses the first one's compiled code through inductor's cache."""
    import torch  # lazy: the parent process never imports torch for this

    from maxout.insight import benchmark  # lazy: imports torch

    cuda = torch.cuda.is_available()
    arch = "bert_base" if ctx.full else "tiny"
    base = base_overrides(ctx)
    ctx.record("setup", {"model": arch, "steps_per_cell": DEFAULT_STEPS if ctx.full else 4, "rounds": rounds,
                         "base_overrides": base[len(workloads.model(arch)):]})
    done: dict[str, dict] = {}
    for name, spec, extra, needs_s, steps in grids(ctx, cuda)[:first]:
        ran = False  # a round of this grid ran: its code is compiled and cached, so a later round needs a third
        for r in range(rounds):
            label = name if rounds == 1 else f"{name}, round {r + 1}"
            # (not "every round after the first": on the H200 (run 7) round 1 was left out with 130 s left, and round
            # 2 then ran cold under the cached round's estimate)
            needed = needs_s / 3 if ran else needs_s
            if ctx.left() < needed:
                done[label] = {"grid": spec,
                               "left_out": f"{ctx.left():.0f} s left in the section, the grid needs ~{needed:.0f} s"}
                ctx.record("grids", done)
                continue
            started = time.time()
            report = benchmark.run(merged(base, extra), grid_spec=spec, steps=steps, out_dir=str(
                ctx.work / "ablation" / re.sub(r"\W+", "-", label).strip("-")), progress=True)
            table = report.table.where(report.table.notna(), None)
            done[label] = {"grid": spec, "extra": extra, "steps": steps, "seconds": time.time() - started,
                           "baseline": report.baseline.cell.name if report.baseline else None,
                           "cells": table.to_dict("records")}
            ctx.record("grids", done)
            ran = True


def markdown(results: dict) -> str:
    fmt = lambda v, spec, suffix="": "–" if v is None else format(v, spec) + suffix  # noqa: E731
    setup = results.get("setup", {})
    rounds = setup.get("rounds", 1)
    interleaved = f", {rounds} rounds of each grid, its cells in the same order" if rounds > 1 else ""
    lines = [f"Model: random {setup.get('model')}; {setup.get('steps_per_cell')} optimizer steps per cell, steady "
             f"state{interleaved}; "
             f"base: `{' '.join(setup.get('base_overrides', []))}`.", "",
             "| grid | cell | samples/s | speed-up | padding eff. | peak memory GiB | memory ratio | MFU | compile s "
             "| note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, g in results.get("grids", {}).items():
        if "left_out" in g:
            lines.append(f"| {name} | `{g['grid']}` | | | | | | | | left out: {g['left_out']} |")
            continue
        if g.get("steps") not in (None, setup.get("steps_per_cell")):
            name = f"{name}, {g['steps']} steps"
        for c in g["cells"]:
            note = c["reason"] or ("baseline" if c["cell"] == g["baseline"] else "")
            note = f"{c['status']}: {note}" if c["status"] != "ok" else note
            lines.append(f"| {name} | {c['cell']} | {fmt(c['steady samples/s'], '.1f')} | "
                         f"{fmt(c['speed-up'], '.2f', '×')} | {fmt(c.get('padding efficiency'), '.0%')} | "
                         f"{fmt(c['peak memory GiB'], '.2f')} | "
                         f"{fmt(c['memory ratio'], '.2f', '×')} | {fmt(c['MFU'], '.1%')} | "
                         f"{fmt(c['compile s'], '.1f')} | {note.replace('|', '/')} |")
    if "cudagraph_counters" in results:
        seen = ", ".join(f"`{k}` {v}" for k, v in results["cudagraph_counters"].items()) or "none counted"
        lines += ["", f"Inductor's CUDA-graph counters over the section: {seen}."]
    return "\n".join(lines)


def chart(results: dict, path: Path) -> bool:
    from .charts import bars  # lazy: matplotlib

    labels, values = [], []
    for name, g in results.get("grids", {}).items():
        for c in g.get("cells", []):
            if c.get("speed-up") is not None:
                labels.append(f"{name}: {c['cell']}")
                values.append(c["speed-up"])
    return bars(path, labels, {"speed-up vs the grid's baseline": values}, "× baseline", "ablation", fmt="%.2f")


SECTION = Section("ablation", "Ablation (maxout benchmark)", run, needs=(), min_s={"full": 60, "smoke": 15},
                  max_s={"full": 420, "smoke": 180}, markdown=markdown, chart=chart)


def run_compile_modes(ctx: Context) -> None:
    """The first grid alone, in two rounds (the second with every kernel compiled and cached): does
    replaying CUDA graphs take the host out of a batch-64 step? On the H200 (2026-11-27) maxout's compiled step took
    27-34 ms of wall time for 8.5 ms of kernels: 880 kernel launches and the compiled graphs' Python wrappers. Dynamo's
    recompile reasons and inductor's CUDA-graph decisions (a skipped graph says why) go to the section's log."""
    import torch  # lazy: the parent process never imports torch for this
    from torch._dynamo.utils import counters

    torch._logging.set_logs(recompiles=True, perf_hints=True)
    try:
        run(ctx, first=1, rounds=2)
    finally:  # how often inductor skipped CUDA graphs, and what they recorded, even when the grid is cut short
        ctx.record("cudagraph_counters", {k: v for k, v in counters["inductor"].items() if "cudagraph" in k})


SECTION_COMPILE_MODES = Section(
    "compile_modes", "CUDA graphs at batch 64: compile mode default vs reduce-overhead", run_compile_modes,
    needs=("cuda",), min_s={"full": 60, "smoke": 15}, max_s={"full": 240, "smoke": 120}, markdown=markdown,
    chart=chart)

"""3. maxout vs the Hugging Face Trainer with its best flags, BERT-base (random weights), bf16, on the demo's length
mix and on a 128-512-token mix: samples/s, tokens/s and peak memory, each contender in one process, in the order
maxout, Trainer, Trainer compiled, then reversed (benchmarks/bench_vs_hf_trainer.py's ``measure``).

maxout runs ``hardware=auto`` (on an H100 the h100 profile: bf16, TF32, fused AdamW, SDPA, compile, bucketing);
the Trainer gets bf16, TF32, ``adamw_torch_fused``, ``group_by_length``, SDPA, and ``torch_compile`` off and on.
Both get the same micro-batch, rows and DataLoader workers, two epochs each, the second timed after its third step.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .. import workloads
from ..registry import Context, Section


def mixes(ctx: Context) -> list[tuple[str, list[str]]]:
    if ctx.full:
        return [("demo mix (mean 62 tokens)", workloads.demo(ctx.work, copies=8)),
                ("128-512 tokens", workloads.long_mix(ctx.work, rows=3200))]
    return [("demo mix (mean 62 tokens)", workloads.demo(ctx.work, rows=64))]  # smoke: the code path, not a figure


def run(ctx: Context) -> None:
    import torch  # lazy: the parent process never imports torch for this

    from benchmarks import bench_vs_hf_trainer as bench  # lazy: transformers' Trainer

    cuda = torch.cuda.is_available()
    contenders = ("maxout", "trainer_best", "trainer_best_compiled") if cuda else ("maxout", "trainer_best")
    workers = max((len(os.sched_getaffinity(0)) - 2), 0) if cuda else 0
    arch = "bert_base" if ctx.full else "tiny"
    results = {}
    for name, data in mixes(ctx):
        args = argparse.Namespace(model="tiny", batch=64 if ctx.full else 16, precision="bf16", compile=None,
                                  epochs=2, warmup=3 if ctx.full else 1, trainer_attention="default",
                                  trainer_workers=workers, rounds=1,
                                  override=[*workloads.model(arch, group=False), *data], maxout_override=[])
        report = bench.measure(args, contenders, log=print)
        results[name] = {k: v for k, v in report.items() if k not in ("date", "torch", "device", "overrides")}
        ctx.record("mixes", results)
    ctx.record("model", arch)


def _mean(runs: list, key: str):
    values = [r[key] for r in runs if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def markdown(results: dict) -> str:
    lines = [f"Model: random {results.get('model', '?')}; two epochs per contender, the second timed; both orders.",
             "", "| mix | contender | samples/s | tokens/s | peak memory GiB | compile s | maxout ÷ this (maxout "
             "first / last) |", "|---|---|---|---|---|---|---|"]
    for mix, r in results.get("mixes", {}).items():
        per_order = r.get("ratios_per_order", [])
        for contender, runs in r["runs"].items():
            short = contender.removeprefix("trainer_")
            ratio = r.get(f"ratio_vs_{contender}")
            orders = " / ".join(f"{o[short]:.2f}" for o in per_order if short in o)
            fmt = lambda v, spec: "–" if v is None else format(v, spec)  # noqa: E731
            lines.append(f"| {mix} | {contender} | {fmt(_mean(runs, 'samples_per_s'), '.1f')} | "
                         f"{fmt(_mean(runs, 'tokens_per_s'), '.0f')} | {fmt(_mean(runs, 'peak_memory_gb'), '.2f')} | "
                         f"{fmt(_mean(runs, 'compile_s'), '.1f')} | "
                         f"{'–' if ratio is None else f'**{ratio:.2f}×** ({orders})'} |")
        lines.append(f"| {mix} | | | | | | precision {r.get('precision')}, TF32 {r.get('tf32')}, maxout compile "
                     f"{r.get('compile', {}).get('maxout')}, attention {r.get('attention')}, batch {r.get('batch')}, "
                     f"{r.get('rows')} rows of mean length {r.get('mean_length', 0):.0f} |")
    return "\n".join(lines)


def chart(results: dict, path: Path) -> bool:
    from .charts import bars  # lazy: matplotlib

    mixes_ = results.get("mixes", {})
    contenders = sorted({c for r in mixes_.values() for c in r["runs"]}, key=lambda c: (c != "maxout", c))
    series = {c: [_mean(r["runs"].get(c, []), "samples_per_s") or 0.0 for r in mixes_.values()] for c in contenders}
    return bars(path, list(mixes_), series, "samples/s (steady state)", "maxout vs the HF Trainer (best flags)")


SECTION = Section("vs_trainer", "maxout vs the Hugging Face Trainer", run, needs=("accelerate",),
                  min_s={"full": 90, "smoke": 20}, max_s={"full": 240, "smoke": 240}, markdown=markdown, chart=chart)

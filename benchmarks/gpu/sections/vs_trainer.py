"""3. maxout vs the Hugging Face Trainer with its best flags, BERT-base (random weights), bf16, batch 64, on the demo's
length mix x4 and on 1,600 rows of 128-512 tokens: samples/s, tokens/s and peak memory, each run in this one process
(benchmarks/bench_vs_hf_trainer.py's ``maxout_run`` and ``trainer_run``).

maxout runs ``hardware=auto`` (on an H100/H200 the profile's bf16, TF32, fused AdamW, SDPA, compile, bucketing); the
Trainer gets bf16, TF32, ``adamw_torch_fused``, ``group_by_length``, SDPA and the same DataLoader workers. Both get the
same micro-batch and rows, two epochs each, the second timed after its third step. On a GPU each run also records the
device's busy share over that window (CUDA events around each step, on both sides): near 100%, the GPU sets the pace;
far below, the host does (launches, data loading, syncs), which is where batch 64 was on the H200.

The order fits the call's minutes and keeps the headline first: maxout then the Trainer on the demo mix, then maxout
with compile off (``maxout_eager``: what compile gives or costs at batch 64, where the step is bound by the host; the
H200 runs of 2026-11-26 never measured it), the same on the 128-512 mix, then both mixes again in the other order
(Trainer first). Every run is recorded the moment it ends,
so a section cut at its limit keeps each figure it printed. A run is started only where the time left holds what the
same contender's last run took, less most of its compile (maxout's first run pays it; the later ones hit inductor's
caches). The
compiled Trainer (``torch_compile=True``, a compile of its own per mix) comes last, only with time left, and the
report says when it was left out.

maxout's runs share this process's compiled code: dynamo keeps it on the model class's forward, with the weights as
inputs, so only the first run compiles (the later ones log compile 0 s). Under CUDA graphs the graphs recorded for
one mix stay in the same tree when the next mix records its own widths: that is why the H200 run of 2026-11-26
warned of 9 recorded sizes (inductor warns once, past 8) with 8 widths per mix. A single ``maxout train`` run
records only its own widths.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import time
from pathlib import Path

from .. import host_time, workloads
from ..registry import Context, Section

DEMO, LONG = "demo mix (mean 62 tokens)", "128-512 tokens"
FIRST_RUN_S = {"maxout": 150.0, "maxout_eager": 30.0, "trainer_best": 45.0,  # guesses before a run is seen
               "trainer_best_compiled": 120.0}


def mixes(ctx: Context) -> dict[str, list[str]]:
    # Sized for the call: 50 steps an epoch on the demo mix, 25 on the long one, the second epoch timed (the H200 ran
    # the demo x8; samples/s at batch 64 does not depend on the epoch's length once the window holds ~20 steps).
    if ctx.full:
        return {DEMO: workloads.demo(ctx.work, copies=4), LONG: workloads.long_mix(ctx.work, rows=1600)}
    return {DEMO: workloads.demo(ctx.work, rows=64)}  # smoke: the code path, not a figure


def left_out_note(run: str, left_s: float, needs_s: float, seen: bool) -> str:
    """Why ``run`` was not started: the time its contender's last run took, or, where none has run yet, the guess
    (FIRST_RUN_S; runs 4 to 7 said "its last run took 120 s" of a compiled Trainer that had never run)."""
    why = (f"its last run took {needs_s:.0f} s" if seen
           else f"it needs ~{needs_s:.0f} s (a guess: none of its runs has been seen)")
    return f"{run}: {left_s:.0f} s left, {why}"


def schedule(names: list[str], compiled: bool) -> list[tuple[str, str, str]]:
    """(mix, contender, order) in the order run: each mix maxout first (then maxout with compile off), then each
    mix Trainer first; the compiled Trainer last."""
    runs = [(m, c, "maxout first") for m in names for c in ("maxout", "trainer_best", "maxout_eager")]
    runs += [(m, c, "maxout last") for m in names for c in ("trainer_best", "maxout")]
    return runs + ([(m, "trainer_best_compiled", "last") for m in names] if compiled else [])


def summarize(runs: list[dict]) -> dict:
    """Per mix: mean samples/s per contender, maxout over each Trainer, and the ratio within each order."""
    out: dict[str, dict] = {}
    for mix in dict.fromkeys(r["mix"] for r in runs):
        mine = [r for r in runs if r["mix"] == mix]
        mean = {}
        for c in dict.fromkeys(r["contender"] for r in mine):
            values = [r["samples_per_s"] for r in mine if r["contender"] == c]
            mean[c] = sum(values) / len(values)
        per_order = []
        for order in ("maxout first", "maxout last"):
            pair = {r["contender"]: r["samples_per_s"] for r in mine if r["order"] == order}
            if "maxout" in pair and "trainer_best" in pair:
                per_order.append({"order": order, "best": pair["maxout"] / pair["trainer_best"]})
        out[mix] = {"samples_per_s": mean, "ratios_per_order": per_order,
                    **{f"ratio_vs_{c}": mean["maxout"] / v for c, v in mean.items() if c != "maxout" and
                       "maxout" in mean}}
        if "maxout_eager" in mean and "trainer_best" in mean:  # maxout without compile against the same Trainer
            out[mix]["eager_ratio_vs_trainer_best"] = mean["maxout_eager"] / mean["trainer_best"]
    return out


def run(ctx: Context) -> None:
    import torch  # lazy: the parent process never imports torch for this

    from benchmarks import bench_vs_hf_trainer as bench  # lazy: transformers' Trainer
    from maxout import data as data_mod, loading, modeling  # lazy: imports torch

    torch._logging.set_logs(recompiles=True)  # a second graph's cause, in the section's output
    cuda = torch.cuda.is_available()
    workers = max((len(os.sched_getaffinity(0)) - 2), 0) if cuda else 0
    arch = "bert_base" if ctx.full else "tiny"
    found = mixes(ctx)
    ctx.record("model", arch)
    ctx.record("plan", [f"{m}: {c} ({o})" for m, c, o in schedule(list(found), cuda)])
    args_of, runs, left_out, spent = {}, [], [], {}
    for mix, contender, order in schedule(list(found), cuda):
        if mix not in args_of:  # the same rows and lengths on both sides
            args = argparse.Namespace(model="tiny", batch=64 if ctx.full else 16, precision="bf16", compile=None,
                                      epochs=2, warmup=3 if ctx.full else 1, trainer_attention="default",
                                      trainer_workers=workers, rounds=1, maxout_override=[],
                                      override=[*workloads.model(arch, group=False), *found[mix]])
            cfg = loading.load([f"model={args.model}", *args.override])
            table = data_mod.load(cfg.data).train
            lengths = [len(ids) for ids in modeling.load_tokenizer(cfg.model)(
                table.texts, table.pairs, truncation="longest_first", max_length=cfg.data.max_length)["input_ids"]]
            args.train_rows, args.mean_length = len(table), sum(lengths) / len(table)
            args_of[mix] = args
        args = args_of[mix]
        needs = spent.get(contender, FIRST_RUN_S[contender] if ctx.full else 5.0)
        if ctx.left() < needs:
            left_out.append(left_out_note(f"{mix}: {contender} ({order})", ctx.left(), needs, contender in spent))
            ctx.record("left_out", left_out)
            continue
        started = time.time()
        if contender in ("maxout", "maxout_eager"):
            # the demo mix's maxout runs also say where their host time goes (host_time.py); only its last one is
            # profiled, so no profiling comes before a headline run but the long mix's last pair (bound by the GPU)
            profiled = (3 if ctx.full else 1) if order == "maxout last" else 0
            split = functools.partial(host_time.split, steps=10 if ctx.full else 2, profiled=profiled,
                                      guards_every_call=True)  # hardware.skip_guards's A B A, ~0.3 s at batch 64
            got = bench.maxout_run(args if contender == "maxout" else argparse.Namespace(**{**vars(args),
                                                                                           "compile": False}),
                                   after=(lambda r: split(r.setup)) if mix == DEMO else None)
            if got["after"] is not None:
                ctx.record("host", {**ctx.results.get("host", {}), f"{contender} ({order})": got["after"]})
            if contender == "maxout":  # the profile as it is (maxout_eager turns compile off)
                ctx.record("maxout_decisions", {k: got[k] for k in ("precision", "tf32", "attention", "compile",
                                                                    "compile_mode", "profile")})
        else:  # the Trainer takes the precision and TF32 maxout's device check chose (bf16 and TF32 on a GPU)
            decided = ctx.results.get("maxout_decisions", {"precision": "bf16", "tf32": cuda})
            got = bench.trainer_run(args, True, decided["precision"], "sdpa",
                                    contender == "trainer_best_compiled", decided["tf32"])
        # what the same contender's next run needs: this one's time, less its compile (maxout's later runs in this
        # process reuse the graph: 0.0 s of compile on the H200; the compiled Trainer's hit inductor's caches)
        spent[contender] = max(time.time() - started - (got.get("compile_s") or 0.0), 5.0)
        runs.append({"mix": mix, "contender": contender, "order": order, "seconds": time.time() - started,
                     "rows": args.train_rows, "mean_length": args.mean_length, "batch": args.batch,
                     **{k: got.get(k) for k in ("samples_per_s", "tokens_per_s", "peak_memory_gb", "compile_s",
                                                "compile_graphs", "padding_efficiency", "precision", "attention",
                                                "compile", "busy_share", "gpu_utilization")}})
        print(f"vs_trainer: {mix}: {contender} ({order}): {got['samples_per_s']:.2f} samples/s "
              f"({runs[-1]['seconds']:.0f} s)", flush=True)
        ctx.record("runs", runs)
        ctx.record("mixes", summarize(runs))
        del got
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def markdown(results: dict) -> str:
    fmt = lambda v, spec: "–" if v is None else format(v, spec)  # noqa: E731
    d = results.get("maxout_decisions", {})
    batch = next((r["batch"] for r in results.get("runs", [])), "?")
    lines = [f"Model: random {results.get('model', '?')}; batch {batch}, two epochs per run, the second timed; maxout "
             f"{d.get('profile', '?')} profile (precision {d.get('precision')}, TF32 {d.get('tf32')}, attention "
             f"{d.get('attention')}, compile {d.get('compile')}, compile mode {d.get('compile_mode')}).", "",
             # NVML: the device's own utilization in the steady window (maxout only). In-step share: CUDA-event time
             # inside the steps over the window, both sides; a host launching slower than the device counts as busy
             # there, so it is an upper bound (0.98-1.00 on every run of 2026-11-27; NVML 33-41% on the demo mix)
             "| mix | contender | order | samples/s | tokens/s | NVML utilization | in-step share (upper bound) | "
             "peak memory GiB | compile s (graphs) | run s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results.get("runs", []):
        graphs = f" ({r['compile_graphs']})" if r.get("compile_graphs") is not None else ""
        nvml = "–" if r.get("gpu_utilization") is None else f"{r['gpu_utilization']:.0f}%"
        lines.append(f"| {r['mix']} | {r['contender']} | {r['order']} | {fmt(r['samples_per_s'], '.1f')} | "
                     f"{fmt(r['tokens_per_s'], '.0f')} | {nvml} | {fmt(r.get('busy_share'), '.0%')} | "
                     f"{fmt(r['peak_memory_gb'], '.2f')} | {fmt(r['compile_s'], '.1f')}{graphs} | {r['seconds']:.0f} |")
    lines += ["", "| mix | maxout ÷ Trainer best (mean) | per order | maxout ÷ Trainer compiled | "
                  "compile's gain (maxout ÷ maxout eager) | maxout eager ÷ Trainer best |", "|---|---|---|---|---|---|"]
    for mix, m in results.get("mixes", {}).items():
        orders = ", ".join(f"{o['order']} {o['best']:.2f}×" for o in m["ratios_per_order"])
        lines.append(f"| {mix} | **{fmt(m.get('ratio_vs_trainer_best'), '.2f')}×** | {orders or '–'} | "
                     f"{fmt(m.get('ratio_vs_trainer_best_compiled'), '.2f')} | "
                     f"{fmt(m.get('ratio_vs_maxout_eager'), '.2f')} | "
                     f"{fmt(m.get('eager_ratio_vs_trainer_best'), '.2f')} |")
    if results.get("left_out"):
        lines += ["", "Left out for lack of time: " + "; ".join(results["left_out"]) + "."]
    if results.get("host"):
        lines += ["", f"Where maxout's step time goes on the host ({DEMO}, more steps after each of its maxout runs, "
                      "warm; the profiled columns from the last run only; benchmarks/gpu/host_time.py):", "",
                  *host_time.markdown(results["host"])]
    return "\n".join(lines)


def chart(results: dict, path: Path) -> bool:
    from .charts import bars  # lazy: matplotlib

    mixes_ = results.get("mixes", {})
    contenders = sorted({c for m in mixes_.values() for c in m["samples_per_s"]}, key=lambda c: (c != "maxout", c))
    series = {c: [m["samples_per_s"].get(c, 0.0) for m in mixes_.values()] for c in contenders}
    return bars(path, list(mixes_), series, "samples/s (steady state)", "maxout vs the HF Trainer (best flags)")


SECTION = Section("vs_trainer", "maxout vs the Hugging Face Trainer", run, needs=("accelerate",),
                  min_s={"full": 90, "smoke": 20}, max_s={"full": 380, "smoke": 240}, markdown=markdown, chart=chart)

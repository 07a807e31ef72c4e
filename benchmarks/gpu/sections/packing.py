"""P8: packed vs length-bucketed batches on the GPU (target: packed >= 1.3x bucketed samples/s). Random BERT-base,
bf16, the demo mix x8, a micro-batch of 256 rows (about 16k tokens a step: the GPU's work, not the host's launches,
sets the pace), compile off on both sides (one compile each would not fit the call; eager is the same for both).
Bucketed: dynamic padding with length bucketing (maxout's default). Packed: ``data.padding=packed`` with the auto token
budget (micro-batch x mean row length: the same tokens a step on average), through the attention backend
``data.packing_attention=auto`` picks, which the run logs as ``opt.packing.*`` and this section records (on a GPU in
bf16: torch's variable-length flash attention, no mask; on a CPU: a dense block-diagonal mask). Binned: the same
token budget as rows of ``data.max_length`` tokens holding several samples each (``data.packing_attention=bins``,
optimizations/bin_packing.py: SDPA with a block-diagonal mask per bin, attention dropout kept, one batch shape).

After an untimed warm-up run, both orders (bucketed, packed, binned, then binned, packed, bucketed), each run recorded
the moment it ends; then the 128-512-token mix, where padding costs most, if time is left."""

from __future__ import annotations

import gc
import time

from .. import workloads
from ..registry import Context, Section

SETTINGS = {"bucketed": ["data.padding=dynamic", "data.bucketing=true"],
            "packed": ["data.padding=packed", "data.max_tokens_per_batch=auto"],
            "binned": ["data.padding=packed", "data.max_tokens_per_batch=auto", "data.packing_attention=bins"]}
ORDER = (*SETTINGS, *reversed(SETTINGS))  # one round each way: A B C, C B A
CONTENDERS = ("packed", "binned")  # each over bucketed


def ratio(runs: list[dict], mix: str) -> dict:
    """Mean samples/s of each setting on ``mix``, packed and binned over bucketed (None until both have run), and
    each ratio within each round that ran every setting (one per order)."""
    mine = [r for r in runs if r["mix"] == mix]
    mean = {k: sum(r["samples_per_s"] for r in mine if r["setting"] == k) / n
            for k in SETTINGS if (n := sum(r["setting"] == k for r in mine))}
    rounds = [{r["setting"]: r["samples_per_s"] for r in mine[i:i + len(SETTINGS)]}
              for i in range(0, len(mine), len(SETTINGS))]
    over = lambda got, k: got[k] / got["bucketed"] if k in got and "bucketed" in got else None  # noqa: E731
    return {"samples_per_s": mean, **{f"{k}_over_bucketed": over(mean, k) for k in CONTENDERS},
            "per_order": {k: [over(r, k) for r in rounds if len(r) == len(SETTINGS)] for k in CONTENDERS}}


def run(ctx: Context) -> None:
    import torch  # lazy: the parent process never imports torch for this

    from maxout import loading  # lazy: imports torch
    from maxout.tracking.tracker import NullTracker  # lazy: imports mlflow's pieces
    from maxout.train import train  # lazy: imports torch

    cuda = torch.cuda.is_available()
    arch, batch, steps, warmup = ("bert_base", 256, 30, 8) if ctx.full else ("tiny", 16, 6, 2)
    if ctx.full:  # the long mix's files are the vs_trainer section's where it ran first (same scratch folder)
        mixes = [("demo mix (mean 62 tokens)", lambda: workloads.demo(ctx.work, copies=8)),
                 ("128-512 tokens", lambda: workloads.long_mix(ctx.work, rows=3200))]
    else:
        mixes = [("demo mix (mean 62 tokens)", lambda: workloads.demo(ctx.work, rows=64))]
    base = [*workloads.model(arch), "tracking=none", "hardware.compile=false", "checkpoint.enabled=false",
            f"train.batch_size={batch}", f"train.target_effective_batch={batch}", f"train.max_steps={steps}",
            "train.epochs=1000", "train.eval_every_epochs=1000", f"train.warmup_steps_excluded={warmup}",
            "train.log_every=5"]
    ctx.record("setup", {"model": arch, "micro_batch": batch, "steps": steps, "warmup_steps_excluded": warmup,
                         "compile": False})
    runs, spent, decisions = [], {}, {}
    # Untimed warm-up: the process's first run ran at half speed (bucketed 2314.0 samples/s, then 4736.4 at the end
    # of the same order on the H200, 2026-11-26 run 3), which made the two orders say 1.75x and 0.79x. Costs paid
    # once per process are the likely cause: CUDA loads kernels lazily, cuBLAS picks its kernels per new shape.
    started = time.time()
    train(loading.load([*base, *mixes[0][1](), *SETTINGS["bucketed"], f"train.max_steps={max(steps // 2, 2)}"]),
          tracker=NullTracker(), progress=False, verbose=False)
    ctx.record("warm_up_s", time.time() - started)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    for mix, data in mixes:
        overrides = data()
        for setting in ORDER:
            needs = spent.get(setting, 40.0 if ctx.full else 5.0)
            if ctx.left() < needs:
                ctx.record("left_out", [*ctx.results.get("left_out", []),
                                        f"{mix}: {setting}: {ctx.left():.0f} s left, its last run took {needs:.0f} s"])
                continue
            started, tracker = time.time(), NullTracker()
            result = train(loading.load([*base, *overrides, *SETTINGS[setting]]), tracker=tracker, progress=False,
                           verbose=False)
            spent[setting] = time.time() - started
            m = result.metrics
            if setting == "packed":  # auto's pick; the binned runs' is bins, asked for by name
                decisions = {k: v for k, v in tracker.params.items() if k.startswith(("opt.packing.", "opt.padding.",
                                                                                       "opt.attention."))}
                ctx.record("decisions", decisions)
            runs.append({"mix": mix, "setting": setting, "samples_per_s": m.get("perf/steady_samples_per_s"),
                         "tokens_per_s": m.get("perf/steady_tokens_per_s"),
                         "padding_efficiency": m.get("perf/padding_efficiency"),
                         "peak_memory_gb": m.get("mem/peak_allocated_gb"), "seconds": spent[setting],
                         "effective": result.setup.decision("padding").effective})
            print(f"packing: {mix}: {setting}: {runs[-1]['samples_per_s']:.1f} samples/s", flush=True)
            ctx.record("runs", runs)
            ctx.record("ratios", {name: ratio(runs, name) for name, _ in mixes if any(r["mix"] == name for r in runs)})
            del result
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()


def markdown(results: dict) -> str:
    fmt = lambda v, spec: "–" if v is None else format(v, spec)  # noqa: E731
    s = results.get("setup", {})
    d = results.get("decisions", {})
    lines = [f"Model: random {s.get('model')}, micro-batch {s.get('micro_batch')} (packed: the same tokens a step on "
             f"average), {s.get('steps')} steps a run, the first {s.get('warmup_steps_excluded')} untimed, compile off, "
             f"after an untimed warm-up run ({fmt(results.get('warm_up_s'), '.0f')} s). "
             f"Packed attention: **{d.get('opt.packing.effective', '?')}** ({d.get('opt.packing.reason', '')}).", "",
             "| mix | setting | samples/s | tokens/s | padding efficiency | peak memory GiB |", "|---|---|---|---|---|---|"]
    for r in results.get("runs", []):
        lines.append(f"| {r['mix']} | {r['setting']} | {fmt(r['samples_per_s'], '.1f')} | "
                     f"{fmt(r['tokens_per_s'], '.0f')} | {fmt(r['padding_efficiency'], '.1%')} | "
                     f"{fmt(r['peak_memory_gb'], '.2f')} |")
    # What padding alone can give: the tokens bucketed batches process per real token. Beyond it, only the costs
    # packing also removes (the mask, per-batch overheads) can lift the ratio (1.14x on the H200's demo mix).
    bucketed: dict[str, float] = {}
    for r in results.get("runs", []):
        if r["setting"] == "bucketed" and r.get("padding_efficiency"):
            bucketed[r["mix"]] = min(bucketed.get(r["mix"], 1.0), r["padding_efficiency"])
    lines += ["", "| mix | packed ÷ bucketed (P8, goal ≥ 1.3×) | per order | binned ÷ bucketed | per order | "
                  "padding alone bounds it at |", "|---|---|---|---|---|---|"]
    for mix, r in results.get("ratios", {}).items():
        cells = [f"**{fmt(r.get(f'{k}_over_bucketed'), '.2f')}×** | "
                 f"{', '.join(f'{x:.2f}×' for x in r['per_order'].get(k, [])) or '–'}" for k in CONTENDERS]
        lines.append(f"| {mix} | {' | '.join(cells)} | "
                     f"{fmt(1 / bucketed[mix] if mix in bucketed else None, '.2f')}× |")
    if results.get("left_out"):
        lines += ["", "Left out for lack of time: " + "; ".join(results["left_out"]) + "."]
    return "\n".join(lines)


SECTION = Section("packing", "P8: packed vs bucketed batches", run, needs=(), min_s={"full": 45, "smoke": 10},
                  max_s={"full": 150, "smoke": 120}, markdown=markdown)

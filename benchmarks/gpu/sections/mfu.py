"""4. MFU: BERT-base at sequence length <= 128, bf16, ``hardware=auto``'s profile, at a given micro-batch (no batch
finder: its probes compiled graphs of their own, 108 s on the H200), against the data sheet's dense peak and against
the matmul peak the environment section measured; then torch.profiler over a few more steps: the top kernels, the
share of device time that is neither matmul nor attention, and the step budget (``step_budget``): the step's
milliseconds by kind of kernel, the matmuls' own TFLOP/s from the FLOPs the profiler counts for them, and the step
P3's MFU would need. Run 7's eager case, worked out by hand from its profile, had matmuls at ~90% of the measured
peak and 47 of its 117 kernel milliseconds a step in neither matmul nor attention: where P3's time must come from.

Two sections, because compiling does not fit call 1: ``mfu`` runs compile off (a figure and a profile in ~25 s,
whatever compiling costs; bucketed with prepared masks, then without them, the flag's A/B in one process, then
packed into bins of 128 tokens, then packed through the varlen kernel), ``mfu_compiled`` compiles in default mode
(the profile's other flags as it sets them) with inductor's mix-order reduction off: the whole model bucketed, then
its layers compiled alone packed and bucketed, then BERT-large at 512 with time left. Three H200 calls cut the
compiled case at its limit while it compiled (100 s twice, 148 s on 2026-11-27 after the compile-off case), so it
has a call of its own (call3, with what the loan has left after calls 1 and 2).
Its compile's graphs are counted (``time/compile_graphs``) and dynamo's recompile reasons printed, so a cut run still
says why it compiled more than once.

The micro-batch is what the finder found on the H200 (1024 rows of <= 128 tokens, 45.5 GiB peak: it fits an H100's
80 GB too). Evaluation is left out of the timed run (it would compile a graph of its own), and every figure is
recorded as soon as it exists: the throughput before the profile, the profile after."""

from __future__ import annotations

import functools
import gc
import re
from pathlib import Path

from .. import attention_kernels, host_time, workloads
from ..registry import Context, Section
from ..step_budget import kernel_ms_per_step, step_budget

MATMUL = re.compile(r"gemm|nvjet|cutlass|xmma|cublas|sm\d+_.*_(tn|nt|nn|tt)|\bmm\b|addmm|bmm|_tem_fused_.*mm|matmul|"
                    r"wgmma|linear", re.I)
ATTENTION = re.compile(r"flash|fmha|attention|attn|sdpa|softmax.*mask|mha", re.I)
# The host-side ops torch.profiler counts FLOPs for (with_flops) that are matrix products: their sum over a step is
# the matmul work the device really did, padding included, which the matmul kernels' time divides into TFLOP/s
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
ATTENTION_KERNELS_S = 60  # what the section must have left to time the attention kernels alone (~5 s) first


LOW_PRECISION_LN = "BERT-base, seq <= 128, compile off, low-precision LayerNorm"
MASK_READ = "BERT-base, seq <= 128, compile off, low-precision LayerNorm, transformers' mask read"
PACKED = "BERT-base, seq <= 128, compile off, low-precision LayerNorm, packed"
BINS = "BERT-base, seq <= 128, compile off, low-precision LayerNorm, packed into bins of 128"
MIX_ORDER_OFF = "BERT-base, seq <= 128, inductor's mix-order reduction off"
MIX_ORDER_OFF_PACKED_LAYERS = "BERT-base, seq <= 128, inductor's mix-order reduction off, packed, layers compiled alone"
MIX_ORDER_OFF_LAYERS = "BERT-base, seq <= 128, inductor's mix-order reduction off, layers compiled alone"
# The ratios a table ends with: (a case, the case it is compared with, what the ratio says), both in one process
RATIOS = ((LOW_PRECISION_LN, MASK_READ, "Prepared masks ÷ transformers' mask read on the host (compile off, the "
                                        "same run)"),
          (PACKED, LOW_PRECISION_LN, "Packed ÷ bucketed (compile off, low-precision LayerNorm, the same run)"),
          (BINS, LOW_PRECISION_LN, "Bins ÷ bucketed (compile off, low-precision LayerNorm, the same run)"),
          (BINS, PACKED, "Bins ÷ packed through the varlen kernel (compile off, the same run)"),
          (MIX_ORDER_OFF_LAYERS, MIX_ORDER_OFF, "Layers compiled alone ÷ the whole model compiled (bucketed, "
                                                "mix-order reduction off, the same run)"),
          (MIX_ORDER_OFF_PACKED_LAYERS, MIX_ORDER_OFF_LAYERS, "Packed ÷ bucketed (layers compiled alone, mix-order "
                                                              "reduction off, the same run)"))


def kind(kernel: str) -> str:
    """matmul, attention or other, from a kernel's (or, on a CPU, an op's) name."""
    return "attention" if ATTENTION.search(kernel) else "matmul" if MATMUL.search(kernel) else "other"


def profile_steps(setup, steps: int = 3, top: int = 15) -> dict:
    """Device time per kernel over ``steps`` more training steps of ``setup`` (CPU: self time per op)."""
    import torch  # lazy: the parent process never imports torch for this
    from torch.profiler import ProfilerActivity, profile

    from maxout.metrics import Throughput  # lazy: imports torch
    from maxout.train.loop import accumulation_groups, train_step  # lazy: imports torch

    cuda = setup.device.is_cuda
    groups = accumulation_groups(setup.train_loader, setup.accum_steps)
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    meter = Throughput(setup.device.torch_device)
    host_time.teardown_cupti()  # as the host split's profile after it does, or that one catches no kernels
    with profile(activities=activities, with_flops=True) as prof:
        for _, group in zip(range(steps), groups):
            train_step(setup, group, meter)
        if cuda:
            torch.cuda.synchronize()
    wanted = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    times: dict[str, float] = {}
    events = prof.key_averages()
    # FLOPs are the host-side ops' (the kernels they launch carry none), so they are summed over every device type
    matmul_flops = sum(e.flops or 0 for e in events if e.key in MATMUL_OPS)
    for event in events:
        if event.device_type != wanted:
            continue
        spent = getattr(event, "self_device_time_total", None) if cuda else event.self_cpu_time_total
        if spent is None:  # torch before the device-neutral names
            spent = event.self_cuda_time_total
        if spent > 0:
            times[event.key] = times.get(event.key, 0.0) + spent / 1000.0  # ms
    total = sum(times.values()) or 1.0
    shares = {k: sum(t for name, t in times.items() if kind(name) == k) / total for k in ("matmul", "attention",
                                                                                          "other")}
    ranked = sorted(times.items(), key=lambda kv: -kv[1])[:top]
    matmul_ms = shares["matmul"] * total
    return {"steps": steps, "device_ms": total, "shares": shares,
            "per_step_ms": kernel_ms_per_step({"steps": steps, "device_ms": total, "shares": shares}),
            "matmul_flops_per_step": matmul_flops / steps if matmul_flops else None,
            # None where the products ran where the profiler counts none (inside a CUDA graph, a Triton template)
            "matmul_tflops": matmul_flops / (matmul_ms / 1e3) / 1e12 if matmul_flops and matmul_ms else None,
            "top": [{"kernel": name[:120], "ms": ms, "share": ms / total, "kind": kind(name)} for name, ms in ranked]}


def cases(ctx: Context, compiled: bool) -> list[dict]:
    """Each case with the seconds it is expected to need (compile included): one that no longer fits is left out.
    ``compiled``: the profile's compile (on for the GPU profiles); else compile off."""
    if ctx.full:
        base = lambda: [*workloads.demo(ctx.work, copies=8), "data.max_length=128"]  # noqa: E731
        if not compiled:
            # LayerNorm in bf16 (low_precision_layernorm.py), as the Hopper profiles run it: 1.13x fp32 LayerNorm's
            # tokens/s in one process on the H200 in runs 5, 6 and 7 (whose first case asked for fp32 by name; the
            # ablation's low_precision_layernorm axis measures it since)
            def compile_off(name: str, *flags: str) -> dict:
                """BERT-base at micro-batch 1024 with compile off; the cases differ only by ``flags``."""
                return dict(name=name, arch="bert_base", batch=1024, steps=30, needs_s=40,
                            data=lambda: [*base(), "hardware.compile=false", "hardware.low_precision_layernorm=true",
                                          *flags])

            # first with prepared masks (prepared_mask.py, the profiles' default), then without them: transformers
            # then reads each batch's padding mask on the host, one sync a step, which packed batches never made
            # (run 7, 26.2% MFU: 1.0 syncs a step bucketed, 0 packed, the bucketed device busy 86% of the time). In
            # this order a first case's warm-up, if any, counts against the flag
            return [compile_off(LOW_PRECISION_LN),
                    compile_off(MASK_READ, "hardware.prepared_mask=false"),
                    # the same token budget in bins of 128 tokens, several samples each, a block-diagonal mask per
                    # bin (bin_packing.py): SDPA's kernels with the mask and attention dropout, as bucketing runs
                    # them, on ~96% real tokens (bucketed: 85-88%), samples sharing the bins' tiles (fewer tiles than
                    # bucketed rows of 65-128 tokens, more than rows of <= 64). Before varlen: run 7 measured that
                    # one (24.6%), never this
                    compile_off(BINS, "data.padding=packed", "data.max_tokens_per_batch=auto",
                                "data.packing_attention=bins"),
                    # padding-free at the same tokens a step (the auto token budget: micro-batch x mean row length),
                    # through torch's varlen flash kernel: bucketed batches of 1024 rows were 85% real tokens
                    # (2026-11-27, run 6), and at this micro-batch the GPU, not the host, sets the pace, which P8's
                    # 256 rows did not show. Run 7's packed batches waited 52.6 ms a step on transformers' flattening
                    # collator, vectorized since (3.2 ms per 1024 demo rows on a 2-core CPU)
                    compile_off(PACKED, "data.padding=packed", "data.max_tokens_per_batch=auto")]
        # compile: 65.9 s for BERT-base at micro-batch 1024 on 2026-11-26 (run 1), 110.3 s for two graphs on
        # 2026-11-27 (run 5: a partial last batch crossed shape padding's guard, off since), so ~55 s for one.
        # Then the same with inductor's mix-order reduction off: in run 5 its fused LayerNorm-backward kernels took
        # 33% of the compiled step's kernel time (~2 ms each on [~75k, 768]; eager's LayerNorm backward ~0.35 ms), and
        # the compiled step's kernel time was no lower than eager's; pytorch/pytorch#185814 reports that kernel's
        # block size leaving it at ~10% of memory bandwidth on some shapes
        # Compile mode default by name: the Hopper profiles record CUDA graphs since run 6, over 8 widths whose first
        # two calls each (a warm-up, then the recording) would fall inside 30 steps; at this micro-batch the step is
        # the GPU's, and default mode is what runs 5 and 7 measured (19.0%, 24.5%). Run 7's profile of it is the
        # baseline: its fused LayerNorm-backward kernels took 25.6% of the kernel time, 2.7x what eager's separate
        # kernels took. So every case turns the fusion off (hardware.mix_order_reduction, the product's flag: the
        # run sets inductor's switch and records the decision). The whole model first, then its layers compiled alone
        # (hardware.compile_scope=layers: one layer's compile, 0.20x the whole model's for BERT-base on a CPU),
        # packed at the same tokens a step (varlen: the padding of 1024 bucketed rows was 15% of their tokens), the
        # configuration most likely to be the fastest, then bucketed: the price of compiling the layers alone at a
        # step the GPU sets the pace of, in the same process. Two whole-model compiles (~55 s each) were all call 3's
        # budget held; the layers' compiles leave room for a third case
        compiled_default = lambda: [*base(), "hardware.compile_mode=default",  # noqa: E731
                                    "hardware.mix_order_reduction=false"]
        layers = lambda: [*compiled_default(), "hardware.compile_scope=layers"]  # noqa: E731
        return [dict(name=MIX_ORDER_OFF, arch="bert_base", batch=1024, steps=30, needs_s=90, data=compiled_default),
                dict(name=MIX_ORDER_OFF_PACKED_LAYERS, arch="bert_base", batch=1024, steps=30, needs_s=60,
                     data=lambda: [*layers(), "data.padding=packed", "data.max_tokens_per_batch=auto"]),
                dict(name=MIX_ORDER_OFF_LAYERS, arch="bert_base", batch=1024, steps=30, needs_s=60, data=layers),
                dict(name="BERT-large, seq 512", arch="bert_large", batch=128, steps=20, needs_s=150,
                     data=lambda: workloads.long_mix(ctx.work, rows=1024, low=512, high=512))]
    return [dict(name=f"tiny, seq <= 128{'' if compiled else ', compile off'}", arch="tiny", batch=32, steps=8,
                 needs_s=10, data=lambda: [*workloads.demo(ctx.work, rows=64), "data.max_length=128",
                                           *([] if compiled else ["hardware.compile=false"])])]


def run(ctx: Context, compiled: bool = False) -> None:
    import torch  # lazy: the parent process never imports torch for this

    from maxout import loading, metrics  # lazy: imports torch
    from maxout.tracking.tracker import NullTracker  # lazy: imports mlflow's pieces
    from maxout.train import train  # lazy: imports torch

    torch._logging.set_logs(recompiles=True)  # a second graph's cause, in the section's output
    env = ctx.previous.get("environment", {}).get("results", {})
    measured_peaks = {k: v["measured_tflops"] * 1e12 for k, v in env.get("matmul", {}).items()}
    if not compiled and ctx.left() > ATTENTION_KERNELS_S:
        # first, before any model holds the memory: a few seconds (cuDNN plans its kernel at each one's first call)
        shape = {} if ctx.full else dict(rows=32, width=16, layers=2, reps=2)
        ctx.record("attention_kernels", attention_kernels.measure(
            "cuda" if torch.cuda.is_available() else "cpu", **shape))
    results = {}
    for case in cases(ctx, compiled):
        if ctx.left() < case["needs_s"]:
            ctx.record("left_out", [*ctx.results.get("left_out", []), f"{case['name']}: {ctx.left():.0f} s left, "
                                                                       f"it needs ~{case['needs_s']} s"])
            continue
        warmup = max(5, case["steps"] // 4)
        # eval_every_epochs: past the run's end, so no evaluation (and no graph for it) inside the timed window
        overrides = [*workloads.model(case["arch"]), *case["data"](), "tracking=none",
                     f"train.batch_size={case['batch']}", f"train.target_effective_batch={case['batch']}",
                     f"train.max_steps={case['steps']}", "train.epochs=1000", "train.eval_every_epochs=1000",
                     f"train.warmup_steps_excluded={warmup}", "train.log_every=5", "checkpoint.enabled=false"]
        # each compiled case compiles its own graph: compile.apply starts every run from an empty dynamo cache (the last
        # case's graph would otherwise serve this one, whatever inductor settings this case's run sets)
        result = train(loading.load(overrides), tracker=NullTracker(), progress=False, verbose=True)
        m, setup = result.metrics, result.setup
        precision = setup.decision("precision").effective
        tf32 = setup.decision("tf32").effective
        peak_key = precision if precision != "fp32" else ("tf32" if tf32 else "fp32")
        tokens_s = m.get("perf/steady_tokens_per_s", m["perf/tokens_per_s"])
        mean_len = m["train/real_tokens"] / max(m["train/samples"], 1)
        count = metrics.count_flops(setup.model, setup.model_config, mean_len)
        measured = measured_peaks.get(peak_key)
        results[case["name"]] = {
            "micro_batch": setup.micro_batch, "accumulation": setup.accum_steps,
            "precision": precision, "compile": setup.decision("compile").effective,
            "attention": setup.decision("attention").effective, "mean_length": mean_len,
            "low_precision_layernorm": setup.decision("low_precision_layernorm").effective,
            "prepared_mask": setup.decision("prepared_mask").effective,
            "packing": setup.decision("packing").effective,
            "mix_order_reduction": setup.decision("mix_order_reduction").effective,
            "compile_scope": setup.decision("compile_scope").effective,
            "padding_efficiency": m["perf/padding_efficiency"], "steady_tokens_per_s": tokens_s,
            "steady_samples_per_s": m.get("perf/steady_samples_per_s"), "flops_per_token": count.total,
            "step_ms": 1e3 / m.get("perf/steady_it_per_s", m["perf/it_per_s"]),
            "flops": {"forward": count.forward, "weight_grads": count.weight_grads,
                      "input_grads": count.input_grads, "attention": count.attention},
            "mfu_datasheet": m.get("perf/mfu"),
            "mfu_measured_peak": count.total * tokens_s / measured if measured else None,
            "measured_peak_tflops": measured / 1e12 if measured else None, "compile_s": m.get("time/compile_s"),
            "compile_graphs": m.get("time/compile_graphs"),
            "peak_memory_gb": m.get("mem/peak_allocated_gb"), "gpu_utilization": m.get("gpu/utilization_mean")}
        ctx.record("cases", results)
        results[case["name"]]["profile"] = profile_steps(setup, steps=3 if ctx.full else 2)
        ctx.record("cases", results)
        # compiled, the H200 idled ~30 ms of each ~175 ms step at this micro-batch (NVML 80%, 2026-11-27) with the
        # same kernel time as eager: whether the host waits inside the step, and on what, is this split's question
        results[case["name"]]["host"] = host_time.split(setup, steps=10 if ctx.full else 2,
                                                        counted=5 if ctx.full else 1, profiled=3 if ctx.full else 1)
        ctx.record("cases", results)
        del result, setup
        gc.collect()  # the next case's micro-batch of 1024 needs the memory this one held (~50 GiB)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def markdown(results: dict) -> str:
    fmt = lambda v, spec: "–" if v is None else format(v, spec)  # noqa: E731
    lines = ["| case | micro-batch × accumulation | tokens/s | FLOPs/token | MFU vs data sheet | MFU vs measured "
             "matmul peak | padding efficiency | NVML utilization | compile s (graphs) | peak memory GiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in results.get("cases", {}).items():
        graphs = f" ({c['compile_graphs']})" if c.get("compile_graphs") is not None else ""
        nvml = "–" if c.get("gpu_utilization") is None else f"{c['gpu_utilization']:.0f}%"
        lines.append(f"| {name} | {c['micro_batch']} × {c['accumulation']} | {c['steady_tokens_per_s']:.0f} | "
                     f"{c['flops_per_token'] / 1e9:.3f} G | {fmt(c['mfu_datasheet'], '.1%')} | "
                     f"{fmt(c['mfu_measured_peak'], '.1%')} | {c['padding_efficiency']:.1%} | {nvml} | "
                     f"{fmt(c['compile_s'], '.1f')}{graphs} | {fmt(c['peak_memory_gb'], '.1f')} |")
    if results.get("left_out"):
        lines += ["", "Left out for lack of time: " + "; ".join(results["left_out"]) + "."]
    kernels = attention_kernels.markdown(results.get("attention_kernels"))
    lines += ["", *kernels] if kernels else []
    cases_ = results.get("cases", {})
    for case, against, what in RATIOS:
        if case in cases_ and against in cases_:
            gain = cases_[case]["steady_tokens_per_s"] / cases_[against]["steady_tokens_per_s"]
            lines += ["", f"{what}: **{gain:.2f}×** tokens/s."]
    hosts = {name: c["host"] for name, c in cases_.items() if c.get("host")}
    if hosts:
        lines += ["", "Where each case's step time goes on the host (more steps after its run; benchmarks/gpu/"
                      "host_time.py):", "", *host_time.markdown(hosts)]
    for name, c in cases_.items():
        p = c.get("profile")
        if not p:
            continue
        s = p["shares"]
        lines += ["", f"Profile of {name} ({p['steps']} steps, {p['device_ms']:.1f} ms of kernel time): matmul "
                      f"{s['matmul']:.0%}, attention {s['attention']:.0%}, other {s['other']:.0%}.", "",
                  "| kernel | kind | ms | share |", "|---|---|---|---|"]
        lines += [f"| `{k['kernel'][:90]}` | {k['kind']} | {k['ms']:.2f} | {k['share']:.1%} |" for k in p["top"]]
        lines += ["", step_budget(name, c)]
    return "\n".join(lines)


def chart(results: dict, path: Path) -> bool:
    from .charts import bars  # lazy: matplotlib

    cases_ = results.get("cases", {})
    series = {"vs data sheet": [100 * (c["mfu_datasheet"] or 0) for c in cases_.values()],
              "vs measured matmul peak": [100 * (c["mfu_measured_peak"] or 0) for c in cases_.values()]}
    return bars(path, list(cases_), series, "MFU %", "model FLOPs utilization (bf16)")


WHY_CUDA = "needs a CUDA device: there is no meaningful peak to divide by on a CPU"
SECTION = Section("mfu", "MFU, compile off", run, needs=("cuda",), min_s={"full": 45, "smoke": 20},
                  max_s={"full": 120, "smoke": 120}, markdown=markdown, chart=chart, why_cuda=WHY_CUDA)
SECTION_COMPILED = Section("mfu_compiled", "MFU, compiled in default mode",
                           functools.partial(run, compiled=True), needs=("cuda",), min_s={"full": 100, "smoke": 20},
                           max_s={"full": 300, "smoke": 120}, markdown=markdown, chart=chart, why_cuda=WHY_CUDA)

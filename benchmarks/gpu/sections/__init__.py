"""The GPU report's sections, in order of value (registry.py says what a section is), and the two device calls that
run them (PLANS). Add a section by appending its Section here. 1-vs-N GPU scaling needs a machine with several GPUs
(benchmarks/bench_ddp.py). Importing this is light: each section imports torch and maxout when it runs."""

from __future__ import annotations

from ..registry import Plan
from . import ablation, audit, environment, gpu_tests, hpo, memory, mfu, packing, tracking, vs_trainer

SECTIONS = [
    environment.SECTION,
    gpu_tests.SECTION,
    vs_trainer.SECTION,
    mfu.SECTION,
    mfu.SECTION_COMPILED,
    ablation.SECTION_COMPILE_MODES,
    packing.SECTION,
    ablation.SECTION,
    memory.SECTION,
    tracking.SECTION,
    audit.SECTION,
    hpo.SECTION,
]

# What each planned section takes on an H100/H200 at full scale, seconds: measured on the H200 (2026-11-26, run 2,
# c5cb8fe, and 2026-11-27, a1d7f67: benchmarks/gpu/reports/) unless marked as an estimate.
EXPECTED_S = {
    "environment": 22,  # 16 on 2026-11-27
    # 229 s on 2026-11-27: both mixes in both orders and maxout eager (maxout's first run 118 s, 98 of them compile);
    # the compiled Trainer, last, is what the limit leaves out; + ~10 s for the host split of maxout's three demo-mix
    # runs (host_time.py: 10 timed and 5 counted steps each, 3 profiled after the last; an estimate); 205 s on
    # 2026-11-27 (run 6, maxout's compile 67.2 s, default mode). The Hopper profiles record CUDA graphs since: their
    # graph compiled in 67.1 s where default mode's took 25.1 (compile_modes, run 6, inductor's cache warm), so ~+40 s
    # + the compiled Trainer on the demo mix (FIRST_RUN_S's guess: 120 s), first given the time after run 7 (227 s)
    "vs_trainer": 350,
    # compile off, 30 steps at micro-batch 1024 and a 3-step profile, twice (fp32 LayerNorm, then low-precision
    # LayerNorm): 35 s on 2026-11-27 (run 5); 48 s with each case's host split (run 6); + ~22 s for the packed case
    # (75 s in run 7); + ~5 s of attention kernels alone, + ~22 s for the bins case (estimates)
    "mfu": 100,
    # estimate: 65.9 s of compile at micro-batch 1024 on 2026-11-26 (run 1), 30 steps and a profile; cut at 100 s
    # (twice) and 148 s (2026-11-27, after the compile-off case) while it compiled
    # 142 s on 2026-11-27 (13a3e98) with 110.3 s of compile for 2 graphs: an epoch's partial last batch crossed shape
    # padding's guard (compile.no_size_guards turns it off since); one graph ~55 s, with the host split ~80 s; then the
    # same with mix-order reduction off (~80 s) where the budget has room. 92 s on 2026-11-28 (run 7: 56.2 s of
    # compile, 1 graph; the second case left out with 70 s left). Since: mix-order reduction off, bucketed then
    # packed, each its own compile: ~180 (an estimate)
    "mfu_compiled": 180,
    # 143 s on 2026-11-27 (run 6) for one round (default compiled in 25.1 s, reduce-overhead in 67.1 s): the second
    # was left out. After mfu_compiled (default mode) and vs_trainer (reduce-overhead) both graphs are in inductor's
    # cache (an estimate)
    "compile_modes": 120,
    "packing": 60,  # 76 s on 2026-11-27 with the 128-512 mix's packed run left out (4 s left)
    "gpu_tests": 100,  # 4 xdist workers: 33 of 34 tests finished in 100 s (runs 6 and 7), the compiled varlen run cut
    "batch_finder": 70,  # 54-58 s
    "tracking": 60,  # 45-53 s
}

# A GPU machine is lent for 15 minutes in all: ~30 s to start it and send the tree, then call1 (8 minutes at most, the
# carried wheels' install included), then call2 at once (the machine stays warm 30 s; 5 minutes at most). On 2026-11-27
# the loan had held 472.6 s after call 1 (440 s wall) and 698.3 s after call 2 (213 s wall): 202 s were left on a warm
# machine, which call3 takes (no start needed, since the machine is warm); 329 s and 285 s on the day's later loans (run
# 6: held 401.6 s after call 1, 369 s wall, and 614.6 s after call 2). A fixed limit holds its section's EXPECTED_S with
# room; None: what the budget has left when the section starts. The hpo workers (a trial's start-up alone outlasted the
# 16 s each study had in call 2), the ablation, the audit and BERT-large's MFU fit none of the calls: each needs a loan
# of its own (--sections hpo, benchmarks/README.md), and so does P8 (--sections packing) since run 6, and the batch
# finder and tracking since run 7.
PLANS = (
    # P8 (packing) left call 1 after run 6: four runs put it at 0.92-1.23x, bounded by padding at 1.14x, and mfu's
    # packed case now measures packed against bucketed at micro-batch 1024 in one process.
    # After run 7, mfu moved to call 2, so that vs_trainer has the time for the compiled Trainer (torch_compile), left
    # out of runs 4 to 7 for lack of it: with CUDA graphs maxout ran 3.13x the Trainer's best flags in the warm order,
    # and the Trainer compiled is the peer a reader asks about next
    Plan("call1", budget_s=400, limits={"environment": 30, "vs_trainer": None},
         what="the headline: vs the Trainer on both mixes in both orders, then the compiled Trainer"),
    # gpu_tests: 110 s cut the compiled packed run through the varlen kernel, the last test handed out, in runs 6
    # and 7 (call 2 took 203 and 213 s wall of its 300). batch_finder and tracking left call 2 after run 7, to a loan
    # of their own (--sections batch_finder,tracking): five runs found the same batches (2048, largest fit 3413 since
    # bf16 LayerNorm, the first real out-of-memory error at 3584), and seven put MLflow at 0.95-1.06x no tracker
    Plan("call2", budget_s=280, limits={"gpu_tests": 130, "mfu": None},
         what="every pytest -m gpu test, then MFU with compile off and its profiles (bf16 LayerNorm: prepared "
              "masks, transformers' mask read, packed into bins, then packed through varlen)"),
    # compile_modes left call 3 after run 7: CUDA graphs at batch 64 measured 2.14x and 1.79x default mode (runs 6
    # and 7), the Hopper profiles record them and vs_trainer measures them. Compiled in default mode, run 7's MFU case
    # (24.5%) spent 25.6% of its kernel time in inductor's fused LayerNorm backward, 2.7x eager's separate kernels:
    # both compiled cases now turn that fusion (mix-order reduction) off, bucketed, then packed (the same tokens a
    # step without the 15% of padding), each with its own compile; run 7's profile is the default mode's baseline
    # 215 s: what calls 1 and 2 as they now stand should leave of the loan (~250 s, see the test), less the install;
    # both compiled cases (~90 s each) fit it
    Plan("call3", budget_s=215, limits={"mfu_compiled": None},
         what="with what the loan has left after calls 1 and 2 (202, 329 and 285 s on 2026-11-27, 295 s on "
              "2026-11-28): MFU compiled in default mode with inductor's mix-order reduction off and its profile, "
              "bucketed, then packed"),
)

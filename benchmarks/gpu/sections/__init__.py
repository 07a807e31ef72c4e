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
    packing.SECTION,
    ablation.SECTION,
    memory.SECTION,
    tracking.SECTION,
    audit.SECTION,
    hpo.SECTION,
]

# What each planned section takes on an H100/H200 at full scale, seconds: measured on the H200 on 2026-11-26 (the second
# run, c5cb8fe: benchmarks/gpu/reports/2026-11-26-h200-run2) unless marked as an estimate.
EXPECTED_S = {
    "environment": 22,
    # 257 s with CUDA graphs, 146 of them maxout's first run (120 s of compile + recording); compile mode default
    # compiles one graph of ~36 s instead: estimate
    "vs_trainer": 190,
    # estimate: one ~36 s compile, 30 steps at micro-batch 1024 and a 3-step profile (cut at 100 s on 2026-11-26 while
    # recording CUDA graphs for 8 widths at micro-batch 1024)
    "mfu": 75,
    "packing": 60,  # estimate: four eager runs of 30 steps (never reached yet)
    "gpu_tests": 100,  # every test reached, 4 xdist workers
    "batch_finder": 70,  # cut at 50 s in its third rung; that rung now ends at its out-of-memory recovery
    "tracking": 60,  # cut at 40 s after both repetitions, before the logging-path measure
}

# A GPU machine is lent for 15 minutes in all: ~30 s to start it and send the tree (the 2026-11-26 loan: 61 s with the
# warm gap), then call1 (8 minutes at most, the carried wheels' install included: 400 s wall for a 396 s report),
# then call2 at once (the machine stays warm 30 s; 5 minutes at most): ~13.5 of the 15 minutes, the rest a margin. A
# fixed limit holds its section's EXPECTED_S with room; None: what the budget has left when the section starts. The
# hpo workers (a trial's start-up alone outlasted the 16 s each study had in call 2), the ablation, the audit and
# BERT-large's MFU fit neither call: each needs a loan of its own (--sections hpo, benchmarks/README.md).
PLANS = (
    Plan("call1", budget_s=450, limits={"environment": 30, "vs_trainer": 230, "mfu": 100, "packing": None},
         what="the headline: vs the Trainer on both mixes in both orders, MFU and a profile, then P8"),
    Plan("call2", budget_s=280, limits={"gpu_tests": 110, "batch_finder": 80, "tracking": None},
         what="every pytest -m gpu test, the batch finder against real memory, then tracking"),
)

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

# A GPU machine is lent for 15 minutes in all: ~30 s to start it and send the tree, then call1 (8 minutes at most, the
# carried wheels' install included), then call2 at once (the machine stays warm 30 s; 5 minutes at most): ~13.5 of
# the 15 minutes, the rest a margin. The seconds per section are the H200 run's (2026-11-26) plus what changed since:
# a BERT-base compile ~36 s a graph with TORCHINDUCTOR_COMPILE_THREADS set, the Trainer's runs ~20 s each. None: what
# the budget has left when the section starts. The ablation, the audit and BERT-large's MFU fit neither call: run
# them with --sections in a later loan.
PLANS = (
    Plan("call1", budget_s=450, limits={"environment": 30, "vs_trainer": 260, "mfu": 100, "packing": None},
         what="the headline: vs the Trainer on both mixes in both orders, MFU and a profile, then P8"),
    Plan("call2", budget_s=280, limits={"gpu_tests": 110, "batch_finder": 50, "tracking": 40, "hpo": None},
         what="every pytest -m gpu test, the batch finder against real memory, tracking, then the hpo workers"),
)

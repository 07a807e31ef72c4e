"""The GPU report's sections, in order of value (registry.py says what a section is). Add one by appending its
Section here. Packed vs bucketed batches are a grid of the ablation; 1-vs-N GPU scaling needs a machine with
several GPUs (benchmarks/bench_ddp.py). Importing this is light: each section imports torch and maxout when it
runs."""

from __future__ import annotations

from . import ablation, audit, environment, gpu_tests, hpo, memory, mfu, tracking, vs_trainer

SECTIONS = [
    environment.SECTION,
    gpu_tests.SECTION,
    vs_trainer.SECTION,
    mfu.SECTION,
    ablation.SECTION,
    memory.SECTION,
    tracking.SECTION,
    audit.SECTION,
    hpo.SECTION,
]

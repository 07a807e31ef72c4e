"""The GPU report's sections, in order of value (registry.py says what a section is). Add one by appending its
Section here: issue 16's packed vs bucketed batches (BERT-base and a 1B decoder), issue 18's `maxout audit`,
issue 15's 1-vs-N GPU scaling. Importing this is light: each section imports torch and maxout when it runs."""

from __future__ import annotations

from . import ablation, environment, gpu_tests, memory, mfu, tracking, vs_trainer

SECTIONS = [
    environment.SECTION,
    gpu_tests.SECTION,
    vs_trainer.SECTION,
    mfu.SECTION,
    ablation.SECTION,
    memory.SECTION,
    tracking.SECTION,
]

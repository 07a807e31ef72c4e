"""The whole trained model, for the MLflow model a run logs, whatever data parallelism trained it.

With FSDP no rank holds the whole model: every rank takes part in gathering the full state dict onto rank 0's CPU
(``get_model_state_dict(full_state_dict=True, cpu_offload=True)``), which loads it into a plain copy of the model
built there. The logged model is then the same files as a run without FSDP writes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from .. import modeling
from ..optimizations import data_parallel, lora
from .setup import Setup


def full_model(setup: Setup) -> Optional[torch.nn.Module]:
    """The trained model on the rank that logs it (rank 0), None on the others. With FSDP every rank must call this
    (it is a collective)."""
    if setup.decision("data_parallel").effective != "fsdp":
        return setup.model if setup.world.is_main else None
    state = data_parallel.full_model_state(setup.model)
    if not setup.world.is_main:
        return None
    return plain_copy(setup, state)


def plain_copy(setup: Setup, state: dict) -> torch.nn.Module:
    """An unsharded model of the same architecture (and adapter) on the CPU, with ``state`` loaded. Built from the
    config (random weights, overwritten at once): reading the pretrained weights again would be wasted."""
    mc = setup.cfg.model
    model = modeling.load_model(replace(mc, source="config"), setup.model_config,
                                setup.decision("attention").effective)
    if setup.decision("adapter").effective != "none":
        model = lora.apply(model, setup.decision("adapter").effective, mc.lora_r, mc.lora_alpha, mc.lora_dropout,
                           lora.target_modules(model, mc.lora_target_modules))
    model.load_state_dict(state)
    return model

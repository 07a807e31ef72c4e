"""Gradient accumulation derived from a target effective batch, so the optimizer sees the same number of
samples per step whatever micro-batch fits the device, and however many processes share the step (each
contributes a micro-batch per accumulation step: steps = ceil(target / (micro-batch x world size)))."""

from __future__ import annotations

import math
from typing import Optional

from .base import Decision


def plan(target: Optional[int], micro_batch: int, world_size: int = 1) -> tuple[int, Decision]:
    """Accumulation steps and the decision: requested = target effective batch, effective = what runs."""
    per_step = micro_batch * world_size
    if target is None:
        return 1, Decision("accumulation", None, per_step)
    steps = max(1, math.ceil(target / per_step))
    effective = steps * per_step
    # With several processes each step takes a micro-batch from every rank: steps = target / (micro x ranks).
    unit = f"the micro-batch {micro_batch}" + (f" x {world_size} processes" if world_size > 1 else "")
    ranks = f" x {world_size}" if world_size > 1 else ""
    reason = "" if effective == target else (
        f"target {target} is not a multiple of {unit}: {steps} x {micro_batch}{ranks} = {effective} samples per step")
    if target < per_step:
        reason = f"target {target} is below {unit}: one micro-batch per step"
    return steps, Decision("accumulation", target, effective, reason)

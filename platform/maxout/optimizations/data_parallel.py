"""Data parallelism across the processes torchrun starts: DDP (a full replica per process) or FSDP (``fully_shard``).

- ``ddp``: every rank holds the whole model; backward all-reduces (averages) the gradients, bucketed and overlapped
  with the backward pass. The default with more than one process: the fastest while the model, its gradients and
  AdamW's two moments fit one device.
- ``fsdp``: FSDP2's ``fully_shard`` on every transformer block (the classes the model lists in
  ``_no_split_modules``) and on the root, so each rank keeps 1/N of the weights, gradients and optimizer state and
  all-gathers a block's weights just before it runs: for models that do not fit one device (a Gemma-2B or
  DeBERTa-large fine-tune on 24 GB cards). Checkpoints hold each rank's shard (``sharded_state_dicts``, written by
  torch.distributed.checkpoint: train/sharded_checkpoint.py), or with ``checkpoint.sharded=false`` the full state
  gathered on rank 0; the logged model is always the full state. Works on CPU with gloo in torch 2.13 (tested), and
  on CUDA with NCCL.

Gradient accumulation: ``gradient_sync(module, last)`` turns the sync off for every backward of an optimizer step
but the last (DDP's ``no_sync``, FSDP's ``set_requires_gradient_sync``), so gradients cross the network once per
optimizer step, not once per micro-batch.

Ground floor. May import: errors, optimizations.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Optional

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict, set_state_dict)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from .base import Decision

NAME = "data_parallel"


def supported_fsdp(precision: str) -> tuple[bool, str]:
    if precision == "fp16":
        return False, ("fp16 needs a gradient scaler that unscales FSDP's sharded gradients, which maxout does not "
                       "set up: use bf16 (or fp32) with fsdp")
    return True, ""


def resolve(requested: str, world_size: int, initialized: bool, precision: str) -> Decision:
    """What runs: ``none`` in a single process, ``ddp`` for ``auto`` (and for an ``fsdp`` the setup cannot honour)."""
    if requested == "none":
        return Decision(NAME, requested, "none")
    if world_size <= 1:
        return Decision(NAME, requested, "none", "one process: nothing to synchronise (torchrun starts several)")
    if not initialized:
        return Decision(NAME, requested, "none", f"WORLD_SIZE={world_size} but no process group was initialised")
    if requested == "auto":
        return Decision(NAME, requested, "ddp", f"auto: ddp, one full replica on each of the {world_size} processes")
    if requested == "fsdp":
        ok, reason = supported_fsdp(precision)
        if not ok:
            return Decision(NAME, requested, "ddp", reason)
    return Decision(NAME, requested, requested)


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules FSDP shards one by one: instances of the classes the model names in ``_no_split_modules``
    (transformer blocks, embeddings), bottom-up, as ``fully_shard`` must be called."""
    names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or [])}
    return [m for m in reversed(list(model.modules())) if type(m).__name__ in names and m is not model]


def apply(model: torch.nn.Module, strategy: str, device_type: str, local_rank: int,
          find_unused_parameters: bool = False, reshard_after_forward: bool = True) -> Optional[torch.nn.Module]:
    """The module the training forward runs through: DDP's wrapper around ``model``, or ``model`` itself sharded in
    place (FSDP replaces its parameters with shards: build the optimizer after this). None for ``none``."""
    if strategy == "ddp":
        return DistributedDataParallel(model, device_ids=[local_rank] if device_type == "cuda" else None,
                                       find_unused_parameters=find_unused_parameters)
    if strategy == "fsdp":
        for unit in shard_units(model):
            fully_shard(unit, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        return model
    return None


def gradient_sync(module: Any, enabled: bool) -> ContextManager:
    """Backward inside this context syncs gradients across ranks only when ``enabled`` (the optimizer step's last
    backward); the others accumulate locally."""
    if isinstance(module, DistributedDataParallel):
        return contextlib.nullcontext() if enabled else module.no_sync()
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


def state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer, strategy: str) -> tuple[dict, dict]:
    """Model and optimizer state to save. FSDP: the full state dicts, gathered on rank 0's CPU (every rank must call
    this; the others get empty dicts), so a checkpoint is the same file as without FSDP."""
    if strategy != "fsdp":
        return model.state_dict(), optimizer.state_dict()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return (get_model_state_dict(model, options=options),
            get_optimizer_state_dict(model, optimizer, options=options))


def load_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                     optimizer_state: dict, strategy: str) -> None:
    """The inverse of :func:`state_dicts`, on every rank (each one read the checkpoint; FSDP keeps its shard)."""
    if strategy != "fsdp":
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)
        return
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)


def sharded_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """FSDP: this rank's shards of the model and optimizer state (DTensors keyed by parameter name), for
    torch.distributed.checkpoint to write (each rank its own) or to load into in place. Nothing is gathered."""
    return get_state_dict(model, optimizers=optimizer)


def load_sharded_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                             optimizer_state: dict) -> None:
    """The inverse of :func:`sharded_state_dicts`, on every rank (each with the shards it read)."""
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)


def full_model_state(model: torch.nn.Module) -> dict:
    """FSDP: the whole model's weights on rank 0's CPU (a collective: every rank calls it; the others get {})."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

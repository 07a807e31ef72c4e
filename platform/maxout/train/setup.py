"""Build everything the loop needs, deciding and applying each optimization once, in a fixed order.

Each decision (requested, effective, reason) is recorded in ``Setup.decisions``; nothing the device cannot
honour is turned off silently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Optional

import torch
from transformers import get_scheduler

from .. import data as data_mod
from .. import modeling
from ..config import Config
from ..errors import ConfigError
from ..hardware import DeviceInfo
from ..optimizations import Decision, decide, named
from ..optimizations import accumulation, attention, bucketing, compile as compile_opt, cudnn_benchmark
from ..optimizations import data_parallel, dataloader, deterministic, fast_dropout, freeze, fused_adamw
from ..optimizations import grad_clipping, gradient_checkpointing, lora, precision as precision_opt, tf32
from .distributed import SINGLE, World
from .oom import OOMRecovery


@dataclass
class Setup:
    cfg: Config
    device: DeviceInfo
    dataset: data_mod.Dataset
    tokenizer: Any
    model_config: Any
    model: torch.nn.Module  # the trainable module (peft-wrapped when an adapter is on)
    forward: Callable  # what the loop calls: the compiled module when compile is on
    optimizer: torch.optim.Optimizer
    scheduler: Any
    precision: precision_opt.Precision
    train_loader: torch.utils.data.DataLoader
    eval_loader: torch.utils.data.DataLoader
    sampler: bucketing.EpochBatchSampler
    micro_batch: int
    accum_steps: int
    clip_norm: float  # 0: no clipping
    decisions: list = field(default_factory=list)
    derived: dict = field(default_factory=dict)
    oom: OOMRecovery = field(default_factory=OOMRecovery)  # halves the rows per forward on out-of-memory
    world: World = SINGLE  # this process's place in the job (train/distributed.py)
    parallel: Any = None  # DDP's wrapper, or the FSDP-sharded model; None in one process

    def decision(self, name: str) -> Decision:
        return named(self.decisions, name)

    def gradient_sync(self, last: bool) -> ContextManager:
        """Data parallel: gradients cross the network on the optimizer step's last backward only."""
        return data_parallel.gradient_sync(self.parallel, last)

    @property
    def steps_per_epoch(self) -> int:
        return planned_steps(len(self.train_loader), self.accum_steps, self.cfg.train)[0]

    @property
    def total_steps(self) -> int:
        return planned_steps(len(self.train_loader), self.accum_steps, self.cfg.train)[1]


def planned_steps(micro_batches_per_epoch: int, accum_steps: int, tr: Any) -> tuple[int, int]:
    """(optimizer steps per epoch, total optimizer steps); max_steps > 0 caps the total."""
    per_epoch = math.ceil(micro_batches_per_epoch / accum_steps)
    total = per_epoch * tr.epochs
    return per_epoch, (min(total, tr.max_steps) if tr.max_steps > 0 else total)


def resolve_micro_batch(cfg: Config) -> int:
    """The per-device micro-batch. ``auto`` is the batch finder's job: batch_finder.resolve() runs it (it needs a
    model to probe) and passes the result to build(micro_batch=...)."""
    batch = cfg.batch_size
    if batch == "auto":
        raise ConfigError("batch_size=auto is resolved by maxout.train.batch_finder.resolve(); pass its micro-batch to "
                          "build(micro_batch=...), or set train.batch_size to a positive integer")
    return int(batch)


def backend_decisions(cfg: Config, device: DeviceInfo) -> list[Decision]:
    """Process-wide switches, applied before the model exists (seed first: the head's init depends on it)."""
    hw, tr = cfg.hardware, cfg.train
    deterministic.seed_everything(tr.seed)
    d_det = decide("deterministic", tr.deterministic, deterministic.supported(device))
    deterministic.apply(d_det.effective)
    d_prec = precision_opt.resolve(hw.precision, device)
    d_tf32 = decide("tf32", hw.tf32, tf32.supported(device))
    tf32.apply(d_tf32.effective)
    d_cudnn = decide("cudnn_benchmark", hw.cudnn_benchmark, cudnn_benchmark.supported(device, d_det.effective))
    cudnn_benchmark.apply(d_cudnn.effective)
    return [d_prec, d_tf32, d_cudnn, d_det]


def build_model(cfg: Config, device: DeviceInfo, dataset: data_mod.Dataset, tokenizer: Any,
                precision: str) -> tuple[Any, torch.nn.Module, list[Decision]]:
    hw, mc = cfg.hardware, cfg.model
    model_config = modeling.build_config(mc, dataset.label_names, len(tokenizer))
    d_attn = attention.resolve(hw.attn_implementation, modeling.model_class(model_config), device, precision)
    model = modeling.load_model(mc, model_config, d_attn.effective)

    d_adapter = decide("adapter", mc.adapter, lora.supported(mc.adapter), off="none")
    d_freeze = decide("freeze_encoder", mc.freeze_encoder, freeze.supported(model, d_adapter.effective))
    if d_freeze.effective:
        freeze.apply(model)
    d_ckpt = decide("gradient_checkpointing", hw.gradient_checkpointing, gradient_checkpointing.supported(model))
    if d_ckpt.effective:  # before peft wraps the model: checkpointing lives on the transformers module
        gradient_checkpointing.apply(model)
    if d_adapter.effective != "none":
        model = lora.apply(model, d_adapter.effective, mc.lora_r, mc.lora_alpha, mc.lora_dropout,
                           mc.lora_target_modules)
    return model_config, model.to(device.torch_device), [d_attn, d_ckpt, d_freeze, d_adapter]


def build_collator(cfg: Config, device: DeviceInfo, tokenizer: Any) -> data_mod.Collator:
    dc = cfg.data
    multiple = (8 if device.is_cuda else None) if dc.pad_to_multiple_of == "auto" else dc.pad_to_multiple_of
    return data_mod.Collator(tokenizer.pad_token_id, dc.max_length if dc.padding == "max_length" else None, multiple)


def build_loaders(cfg: Config, device: DeviceInfo, dataset: data_mod.Dataset, tokenizer: Any, micro_batch: int,
                  world: World = SINGLE) -> tuple[Any, Any, bucketing.EpochBatchSampler, list[Decision]]:
    dc = cfg.data
    train_enc = data_mod.encode(tokenizer, dataset.train, dc.max_length)
    eval_enc = data_mod.encode(tokenizer, dataset.validation, dc.max_length)
    d_pad = Decision("padding", dc.padding, dc.padding)
    d_bucket = decide("bucketing", dc.bucketing, bucketing.supported(dc.padding))
    collate = build_collator(cfg, device, tokenizer)
    settings, d_loader = dataloader.resolve(cfg.hardware, device, world.local_size)
    sampler = bucketing.apply(train_enc.lengths, micro_batch, cfg.train.seed, d_bucket.effective,
                              dc.bucket_batches, world.rank, world.size)  # this rank's share of each global batch
    train_loader = dataloader.apply(train_enc, sampler, collate, settings)
    # Evaluation: no gradients, so twice the batch fits; each rank evaluates its share (metrics are all-reduced).
    eval_batches = bucketing.eval_batches(eval_enc.lengths, 2 * micro_batch, world.rank, world.size)
    eval_loader = dataloader.apply(eval_enc, eval_batches, collate, settings)
    return train_loader, eval_loader, sampler, d_loader + [d_bucket, d_pad]


def build_optimizer(cfg: Config, device: DeviceInfo, model: torch.nn.Module, total_steps: int
                    ) -> tuple[torch.optim.Optimizer, Any, list[Decision]]:
    tr = cfg.train
    d_fused = decide("fused_adamw", cfg.hardware.fused_adamw, fused_adamw.supported(device))
    optimizer = fused_adamw.apply(model, tr.lr, tr.weight_decay, d_fused.effective)
    warmup = int(tr.warmup_ratio * total_steps)
    name = {"constant": "constant_with_warmup"}.get(tr.schedule, tr.schedule)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)
    d_clip = decide("grad_clipping", tr.max_grad_norm, grad_clipping.supported(tr.max_grad_norm), off=0.0)
    return optimizer, scheduler, [d_fused, d_clip]


def build_parallel(cfg: Config, device: DeviceInfo, model: torch.nn.Module, world: World,
                   precision: str) -> tuple[Optional[torch.nn.Module], Decision]:
    """DDP or FSDP across the job's processes; before the optimizer, whose parameters FSDP replaces with shards."""
    dc = cfg.distributed
    d_parallel = data_parallel.resolve(dc.strategy, world.size, world.initialized, precision)
    return data_parallel.apply(model, d_parallel.effective, device.torch_device, world.local_rank,
                               dc.find_unused_parameters, dc.fsdp_reshard_after_forward), d_parallel


def build_compile(cfg: Config, device: DeviceInfo, model: torch.nn.Module) -> tuple[Callable, list[Decision]]:
    hw = cfg.hardware
    d_compile = decide("compile", hw.compile, compile_opt.supported(device))
    static = cfg.data.padding == "max_length"
    d_mode = compile_opt.resolve_mode(hw.compile_mode, device, static)
    if not d_compile.effective:
        return model, [d_compile, Decision("compile_mode", hw.compile_mode, "none", "compile is off")]
    # Dynamic padding changes the sequence length every batch: mark shapes dynamic up front (one compile).
    return compile_opt.apply(model, d_mode.effective, dynamic=None if static else True), [d_compile, d_mode]


def build(cfg: Config, device: DeviceInfo, dataset: data_mod.Dataset, tokenizer: Any,
          micro_batch: Optional[int] = None, world: World = SINGLE) -> Setup:
    micro_batch = micro_batch or resolve_micro_batch(cfg)
    decisions = backend_decisions(cfg, device)
    prec = named(decisions, "precision").effective
    model_config, model, d_model = build_model(cfg, device, dataset, tokenizer, prec)
    if world.size > 1:  # same initial weights on every rank (seeded alike above), then each rank its own dropout
        deterministic.seed_everything(cfg.train.seed + world.rank)
    train_loader, eval_loader, sampler, d_data = build_loaders(cfg, device, dataset, tokenizer, micro_batch, world)
    accum_steps, d_accum = accumulation.plan(cfg.train.target_effective_batch, micro_batch, world.size)
    _, total = planned_steps(len(train_loader), accum_steps, cfg.train)
    parallel, d_parallel = build_parallel(cfg, device, model, world, prec)
    optimizer, scheduler, d_optim = build_optimizer(cfg, device, model, total)
    forward, d_compile = build_compile(cfg, device, parallel or model)
    decisions += d_model + d_data + [d_accum] + d_optim + d_compile + [d_parallel]
    d_dropout = decide("fast_dropout", cfg.hardware.fast_dropout,
                       fast_dropout.supported(device, named(decisions, "compile").effective,
                                              named(decisions, "gradient_checkpointing").effective))
    if d_dropout.effective:
        forward = fast_dropout.apply(forward)
    decisions.append(d_dropout)
    setup = Setup(cfg=cfg, device=device, dataset=dataset, tokenizer=tokenizer, model_config=model_config,
                  model=model, forward=forward, optimizer=optimizer, scheduler=scheduler,
                  precision=precision_opt.apply(prec, device.torch_device), train_loader=train_loader,
                  eval_loader=eval_loader, sampler=sampler, micro_batch=micro_batch, accum_steps=accum_steps,
                  clip_norm=cfg.train.max_grad_norm if named(decisions, "grad_clipping").effective else 0.0,
                  decisions=decisions, world=world, parallel=parallel,
                  # one rank re-running a step alone would leave the others waiting at its all-reduce
                  oom=OOMRecovery(enabled=world.size == 1))
    counts = modeling.count_parameters(model)
    setup.derived = {
        "micro_batch": micro_batch, "accumulation_steps": accum_steps,
        "effective_batch": micro_batch * accum_steps * world.size,
        "steps_per_epoch": setup.steps_per_epoch, "total_steps": setup.total_steps,
        "warmup_steps": int(cfg.train.warmup_ratio * setup.total_steps),
        "train_samples": len(dataset.train), "validation_samples": len(dataset.validation),
        "num_labels": dataset.num_labels, "labels": ",".join(dataset.label_names),
        "data_fingerprint": dataset.fingerprint, "params_total": counts["total"],
        "params_trainable": counts["trainable"], "host_sync_every_steps": cfg.train.log_every,
        "zero_grad_set_to_none": True,
    }
    return setup

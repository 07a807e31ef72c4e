"""Build everything the loop needs, deciding and applying each optimization once, in a fixed order.

Each decision (requested, effective, reason) is recorded in ``Setup.decisions``; nothing the device cannot
honour is turned off silently. The decisions that need nothing built are made in one place, ``plan_decisions``
(the config, the device and the model's class are enough), which ``maxout audit`` also asks; the rest (adapter,
frozen encoder, accumulation) need the loaded model or the micro-batch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Optional

import torch
from transformers import get_scheduler

from .. import data as data_mod
from .. import metrics as m
from .. import modeling
from ..config import Config
from ..errors import ConfigError
from ..hardware import DeviceInfo
from ..optimizations import Decision, decide, named
from ..optimizations import accumulation, attention, bin_packing, bucketing, compile as compile_opt, cudnn_benchmark
from ..optimizations import data_parallel, dataloader, deterministic, fast_dropout, freeze, fused_adamw
from ..optimizations import grad_clipping, gradient_checkpointing, lora, packing, pad_widths, precision as precision_opt
from ..optimizations import inductor_tuning, liger_kernel, low_precision_layernorm, mix_order_reduction
from ..optimizations import prepared_mask, regional_compile, skip_guards, tf32, unmasked_causal, varlen
from ..serving import pooling
from .distributed import SINGLE, World, keep_until_exit
from .divergence import DivergenceWatch
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
    classifier: torch.nn.Module  # what evaluation calls: ``model``, or it with per-sample pooling (pooling.py)
    optimizer: torch.optim.Optimizer
    scheduler: Any
    precision: precision_opt.Precision
    train_loader: torch.utils.data.DataLoader
    eval_loader: torch.utils.data.DataLoader
    sampler: bucketing.EpochBatchSampler  # or its token-budget subclass, packing.TokenBudgetSampler
    micro_batch: int
    accum_steps: int
    clip_norm: float  # 0: no clipping
    decisions: list = field(default_factory=list)
    derived: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)  # time/model_load_s, time/tokenize_s: the set-up a trial pays
    flop_probe: Any = None  # metrics.FlopProbe of the plain model, for MFU (taken before data parallelism wraps it)
    oom: OOMRecovery = field(default_factory=OOMRecovery)  # halves the rows per forward on out-of-memory
    divergence: DivergenceWatch = field(default_factory=DivergenceWatch)  # the first non-finite step, on device
    world: World = SINGLE  # this process's place in the job (train/distributed.py)
    parallel: Any = None  # DDP's wrapper, or the FSDP-sharded model; None in one process
    eager: Optional[Callable] = None  # ``forward`` before compile wrapped it (None: forward is not compiled)
    cuda_graphs: bool = False  # the compiled forward replays CUDA graphs (compile.py; gradients_in_buffers below)
    mask_preparer: Optional[prepared_mask.MaskPreparer] = None  # eager forwards' attention masks (prepared_mask.py)
    compile_scope: str = "model"  # what ``forward`` compiled: the whole model, or its layers (regional_compile.py)

    def decision(self, name: str) -> Decision:
        return named(self.decisions, name)

    def forward_for(self, rows: int) -> Callable:
        """What a micro-batch of ``rows`` rows (a packed batch: samples) runs. Dynamo specializes a dimension of size
        1, so a one-row batch (an epoch's remainder, or out-of-memory recovery's smallest chunk) would compile a
        second graph, a full compile for one batch: it runs eager instead. So does a packed batch of one sample (an
        epoch's last, or a row that fills the token budget alone): a packed batch is always one row, but its labels
        and pooled outputs have a dimension per sample.

        Under CUDA graphs every other row count but the full chunk's (an epoch's partial last batch, the last,
        shorter chunk of out-of-memory recovery) runs eager too: cudagraph trees record a graph per distinct
        (rows, width), so the partial batch would add a recording each epoch at whatever width it lands on, beyond
        the pad widths the run was given, each kept in the tree for the rest of the run. One eager batch an epoch
        costs little beside that."""
        if self.eager is None:
            return self.forward
        if rows == 1 or (self.cuda_graphs and rows != self.oom.rows_per_forward(self.micro_batch)):
            return self.eager
        return self.forward

    def compiled(self, forward: Callable) -> bool:
        """Whether ``forward`` (what ``forward_for`` chose) is the compiled module."""
        return self.eager is not None and forward is not self.eager

    def model_inputs(self, batch: dict, compiled: bool = False) -> dict:
        """``batch``'s model inputs on the device. An eager forward's come with the attention mask prepared from the
        batch's host copy where prepared_mask is on, so transformers does not read it on the host (a sync per
        forward); a compiled model's keep the 2D mask its graph was traced with, unless unmasked_causal hands some
        layers none (the same layout every batch: MaskPreparer.serves_compiled). Compiled layers (compile_scope
        layers) run inside an eager model, which builds their mask as an eager one does: theirs are prepared too."""
        device = self.device.torch_device
        inputs = {k: batch[k].to(device, non_blocking=True) for k in data_mod.MODEL_INPUTS if k in batch}
        if self.mask_preparer is None or (compiled and self.compile_scope == "model"
                                          and not self.mask_preparer.serves_compiled):
            return inputs
        with self.precision.autocast():  # an eager mask's dtype is the embeddings' under the forward's autocast
            return self.mask_preparer(inputs, prepared_mask.padded(batch))

    @property
    def gradients_in_buffers(self) -> bool:
        """Whether each .grad keeps a buffer of its own between steps, zeroed in place: under CUDA graphs, where a
        step makes several backward passes (accumulation, or out-of-memory recovery's chunks). Left where a backward
        graph wrote them, the first pass's gradients would be overwritten by the next pass's replay before the
        optimizer reads them (compile.py). With one backward a step they are taken as the graph wrote them, which
        spares an add kernel per parameter, launched by the host outside the graphs: BERT-base has 201, and an H200
        step at batch 64 made 272 launch calls (2026-11-28, run 7; the next GPU report's host split names their
        sources). A step that makes several passes anyway gets its buffers first (``ensure_gradient_buffers``)."""
        return self.cuda_graphs and (self.accum_steps > 1 or self.oom.halvings > 0)

    def zero_grad(self) -> None:
        """Clear the gradients: set to None (frees their memory, skips a memset), or zero their buffers in place
        (``gradients_in_buffers``)."""
        if self.gradients_in_buffers:
            self.optimizer.zero_grad(set_to_none=False)
            self.ensure_gradient_buffers()  # after: a buffer it allocates is zero already
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def ensure_gradient_buffers(self) -> None:
        """A zeroed buffer for every trainable parameter's .grad that has none (before a step of several backward
        passes under CUDA graphs: see ``gradients_in_buffers``)."""
        for p in self.model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    def gradient_sync(self, last: bool) -> ContextManager:
        """Data parallel: gradients cross the network on the optimizer step's last backward only."""
        return data_parallel.gradient_sync(self.parallel, last)

    @property
    def packed(self) -> bool:
        return self.decision("padding").effective == "packed"

    @property
    def steps_per_epoch(self) -> int:
        return planned_steps(self.sampler.batches_in_epoch, self.accum_steps, self.cfg.train)[0]

    @property
    def total_steps(self) -> int:
        return planned_steps(self.sampler.batches_in_epoch, self.accum_steps, self.cfg.train)[1]


def planned_steps(micro_batches: int | Callable[[int], int], accum_steps: int, tr: Any) -> tuple[int, int]:
    """(optimizer steps in the first epoch, total optimizer steps); max_steps > 0 caps the total.
    ``micro_batches``: per epoch, or a function of the epoch (a token budget packs a different count each epoch)."""
    count = micro_batches if callable(micro_batches) else (lambda _epoch: micro_batches)
    total = 0
    for epoch in range(tr.epochs):
        total += math.ceil(count(epoch) / accum_steps)
        if 0 < tr.max_steps <= total:
            return math.ceil(count(0) / accum_steps), tr.max_steps
    return math.ceil(count(0) / accum_steps), total


def resolve_micro_batch(cfg: Config) -> int:
    """The per-device micro-batch. ``auto`` is the batch finder's job: batch_finder.resolve() runs it (it needs a
    model to probe) and passes the result to build(micro_batch=...)."""
    batch = cfg.batch_size
    if batch == "auto":
        raise ConfigError("batch_size=auto is resolved by maxout.train.batch_finder.resolve(); pass its micro-batch to "
                          "build(micro_batch=...), or set train.batch_size to a positive integer")
    return int(batch)


def plan_decisions(cfg: Config, device: DeviceInfo, model_class: type, world: World = SINGLE) -> list[Decision]:
    """Every decision that needs nothing built, from the config, the device, the model's class and the job's
    processes alone. build() applies these and never decides them again, and ``maxout audit`` asks this what a
    config would get on a device without building anything: the reasons it lists are the very strings a run logs
    as ``opt.<name>.reason``."""
    hw, tr, dc = cfg.hardware, cfg.train, cfg.data
    d_det = decide("deterministic", tr.deterministic, deterministic.supported(device))
    d_prec = precision_opt.resolve(hw.precision, device)
    d_tf32 = decide("tf32", hw.tf32, tf32.supported(device))
    d_cudnn = decide("cudnn_benchmark", hw.cudnn_benchmark, cudnn_benchmark.supported(device, d_det.effective))
    d_attn = attention.resolve(hw.attn_implementation, model_class, device, d_prec.effective)
    d_ckpt = decide("gradient_checkpointing", hw.gradient_checkpointing, gradient_checkpointing.supported(model_class))
    _, d_loader = dataloader.resolve(hw, device, world.local_size)
    d_pad = packing.resolve(dc.padding, model_class.config_class.model_type, d_attn.effective)
    d_packing = packing.resolve_attention(dc.packing_attention, d_pad.effective, d_attn.effective, model_class, device,
                                          d_prec.effective)
    # Packing that fell back pads dynamically, with length bucketing whatever data.bucketing says.
    d_bucket = (Decision("bucketing", dc.bucketing, True, "padding fell back from packed") if d_pad.changed
                else decide("bucketing", dc.bucketing, bucketing.supported(d_pad.effective)))
    d_fused = decide("fused_adamw", hw.fused_adamw, fused_adamw.supported(device))
    d_clip = decide("grad_clipping", tr.max_grad_norm, grad_clipping.supported(tr.max_grad_norm), off=0.0)
    d_compile = decide("compile", hw.compile, compile_opt.supported(device))
    d_parallel = data_parallel.resolve(cfg.distributed.strategy, world.size, world.initialized, d_prec.effective)
    d_widths = pad_widths.resolve(hw.pad_widths, device, d_compile.effective, hw.compile_mode, d_pad.effective,
                                  d_parallel.effective)
    d_mode = (compile_opt.resolve_mode(hw.compile_mode, device, d_pad.effective, d_widths.effective,
                                       d_parallel.effective)
              if d_compile.effective else Decision("compile_mode", hw.compile_mode, "none", "compile is off"))
    d_scope = decide("compile_scope", hw.compile_scope,
                     regional_compile.supported(d_compile.effective, d_parallel.effective), off="model")
    d_dropout = decide("fast_dropout", hw.fast_dropout,
                       fast_dropout.supported(device, d_compile.effective, d_ckpt.effective))
    d_liger = decide("liger_kernel", hw.liger_kernel,
                     liger_kernel.supported(device, model_class.config_class.model_type))
    d_tuning = decide("inductor_tuning", hw.inductor_tuning, inductor_tuning.supported(device, d_compile.effective))
    d_mix_order = decide("mix_order_reduction", hw.mix_order_reduction,
                         mix_order_reduction.supported(device, d_compile.effective))
    d_mask = decide("prepared_mask", hw.prepared_mask, prepared_mask.supported(
        model_class.config_class.model_type, d_attn.effective, d_pad.effective, cfg.model.pooling))
    d_unmasked = decide("unmasked_causal", hw.unmasked_causal, unmasked_causal.supported(
        model_class.config_class.model_type, d_attn.effective, d_pad.effective, d_mask.effective))
    d_skip = decide("skip_guards", hw.skip_guards, skip_guards.supported(
        d_compile.effective, d_pad.effective == "packed", d_parallel.effective))
    return [d_prec, d_tf32, d_cudnn, d_det, d_attn, d_ckpt, *d_loader, d_bucket, d_pad, d_packing, d_widths, d_fused,
            d_clip, d_compile, d_mode, d_scope, d_dropout, d_liger, d_tuning, d_mix_order, d_mask, d_unmasked,
            d_skip, d_parallel]


def apply_backend(cfg: Config, planned: list[Decision]) -> None:
    """Process-wide switches, applied before the model exists (seed first: the head's init depends on it)."""
    deterministic.seed_everything(cfg.train.seed)
    deterministic.apply(named(planned, "deterministic").effective)
    tf32.apply(named(planned, "tf32").effective)
    cudnn_benchmark.apply(named(planned, "cudnn_benchmark").effective)
    inductor_tuning.apply(named(planned, "inductor_tuning").effective)
    mix_order = named(planned, "mix_order_reduction")  # one that fell back leaves inductor at its default
    mix_order_reduction.apply(None if mix_order.changed else mix_order.effective)


def build_model(cfg: Config, device: DeviceInfo, model_config: Any, planned: list[Decision]
                ) -> tuple[torch.nn.Module, list[Decision]]:
    mc = cfg.model
    # Packed rows through torch's varlen kernel: maxout's attention function, registered with transformers (padded
    # batches, evaluation's, go through it to SDPA: the attention decision's implementation)
    varlen_packing = named(planned, "packing").effective == "varlen"
    model = modeling.load_model(mc, model_config, varlen.apply() if varlen_packing else named(planned,
                                                                                              "attention").effective)

    d_adapter = decide("adapter", mc.adapter, lora.supported(mc.adapter), off="none")
    d_freeze = decide("freeze_encoder", mc.freeze_encoder, freeze.supported(model, d_adapter.effective))
    if d_freeze.effective:
        freeze.apply(model)
    if named(planned, "gradient_checkpointing").effective:  # before peft wraps it: it lives on the transformers module
        gradient_checkpointing.apply(model)
    if named(planned, "liger_kernel").effective:  # before peft wraps it: liger finds the layers on the model itself
        liger_kernel.apply(model)
    # decided on the built model, not planned: only the model says whether it has a torch.nn.LayerNorm
    d_lp_norm = decide("low_precision_layernorm", cfg.hardware.low_precision_layernorm,
                       low_precision_layernorm.supported(device, named(planned, "precision").effective, model))
    if d_lp_norm.effective:
        low_precision_layernorm.apply(model)
    if d_adapter.effective != "none":
        targets = lora.target_modules(model, mc.lora_target_modules)
        model = lora.apply(model, d_adapter.effective, mc.lora_r, mc.lora_alpha, mc.lora_dropout, targets)
    return model.to(device.torch_device), [d_freeze, d_adapter, d_lp_norm]


def build_classifier(cfg: Config, model: torch.nn.Module, packed: bool) -> torch.nn.Module:
    """``model`` itself, or with per-sample pooling (serving/pooling.py) when ``model.pooling`` is set or batches are
    packed (a model's own head pools per row, and a packed row holds many samples)."""
    inner = lora.transformers_model(model)  # peft's adapters live inside its layers
    kind = cfg.model.pooling or (pooling.native_pooling(inner) if packed else None)
    return pooling.PooledClassifier(inner, kind) if kind else model


def pad_multiple(cfg: Config, device: DeviceInfo) -> Optional[int]:
    dc = cfg.data
    return (8 if device.is_cuda else None) if dc.pad_to_multiple_of == "auto" else dc.pad_to_multiple_of


def build_collator(cfg: Config, device: DeviceInfo, tokenizer: Any, widths: Optional[list] = None
                   ) -> data_mod.Collator:
    """``widths``: the only widths dynamic padding may take (pad_widths.ladder), None for any."""
    dc = cfg.data
    return data_mod.Collator(tokenizer.pad_token_id, dc.max_length if dc.padding == "max_length" else None,
                             pad_multiple(cfg, device), widths)


Encode = Callable[[Any, data_mod.Table, int], data_mod.Encoded]  # data.encode, or a warm start's cache of it


def build_loaders(cfg: Config, device: DeviceInfo, dataset: data_mod.Dataset, tokenizer: Any, micro_batch: int,
                  model_config: Any, planned: list[Decision], encode: Encode = data_mod.encode,
                  world: World = SINGLE) -> tuple[Any, Any, bucketing.EpochBatchSampler]:
    dc = cfg.data
    train_enc = encode(tokenizer, dataset.train, dc.max_length)
    eval_enc = encode(tokenizer, dataset.validation, dc.max_length)
    count = named(planned, "pad_widths").effective
    widths = pad_widths.ladder(train_enc.lengths, count, pad_multiple(cfg, device)) if count else None
    collate = build_collator(cfg, device, tokenizer, widths)
    settings = loader_settings(planned)
    if named(planned, "padding").effective == "packed":  # this rank's share of the epoch's token-budget batches
        budget = packing.token_budget(dc.max_tokens_per_batch, micro_batch, train_enc.lengths)
        start = packing.position_start(model_config.model_type, model_config.pad_token_id)
        if named(planned, "packing").effective == "bins":  # the budget's worth of bins of data.max_length tokens
            width = collate.width(dc.max_length)  # a batch's padded width at the longest row allowed
            sampler, packed_collate = bin_packing.apply(train_enc.lengths, budget, width, cfg.train.seed,
                                                        tokenizer.pad_token_id or 0, start, world.rank, world.size)
        else:
            sampler, packed_collate = packing.apply(train_enc.lengths, budget, cfg.train.seed, start, world.rank,
                                                    world.size, longest=dc.max_length)
        train_loader = dataloader.apply(train_enc, sampler, packed_collate, settings)
    else:  # this rank's share of each global batch
        sampler = bucketing.apply(train_enc.lengths, micro_batch, cfg.train.seed,
                                  named(planned, "bucketing").effective, dc.bucket_batches, world.rank, world.size)
        train_loader = dataloader.apply(train_enc, sampler, collate, settings)
    eval_loader = _eval_loader(eval_enc, micro_batch, collate, settings, world)
    return train_loader, eval_loader, sampler


def loader_settings(planned: list[Decision]) -> dataloader.LoaderSettings:
    return dataloader.LoaderSettings(*(named(planned, n).effective for n in (
        "num_workers", "pin_memory", "persistent_workers", "prefetch_factor")))


def _eval_loader(enc: data_mod.Encoded, micro_batch: int, collate: Any, settings: Any, world: World) -> Any:
    # Evaluation: no gradients, so twice the batch fits; rows in length order pad least (order is irrelevant).
    # Each rank evaluates its share (evaluate.py sums the counts over the ranks).
    batches = bucketing.eval_batches(enc.lengths, 2 * micro_batch, world.rank, world.size)
    return dataloader.apply(enc, batches, collate, settings)


def split_loader(s: Setup, table: data_mod.Table, encode: Encode = data_mod.encode) -> Any:
    """An evaluation loader for another split (the test set), built like the validation loader."""
    return _eval_loader(encode(s.tokenizer, table, s.cfg.data.max_length), s.micro_batch,
                        build_collator(s.cfg, s.device, s.tokenizer), loader_settings(s.decisions), s.world)


def build_optimizer(cfg: Config, model: torch.nn.Module, total_steps: int, planned: list[Decision]
                    ) -> tuple[torch.optim.Optimizer, Any]:
    tr = cfg.train
    optimizer = fused_adamw.apply(model, tr.lr, tr.weight_decay, named(planned, "fused_adamw").effective)
    warmup = int(tr.warmup_ratio * total_steps)
    name = {"constant": "constant_with_warmup"}.get(tr.schedule, tr.schedule)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)
    return optimizer, scheduler


def build_parallel(cfg: Config, device: DeviceInfo, model: torch.nn.Module, world: World,
                   planned: list[Decision]) -> Optional[torch.nn.Module]:
    """DDP or FSDP across the job's processes; before the optimizer, whose parameters FSDP replaces with shards."""
    dc = cfg.distributed
    return data_parallel.apply(model, named(planned, "data_parallel").effective, device.torch_device,
                               world.local_rank, dc.find_unused_parameters, dc.fsdp_reshard_after_forward)


def build_compile(cfg: Config, model: torch.nn.Module, planned: list[Decision]) -> tuple[Callable, Decision]:
    """What the loop calls, and the compile_scope decision, checked on the built model (its repeated blocks)."""
    d_scope = named(planned, "compile_scope")
    if d_scope.effective == "layers":
        d_scope = decide("compile_scope", d_scope.requested, regional_compile.supported(True, "none", model),
                         off="model")
    if not named(planned, "compile").effective:
        return model, d_scope
    # Dynamic padding changes the sequence length every batch: mark shapes dynamic up front (one compile).
    static = cfg.data.padding == "max_length"
    mode = named(planned, "compile_mode").effective
    compiled = compile_opt.apply(model, mode, dynamic=None if static else True, scope=d_scope.effective)
    return (compile_opt.with_step_marks(compiled) if compile_opt.records_graphs(mode) else compiled), d_scope


def _mask_preparer(model: torch.nn.Module, classifier: torch.nn.Module, decisions: list[Decision],
                   layers_compiled: bool) -> Optional[prepared_mask.MaskPreparer]:
    """What hands the forwards their attention masks (prepared_mask.py, unmasked_causal.py), None where transformers
    builds them."""
    if not named(decisions, "prepared_mask").effective:
        return None
    preparer = prepared_mask.apply(model, pooled=isinstance(classifier, pooling.PooledClassifier),
                                   always=layers_compiled)
    return unmasked_causal.apply(preparer) if named(decisions, "unmasked_causal").effective else preparer


def build(cfg: Config, device: DeviceInfo, dataset: data_mod.Dataset, tokenizer: Any,
          micro_batch: Optional[int] = None, encode: Encode = data_mod.encode, world: World = SINGLE) -> Setup:
    micro_batch = micro_batch or resolve_micro_batch(cfg)
    model_config = modeling.build_config(cfg.model, dataset.label_names, len(tokenizer), tokenizer.pad_token_id)
    decisions = plan_decisions(cfg, device, modeling.model_class(model_config), world)
    apply_backend(cfg, decisions)
    started = time.perf_counter()
    model, d_model = build_model(cfg, device, model_config, decisions)
    loaded = time.perf_counter()
    if world.size > 1:  # same initial weights on every rank (seeded alike above), then each rank its own dropout
        deterministic.seed_everything(cfg.train.seed + world.rank)
    train_loader, eval_loader, sampler = build_loaders(cfg, device, dataset, tokenizer, micro_batch, model_config,
                                                       decisions, encode, world)
    timings = {"time/model_load_s": loaded - started, "time/tokenize_s": time.perf_counter() - loaded}
    classifier = build_classifier(cfg, model, named(decisions, "padding").effective == "packed")
    accum_steps, d_accum = accumulation.plan(cfg.train.target_effective_batch, micro_batch, world.size)
    _, total = planned_steps(sampler.batches_in_epoch, accum_steps, cfg.train)
    # Data parallelism wraps what the loop calls (with per-sample pooling, the head too): DDP all-reduces all its
    # gradients, and FSDP's root (sharded in place) gathers whatever the pooled head calls outside the blocks.
    flop_probe = m.probe(model, model_config)
    parallel = build_parallel(cfg, device, classifier, world, decisions)
    keep_until_exit(parallel)  # a rank's process group is never torn down by a destructor (distributed.py)
    optimizer, scheduler = build_optimizer(cfg, model, total, decisions)
    eager = parallel or classifier
    forward, d_scope = build_compile(cfg, eager, decisions)
    decisions = [d_scope if d.name == "compile_scope" else d for d in decisions]
    compiled = forward is not eager
    if named(decisions, "skip_guards").effective:  # guards for unseen inputs only (skip_guards.py; needs compile)
        forward = skip_guards.apply(forward, eager)
    if named(decisions, "fast_dropout").effective:
        forward = fast_dropout.apply(forward)
    decisions += d_model + [d_accum]
    prec = named(decisions, "precision").effective
    setup = Setup(cfg=cfg, device=device, dataset=dataset, tokenizer=tokenizer, model_config=model_config,
                  model=model, forward=forward, classifier=classifier, optimizer=optimizer, scheduler=scheduler,
                  precision=precision_opt.apply(prec, device.torch_device), train_loader=train_loader,
                  eval_loader=eval_loader, sampler=sampler, micro_batch=micro_batch, accum_steps=accum_steps,
                  clip_norm=cfg.train.max_grad_norm if named(decisions, "grad_clipping").effective else 0.0,
                  decisions=decisions, timings=timings, flop_probe=flop_probe, world=world, parallel=parallel,
                  eager=eager if compiled else None,
                  cuda_graphs=compiled and compile_opt.records_graphs(named(decisions, "compile_mode").effective),
                  compile_scope=d_scope.effective,
                  mask_preparer=_mask_preparer(model, classifier, decisions,
                                               layers_compiled=compiled and d_scope.effective == "layers"),
                  # one rank re-running a step alone would leave the others waiting at its all-reduce
                  oom=OOMRecovery(enabled=world.size == 1))
    setup.zero_grad()  # buffers from the start where gradients keep them (Setup.gradients_in_buffers)
    counts = modeling.count_parameters(model)
    setup.derived = {
        "micro_batch": micro_batch, "accumulation_steps": accum_steps,
        "effective_batch": micro_batch * accum_steps * world.size,
        "steps_per_epoch": setup.steps_per_epoch, "total_steps": setup.total_steps,
        "warmup_steps": int(cfg.train.warmup_ratio * setup.total_steps),
        "train_samples": len(dataset.train), "validation_samples": len(dataset.validation),
        **({"test_samples": len(dataset.test)} if dataset.test is not None else {}),
        "num_labels": dataset.num_labels, "labels": ",".join(dataset.label_names),
        "data_fingerprint": dataset.fingerprint, "params_total": counts["total"],
        "params_trainable": counts["trainable"], "host_sync_every_steps": cfg.train.log_every,
        "zero_grad_set_to_none": not setup.gradients_in_buffers,
        **{f"rows_dropped_{split}": n for split, n in dataset.dropped.items()},  # data.on_missing=drop
    }
    commit = modeling.base_commit(cfg.model)  # resolved in the checks before the run: no download here
    if commit:
        setup.derived["model_commit"] = commit
    if isinstance(classifier, pooling.PooledClassifier):
        setup.derived["pooling"] = classifier.pooling
    if setup.packed:
        setup.derived["max_tokens_per_batch"] = sampler.max_tokens
    widths = getattr(train_loader.collate_fn, "widths", None)
    if widths:
        setup.derived["pad_widths"] = " ".join(map(str, widths))
    if named(decisions, "adapter").effective != "none":
        setup.derived["lora_target_modules"] = lora.describe(lora.applied_targets(model))
    return setup

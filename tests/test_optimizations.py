"""One smoke test per optimization, driven by a settings table: each case trains the tiny model for a few steps
on CPU through ``train()``, then asserts the optimization's *effect* on the built objects and the params it logged
(requested, effective and, where they differ, the reason).

Expectations that depend on the machine (does this CPU have native bf16?) are computed from the detected device,
never hard-coded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch

from maxout import loading
from maxout.optimizations import NAMES, grad_clipping, inductor_tuning, low_precision_layernorm, mix_order_reduction
from maxout.optimizations import skip_guards, tf32
from maxout.tracking.tracker import NullTracker
from maxout.train import train

from .conftest import TINY, fake_cuda


def cpu_bf16(device) -> str:
    return "bf16" if device.bf16 else "fp32"


def logits_dtype(result) -> torch.dtype:
    s = result.setup
    batch = next(iter(s.eval_loader))
    with torch.no_grad(), s.precision.autocast():
        return s.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.dtype


@dataclass
class Case:
    overrides: list
    params: dict  # param key -> expected value, or a function of the device
    effect: Callable[[Any, Any], bool]  # (result, device) -> the optimization really took effect
    reasons: dict = field(default_factory=dict)  # param key -> substring of the logged reason


SETTINGS: dict[str, Case] = {
    "precision_bf16": Case(["hardware.precision=bf16"], {"opt.precision.effective": cpu_bf16},
                           lambda r, d: logits_dtype(r) == (torch.bfloat16 if d.bf16 else torch.float32)),
    "precision_fp16_falls_back_on_cpu": Case(
        ["hardware.precision=fp16"], {"opt.precision.requested": "fp16", "opt.precision.effective": cpu_bf16},
        lambda r, d: not r.setup.precision.scaler.is_enabled(), {"opt.precision.reason": "no CUDA device"}),
    "precision_fp32": Case(["hardware.precision=fp32"], {"opt.precision.effective": "fp32"},
                           lambda r, d: logits_dtype(r) == torch.float32),
    "tf32_off_without_cuda": Case(["hardware.tf32=true"], {"opt.tf32.requested": "true", "opt.tf32.effective": "false"},
                                  lambda r, d: not tf32.enabled(), {"opt.tf32.reason": "no CUDA device"}),
    "cudnn_benchmark_off_without_cuda": Case(
        ["hardware.cudnn_benchmark=true"], {"opt.cudnn_benchmark.effective": "false"},
        lambda r, d: not torch.backends.cudnn.benchmark, {"opt.cudnn_benchmark.reason": "no CUDA device"}),
    "deterministic": Case(["train.deterministic=true"], {"opt.deterministic.effective": "true"},
                          lambda r, d: torch.are_deterministic_algorithms_enabled()),
    "fused_adamw": Case(["hardware.fused_adamw=true"], {"opt.fused_adamw.effective": "true"},
                        lambda r, d: r.setup.optimizer.defaults["fused"] is True),
    "foreach_adamw": Case(["hardware.fused_adamw=false"], {"opt.fused_adamw.effective": "false"},
                          lambda r, d: r.setup.optimizer.defaults["foreach"] is True),
    "compile": Case(["hardware.compile=true"], {"opt.compile.effective": "true", "opt.compile_mode.effective": "default",
                                                "opt.skip_guards.effective": "true"},
                    lambda r, d: isinstance(r.setup.forward, skip_guards.GuardSkippingForward)
                    and isinstance(r.setup.forward.__wrapped__, torch._dynamo.eval_frame.OptimizedModule)
                    and r.metrics["time/compile_s"] > 0 and r.metrics["compile/forwards_guarded"] >= 1),
    "skip_guards_off_without_compile": Case(  # on in every profile; the tiny run here does not compile
        [], {"opt.skip_guards.requested": "true", "opt.skip_guards.effective": "false"},
        lambda r, d: not isinstance(r.setup.forward, skip_guards.GuardSkippingForward),
        {"opt.skip_guards.reason": "compile is off"}),
    "compile_mode_cudagraphs_fall_back_on_cpu": Case(
        ["hardware.compile=true", "hardware.compile_mode=reduce-overhead"],
        {"opt.compile_mode.requested": "reduce-overhead", "opt.compile_mode.effective": "default"},
        lambda r, d: isinstance(r.setup.forward.__wrapped__, torch._dynamo.eval_frame.OptimizedModule),
        {"opt.compile_mode.reason": "CUDA graphs need a CUDA device"}),
    "gradient_checkpointing": Case(["hardware.gradient_checkpointing=true"],
                                   {"opt.gradient_checkpointing.effective": "true"},
                                   lambda r, d: r.setup.model.is_gradient_checkpointing),
    "attention_eager": Case(["hardware.attn_implementation=eager"], {"opt.attention.effective": "eager"},
                            lambda r, d: r.setup.model.config._attn_implementation == "eager"),
    "attention_sdpa": Case(["hardware.attn_implementation=sdpa"], {"opt.attention.effective": "sdpa"},
                           lambda r, d: r.setup.model.config._attn_implementation == "sdpa"),
    "attention_flash_falls_back": Case(
        ["hardware.attn_implementation=flash_attention_2"],
        {"opt.attention.requested": "flash_attention_2", "opt.attention.effective": "sdpa"},
        lambda r, d: r.setup.model.config._attn_implementation == "sdpa", {"opt.attention.reason": "no CUDA device"}),
    "accumulation_from_target": Case(
        ["train.batch_size=16", "train.target_effective_batch=40"],
        {"opt.accumulation.requested": "40", "opt.accumulation.effective": "48", "derived.accumulation_steps": "3"},
        lambda r, d: r.setup.accum_steps == 3 and r.metrics["train/samples"] == 3 * 48,
        {"opt.accumulation.reason": "not a multiple of the micro-batch 16"}),
    "grad_clipping": Case(["train.max_grad_norm=0.5"], {"opt.grad_clipping.effective": "0.5"},
                          lambda r, d: r.setup.clip_norm == 0.5),
    "grad_clipping_off": Case(["train.max_grad_norm=0"], {"opt.grad_clipping.effective": "0.0"},
                              lambda r, d: r.setup.clip_norm == 0),
    "dataloader_workers": Case(
        ["hardware.num_workers=1", "hardware.persistent_workers=true", "hardware.prefetch_factor=4"],
        {"opt.num_workers.effective": "1", "opt.persistent_workers.effective": "true",
         "opt.prefetch_factor.effective": "4"},
        lambda r, d: (r.setup.train_loader.num_workers, r.setup.train_loader.persistent_workers,
                      r.setup.train_loader.prefetch_factor) == (1, True, 4)),
    "dataloader_auto_workers": Case(
        ["hardware.num_workers=auto"], {"opt.num_workers.requested": "auto",
                                        "opt.num_workers.effective": lambda d: str(max(0, d.cpu_count - 2))},
        lambda r, d: r.setup.train_loader.num_workers == max(0, d.cpu_count - 2),
        {"opt.num_workers.reason": "cores - 2"}),
    "pin_memory_off_without_cuda": Case(["hardware.pin_memory=true"], {"opt.pin_memory.effective": "false"},
                                        lambda r, d: r.setup.train_loader.pin_memory is False,
                                        {"opt.pin_memory.reason": "no CUDA device"}),
    "bucketing": Case(["data.bucketing=true"], {"opt.bucketing.effective": "true"},
                      lambda r, d: r.setup.sampler.bucketing and r.metrics["perf/padding_efficiency"] > 0.75),
    "no_bucketing": Case(["data.bucketing=false"], {"opt.bucketing.effective": "false"},
                         lambda r, d: not r.setup.sampler.bucketing and r.metrics["perf/padding_efficiency"] < 0.7),
    "padding_max_length": Case(["data.padding=max_length", "data.max_length=128"],
                               {"opt.padding.effective": "max_length", "opt.bucketing.effective": "false"},
                               lambda r, d: next(iter(r.setup.train_loader))["input_ids"].shape[1] == 128,
                               {"opt.bucketing.reason": "pads every row to the same length"}),
    "pad_widths": Case(["hardware.pad_widths=3"], {"opt.pad_widths.effective": "3"},
                       lambda r, d: len({b["input_ids"].shape[1] for b in r.setup.train_loader}) <= 3),
    "pad_widths_auto_off_without_cuda_graphs": Case(
        ["hardware.pad_widths=auto"], {"opt.pad_widths.requested": "auto", "opt.pad_widths.effective": "none"},
        lambda r, d: r.setup.train_loader.collate_fn.widths is None, {"opt.pad_widths.reason": "only CUDA graphs"}),
    "liger_kernel_off_without_cuda": Case(
        ["hardware.liger_kernel=true"], {"opt.liger_kernel.requested": "true", "opt.liger_kernel.effective": "false"},
        lambda r, d: not any(type(m).__name__.startswith("Liger") or "Liger" in m._get_name()
                             for m in r.setup.model.modules()), {"opt.liger_kernel.reason": "no CUDA device"}),
    # on a CPU too (CPU autocast leaves LayerNorm, and BERT's fp32 residual stream, in fp32), where it autocasts
    "low_precision_layernorm": Case(
        ["hardware.low_precision_layernorm=true", "hardware.precision=bf16"],
        {"opt.low_precision_layernorm.effective": lambda d: str(d.bf16).lower()},
        lambda r, d: any(isinstance(m, low_precision_layernorm.LowPrecisionLayerNorm)
                         for m in r.setup.model.modules()) is d.bf16),
    "low_precision_layernorm_off_in_fp32": Case(
        ["hardware.low_precision_layernorm=true", "hardware.precision=fp32"],
        {"opt.low_precision_layernorm.requested": "true", "opt.low_precision_layernorm.effective": "false"},
        lambda r, d: not any(isinstance(m, low_precision_layernorm.LowPrecisionLayerNorm)
                             for m in r.setup.model.modules()),
        {"opt.low_precision_layernorm.reason": "precision fp32: no autocast"}),
    "prepared_mask": Case(
        ["hardware.attn_implementation=sdpa", "hardware.prepared_mask=true"], {"opt.prepared_mask.effective": "true"},
        lambda r, d: r.setup.mask_preparer is not None and "attention_mask" not in r.setup.model_inputs(
            {**next(iter(r.setup.train_loader)), "num_real_tokens": 1, "num_tokens": 1})),
    "prepared_mask_pooled_decoder": Case(  # the group pools each row's last token: the masks go to the backbone
        ["model=tiny_qwen3", "hardware.attn_implementation=sdpa"], {"opt.prepared_mask.effective": "true"},
        lambda r, d: list(r.setup.mask_preparer.builders) == ["full_attention"] and isinstance(r.setup.model_inputs(
            {**next(iter(r.setup.train_loader)), "num_real_tokens": 1, "num_tokens": 2})["backbone_mask"], dict)),
    "unmasked_causal": Case(  # a right-padded Qwen batch: its full-attention layers handed no mask (causal SDPA)
        ["model=tiny_qwen3", "hardware.attn_implementation=sdpa", "hardware.unmasked_causal=true"],
        {"opt.unmasked_causal.effective": "true"},
        lambda r, d: r.setup.model_inputs(next(iter(r.setup.train_loader)))["backbone_mask"] == {
            "full_attention": None}),
    "prepared_mask_with_eager_attention": Case(  # the CPU profile's: transformers reads an encoder's eager mask too
        ["hardware.attn_implementation=eager", "hardware.prepared_mask=true"], {"opt.prepared_mask.effective": "true"},
        lambda r, d: r.setup.mask_preparer.norm is not None and "attention_mask" not in r.setup.model_inputs(
            {**next(iter(r.setup.train_loader)), "num_real_tokens": 1, "num_tokens": 1})),
    "prepared_mask_off_for_an_eager_decoder": Case(
        ["model=tiny_qwen3", "hardware.attn_implementation=eager", "hardware.prepared_mask=true"],
        {"opt.prepared_mask.requested": "true", "opt.prepared_mask.effective": "false"},
        lambda r, d: r.setup.mask_preparer is None and r.setup.model_inputs(next(iter(r.setup.train_loader)))[
            "attention_mask"].dim() == 2, {"opt.prepared_mask.reason": "causal mask without reading it on the host"}),
    "inductor_tuning_off_without_cuda": Case(
        ["hardware.inductor_tuning=true", "hardware.compile=true"], {"opt.inductor_tuning.effective": "false"},
        lambda r, d: not inductor_tuning.enabled(), {"opt.inductor_tuning.reason": "no CUDA device"}),
    "mix_order_reduction_off_without_compile": Case(  # on by default, as inductor has it; no compile here
        [], {"opt.mix_order_reduction.requested": "true", "opt.mix_order_reduction.effective": "false"},
        lambda r, d: mix_order_reduction.enabled() is mix_order_reduction.INDUCTOR_DEFAULT,  # as the run found it
        {"opt.mix_order_reduction.reason": "compile is off"}),
    "compile_scope_layers_off_without_compile": Case(  # the layers compile only where the model does
        ["hardware.compile_scope=layers"],
        {"opt.compile_scope.requested": "layers", "opt.compile_scope.effective": "model"},
        lambda r, d: r.setup.eager is None and r.setup.compile_scope == "model",
        {"opt.compile_scope.reason": "compile is off"}),
    "packing_mask_on_cpu": Case(
        ["data.padding=packed", "data.packing_attention=varlen"],
        {"opt.packing.requested": "varlen", "opt.packing.effective": "mask"},
        lambda r, d: r.setup.packed and r.setup.model.config._attn_implementation != "maxout_varlen",
        {"opt.packing.reason": "on CUDA only -> a block-diagonal mask over the packed row"}),
    "freeze_encoder": Case(["model.freeze_encoder=true"], {"opt.freeze_encoder.effective": "true"},
                           lambda r, d: {n for n, p in r.setup.model.named_parameters() if p.requires_grad}
                           == {"classifier.weight", "classifier.bias"}),
    "lora": Case(["model.adapter=lora", "model.lora_r=4"], {"opt.adapter.effective": "lora"},
                 lambda r, d: any("lora_A" in n for n, p in r.setup.model.named_parameters() if p.requires_grad)
                 and not any(p.requires_grad for n, p in r.setup.model.named_parameters() if "word_embeddings" in n)),
    "dora": Case(["model.adapter=dora", "model.lora_r=4"], {"opt.adapter.effective": "dora"},
                 lambda r, d: r.setup.model.peft_config["default"].use_dora is True),
    "fast_dropout": Case(["hardware.fast_dropout=true"], {"opt.fast_dropout.effective": "true"},
                         lambda r, d: r.setup.forward.__wrapped__ is r.setup.model),
    "fast_dropout_off_with_checkpointing": Case(
        ["hardware.fast_dropout=true", "hardware.gradient_checkpointing=true"],
        {"opt.fast_dropout.requested": "true", "opt.fast_dropout.effective": "false"},
        lambda r, d: r.setup.forward is r.setup.model, {"opt.fast_dropout.reason": "recomputes dropout"}),
    "data_parallel_off_in_one_process": Case(
        ["distributed.strategy=ddp"], {"opt.data_parallel.requested": "ddp", "opt.data_parallel.effective": "none",
                                       "dist.world_size": "1", "dist.backend": "none"},
        lambda r, d: r.setup.parallel is None and r.setup.world.size == 1, {"opt.data_parallel.reason": "one process"}),
    "freeze_with_adapter_is_redundant": Case(
        ["model.adapter=lora", "model.freeze_encoder=true"], {"opt.freeze_encoder.effective": "false"},
        lambda r, d: type(r.setup.model).__name__.startswith("Peft"), {"opt.freeze_encoder.reason": "already freezes"}),
}


def test_the_table_covers_every_optimization():
    covered = {k.split(".")[1] for case in SETTINGS.values() for k in case.params if k.startswith("opt.")}
    assert covered == set(NAMES)


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_optimization_support_apply_and_params(name, cpu_device):
    case = SETTINGS[name]
    cfg = loading.load([*TINY, *case.overrides], device=cpu_device)
    tracker = NullTracker()
    result = train(cfg, tracker=tracker, progress=False, device=cpu_device, verbose=False)
    for key, expected in case.params.items():
        want = expected(cpu_device) if callable(expected) else expected
        assert tracker.params.get(key) == want, (key, tracker.params.get(key))
    for key, fragment in case.reasons.items():
        assert fragment in tracker.params.get(key, ""), (key, tracker.params.get(key))
    for decision in result.setup.decisions:  # every decision is logged, with a reason whenever it changed
        assert tracker.params[f"opt.{decision.name}.effective"] is not None
        if decision.changed:
            assert tracker.params.get(f"opt.{decision.name}.reason"), decision
    assert case.effect(result, cpu_device)
    assert result.metrics["train/optimizer_steps"] == 3


@pytest.mark.parametrize("forced, native", [("1", True), ("0", False)])
def test_both_cpu_precisions_train_on_any_cpu(monkeypatch, forced, native):
    """The table above follows the CPU it runs on (CI runs it with MAXOUT_CPU_BF16=0): each side of the bf16
    decision still trains, whatever this CPU's instructions, with the override's reason logged."""
    from maxout import hardware

    monkeypatch.setenv(hardware.CPU_BF16_VAR, forced)
    device = hardware.detect()
    assert device.bf16 is native
    tracker = NullTracker()
    result = train(loading.load([*TINY, "hardware.precision=bf16"], device=device), tracker=tracker,
                   progress=False, device=device, verbose=False)
    assert tracker.params["opt.precision.effective"] == ("bf16" if native else "fp32")
    assert logits_dtype(result) == (torch.bfloat16 if native else torch.float32)
    assert f"forced by MAXOUT_CPU_BF16={forced}" in " ".join(device.notes)
    losses = [value for _, value in tracker.metrics.get("train/loss", [])]
    assert result.metrics["train/optimizer_steps"] == 3 and losses and all(map(math.isfinite, losses))


def test_support_checks_on_a_gpu_description():
    """The pure support checks, on a described (not present) pre-Ampere GPU: bf16 falls back to fp16."""
    from maxout.optimizations import attention, cudnn_benchmark, precision
    from transformers import BertForSequenceClassification

    turing = fake_cuda(name="Tesla T4", memory_gb=15, cc=(7, 5))
    d = precision.resolve("bf16", turing)
    assert (d.effective, "needs 8.0+" in d.reason, "GradScaler" in d.reason) == ("fp16", True, True)
    assert tf32.supported(turing)[0] is False and "needs 8.0+" in tf32.supported(turing)[1]
    assert cudnn_benchmark.supported(turing, deterministic=True) == (
        False, "train.deterministic=true: benchmark picks kernels non-deterministically")
    ampere = fake_cuda(flash=True)
    assert attention.resolve("flash_attention_2", BertForSequenceClassification, ampere, "bf16").effective == \
        "flash_attention_2"
    assert "fp16/bf16 only" in attention.resolve("flash_attention_2", BertForSequenceClassification, ampere,
                                                 "fp32").reason


def test_clipping_bounds_the_gradient_norm_without_a_host_sync():
    layer = torch.nn.Linear(8, 8)
    (layer(torch.randn(4, 8)) * 1e3).sum().backward()
    before = grad_clipping.apply(layer.parameters(), 1.0)
    after = torch.norm(torch.stack([p.grad.norm() for p in layer.parameters()]))
    assert isinstance(before, torch.Tensor) and before.item() > 1.0 and after.item() == pytest.approx(1.0, rel=1e-4)


def test_tf32_keeps_torchs_legacy_and_new_flags_in_agreement():
    """torch >= 2.9 raises from a legacy getter that disagrees with the new ``fp32_precision`` flags, and torch's own
    inductor reads the legacy ones (max-autotune's kernel selection calls torch.get_float32_matmul_precision()): after
    tf32.apply, whichever API anyone reads must answer, and answer the same. The flags are CPU-side state, so a
    CPU build checks what a GPU run meets. It starts where transformers' Trainer (tf32=True) leaves torch: the global
    ``torch.backends.fp32_precision`` alone set, which cuDNN's flags inherit."""
    new_api = hasattr(torch.backends, "fp32_precision")  # torch >= 2.9
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        if new_api:
            torch.backends.fp32_precision = "tf32"
        for on in (False, True, False, True):
            tf32.apply(on)
            assert tf32.enabled() is on
            assert torch.get_float32_matmul_precision() == ("high" if on else "highest")
            assert torch.backends.cuda.matmul.allow_tf32 is on and torch.backends.cudnn.allow_tf32 is on
            if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9
                assert (torch.backends.cuda.matmul.fp32_precision == "tf32") is on
                assert (torch.backends.cudnn.conv.fp32_precision == "tf32") is on
    finally:
        if new_api:
            torch.backends.fp32_precision = "none"
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]

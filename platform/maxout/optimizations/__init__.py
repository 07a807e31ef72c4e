"""Each speed-up is one module with ``supported(...) -> (ok, reason)`` and ``apply(...)``, usable without the trainer.

The trainer turns each one into a :class:`Decision` (requested value, effective value, reason when they differ);
decisions become MLflow params ``opt.<name>.requested`` / ``opt.<name>.effective`` / ``opt.<name>.reason``.

This package's ``__init__`` also holds the values the optimizations accept. It imports no torch, so the typed
config validates against these very tuples without paying for torch.

Ground floor. May import: errors, optimizations. (Not config, not hardware: a device is anything with the fields
the checks read, so each function works with a hand-made stand-in.)
"""

from .base import Decision, decide, named

# Every optimization the trainer decides on, in the order they are logged (the smoke test is driven by this).
NAMES = (
    "precision", "tf32", "cudnn_benchmark", "deterministic", "fused_adamw", "compile", "compile_mode", "compile_scope",
    "gradient_checkpointing", "attention", "accumulation", "grad_clipping", "num_workers", "pin_memory",
    "persistent_workers", "prefetch_factor", "bucketing", "padding", "packing", "pad_widths", "freeze_encoder",
    "adapter", "fast_dropout", "liger_kernel", "low_precision_layernorm", "prepared_mask", "unmasked_causal",
    "inductor_tuning", "mix_order_reduction", "skip_guards", "data_parallel",
)

PRECISIONS = ("bf16", "fp16", "fp32")  # precision.py: autocast dtype per name
ATTENTION = ("flash_attention_2", "sdpa", "eager")  # attention.py: fastest first, the fallback chain
PACKING_ATTENTION = ("auto", "varlen", "mask", "bins")  # packing.py: how packed rows are kept apart in attention
# (bins: bin_packing.py, rows of data.max_length holding several samples, a block-diagonal mask per row)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")  # the compile modes that record CUDA graphs
COMPILE_SCOPES = ("model", "layers")  # regional_compile.py: the whole model, or each repeated block (its layers)
ADAPTERS = ("none", "lora", "dora")  # lora.py (peft)
DATA_PARALLEL = ("auto", "ddp", "fsdp", "none")  # data_parallel.py: auto = ddp when there is more than one process
BACKENDS = ("auto", "nccl", "gloo")  # the process group's backend: auto = nccl on CUDA, gloo on CPU

__all__ = ["Decision", "decide", "named", "NAMES", "PRECISIONS", "ATTENTION", "PACKING_ATTENTION", "COMPILE_MODES",
           "CUDAGRAPH_MODES", "COMPILE_SCOPES", "ADAPTERS", "DATA_PARALLEL", "BACKENDS"]

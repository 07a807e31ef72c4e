"""Each speed-up is one module with ``supported(...) -> (ok, reason)`` and ``apply(...)``, usable without the trainer.

The trainer turns each one into a :class:`Decision` (requested value, effective value, reason when they differ);
decisions become MLflow params ``opt.<name>.requested`` / ``opt.<name>.effective`` / ``opt.<name>.reason``.
"""

from .base import Decision, decide

# Every optimization the trainer decides on, in the order they are logged (the smoke test is driven by this).
NAMES = (
    "precision", "tf32", "cudnn_benchmark", "deterministic", "fused_adamw", "compile", "compile_mode",
    "gradient_checkpointing", "attention", "accumulation", "grad_clipping", "num_workers", "pin_memory",
    "persistent_workers", "prefetch_factor", "bucketing", "padding", "freeze_encoder", "adapter", "fast_dropout",
)

__all__ = ["Decision", "decide", "NAMES"]

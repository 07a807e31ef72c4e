"""LoRA / DoRA adapters through peft: train low-rank updates (plus the head) instead of the whole encoder."""

from __future__ import annotations

import importlib.util
import inspect
from typing import Any

import torch


def supported(adapter: str) -> tuple[bool, str]:
    if adapter == "none":
        return True, ""
    if importlib.util.find_spec("peft") is None:
        return False, "the peft package is not installed (pip install peft)"
    if adapter == "dora":
        from peft import LoraConfig  # lazy: peft takes 3 s to import; only model.adapter=lora|dora needs it

        if "use_dora" not in inspect.signature(LoraConfig).parameters:
            return False, "this peft version has no DoRA (use_dora); upgrade peft"
    return True, ""


def apply(model: torch.nn.Module, adapter: str, r: int, alpha: int, dropout: float, target_modules: Any) -> Any:
    from peft import LoraConfig, TaskType, get_peft_model  # lazy: 3 s to import; only adapter runs need it

    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    config = LoraConfig(task_type=TaskType.SEQ_CLS, r=r, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=targets, use_dora=adapter == "dora")
    return get_peft_model(model, config)


def merged(model: Any) -> torch.nn.Module:
    """A plain transformers model with the adapter folded in, for saving and serving."""
    return model.merge_and_unload() if hasattr(model, "merge_and_unload") else model

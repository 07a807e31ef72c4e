"""LoRA / DoRA adapters through peft: train low-rank updates (plus the head) instead of the whole encoder.

Target modules are found from the model's own linear layers, whatever the architecture (BERT's query/key/value,
Gemma's and Qwen's q/k/v/o and gate/up/down projections, ModernBERT's Wqkv/Wo/Wi): ``all-linear`` is every
``nn.Linear`` but the classification head (which peft trains whole, as modules_to_save), ``attention`` only those
inside attention blocks; a list names modules as peft does. The resolved list is what the run logs.
"""

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


HEAD_NAMES = ("score", "classifier")  # sequence-classification heads (peft's SEQ_CLS_HEAD_NAMES): trained whole
SHORTHANDS = ("all-linear", "attention")


def target_modules(model: torch.nn.Module, spec: Any) -> list[str]:
    """The full names of the layers ``spec`` picks: ``all-linear``, ``attention`` or a list of names."""
    if not isinstance(spec, str):
        return list(spec)
    if spec not in SHORTHANDS:
        return [spec]
    found = []
    for name, module in model.named_modules():
        parts = name.split(".")
        if not isinstance(module, torch.nn.Linear) or parts[0] in HEAD_NAMES:
            continue
        if spec == "attention" and not any("attn" in p.lower() or "attention" in p.lower() for p in parts[:-1]):
            continue
        found.append(name)
    return found


def describe(targets: list[str]) -> str:
    """``q_proj,v_proj (4 layers)``: the distinct layer names (what a param can hold; the full list is long)."""
    return f"{','.join(sorted({t.rsplit('.', 1)[-1] for t in targets}))} ({len(targets)} layers)"


def apply(model: torch.nn.Module, adapter: str, r: int, alpha: int, dropout: float, target_modules: Any) -> Any:
    """``target_modules``: a list of module names (see target_modules())."""
    from peft import LoraConfig, TaskType, get_peft_model  # lazy: 3 s to import; only adapter runs need it

    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    config = LoraConfig(task_type=TaskType.SEQ_CLS, r=r, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=targets, use_dora=adapter == "dora")
    return get_peft_model(model, config)


def applied_targets(model: Any) -> list[str]:
    """The module names a peft model's adapter went into."""
    return sorted(model.peft_config["default"].target_modules)


def transformers_model(model: Any) -> torch.nn.Module:
    """The transformers model inside a peft model (its layers carry the adapters), or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def merged(model: Any) -> torch.nn.Module:
    """A plain transformers model with the adapter folded in, for saving and serving."""
    return model.merge_and_unload() if hasattr(model, "merge_and_unload") else model

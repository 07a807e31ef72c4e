"""The param naming scheme every run shares (README, "MLflow params"): ``cfg.<section>.<key>`` for the config,
``device.*`` for the machine. The trainer adds ``opt.*`` (its decisions) and ``derived.*`` (its numbers), the
HPO parent ``hpo.*``.
"""

from __future__ import annotations

import json
from dataclasses import fields, is_dataclass
from typing import Any

from ..config import Config, to_dict
from ..hardware import DeviceInfo

# Logged under their own prefix by their own command, not as cfg.*: the HPO parent logs its section as hpo.*.
OWN_PREFIX = ("hpo",)


def flatten(tree: Any, prefix: str) -> dict[str, str]:
    """Nested mappings as ``prefix.key.subkey`` -> string (lists as JSON, everything else as ``str``)."""
    out: dict[str, str] = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}.{key}"))
    else:
        out[prefix] = json.dumps(tree) if isinstance(tree, (list, tuple)) else str(tree)
    return out


def config_params(cfg: Config) -> dict[str, str]:
    """``cfg.<section>.*`` for every section of the config (the dataclass ones; ``resume`` and ``debug`` are not
    settings of the training itself)."""
    tree = to_dict(cfg)
    out: dict[str, str] = {}
    for f in fields(cfg):
        if is_dataclass(getattr(cfg, f.name)) and f.name not in OWN_PREFIX:
            out.update(flatten(tree[f.name], f"cfg.{f.name}"))
    return out


def device_params(dev: DeviceInfo) -> dict[str, str]:
    return {"device.kind": dev.kind, "device.name": dev.name, "device.count": str(dev.count),
            "device.memory_gb": str(dev.total_memory_gb), "device.cpu_count": str(dev.cpu_count),
            "device.compute_capability": ".".join(map(str, dev.compute_capability or ())) or "none",
            "device.driver": str(dev.driver_version), "device.cuda": str(dev.cuda_version),
            "device.torch": dev.torch_version}

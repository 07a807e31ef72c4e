"""The param naming scheme every run shares (docs/reference/what-a-run-logs.md): ``cfg.<section>.<key>`` for the config,
``device.*`` for the machine. The trainer adds ``opt.*`` (its decisions) and ``derived.*`` (its numbers), the
HPO parent ``hpo.*``. And the run names: a run is named after its model, its hardware profile and the speed-up
settings it changes from that profile, so runs that differ in a setting do not all read ``tiny-cpu``.
"""

from __future__ import annotations

import json
from dataclasses import fields, is_dataclass
from typing import Any

from ..config import Config, DataConfig, HardwareConfig, to_dict
from ..hardware import DeviceInfo, load_profiles

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
            "device.torch_threads": str(dev.torch_threads),
            "device.compute_capability": ".".join(map(str, dev.compute_capability or ())) or "none",
            "device.driver": str(dev.driver_version), "device.cuda": str(dev.cuda_version),
            "device.torch": dev.torch_version}


# The settings a run name spells out when they differ from the hardware profile's (data: from the defaults).
NAMED_SETTINGS = {
    "hardware": ("precision", "tf32", "cudnn_benchmark", "compile", "compile_mode", "gradient_checkpointing",
                 "attn_implementation", "fused_adamw", "fast_dropout", "batch_size", "num_workers", "pin_memory"),
    "data": ("padding", "bucketing"),
}
SHORT = {"attn_implementation": "attention", "gradient_checkpointing": "checkpointing"}


def show(key: str, value: Any) -> str:
    """``bucketing=off``, ``precision=fp32``: a setting as run names and the audit's rows spell it."""
    text = ("on" if value else "off") if isinstance(value, bool) else str(value)
    return f"{SHORT.get(key, key)}={text}"


def changed_settings(cfg: Config) -> list[str]:
    """The speed-up settings ``cfg`` changes from its hardware profile (and the data defaults), in table order."""
    profile = dict(load_profiles().get(cfg.hardware.name) or {})
    reference = {"hardware": {k: profile.get(k, getattr(HardwareConfig(), k)) for k in NAMED_SETTINGS["hardware"]},
                 "data": {k: getattr(DataConfig(), k) for k in NAMED_SETTINGS["data"]}}
    out = []
    for section, keys in NAMED_SETTINGS.items():
        for key in keys:
            value = getattr(getattr(cfg, section), key)
            if key == "compile_mode" and not cfg.hardware.compile:
                continue  # a mode without compile changes nothing
            if value != reference[section][key]:
                out.append(show(key, value))
    if cfg.train.batch_size is not None:
        out.append(show("batch_size", cfg.train.batch_size))
    return out


def run_name(cfg: Config) -> str:
    """``tiny-cpu``, or ``tiny-cpu precision=fp32 bucketing=off`` (tracking.run_name, when set, wins)."""
    return cfg.tracking.run_name or " ".join([f"{cfg.model.name}-{cfg.hardware.name}", *changed_settings(cfg)])


NOTE = "mlflow.note.content"  # the run's description: the MLflow UI shows it on the run page, rendered as markdown
NOTE_LIMIT = 5000  # what a tag value may hold here (tracking/mlflow_run.py cuts tags there)


def note(markdown: str, artifact: str, limit: int = NOTE_LIMIT) -> str:
    """``markdown`` as a run description; cut at a line boundary, with a pointer to ``artifact``, when too long."""
    if len(markdown) <= limit:
        return markdown
    tail = f"\n\n… cut here: the whole report is the artifact `{artifact}`.\n"
    kept = markdown[:limit - len(tail)]
    return kept[:kept.rfind("\n") + 1 or len(kept)] + tail

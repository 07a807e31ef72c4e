"""``maxout check-hardware``: what this machine offers for training, with a reason for everything it lacks, the
profile ``hardware=auto`` picks and why, and the micro-batch the batch finder recommends for the configured model
and sequence length (from its cache, else a quick search). It lists every GPU NVML sees and how each pair is
linked (NVLink, or how far apart on PCIe), and suggests the command that uses them all (``scale_out``).

``report()`` returns plain data (``--json`` prints it); ``render()`` turns it into rich tables.
"""

from __future__ import annotations

import platform
from typing import Optional

import torch
from rich.table import Table

from .. import data as data_mod, modeling
from ..config import Config
from ..errors import MaxoutError
from ..hardware import DeviceInfo, Topology, load_profiles, pick_profile, topology
from ..optimizations import accumulation, compile as compile_opt, cudnn_benchmark, dataloader, fast_dropout
from ..optimizations import fused_adamw, precision as precision_opt, tf32
from ..train import batch_finder
from ..train.warm import WarmStart


def support(device: DeviceInfo) -> dict[str, dict]:
    """Each speed-up the device can or cannot use, with the optimizations' own reasons."""
    checks = {
        "bf16 autocast": precision_opt.supported("bf16", device),
        "fp16 autocast + GradScaler": precision_opt.supported("fp16", device),
        "TF32 matmuls": tf32.supported(device),
        "flash-attention 2": (device.flash_attention, device.flash_attention_reason),
        "torch.compile": compile_opt.supported(device),
        "CUDA graphs (compile reduce-overhead)": (device.is_cuda, "" if device.is_cuda else "no CUDA device"),
        "fused AdamW": fused_adamw.supported(device),
        "fast dropout (bulk random bits)": fast_dropout.supported(device, compiled=False, gradient_checkpointing=False),
        "cuDNN benchmark": cudnn_benchmark.supported(device),
        "pinned memory": dataloader.supported_pin_memory(device),
    }
    return {name: {"ok": bool(ok), "reason": reason} for name, (ok, reason) in checks.items()}


def versions(device: DeviceInfo) -> dict[str, Optional[str]]:
    return {"python": platform.python_version(), "torch": device.torch_version, "cuda (torch build)":
            device.cuda_version or torch.version.cuda, "cudnn": str(device.cudnn_version or "") or None,
            "driver": device.driver_version}


def recommended_batch(cfg: Config, device: DeviceInfo, search: bool = True) -> dict:
    """The batch finder's answer for ``cfg`` (cached, or a quick search); an ``error`` entry when it has none."""
    try:
        dataset = data_mod.load(cfg.data)
        tokenizer = modeling.load_tokenizer(cfg.model)
        encode = WarmStart().encode  # the longest row and the probe's set-up share one tokenization
        if not search:
            plan = batch_finder.search_for(cfg, device, dataset, tokenizer, encode)
            entry = batch_finder.cached(cfg, plan.key, plan.upper)
            return ({"source": "cache", "max_batch": entry["max_batch"], "sequence_length": plan.length,
                     "key": plan.key} if entry else
                    {"error": "not in the batch finder's cache (run without --no-search)", "key": plan.key})
        result = batch_finder.find(cfg, device, dataset, tokenizer, encode=encode)
    except MaxoutError as err:
        return {"error": str(err)}
    return {"source": "cache" if result.cache_hit else "search", "micro_batch": result.micro_batch,
            "max_batch": result.max_batch, "capped": result.capped, "safe_batch": result.safe_batch,
            "sequence_length": result.sequence_length, "target_effective_batch": cfg.train.target_effective_batch,
            "accumulation_steps": accumulation.plan(cfg.train.target_effective_batch, result.micro_batch)[0],
            "probes": len(result.probes), "budget_gb": result.budget_gb, "key": result.key}


def scale_out(topo: Topology) -> dict:
    """The command that uses this node's GPUs, one for several such nodes, and what the links mean for the
    strategy (``distributed.strategy``)."""
    n, overrides = len(topo.gpus), "hardware=auto ..."
    if n == 0:
        return {"commands": ["maxout train hardware=cpu ..."],
                "notes": ["no GPU visible: one process; several CPU processes (maxout train --nproc-per-node 2 "
                          "hardware=cpu, gloo) share the same cores, for testing the distributed path only"]}
    if n == 1:
        return {"commands": [f"maxout train {overrides}"], "notes": ["one GPU: one process, no torchrun needed"]}
    commands = [f"maxout train --nproc-per-node {n} {overrides}",
                f"torchrun --nproc-per-node={n} -m maxout train {overrides}",
                f"torchrun --nnodes=NODES --nproc-per-node={n} --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 "
                f"--rdzv-id=JOB -m maxout train {overrides}   # on every node; checkpoint.dir on shared storage"]
    slow = sorted({link.kind for link in topo.links if link.kind != "NVLink"})
    notes = (["every GPU pair is linked by NVLink: gradient all-reduces and FSDP's all-gathers are cheap here"]
             if topo.all_nvlink else
             [f"some GPU pairs talk over {', '.join(slow)}: keep distributed.strategy=auto (DDP, one all-reduce "
              f"per step) while the model fits one GPU; fsdp moves 1.5x the weights per step over these links"])
    return {"commands": commands, "notes": notes}


def report(cfg: Config, device: DeviceInfo, search: bool = True) -> dict:
    profile, why = pick_profile(device, load_profiles())
    out = {"device": device.to_dict(), "support": support(device), "versions": versions(device),
           "auto_profile": {"name": profile, "why": why}, "configured": {
               "profile": cfg.hardware.name, "model": cfg.model.name, "data": cfg.data.name,
               "max_length": cfg.data.max_length, "padding": cfg.data.padding, "precision": cfg.hardware.precision,
               "gradient_checkpointing": cfg.hardware.gradient_checkpointing, "compile": cfg.hardware.compile}}
    topo = topology()
    out["gpus"] = {**topo.to_dict(), **scale_out(topo)}
    out["batch"] = recommended_batch(cfg, device, search)
    return out


def render(rep: dict) -> list:
    """Rich renderables: device, support, versions, profile and batch."""
    dev = rep["device"]
    device = Table(title="Device", show_header=False, title_justify="left")
    device.add_column(style="bold")
    device.add_column()
    rows = [("kind", dev["kind"]), ("name", dev["name"])]
    if dev["kind"] == "cuda":
        cc = dev["compute_capability"]
        rows += [("count", str(dev["count"])), ("memory", f"{dev['total_memory_gb']} GiB"),
                 ("compute capability", f"{cc[0]}.{cc[1]}" if cc else "unknown")]
    rows += [("CPU cores", str(dev["cpu_count"])), ("host memory", f"{dev['host_memory_gb']} GiB"),
             ("C compiler", dev["compiler"] or "none (torch.compile on CPU needs one)"),
             ("in a container", str(dev["in_container"]).lower())]
    rows += [("note", n) for n in dev["notes"]]
    for row in rows:
        device.add_row(*row)

    features = Table(title="Speed-ups on this device", title_justify="left")
    features.add_column("feature", style="bold")
    features.add_column("available")
    features.add_column("why not")
    for name, s in rep["support"].items():
        features.add_row(name, "[green]yes[/]" if s["ok"] else "[red]no[/]", s["reason"])

    versions = Table(title="Versions", show_header=False, title_justify="left")
    versions.add_column(style="bold")
    versions.add_column()
    for name, value in rep["versions"].items():
        versions.add_row(name, value or "–")

    conf, batch = rep["configured"], rep["batch"]
    plan = Table(title="Profile and batch", show_header=False, title_justify="left")
    plan.add_column(style="bold")
    plan.add_column()
    plan.add_row("hardware=auto picks", f"{rep['auto_profile']['name']} ({rep['auto_profile']['why']})")
    plan.add_row("configured", f"profile {conf['profile']}, model {conf['model']}, data {conf['data']} "
                               f"(max_length {conf['max_length']}, padding {conf['padding']}), precision "
                               f"{conf['precision']}, checkpointing {str(conf['gradient_checkpointing']).lower()}, "
                               f"compile {str(conf['compile']).lower()}")
    if "error" in batch:
        plan.add_row("recommended batch", f"[yellow]{batch['error']}[/]")
    elif "micro_batch" in batch:
        found = f">= {batch['max_batch']} (search cap)" if batch["capped"] else str(batch["max_batch"])
        plan.add_row("recommended batch",
                      f"micro-batch {batch['micro_batch']} x accumulation {batch['accumulation_steps']} for the "
                      f"target effective batch {batch['target_effective_batch']} (largest that fits: {found} at "
                      f"sequence length {batch['sequence_length']}; from {batch['source']}, {batch['probes']} probes"
                      + (f", CPU budget {batch['budget_gb']} GiB" if batch["budget_gb"] else "") + ")")
    else:
        plan.add_row("recommended batch", f"largest that fits: {batch['max_batch']} at sequence length "
                                          f"{batch['sequence_length']} (from cache)")
    return [device, features, versions, plan, render_gpus(rep["gpus"])]


def render_gpus(gpus: dict) -> Table:
    table = Table(title="GPUs, links and the command for this node", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    if not gpus["gpus"]:
        table.add_row("GPUs", gpus["error"] or "none visible")
    for gpu in gpus["gpus"]:
        table.add_row(f"GPU {gpu['index']}", f"{gpu['name']}, {gpu['memory_gb']} GiB, {gpu['nvlinks']} NVLink links")
    for link in gpus["links"]:
        table.add_row(f"GPU {link['a']} <-> {link['b']}", link["kind"])
    for command in gpus["commands"]:
        table.add_row("command", command)
    for note in gpus["notes"]:
        table.add_row("note", note)
    return table

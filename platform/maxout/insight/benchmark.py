"""``maxout benchmark``: an ablation over a grid of optimizations that answers "are we maxed out?" with measured
speed-ups and memory ratios instead of guesses.

Each cell of the grid (``--grid "precision=fp32,bf16 compile=off,on"``; by default every value of every axis in
grid.AXES) is one training run (one epoch, or ``--steps`` optimizer steps) and one nested MLflow run under a parent
run, all in one experiment. Cells run one after another in one process, in ``--repeats`` interleaved rounds (every
other one in reverse order), so a noisy, shared machine slows every cell alike and the ratios stay comparable.
Throughput is the steady state (perf/steady_*: the first train.warmup_steps_excluded steps, compile and allocator
warm-up, are left out).

Memory: on a GPU, torch's peak allocated memory over the run. On a CPU, the peak tensor bytes of the run's worst
step (the longest training rows, counted by train/tensor_memory.TensorMemory in eager mode, so compiled cells show eager
memory there): process RSS cannot be reset between cells.

A cell the device cannot honour (fp16 or compile or fused AdamW where unsupported, bucketing with
padding=max_length) is not run; its row says why, using the optimizations' own supported() checks. The parent run
gets the comparison table (markdown and CSV) and bar charts (PNG).
"""

from __future__ import annotations

import math
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import pandas as pd
import torch

from .. import hardware, loading, modeling
from ..config import Config
from ..data import Dataset
from ..errors import ConfigError
from ..hardware import DeviceInfo
from ..optimizations import attention, bucketing, compile as compile_opt, fast_dropout, fused_adamw, named, packing
from ..optimizations import inductor_tuning, liger_kernel, low_precision_layernorm, mix_order_reduction, pad_widths
from ..optimizations import prepared_mask, skip_guards, unmasked_causal
from ..optimizations import precision as precision_opt, tf32
from ..tracking.params import NOTE, device_params, note, run_name
from ..tracking.tracker import Tracker, closing, start
from ..train import prepare, train
from ..train.batch_finder import StepProbe
from ..train.oom import free_cached
from ..train.setup import Setup
from ..train.tensor_memory import GIB
from ..train.warm import WarmStart
from .charts import plot
from .grid import Cell, cells, parse_grid, show

def skip_reason(cell: Cell, device: DeviceInfo, cfg: Config, tokenizer: Any = None) -> str:
    """Why the device cannot honour ``cell`` (empty: it can), from the optimizations' own checks. (A model class
    without an SDPA path is found when the cell's run builds the model: its row then says so.)"""
    asked = dict(cell.values)
    compiled = asked.get("compile", cfg.hardware.compile)
    # the attention and padding asked for, as the mask checks take them (a model class without SDPA says so when
    # its run builds it)
    attention = asked.get("attention", cfg.hardware.attn_implementation)
    padding = "packed" if asked.get("padding", cfg.data.padding) == "packed" else "dynamic"
    checks = {"compile": lambda: compile_opt.supported(device), "fused_adamw": lambda: fused_adamw.supported(device),
              "bucketing": lambda: bucketing.supported(cfg.data.padding),
              "fast_dropout": lambda: fast_dropout.supported(
                  device, compiled, asked.get("gradient_checkpointing", cfg.hardware.gradient_checkpointing)),
              "tf32": lambda: tf32.supported(device),
              "liger_kernel": lambda: liger_kernel.supported(device, _model_type(cfg, tokenizer)),
              "inductor_tuning": lambda: inductor_tuning.supported(device, compiled),
              "mix_order_reduction": lambda: mix_order_reduction.supported(device, compiled),
              "skip_guards": lambda: skip_guards.supported(compiled, padding == "packed"),
              "low_precision_layernorm": lambda: low_precision_layernorm.supported(
                  device, precision_opt.resolve(asked.get("precision", cfg.hardware.precision), device).effective),
              "prepared_mask": lambda: prepared_mask.supported(_model_type(cfg, tokenizer), attention, padding,
                                                               cfg.model.pooling),
              "unmasked_causal": lambda: unmasked_causal.supported(
                  _model_type(cfg, tokenizer), attention, padding,
                  asked.get("prepared_mask", cfg.hardware.prepared_mask))}
    for axis, value in cell.values:
        if axis == "precision":
            decision = precision_opt.resolve(value, device)
            if decision.changed:
                return f"precision {value}: {decision.reason}"
        if axis == "compile_mode":
            if not compiled:
                return "compile_mode: compile is off (add compile=on to the grid, or hardware.compile=true)"
            decision = compile_opt.resolve_mode(value, device, cfg.data.padding, _widths(cfg, device, value))
            if decision.changed:
                return f"compile_mode {value}: {decision.reason}"
        if axis == "compile_scope" and not compiled:
            return "compile_scope: compile is off (add compile=on to the grid, or hardware.compile=true)"
        if axis == "attention" and value == "flash_attention_2" and not device.flash_attention:
            return f"attention flash_attention_2: {device.flash_attention_reason}"
        if value is True and axis in checks:
            ok, reason = checks[axis]()
            if not ok:
                return f"{axis}: {reason}"
        if axis == "padding" and value == "packed":
            ok, reason = packing_support(cfg, device, asked.get("precision", cfg.hardware.precision), tokenizer)
            if not ok:
                return f"padding packed: {reason}"
    return ""


def _model_type(cfg: Config, tokenizer: Any = None) -> str:
    tokenizer = tokenizer or modeling.load_tokenizer(cfg.model)
    return modeling.build_config(cfg.model, ["0", "1"], len(tokenizer), tokenizer.pad_token_id).model_type


def _widths(cfg: Config, device: DeviceInfo, compile_mode: str) -> object:
    """The pad widths a cell with ``compile_mode`` would get (pad_widths.resolve, with compile on)."""
    return pad_widths.resolve(cfg.hardware.pad_widths, device, True, compile_mode, cfg.data.padding).effective


def packing_support(cfg: Config, device: DeviceInfo, precision: str, tokenizer: Any = None) -> tuple[bool, str]:
    """packing.supported() for the configured model and the attention it would get (its config only, no weights)."""
    tokenizer = tokenizer or modeling.load_tokenizer(cfg.model)
    config = modeling.build_config(cfg.model, ["0", "1"], len(tokenizer), tokenizer.pad_token_id)
    precision = precision_opt.resolve(precision, device).effective
    attn = attention.resolve(cfg.hardware.attn_implementation, modeling.model_class(config), device, precision)
    return packing.supported(config.model_type, attn.effective)


def padding_comparison(overrides: Sequence[str] = (), steps: Optional[int] = None, repeats: int = 1,
                       out_dir: Optional[str] = None, device: Optional[DeviceInfo] = None,
                       progress: bool = True) -> Report:
    """Padded (random batches), length-bucketed and packed batches of one model, in one run: padding efficiency
    and samples/s of each (``maxout benchmark --grid "padding=dynamic,bucketed,packed"``). E.g. for the GPU report:
    ``padding_comparison(["hardware=h100", "model=bert_base", "model.path=..."], steps=50, repeats=2)``."""
    return run(overrides, grid_spec="padding=dynamic,bucketed,packed", steps=steps, repeats=repeats,
               out_dir=out_dir, device=device, progress=progress)


@dataclass
class Row:
    cell: Cell
    status: str = "ok"  # ok | skipped | failed
    reason: str = ""
    samples: list = field(default_factory=list)  # one metrics dict per repeat
    run_ids: list = field(default_factory=list)

    def median(self, key: str) -> Optional[float]:
        values = [m[key] for m in self.samples if m.get(key) is not None]
        return statistics.median(values) if values else None


@dataclass
class Report:
    rows: list
    baseline: Optional[Row]
    table: Any  # pandas DataFrame
    files: dict  # kind -> path
    parent_run_id: Optional[str]
    memory_source: str

    def markdown(self) -> str:
        return Path(self.files["markdown"]).read_text()


def run(overrides: Sequence[str] = (), grid_spec: Optional[str] = None, steps: Optional[int] = None,
        repeats: int = 1, out_dir: Optional[str] = None, device: Optional[DeviceInfo] = None,
        progress: bool = True) -> Report:
    """Run the grid on ``overrides`` (the base config) and return the comparison. ``steps`` None: one epoch per
    cell (length bucketing sorts each megabatch longest first, so only whole megabatches measure it fairly). A bad
    grid or config is a ConfigError before anything runs."""
    if (steps is not None and steps < 1) or repeats < 1:
        raise ConfigError(f"benchmark steps={steps} and repeats={repeats} must both be >= 1")
    grid = parse_grid(grid_spec)
    device = device or hardware.detect()
    fixed = ([f"train.max_steps={steps}", "train.epochs=1000"] if steps else ["train.max_steps=-1", "train.epochs=1"])
    fixed.append("tracking.log_model=false")
    base = loading.load([*overrides, *fixed], device=device)
    if steps is not None and steps <= base.train.warmup_steps_excluded:
        raise ConfigError(f"benchmark steps={steps} leaves no steady state after train.warmup_steps_excluded="
                          f"{base.train.warmup_steps_excluded}: use more steps")
    checked = prepare.check(base)  # data, model and tracking store, before the parent run exists
    rows = []
    for cell in cells(grid):
        why = skip_reason(cell, device, base, checked.tokenizer)
        rows.append(Row(cell, "skipped", why) if why else Row(cell))
    runnable = [r for r in rows if r.status == "ok"]
    configs = {r.cell: r.cell.apply(base) for r in runnable}
    dataset = checked.dataset
    # The cells differ in their settings, not their data: the first cell tokenizes, the others reuse its tables
    # (on 55k demo rows tokenizing took 13.4 s a run on one core, the grid's own share of every cell's set-up)
    warm = WarmStart()
    warm.tokenizer(base.model, loaded=checked.tokenizer)
    memory_source = "CUDA peak allocated" if device.is_cuda else "CPU peak tensor bytes of the worst step (eager)"
    out = Path(out_dir or tempfile.mkdtemp(prefix="maxout-benchmark-"))
    out.mkdir(parents=True, exist_ok=True)
    parent = start(base.tracking, run_name=f"benchmark {run_name(base)}",
                   tags={"maxout.command": "benchmark", "maxout.model": base.model.name,
                         "maxout.data": base.data.name, "maxout.hardware_profile": base.hardware.name})
    with closing(parent):
        parent.log_params({"benchmark.grid": " ".join(f"{a}={','.join(map(show, v))}" for a, v in grid.items()),
                           "benchmark.steps": str(steps or "one epoch"), "benchmark.repeats": str(repeats),
                           "benchmark.overrides": " ".join(overrides), "benchmark.memory": memory_source,
                           **device_params(device)})
        for repeat in range(repeats):  # rounds interleave the cells: machine noise hits every cell alike
            # and every other round runs them in reverse (A B C, C B A, ...): a cell is first as often as last, so a
            # drift across a round (a warming cache, a neighbour's job ending) does not favour the first cells
            order = list(enumerate(runnable))[::-1 if repeat % 2 else 1]
            for i, row in order:
                if row.status != "ok":
                    continue
                if progress:
                    print(f"maxout: benchmark round {repeat + 1}/{repeats}, cell {i + 1}/{len(runnable)}: "
                          f"{row.cell.name}", file=sys.stderr)
                _run_cell(row, configs[row.cell], device, dataset, repeat, repeats, warm)
        baseline = next((r for r in rows if r.status == "ok"), None)
        table = comparison(rows, baseline)
        files = write(table, baseline, memory_source, device, steps, repeats, out)
        for path in files.values():
            parent.log_artifact(str(path), "benchmark")
        speedups = [v for v in table["speed-up"] if v is not None and not math.isnan(v)]
        parent.log_metrics({"benchmark/cells": float(len(rows)), "benchmark/cells_run": float(len(runnable)),
                            "benchmark/best_speedup": max(speedups) if speedups else None})
        if baseline is not None:
            parent.set_tags({"maxout.benchmark_baseline": baseline.cell.name})
        parent.set_tags({NOTE: note(files["markdown"].read_text(), "benchmark/benchmark.md")})  # the run page shows it
    return Report(rows, baseline, table, files, parent.run_id, memory_source)


def _run_cell(row: Row, cfg: Config, device: DeviceInfo, dataset: Dataset, repeat: int, repeats: int,
              warm: WarmStart) -> None:
    name = row.cell.name + (f" #{repeat + 1}" if repeats > 1 else "")
    child = start(cfg.tracking, run_name=name, nested=True, system_metrics=False,
                  tags={"maxout.command": "benchmark-cell", "maxout.cell": row.cell.name,
                        "maxout.repeat": str(repeat + 1)})
    try:
        with closing(child):  # FAILED with the reason, or KILLED on Ctrl-C (which also stops the grid)
            measured = measure(cfg, device, dataset, child, warm)
            # each axis is named after the optimization decision it sets (optimizations.NAMES)
            fallbacks = [f"{axis}: {d.reason}" for axis, _ in row.cell.values
                         if (d := named(measured.decisions, axis)).changed]
    except Exception as err:  # one broken cell must not lose the others: record it and go on
        row.status, row.reason = "failed", f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
        return
    row.run_ids.append(child.run_id)
    if fallbacks:  # a setting fell back at build time: the cell did not measure what it names
        row.status, row.reason = "skipped", "; ".join(fallbacks)
        return
    row.samples.append(measured.metrics)


@dataclass
class Measured:
    metrics: dict  # the run's results, plus mem/peak_tensor_gb on a CPU
    decisions: list  # the optimization decisions it ran with
    params: dict  # what it logged as params (opt.*, cfg.*, device.*, derived.*)


def measure(cfg: Config, device: DeviceInfo, dataset: Dataset, tracker: Tracker,
            warm: Optional[WarmStart] = None) -> Measured:
    """One training run of ``cfg`` from a clean process state, logged to ``tracker`` (a run the caller opened and
    closes): what it measured and what it ran with. ``warm``: the tokenizer and tokenized tables of the runs before
    it on the same data (a grid's cells, an audit's runs), kept so that only the first run tokenizes."""
    _fresh_process_state(cfg, device)
    result = train(cfg, tracker=tracker, progress=False, device=device, verbose=False, dataset=dataset, warm=warm)
    metrics = dict(result.metrics)
    if not device.is_cuda:
        metrics["mem/peak_tensor_gb"] = cpu_step_memory(result.setup, cfg)
        tracker.log_metrics({"mem/peak_tensor_gb": metrics["mem/peak_tensor_gb"]}, step=result.setup.total_steps)
    return Measured(metrics, result.setup.decisions, result.params)


def _fresh_process_state(cfg: Config, device: DeviceInfo) -> None:
    """Each cell starts clean: no device memory stays cached from the previous cell. A compiled cell would compile
    from scratch anyway (compile.apply empties dynamo's cache); emptying it here first releases the previous cell's
    CUDA graph pools, so that free_cached returns their memory too."""
    if cfg.hardware.compile:
        torch._dynamo.reset()
    free_cached(device.torch_device)


def cpu_step_memory(setup: Setup, cfg: Config) -> float:
    """GiB of tensors alive at the worst moment of one step on the longest rows, counted in eager mode."""
    # Count eager tensors (a compiled graph allocates outside the dispatcher); fast dropout's masks are its own.
    eager = setup.classifier  # the model, or it with per-sample pooling (packed batches need that)
    setup.forward = fast_dropout.apply(eager) if setup.decision("fast_dropout").effective else eager
    probe = StepProbe(setup, target=cfg.train.target_effective_batch or setup.micro_batch, budget_bytes=None)
    rows = setup.micro_batch
    if setup.packed:  # a packed step holds up to the token budget: as many copies of the longest row as fit
        rows = max(1, setup.sampler.max_tokens // probe.sequence_length)
    return (probe.peak_bytes(rows) or 0) / GIB


def speedups(row: Row, baseline: Row) -> list[float]:
    """Per-round speed-ups vs the baseline's run in the same round (paired: the two ran minutes apart, not hours)."""
    key = "perf/steady_samples_per_s"
    if len(row.samples) != len(baseline.samples):  # a round failed: pair the medians instead
        speed, base = row.median(key), baseline.median(key)
        return [speed / base] if speed and base else []
    return [r[key] / b[key] for r, b in zip(row.samples, baseline.samples) if r.get(key) and b.get(key)]


def comparison(rows: Sequence[Row], baseline: Optional[Row]) -> Any:
    """One line per cell: medians over repeats, speed-up (median of the per-round ratios, and their range) and
    memory ratio vs the baseline cell."""
    base_mem = _memory(baseline) if baseline else None
    records = []
    for row in rows:
        mem = _memory(row)
        ratios = speedups(row, baseline) if baseline and row.samples else []
        records.append({
            "cell": row.cell.name, **{a: show(v) for a, v in row.cell.values}, "status": row.status,
            "steady samples/s": row.median("perf/steady_samples_per_s"),
            "steady tokens/s": row.median("perf/steady_tokens_per_s"),
            "padding efficiency": row.median("perf/padding_efficiency"),
            "speed-up": statistics.median(ratios) if ratios else None,
            "speed-up min": min(ratios) if ratios else None, "speed-up max": max(ratios) if ratios else None,
            "peak memory GiB": mem, "memory ratio": mem / base_mem if mem and base_mem else None,
            "MFU": row.median("perf/mfu"), "GPU util %": row.median("gpu/utilization_mean"),
            "compile s": row.median("time/compile_s"), "reason": row.reason})
    return pd.DataFrame.from_records(records)


def _memory(row: Row) -> Optional[float]:
    return row.median("mem/peak_allocated_gb") or row.median("mem/peak_tensor_gb")


def write(table: Any, baseline: Optional[Row], memory_source: str, device: DeviceInfo, steps: Optional[int],
          repeats: int, out: Path) -> dict:
    files = {"markdown": out / "benchmark.md", "csv": out / "benchmark.csv",
             "speedup_png": out / "speedup.png", "memory_png": out / "memory.png"}
    table.to_csv(files["csv"], index=False)
    files["markdown"].write_text(markdown(table, baseline, memory_source, device, steps, repeats))
    plot(table, "speed-up", f"steady-state samples/s vs baseline ({device.name})", files["speedup_png"])
    plot(table, "memory ratio", f"peak memory vs baseline ({memory_source})", files["memory_png"])
    return files


def markdown(table: Any, baseline: Optional[Row], memory_source: str, device: DeviceInfo, steps: Optional[int],
             repeats: int) -> str:
    head = ["Cell", "Samples/s", "Tokens/s", "Real tokens", "Speed-up", "Per round", "Peak memory (GiB)",
            "Memory ratio", "MFU", "GPU util %", "Compile (s)", "Note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table.to_dict("records"):
        note = r["reason"] or ("baseline" if baseline and r["cell"] == baseline.cell.name else "")
        if r["status"] != "ok":
            note = f"{r['status']}: {note}"
        values = [r["cell"], _fmt(r["steady samples/s"], ".1f"), _fmt(r["steady tokens/s"], ".0f"),
                  _fmt(r["padding efficiency"], ".1%"),
                  _fmt(r["speed-up"], ".2f", "x"),
                  _span(r["speed-up min"], r["speed-up max"]) if repeats > 1 else "–",
                  _fmt(r["peak memory GiB"], ".3f"),
                  _fmt(r["memory ratio"], ".2f", "x"), _fmt(r["MFU"], ".1%"), _fmt(r["GPU util %"], ".0f"),
                  _fmt(r["compile s"], ".1f"), note.replace("|", "/")]
        lines.append("| " + " | ".join(values) + " |")
    window = f"{steps} optimizer steps" if steps else "one epoch"
    caption = (f"Device: {device.name} ({device.kind}); {window} per cell, steady state (warm-up excluded); "
               f"medians of {repeats} interleaved round(s), speed-up = median of the per-round ratios (their range: "
               f"per round); real tokens = padding efficiency (real / processed tokens); memory: {memory_source}; "
               f"ratios vs the baseline cell "
               f"({baseline.cell.name if baseline else 'none: no cell ran'}).")
    return caption + "\n\n" + "\n".join(lines) + "\n"


def _span(low: Any, high: Any) -> str:
    return "–" if _fmt(low, ".2f") == "–" else f"{_fmt(low, '.2f')}–{_fmt(high, '.2f')}"


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return format(value, spec) + suffix

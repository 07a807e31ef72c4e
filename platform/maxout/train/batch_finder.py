"""``batch_size=auto``: the largest micro-batch that survives a real training step, and a plan that keeps the
effective batch.

Search (``search``): probe 1 row (does anything fit?), then the upper end (does everything fit?), then bisect
between the largest batch that fit and the smallest that did not: exact, in at most ceil(log2(upper)) + 2 probes.
Growing exponentially from 1 first would take about twice as many; a probe that does not fit is cheap, because on
a GPU the allocation fails early in the forward pass and on a CPU the budget meter stops it as soon as the budget
is crossed.

Range: the upper end is what the run can use, min(train.target_effective_batch, training rows,
batch_finder.max_batch), divided by the safety margin, so a micro-batch that fits with the margin to spare is proven
by a probe. The micro-batch is then the found maximum times the margin (default 0.9), rounded down to a divisor of
the target where that costs less than half the rows; accumulation (optimizations/accumulation.plan) makes up the
rest, so the optimizer sees the same samples per step on every device. (Hugging Face's auto batch size changes the
effective batch instead.)

Probe (``StepProbe``): one real optimizer step (forward, backward, AdamW step; two accumulated micro-batches when
the run will accumulate, since the first one's gradients are then alive during the second) on copies of the longest
training row, with the optimizer state already allocated: the memory of the run's worst step. It runs eager on every
device, so the finder compiles nothing (the run compiles its one graph afterwards). On a GPU it runs on the device
and catches torch.OutOfMemoryError; on a CPU it runs under batch_finder.memory_budget_gb
(default: the available host memory), counted by tensor_memory.TensorMemory. Any ``fits(rows) -> bool`` can stand
in for it (tests use a synthetic memory model).

Cache: results live in a JSON file beside the local MLflow store, keyed by device, model, sequence length,
precision, gradient checkpointing and compile, plus what else changes the memory (adapter, frozen encoder,
attention, the CPU budget, torch version).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

import psutil
import torch

from .. import data as data_mod
from .distributed import env_local_world_size, env_world_size
from ..config import Config
from ..errors import ConfigError, OutOfMemory
from .. import hardware
from ..hardware import DeviceInfo
from ..metrics import Throughput
from ..optimizations import compile as compile_opt, decide, precision as precision_opt
from ..paths import resolve_path, state_dir
from .loop import train_step
from .oom import free_cached
from .setup import Encode, Setup, build, build_collator, resolve_micro_batch
from .tensor_memory import GIB, TensorMemory, training_state

log = logging.getLogger("maxout")


@dataclass
class Search:
    max_batch: int  # largest batch that fit; 0: not even one row; == upper: nothing failed
    upper: int
    probes: list  # [(rows, fits)] in the order probed


def search(fits: Callable[[int], bool], upper: int) -> Search:
    """The largest ``rows`` in [1, upper] with ``fits(rows)``, assuming fitting is monotone in rows."""
    if upper < 1:
        raise ValueError(f"upper={upper} must be >= 1")
    probes: list = []

    def probe(rows: int) -> bool:
        ok = bool(fits(rows))
        probes.append((rows, ok))
        return ok

    if not probe(1):
        return Search(0, upper, probes)
    if upper == 1 or probe(upper):
        return Search(upper, upper, probes)
    good, bad = 1, upper
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if probe(mid) else (good, mid)
    return Search(good, upper, probes)


def search_range(cap: int, safety_margin: float) -> int:
    """The upper end to probe so that ``cap`` rows are proven to fit with the margin to spare."""
    return max(1, math.ceil(cap / safety_margin - 1e-9))


def micro_batch_for(safe: int, target: int) -> int:
    """The micro-batch to run: the largest divisor of the target that is safe (the effective batch stays exact),
    unless that is under half of the balanced split; then the balanced split (accumulation rounds up, with a reason)."""
    if safe >= target:
        return target
    balanced = math.ceil(target / math.ceil(target / safe))
    divisor = max(d for d in range(1, safe + 1) if target % d == 0)
    return divisor if 2 * divisor >= balanced else balanced


@dataclass
class Result:
    micro_batch: int  # what the run uses
    max_batch: int  # largest batch that fit (== upper: the search never reached the device's limit)
    safe_batch: int  # max_batch x safety margin, at most the cap
    upper: int
    sequence_length: int
    probes: list
    cache_hit: bool
    key: str
    budget_gb: Optional[float] = None  # the CPU budget searched against; None on a GPU
    seconds: float = 0.0

    @property
    def capped(self) -> bool:
        return self.max_batch >= self.upper

    def params(self) -> dict[str, str]:
        return {"batch_finder.max_batch": str(self.max_batch), "batch_finder.capped": str(self.capped).lower(),
                "batch_finder.safe_batch": str(self.safe_batch), "batch_finder.micro_batch": str(self.micro_batch),
                "batch_finder.sequence_length": str(self.sequence_length),
                "batch_finder.probes": " ".join(f"{r}:{'ok' if ok else 'oom'}" for r, ok in self.probes),
                "batch_finder.num_probes": str(len(self.probes)), "batch_finder.cache_hit": str(self.cache_hit).lower(),
                "batch_finder.key": self.key, "batch_finder.budget_gb": str(self.budget_gb),
                "batch_finder.search_s": f"{self.seconds:.2f}"}

    def summary(self) -> str:
        where = "cache" if self.cache_hit else f"{len(self.probes)} probes, {self.seconds:.1f} s"
        found = f">= {self.max_batch} (search cap)" if self.capped else str(self.max_batch)
        return (f"batch finder: largest batch that fits {found} at sequence length {self.sequence_length}; "
                f"micro-batch {self.micro_batch} ({where})")


# ------------------------------------------------------------------------------------------------ probe


class StepProbe:
    """``probe(rows) -> fits``: one real training step at ``rows`` copies of the longest training row."""

    def __init__(self, setup: Setup, target: int, budget_bytes: Optional[float]):
        self.s, self.target, self.budget = setup, target, budget_bytes
        encoded = setup.train_loader.dataset
        self.row = encoded[max(range(len(encoded)), key=encoded.lengths.__getitem__)]
        self.collate = setup.train_loader.collate_fn
        self.meter = Throughput(setup.device.torch_device)
        self.peaks: dict[int, Optional[int]] = {}
        setup.oom.enabled = False  # here an out-of-memory error is the answer, not something to recover from
        self._prime_optimizer()

    @classmethod
    def build(cls, cfg: Config, device: DeviceInfo, dataset: data_mod.Dataset, tokenizer: Any, target: int,
              budget_bytes: Optional[float], encode: Encode = data_mod.encode) -> "StepProbe":
        # Probes run eager on every device. A compiled probe paid a full compile of its own before the run compiled
        # again (dynamo specializes a batch of 1, so the 1-row probe and the next one made two graphs: three full
        # compiles, 108 s on an H200). Eager is the safe side: inductor's fusions keep fewer intermediates, so
        # a compiled step needs no more memory than the eager one (and the CPU meter counts eager tensors).
        cfg = replace(cfg, hardware=replace(cfg.hardware, compile=False))
        return cls(build(cfg, device, dataset, tokenizer, micro_batch=1, encode=encode), target, budget_bytes)

    @property
    def sequence_length(self) -> int:
        return int(self.collate([self.row])["input_ids"].shape[1])

    def _prime_optimizer(self) -> None:
        """Allocate AdamW's state now, so every probe sees the memory of a step in the middle of training."""
        params = [p for p in self.s.model.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.zeros_like(p)
        self.s.optimizer.step()
        self.s.optimizer.zero_grad(set_to_none=True)

    def peak_bytes(self, rows: int, limit_bytes: Optional[float] = None) -> Optional[int]:
        """Peak memory of one step at ``rows`` (CUDA allocated, or CPU tensor bytes); None when it did not fit."""
        s, device_type = self.s, self.s.device.torch_device
        batch = self.collate([self.row] * rows)
        group = [batch, batch] if rows < self.target else [batch]
        peak: Optional[int] = None
        try:
            if device_type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                train_step(s, group, self.meter)
                torch.cuda.synchronize()
                peak = int(torch.cuda.max_memory_allocated())
            else:
                with TensorMemory(limit_bytes, baseline=training_state(s.model, s.optimizer)) as mem:
                    train_step(s, group, self.meter)
                peak = int(mem.peak)
        except torch.OutOfMemoryError:
            pass
        if peak is None:  # outside the handler: the traceback no longer pins the failed step's tensors
            s.optimizer.zero_grad(set_to_none=True)
            free_cached(device_type)
        return peak

    def __call__(self, rows: int) -> bool:
        self.peaks[rows] = self.peak_bytes(rows, self.budget)
        return self.peaks[rows] is not None

    def close(self) -> None:
        device_type = self.s.device.torch_device
        del self.s
        free_cached(device_type)


# ------------------------------------------------------------------------------------------------ cache


def cache_file(cfg: Config) -> Path:
    configured = cfg.batch_finder.cache_path
    return resolve_path(configured) if configured else state_dir() / "batch_finder.json"


def cache_key(cfg: Config, device: DeviceInfo, sequence_length: int, budget_bytes: Optional[float]) -> str:
    hw, mc = cfg.hardware, cfg.model
    where = (f"{device.name} {device.total_memory_gb} GiB" if device.is_cuda
             else f"cpu budget {budget_bytes / GIB:.1f} GiB")
    share = hardware.device_share()
    if device.is_cuda and share < 1.0:  # an HPO worker's share of the GPU (the CPU budget above is already its share)
        where += f" share {share:.3g}"
    compiled = decide("compile", hw.compile, compile_opt.supported(device)).effective
    model = mc.name + (f" ({mc.path or mc.name_or_path})" if mc.source == "pretrained" else "")
    return " | ".join([where, f"model {model}", f"length {sequence_length}",
                       f"precision {precision_opt.resolve(hw.precision, device).effective}",
                       f"checkpointing {str(hw.gradient_checkpointing).lower()}", f"compile {str(compiled).lower()}",
                       f"adapter {mc.adapter}", f"frozen {str(mc.freeze_encoder).lower()}",
                       f"attention {hw.attn_implementation}", f"torch {device.torch_version}"]
                      + (["packed"] if cfg.data.padding == "packed" else []))  # one row of rows*length tokens


def _read_cache(path: Path) -> dict:
    """The cache's table; empty when it is missing, and when it is damaged (then with a warning): the cache is
    only a shortcut, the search runs again and writes a sound file."""
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        table = err
    if not isinstance(table, dict):
        why = table if isinstance(table, Exception) else f"a JSON {type(table).__name__}, not a table"
        log.warning("maxout: batch finder cache %s is damaged (%s); searching again", path, why)
        return {}
    return table


def _sound(entry: Any) -> bool:
    """A cache entry with what find() reads (a damaged or hand-edited one is a miss, not a crash)."""
    try:
        return (int(entry["max_batch"]) >= 0 and int(entry["upper"]) >= 1
                and all(len(probe) == 2 for probe in entry["probes"]))
    except (KeyError, TypeError, ValueError):
        return False


def cached(cfg: Config, key: str, upper: int) -> Optional[dict]:
    """A cached search that answers for ``upper``: one that found a real limit, or searched at least as far."""
    if not cfg.batch_finder.cache:
        return None
    entry = _read_cache(cache_file(cfg)).get(key)
    if not entry or not _sound(entry):
        return None
    if entry["max_batch"] < entry["upper"] or entry["upper"] >= upper:
        return entry
    return None


def _store(cfg: Config, key: str, entry: dict) -> None:
    """Add ``entry`` to the cache, atomically (concurrent runs never read half a file). A disk that refuses (full,
    read-only) is a warning: the search's answer is used all the same."""
    if not cfg.batch_finder.cache:
        return
    path = cache_file(cfg)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        table = _read_cache(path)
        table[key] = entry
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".batch_finder-", delete=False) as tmp:
            json.dump(table, tmp, indent=1, sort_keys=True)
        os.replace(tmp.name, path)
    except OSError as err:
        if tmp is not None:
            Path(tmp.name).unlink(missing_ok=True)
        log.warning("maxout: batch finder cache %s not written (%s); this run uses the search's answer, the next "
                    "one searches again", path, err)


# ----------------------------------------------------------------------------------------------- finder


def budget_bytes(cfg: Config, device: DeviceInfo) -> Optional[float]:
    """The CPU memory budget in bytes; None on a GPU (there the device itself is the limit)."""
    if device.is_cuda:
        return None
    if cfg.batch_finder.memory_budget_gb is not None:
        return cfg.batch_finder.memory_budget_gb * GIB
    # Whole GiB, so the cache key (which names the budget) stays the same while free memory drifts a little; the
    # processes torchrun starts on this node share it.
    # An HPO worker gets its share of it (hardware.device_share).
    share = hardware.device_share()
    return float(max(1, int(psutil.virtual_memory().available * share // GIB // env_local_world_size())) * GIB)


def longest_length(cfg: Config, device: DeviceInfo, dataset: data_mod.Dataset, tokenizer: Any,
                   encode: Encode = data_mod.encode) -> int:
    """The padded length of the longest training row: what the run's widest batch will be. ``encode``: data.encode,
    or a cache of it that the probe and the run then share (one tokenization of the table for all three)."""
    if cfg.data.padding == "max_length":
        return int(build_collator(cfg, device, tokenizer)([{"input_ids": [0], "labels": 0}])["input_ids"].shape[1])
    encoded = encode(tokenizer, dataset.train, cfg.data.max_length)
    row = encoded[max(range(len(encoded)), key=encoded.lengths.__getitem__)]
    return int(build_collator(cfg, device, tokenizer)([row])["input_ids"].shape[1])


def target_batch(cfg: Config) -> int:
    if cfg.train.target_effective_batch is None:
        raise ConfigError("train.batch_size=auto needs train.target_effective_batch (the samples per optimizer "
                          "step to keep whatever micro-batch fits); set it, e.g. train.target_effective_batch=32")
    return cfg.train.target_effective_batch


@dataclass
class SearchPlan:
    """What a search for ``cfg`` looks for, and under which cache key (find() and check-hardware's lookup)."""

    target: int  # the effective batch the micro-batch must divide into
    length: int  # the longest training row, in tokens
    cap: int  # the largest micro-batch the run can use
    upper: int  # the search range's upper end
    budget: Optional[float]  # CPU memory budget in bytes; None on a GPU
    key: str


def search_for(cfg: Config, device: DeviceInfo, dataset: data_mod.Dataset, tokenizer: Any,
               encode: Encode = data_mod.encode) -> SearchPlan:
    # Under torchrun every process feeds its own micro-batch into each step: it divides the process's share.
    target = math.ceil(target_batch(cfg) / env_world_size())
    length = longest_length(cfg, device, dataset, tokenizer, encode)
    cap, budget = min(target, len(dataset.train), cfg.batch_finder.max_batch), budget_bytes(cfg, device)
    return SearchPlan(target, length, cap, search_range(cap, cfg.batch_finder.safety_margin), budget,
                      cache_key(cfg, device, length, budget))


def find(cfg: Config, device: DeviceInfo, dataset: data_mod.Dataset, tokenizer: Any,
         probe: Optional[Callable[[int], bool]] = None, encode: Encode = data_mod.encode) -> Result:
    """Search (or look up) the largest micro-batch for ``cfg`` on ``device``. ``probe`` replaces the real
    StepProbe (and bypasses the cache), e.g. with a synthetic memory model. ``encode``: as longest_length's."""
    started = time.perf_counter()
    bf = cfg.batch_finder
    plan = search_for(cfg, device, dataset, tokenizer, encode)
    target, length, cap, upper, budget, key = plan.target, plan.length, plan.cap, plan.upper, plan.budget, plan.key
    entry = cached(cfg, key, upper) if probe is None else None
    if entry:
        found, probes = min(entry["max_batch"], upper), [tuple(p) for p in entry["probes"]]
    else:
        try:
            real = StepProbe.build(cfg, device, dataset, tokenizer, target, budget, encode) if probe is None else None
        except torch.OutOfMemoryError:  # the weights and optimizer state alone do not fit the device
            raise _no_fit(cfg, device, length, budget, None) from None
        try:
            result = search(real or probe, upper)
            if result.max_batch == 0:
                raise _no_fit(cfg, device, length, budget, real)
        finally:
            if real is not None:
                real.close()
        found, probes = result.max_batch, result.probes
        if probe is None:
            _store(cfg, key, {"max_batch": found, "upper": upper, "probes": probes, "sequence_length": length,
                              "found_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                              "peak_gb": {str(r): (p / GIB if p else None) for r, p in real.peaks.items()}})
    safe = min(cap, max(1, math.floor(found * bf.safety_margin)))
    return Result(micro_batch=micro_batch_for(safe, target), max_batch=found, safe_batch=safe, upper=upper,
                  sequence_length=length, probes=probes, cache_hit=entry is not None, key=key,
                  budget_gb=None if budget is None else round(budget / GIB, 3),
                  seconds=time.perf_counter() - started)


def _no_fit(cfg: Config, device: DeviceInfo, length: int, budget: Optional[float],
            probe: Optional[StepProbe]) -> Exception:
    remedies = ("lower data.max_length, set hardware.gradient_checkpointing=true, use model.adapter=lora, or pick a "
                "smaller model")
    what = f"model '{cfg.model.name}' at sequence length {length}"
    if budget is not None and probe is not None:
        need = probe.peak_bytes(1) or 0  # measured without a limit: what the budget must at least be
        setting = "batch_finder.memory_budget_gb"
        return ConfigError(f"{setting}={budget / GIB:.3g} is below what one sample needs: {need / GIB:.3g} GiB for "
                           f"{what} (weights and optimizer state included); raise {setting} to at least "
                           f"{math.ceil(need / GIB * 1000) / 1000:g}, or {remedies}")
    on = f" on {device.name} ({device.total_memory_gb} GiB)" if device.is_cuda else ""
    return OutOfMemory(f"{what} does not fit even one sample per micro-batch{on}: {remedies}")


def resolve(cfg: Config, device: DeviceInfo, dataset: data_mod.Dataset, tokenizer: Any,
            verbose: bool = True, encode: Encode = data_mod.encode) -> tuple[int, dict[str, str]]:
    """The run's micro-batch and the params that explain it: the configured batch, or the finder's answer."""
    if cfg.batch_size != "auto":
        return resolve_micro_batch(cfg), {}
    result = find(cfg, device, dataset, tokenizer, encode=encode)
    if verbose:
        print(f"maxout: {result.summary()}", file=sys.stderr)
    return result.micro_batch, result.params()

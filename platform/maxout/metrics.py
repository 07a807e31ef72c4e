"""Measurements: throughput over a synced training window, MFU, peak memory, GPU utilization, task metrics.

Throughput counters are host integers filled from the collate function; the clock is read only at points where
the loop already syncs (log intervals), so measuring adds no device sync.

MFU (model FLOPs utilization) = model FLOPs per real token x real tokens/s / device peak FLOP/s, where

    FLOPs per token = 2·N_fwd + 2·N_fwd + 2·N_trainable  (forward, backward wrt activations, wrt weights)
                    + 12·L·d·S                        (attention scores and values, forward + backward)

N_fwd = non-embedding parameters, N_trainable = trainable non-embedding parameters (N_fwd for full fine-tuning,
which gives the familiar 6·N), L layers, d hidden size, S the mean padded sequence length. Real (non-pad)
tokens are counted, so padding waste lowers MFU, as it should. The peak is the dense tensor-core peak for the
precision in use (table in ``hardware.PEAK_TFLOPS``). There is no MFU on CPU: no meaningful peak to divide by.

Ground floor. May import: nothing (numbers in, numbers out; the caller passes the peak).
"""

from __future__ import annotations

import resource
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import pynvml
import torch


def sync(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


@dataclass
class Throughput:
    """Samples / real tokens / processed tokens over a training window that excludes evaluation pauses.

    ``steady_*`` excludes the first ``warmup_steps`` optimizer steps (compile, allocator and cache warm-up).
    """

    device_type: str
    warmup_steps: int = 3
    samples: int = 0
    real_tokens: int = 0
    tokens: int = 0
    steps: int = 0
    elapsed: float = 0.0  # seconds inside the window so far, up to the last mark
    _started: Optional[float] = None
    _steady_base: Optional[tuple] = None  # (elapsed, samples, real_tokens, steps) when warm-up ended
    _base_for_window: tuple = (0.0, 0, 0, 0)

    def start(self) -> None:
        sync(self.device_type)
        self._started = time.perf_counter()

    def pause(self) -> None:
        """Close the window (before evaluation); the caller's next resume() reopens it."""
        self.mark()
        self._started = None

    resume = start

    def add(self, samples: int, real_tokens: int, tokens: int) -> None:
        self.samples += samples
        self.real_tokens += real_tokens
        self.tokens += tokens

    def step(self) -> None:
        self.steps += 1
        if self.steps == self.warmup_steps:
            self.mark()
            self._steady_base = (self.elapsed, self.samples, self.real_tokens, self.steps)

    def mark(self) -> None:
        """Sync and fold the running interval into ``elapsed``."""
        if self._started is None:
            return
        sync(self.device_type)
        now = time.perf_counter()
        self.elapsed += now - self._started
        self._started = now

    def window_rates(self) -> dict[str, float]:
        """Rates since the previous call (for per-interval progress metrics). Call after mark()."""
        t0, s0, r0, k0 = self._base_for_window
        dt = max(self.elapsed - t0, 1e-9)
        self._base_for_window = (self.elapsed, self.samples, self.real_tokens, self.steps)
        return {"perf/window_samples_per_s": (self.samples - s0) / dt,
                "perf/window_tokens_per_s": (self.real_tokens - r0) / dt,
                "perf/window_it_per_s": (self.steps - k0) / dt}

    def summary(self) -> dict[str, float]:
        self.mark()
        t = max(self.elapsed, 1e-9)
        out = {"perf/samples_per_s": self.samples / t, "perf/tokens_per_s": self.real_tokens / t,
               "perf/it_per_s": self.steps / t,
               "perf/padding_efficiency": self.real_tokens / self.tokens if self.tokens else 1.0,
               "time/train_window_s": t, "train/samples": float(self.samples),
               "train/real_tokens": float(self.real_tokens), "train/optimizer_steps": float(self.steps)}
        if self._steady_base and self.steps > self._steady_base[3]:
            t0, s0, r0, k0 = self._steady_base
            dt = max(t - t0, 1e-9)
            out.update({"perf/steady_samples_per_s": (self.samples - s0) / dt,
                        "perf/steady_tokens_per_s": (self.real_tokens - r0) / dt,
                        "perf/steady_it_per_s": (self.steps - k0) / dt})
        return out


def flops_per_token(model: torch.nn.Module, config: Any, mean_seq_len: float) -> float:
    non_embedding = trainable = 0
    for name, p in model.named_parameters():
        if "embeddings" in name:
            continue
        non_embedding += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    layers = getattr(config, "num_hidden_layers", 0)
    hidden = getattr(config, "hidden_size", 0)
    return 4.0 * non_embedding + 2.0 * trainable + 12.0 * layers * hidden * mean_seq_len


def mfu(flops_token: float, tokens_per_s: float, peak_flops: Optional[float]) -> Optional[float]:
    if not peak_flops:
        return None
    return flops_token * tokens_per_s / peak_flops


def reset_peak_memory(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_memory(device_type: str) -> dict[str, float]:
    gib = 2.0**30
    # ru_maxrss is in KiB on Linux: the process's peak resident set since it started.
    out = {"mem/peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / gib}
    if device_type == "cuda":
        out["mem/peak_allocated_gb"] = torch.cuda.max_memory_allocated() / gib
        out["mem/peak_reserved_gb"] = torch.cuda.max_memory_reserved() / gib
    return out


@dataclass
class UtilizationSampler:
    """GPU utilization sampled by NVML on a background thread, only while the training window is open."""

    device_index: int = 0
    interval_s: float = 0.1
    samples: list = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: Optional[threading.Thread] = None
    _handle: Any = None
    available: bool = False

    def start(self) -> "UtilizationSampler":
        try:
            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.device_index)
            self.available = True
        except Exception:  # no NVML (CPU machine, or driver without it): no GPU utilization metric
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="maxout-nvml", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.samples.append(pynvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
            except Exception:
                return

    def stop(self) -> dict[str, float]:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=2)
            self._thread = None
        if not self.available or not self.samples:
            return {}
        return {"gpu/utilization_mean": sum(self.samples) / len(self.samples),
                "gpu/utilization_max": float(max(self.samples))}


def classification_metrics(preds: torch.Tensor, labels: torch.Tensor, num_labels: int) -> dict[str, torch.Tensor]:
    """Accuracy and macro-F1 as device tensors (the caller reads them in one sync)."""
    return scores_from_counts(classification_counts(preds, labels, num_labels), num_labels)


def classification_counts(preds: torch.Tensor, labels: torch.Tensor, num_labels: int) -> torch.Tensor:
    """[rows, correct, tp per class, fp per class, fn per class] as one float tensor: counts add up across shards
    (data-parallel evaluation sums them over the ranks), accuracy and F1 do not."""
    classes = torch.arange(num_labels, device=preds.device)
    is_pred, is_label = preds[:, None] == classes, labels[:, None] == classes
    return torch.cat([torch.stack([torch.tensor(float(labels.numel()), device=preds.device),
                                   (preds == labels).sum().float()]),
                      (is_pred & is_label).sum(0).float(), (is_pred & ~is_label).sum(0).float(),
                      (~is_pred & is_label).sum(0).float()])


def scores_from_counts(counts: torch.Tensor, num_labels: int) -> dict[str, torch.Tensor]:
    """Accuracy and macro-F1 (a class with no true positive scores 0) from :func:`classification_counts`."""
    rows, correct = counts[0], counts[1]
    tp, fp, fn = counts[2:].view(3, num_labels)
    f1 = torch.where(tp > 0, 2 * tp / (2 * tp + fp + fn).clamp(min=1), torch.zeros_like(tp))
    return {"accuracy": correct / rows, "macro_f1": f1.mean()}

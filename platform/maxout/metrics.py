"""Measurements: throughput over a synced training window, MFU, peak memory, GPU utilization, task metrics.

Throughput counters are host integers filled from the collate function; the clock is read only at points where
the loop already syncs (log intervals), so measuring adds no device sync.

Task metrics come from a confusion matrix counted on the device and read once (``confusion_matrix``, then
``classification_scores`` on the host).

MFU (model FLOPs utilization) = model FLOPs per real token x real tokens/s / device peak FLOP/s. The FLOPs are
those of the model's matmuls, counted the way autograd runs them (``count_flops``):

    per linear layer that runs on every token, with n = in x out weights:
        2n forward
      + 2n if its weight trains                       (weight gradient)
      + 2n if its input needs a gradient              (backward through activations: only where a trainable
                                                        parameter lies below it)
    per attention layer, with A = heads x head_dim (the real attention width; Gemma and Qwen3 differ from the
    hidden size) and K = keys per query (S; S/2 when causal; capped by a sliding window):
        4·A·K forward (scores and weighted values) x 3 when a gradient flows through it

S is the mean real (unpadded) sequence length: real tokens / samples. For full fine-tuning this is the familiar
6·N + 12·L·d·S; with a frozen encoder the encoder's backward vanishes; with LoRA the frozen weights cost a
forward and the backward through activations, the adapters all three. GQA's smaller k/v projections are simply
fewer weights. A layer that runs once per sequence (BERT's pooler and classifier) counts 1/S per token.
Elementwise work (norms, activations, softmax, dropout) is not counted, and with mixed lengths the attention term
uses S, not E[S²]/E[S]: both keep MFU conservative. Which weights train and which inputs need a gradient are read
from autograd itself, on a one-row probe in eval mode (forward hooks; no dropout, so no random numbers drawn).
Padding counts as waste, as it should. The peak is the dense tensor-core peak for the precision in use (table in
``hardware.PEAK_TFLOPS``). There is no MFU on CPU: no meaningful peak to divide by.

Ground floor. May import: nothing (numbers in, numbers out; the caller passes the peak).
"""

from __future__ import annotations

import contextlib
import re
import resource
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import pynvml
import torch
from torch.utils._python_dispatch import TorchDispatchMode


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
    window: Optional["SteadyWindow"] = None  # the GPU's figures over the steady window (a CUDA device only)

    def start(self) -> None:
        sync(self.device_type)
        self._started = time.perf_counter()
        if self.window is not None and self._steady_base is not None:  # after an evaluation, or a resumed run
            self.window.resume()

    def pause(self) -> None:
        """Close the window (before evaluation); the caller's next resume() reopens it."""
        self.mark()
        self._started = None
        if self.window is not None:
            self.window.pause()

    resume = start

    @property
    def running(self) -> bool:
        """Started and not paused: time now counts in the window."""
        return self._started is not None

    def begin_step(self) -> None:
        """Before the step's first kernel is queued (CUDA-event busy time)."""
        if self.window is not None:
            self.window.busy.begin()

    def add(self, samples: int, real_tokens: int, tokens: int) -> None:
        self.samples += samples
        self.real_tokens += real_tokens
        self.tokens += tokens

    def step(self) -> None:
        """After the step's last kernel is queued."""
        if self.window is not None:
            self.window.busy.end()
        self.steps += 1
        if self.steps == self.warmup_steps:
            self.mark()
            self._steady_base = (self.elapsed, self.samples, self.real_tokens, self.steps)
            if self.window is not None:
                self.window.resume()

    def mark(self) -> None:
        """Sync and fold the running interval into ``elapsed``."""
        if self._started is None:
            return
        sync(self.device_type)
        now = time.perf_counter()
        self.elapsed += now - self._started
        self._started = now
        if self.window is not None:
            self.window.busy.collect()  # the device is idle: every event recorded so far has completed

    def state_dict(self) -> dict[str, Any]:
        """The counters up to now (one sync), for a checkpoint: a resumed run's figures go on from them."""
        self.mark()
        return {"samples": self.samples, "real_tokens": self.real_tokens, "tokens": self.tokens, "steps": self.steps,
                "elapsed": self.elapsed, "steady_base": list(self._steady_base) if self._steady_base else None}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue from the counters of the run's earlier segments (resume): the samples they trained and the
        seconds they took both count, so every rate stays samples / training-window seconds over the run."""
        self.samples, self.real_tokens, self.tokens = saved["samples"], saved["real_tokens"], saved["tokens"]
        self.steps, self.elapsed = saved["steps"], saved["elapsed"]
        self._steady_base = tuple(saved["steady_base"]) if saved["steady_base"] else None
        self._base_for_window = (self.elapsed, self.samples, self.real_tokens, self.steps)

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
            out.update({"time/steady_window_s": dt, "perf/steady_samples_per_s": (self.samples - s0) / dt,
                        "perf/steady_tokens_per_s": (self.real_tokens - r0) / dt,
                        "perf/steady_it_per_s": (self.steps - k0) / dt})
        return out


@dataclass
class FlopCount:
    """Training FLOPs per real token, by where they go (see the module docstring)."""

    forward: float  # linear layers, forward
    weight_grads: float  # linear layers whose weights train
    input_grads: float  # linear layers whose input needs a gradient (backward through activations)
    attention: float  # scores and weighted values, forward and (where a gradient flows) backward

    @property
    def total(self) -> float:
        return self.forward + self.weight_grads + self.input_grads + self.attention


@dataclass
class _Linear:
    weights: int
    trains: bool
    input_grad: bool
    rows: int  # rows it processed in the probe: the probe's tokens, or 1 for a once-per-sequence layer


@dataclass
class _Attention:
    causal: bool
    window: Optional[int]
    backward: bool


def _first_tensor(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    return next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)


@dataclass(frozen=True)
class FlopProbe:
    """What ``probe`` recorded: enough to count FLOPs at any mean length without running the model again."""

    linears: tuple
    attentions: tuple
    tokens: int


def probe(model: torch.nn.Module, config: Any, tokens: int = 8) -> FlopProbe:
    """The model's matmuls as autograd runs them (see ``count_flops``). Run it on the plain model, before data
    parallelism wraps or shards it (the trainer does, at set-up): a sharded model only runs through its root."""
    return FlopProbe(*map(tuple, _probe(model, config, tokens)), tokens)


def _probe(model: torch.nn.Module, config: Any, tokens: int) -> tuple[list[_Linear], list[_Attention]]:
    """Run one row of ``tokens`` tokens through ``model`` (eval mode, gradients on) and record, per linear layer
    and per attention layer, what autograd would have to compute for it."""
    linears: list[_Linear] = []
    attentions: list[_Attention] = []

    def on_linear(module: torch.nn.Linear, args: tuple, output: torch.Tensor) -> None:
        linears.append(_Linear(module.weight.numel(), module.weight.requires_grad, bool(args[0].requires_grad),
                               output.numel() // module.out_features))

    def on_attention(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        # transformers' attention modules carry `is_causal`; a gradient flows through the scores when their input
        # needs one or the module's own projections (or adapters on them) train
        hidden = _first_tensor(args, kwargs)
        backward = bool(hidden is not None and hidden.requires_grad) or any(
            p.requires_grad for p in module.parameters())
        attentions.append(_Attention(bool(module.is_causal), getattr(module, "sliding_window", None), backward))

    hooks = [m.register_forward_hook(on_linear) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    hooks += [m.register_forward_pre_hook(on_attention, with_kwargs=True) for m in model.modules()
              if hasattr(m, "is_causal") and not isinstance(m, torch.nn.Linear)]
    device = next(model.parameters()).device
    ids = torch.arange(1, tokens + 1, device=device).remainder(max(getattr(config, "vocab_size", tokens + 1) - 1, 1))
    was_training = model.training
    model.eval()  # no dropout: the probe draws no random numbers, so a seeded run stays reproducible
    try:
        with torch.enable_grad():
            model(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None])
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return linears, attentions


def _keys_per_query(seq_len: float, causal: bool, window: Optional[int]) -> float:
    """Mean number of keys a query attends to."""
    if not causal:
        return seq_len
    if window and seq_len > window:  # the first `window` queries see a growing prefix, the rest `window` keys
        return window - window * window / (2 * seq_len)
    return seq_len / 2


def count_flops(model: torch.nn.Module | FlopProbe, config: Any, mean_seq_len: float,
                probe_tokens: int = 8) -> FlopCount:
    """Training FLOPs per real token of ``model`` (optionally peft-wrapped; or its ``probe``) at mean real length
    ``mean_seq_len``."""
    found = model if isinstance(model, FlopProbe) else probe(model, config, probe_tokens)
    linears, attentions, probe_tokens = list(found.linears), list(found.attentions), found.tokens
    forward = weight_grads = input_grads = 0.0
    for layer in linears:
        per_token = layer.rows / probe_tokens if layer.rows > 1 else 1.0 / max(mean_seq_len, 1.0)
        flops = 2.0 * layer.weights * per_token
        forward += flops
        weight_grads += flops if layer.trains else 0.0
        input_grads += flops if layer.input_grad else 0.0
    if not attentions:  # attention modules without `is_causal` (transformers 4's BERT): one per layer, per config
        backward = any(layer.input_grad for layer in linears)
        attentions = [_Attention(bool(getattr(config, "is_decoder", False)), None, backward)] * getattr(
            config, "num_hidden_layers", 0)
    heads = getattr(config, "num_attention_heads", 0)
    width = heads * (getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // max(heads, 1))
    attention = sum(4.0 * width * _keys_per_query(mean_seq_len, a.causal, a.window) * (3 if a.backward else 1)
                    for a in attentions)
    return FlopCount(forward, weight_grads, input_grads, attention)


def flops_per_token(model: torch.nn.Module | FlopProbe, config: Any, mean_seq_len: float) -> float:
    """Training FLOPs per real token (the MFU numerator's first factor; see ``count_flops``)."""
    return count_flops(model, config, mean_seq_len).total


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
    """GPU utilization sampled by NVML on a background thread while it is not paused (the loop samples the steady
    window only: ``SteadyWindow``).

    NVML's figure is the share of its own last sample period (1/6 s to 1 s) in which a kernel ran, so the reading
    taken at stop() still describes the window's end: it is always taken, and a window shorter than ``interval_s``
    gets that one. ``nvml`` is the pynvml module (a stand-in in tests); every nvmlInit is paired with a shutdown."""

    device_index: int = 0
    interval_s: float = 0.1
    samples: list = field(default_factory=list)
    nvml: Any = pynvml
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: Optional[threading.Thread] = None
    _handle: Any = None
    available: bool = False
    _paused: threading.Event = field(default_factory=threading.Event)

    def pause(self) -> None:
        """No samples until resume() (an evaluation: its kernels are not training's)."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    def start(self) -> "UtilizationSampler":
        try:
            self.nvml.nvmlInit()
        except Exception:  # no NVML (CPU machine, or driver without it): no GPU utilization metric
            return self
        try:
            self._handle = self.nvml.nvmlDeviceGetHandleByIndex(self.device_index)
        except Exception:
            self.nvml.nvmlShutdown()
            return self
        self.available = True
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="maxout-nvml", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> bool:
        try:
            self.samples.append(self.nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
            return True
        except Exception:
            return False

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self._paused.is_set() and not self._sample():
                return

    def stop(self) -> dict[str, float]:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=2)
            self._thread = None
        if self.available:
            if not self._paused.is_set():
                self._sample()
            self.available = False
            with contextlib.suppress(Exception):
                self.nvml.nvmlShutdown()
        if not self.samples:
            return {}
        return {"gpu/utilization_mean": sum(self.samples) / len(self.samples),
                "gpu/utilization_max": float(max(self.samples))}


# The aten ops that make the host wait for the device: they return a value the host reads (a scalar, a
# data-dependent size) or copy to host memory. On a CPU they run as everywhere, so counting them there says how
# often the same code would stall a GPU.
SYNC_OPS = frozenset({"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero",
                      "aten::nonzero_static", "aten::equal", "aten::masked_select", "aten::unique_consecutive",
                      "aten::_unique2", "aten::unique_dim"})


class HostSyncs(TorchDispatchMode):
    """Counts, per op name, the calls in ``SYNC_OPS`` and the copies from a device to the host (``.cpu()``,
    ``.to("cpu")``) made while it is active. (``Tensor.tolist()`` of a CPU tensor dispatches nothing: on a GPU it
    is a copy, counted.) ``mark()`` returns the count since the previous mark: the syncs of one step."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self._marked = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket._qualified_op_name
        if name in SYNC_OPS or (name in ("aten::_to_copy", "aten::copy_") and _to_host(name, args, kwargs)):
            self.counts[name] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def mark(self) -> int:
        since, self._marked = self.total - self._marked, self.total
        return since


def _to_host(name: str, args: tuple, kwargs: dict) -> bool:
    if name == "aten::copy_":  # dst.copy_(src)
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    target = kwargs.get("device")
    return args[0].device.type != "cpu" and target is not None and torch.device(target).type == "cpu"


class DeviceBusy:
    """CUDA-event time inside training steps: an event before each step's first kernel is queued and one after its
    last, read at sync points only (``collect``), so measuring adds no sync. The sum over the steady window, beside
    its wall time, says how long the device was kept inside steps: gaps between steps (data loading, a host sync,
    logging) show as the rest. A host that launches more slowly than the device computes leaves idle gaps inside a
    step too, which this counts as busy (an upper bound; NVML's utilization and the profile see those).
    ``event``: makes a timing event (torch.cuda.Event; a stand-in in tests)."""

    def __init__(self, event: Optional[Any] = None):
        self.event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self.active, self.busy_s, self.steps = False, 0.0, 0
        self._begun: Optional[Any] = None
        self._pending: list = []  # (begin, end) events not read yet

    def begin(self) -> None:
        if self.active:
            self._begun = self.event()
            self._begun.record()

    def end(self) -> None:
        if self.active and self._begun is not None:
            done = self.event()
            done.record()
            self._pending.append((self._begun, done))
        self._begun = None

    def collect(self) -> None:
        """Add up the steps recorded so far: call only after a device sync (every event has completed)."""
        for begun, done in self._pending:
            self.busy_s += begun.elapsed_time(done) / 1e3  # milliseconds
            self.steps += 1
        self._pending.clear()


@dataclass
class SteadyWindow:
    """The GPU's figures over the steady window only: after warm-up (compile, CUDA-graph recording, allocator) and
    outside evaluations. Throughput opens it when warm-up ends and pauses it around each evaluation; NVML sampled
    from the first step to the last evaluation logged 7.4% next to 24% MFU on an H200 (issue 37)."""

    sampler: UtilizationSampler
    busy: DeviceBusy
    opened: bool = False

    def resume(self) -> None:
        if not self.opened:
            self.sampler.start()
            self.opened = True
        self.sampler.resume()
        self.busy.active = True

    def pause(self) -> None:
        self.sampler.pause()
        self.busy.active = False

    def stop(self, window_s: Optional[float]) -> dict[str, float]:
        """The window's figures: NVML utilization and the CUDA-event busy time, as seconds and as a share of the
        steady window's wall time ``window_s``."""
        self.busy.collect()
        out = self.sampler.stop() if self.opened else {}
        if self.busy.steps:
            out["gpu/busy_s"] = self.busy.busy_s
            if window_s:
                out["gpu/busy_share"] = self.busy.busy_s / window_s
        return out


def confusion_matrix(preds: torch.Tensor, labels: torch.Tensor, num_labels: int) -> torch.Tensor:
    """Counts on the device (rows: true label, columns: predicted), built without a host sync: every task metric
    (accuracy, macro-F1, per-class precision / recall / F1) follows from it on the host once it is read."""
    index = labels * num_labels + preds  # scatter_add_, not bincount: CUDA's bincount reads the max (a sync)
    counts = torch.zeros(num_labels * num_labels, dtype=torch.long, device=preds.device)
    return counts.scatter_add_(0, index, torch.ones_like(index)).view(num_labels, num_labels)


def label_key(label: str) -> str:
    """A label as it may appear in a metric name (MLflow allows letters, digits, ``_ - . : space``; a ``/`` would
    nest the name)."""
    return re.sub(r"[^\w.\- :]", "_", str(label)) or "_"


def per_class_name(split: str, score: str, label: str) -> str:
    """``eval/f1/<label>``: per-class precision, recall and F1 are named like this."""
    return f"{split}/{score}/{label_key(label)}"


def per_class_scores(confusion: list[list[int]]) -> list[tuple[float, float, float, int]]:
    """Each class's precision, recall, F1 and support (its true rows), from a confusion matrix (host numbers).

    A class with no true positive scores 0 (also when it is absent from both truth and predictions): scikit-learn's
    ``zero_division=0`` with ``labels=`` all classes. The logged metrics and the classification report both read it.
    """
    k = len(confusion)
    true_totals = [sum(confusion[c]) for c in range(k)]
    predicted_totals = [sum(confusion[r][c] for r in range(k)) for c in range(k)]
    scores = []
    for c in range(k):
        tp = confusion[c][c]
        precision = tp / predicted_totals[c] if predicted_totals[c] else 0.0
        recall = tp / true_totals[c] if true_totals[c] else 0.0
        f1 = 2 * tp / (true_totals[c] + predicted_totals[c]) if tp else 0.0
        scores.append((precision, recall, f1, true_totals[c]))
    return scores


def accuracy(confusion: list[list[int]]) -> float:
    """The share of rows on the diagonal (0 for an empty matrix)."""
    total = sum(map(sum, confusion))
    return sum(confusion[c][c] for c in range(len(confusion))) / total if total else 0.0


def classification_scores(confusion: list[list[int]], label_names: list[str], split: str = "eval") -> dict[str, float]:
    """Accuracy, macro-F1 and per-class precision / recall / F1 from a confusion matrix (host numbers); macro-F1
    averages over every class of the label set (per_class_scores)."""
    k = len(confusion)
    out: dict[str, float] = {f"{split}/accuracy": accuracy(confusion)}
    scores = per_class_scores(confusion)
    for name, (precision, recall, f1, _) in zip(label_names, scores):
        out.update({per_class_name(split, "precision", name): precision, per_class_name(split, "recall", name): recall,
                    per_class_name(split, "f1", name): f1})
    out[f"{split}/macro_f1"] = sum(f1 for _, _, f1, _ in scores) / k if k else 0.0
    return out

"""Skip dynamo's guard evaluation for a training forward whose inputs have already passed the full guards this run.

Why: every call of a compiled module first evaluates the guards of its cached graph (each parameter's tensor
properties, module attributes, global state): "TorchDynamo Cache Lookup" in a profile. On the H200 at batch 64, with
CUDA graphs replaying the step, the host set the pace (13.7 ms of wall for 9.5 ms of kernels) and that lookup took
1.81 ms of its CPU time a step (run 7, 2026-11-28). torch's own switch for it,
``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``, runs only the guards that tell cached graphs apart (those
on tensors, and any that failed before), and is "unsafe" because a call in a state no cached graph was compiled for
may then run one that does not fit it: with one graph cached, a module switched to eval mode runs its training graph,
dropout and all (tests/test_skip_guards.py).

What makes it safe here: the forward skips the guards only for an input signature (every input's shape, stride and
dtype, grad mode, autocast, the training flag) that has already passed the full guards in this run, and only while
dynamo has compiled nothing since the first call. A new signature (an epoch's partial batch, a new width, an
out-of-memory chunk, the batch finder's probes) runs the full guards; if they recompile, the skipping ends for the
rest of the run, since with two graphs the differentiating guards alone would have to choose between them. So a
skipped call runs the very graph the same signature's guarded call ran. Where torch's remaining tensor guards still
refuse a call (they see more of a tensor than the signature: an inference tensor's dispatch keys), it raises before
running anything, and the call runs again with the full guards, as every later one. Evaluation runs the eager model
and never comes here.

Not with data parallelism: DDP's gradient sync (``no_sync`` between accumulated micro-batches) and FSDP's hooks are
state of the wrapper that its guards cover and an input signature does not. Not with packed batches: their token
count changes every step, so a signature is rarely seen twice and nothing would be skipped.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from .compile import compiled_graphs

# What dynamo raises (from C++) where a call under skip_guard_eval_unsafe would need a new graph (torch 2.11-2.13)
RECOMPILE_REFUSED = "Recompilation triggered with skip_guard_eval_unsafe stance"


def supported(compiled: bool, packed: bool, parallel: str = "none") -> tuple[bool, str]:
    """``packed``: batches are packed; ``parallel``: the data_parallel decision's value."""
    if not compiled:
        return False, "compile is off: there are no guards to evaluate"
    if parallel != "none":
        return False, (f"data parallel ({parallel}): the wrapper's own state (DDP's gradient sync, FSDP's hooks) is "
                       f"guarded too, and an input signature does not name it")
    if packed:
        return False, ("packed batches change their token count every step: a signature runs the full guards the "
                       "first time it is seen, so nearly none would be skipped")
    return True, ""


def signature(inputs: dict, module: Any) -> Optional[tuple]:
    """What dynamo's guards read of a call that can change between training steps, as a hashable key; None where an
    input is neither a tensor, a plain value nor a mapping of them by name (prepared masks by layer type), so the
    call always runs the full guards."""
    key: list = [torch.is_grad_enabled(), getattr(module, "training", None)]
    for device_type in ("cuda", "cpu"):
        enabled = torch.is_autocast_enabled(device_type)
        key.append((enabled, torch.get_autocast_dtype(device_type) if enabled else None))
    values = _signature(inputs)
    return None if values is None else (*key, values)


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.shape, value.stride(), value.dtype, value.device, value.requires_grad
    if value is None or isinstance(value, (bool, int, float, str)):
        return type(value), value  # the type too: a guard on True does not pass 1
    if isinstance(value, dict) and all(isinstance(name, str) for name in value):
        described = [(name, _signature(value[name])) for name in sorted(value)]
        return None if any(d is None for _, d in described) else ("mapping", tuple(described))
    return None


class GuardSkippingForward:
    """``forward`` (a compiled module, or its CUDA-graph step-marking wrapper) that skips guard evaluation for
    signatures already seen while nothing has recompiled. ``module``: whose training flag the signature reads."""

    def __init__(self, forward: Callable, module: Any, graphs: Callable[[], int] = compiled_graphs):
        functools.update_wrapper(self, forward, updated=())
        self.forward, self.module, self.graphs = forward, module, graphs
        self.seen: set = set()
        self.baseline: Optional[int] = None  # dynamo's graph count after the first call; None before it
        self.active = True  # False once something recompiled: the full guards for the rest of the run
        self.skipped = self.guarded = 0  # calls of each kind (tests and the run's record read them)

    def __call__(self, *args: Any, **inputs: Any) -> Any:
        if args:  # the loop passes inputs by name; anything else always runs the full guards
            return self.forward(*args, **inputs)
        key = signature(inputs, self.module) if self.active else None
        if key is not None and key in self.seen and self.graphs() == self.baseline:
            try:
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    out = self.forward(**inputs)
                self.skipped += 1
                return out
            except RuntimeError as err:
                if RECOMPILE_REFUSED not in str(err):
                    raise
                # The guards that tell graphs apart (those on tensors) failed for a signature seen before: they see
                # more than it does (an inference tensor's dispatch keys, say). dynamo refused before running
                # anything, so the call runs again with the full guards, as every call does from now on.
                self._stop_skipping()
        out = self.forward(**inputs)
        self.guarded += 1
        graphs = self.graphs()
        if self.baseline is None:
            self.baseline = graphs
        elif graphs != self.baseline:  # this call (or someone's in this process) compiled: stop skipping
            self._stop_skipping()
        if self.active and key is not None:
            self.seen.add(key)
        return out

    def _stop_skipping(self) -> None:
        """The full guards for every later call of the run."""
        self.active = False
        self.seen.clear()


def apply(forward: Callable, module: Any) -> GuardSkippingForward:
    return GuardSkippingForward(forward, module)


def counts(forward: Any) -> dict[str, float]:
    """A run's record of its training forwards, guarded and skipped (nothing where ``forward`` skips none)."""
    if not isinstance(forward, GuardSkippingForward):
        return {}
    return {"compile/forwards_guarded": float(forward.guarded), "compile/forwards_guards_skipped": float(forward.skipped)}

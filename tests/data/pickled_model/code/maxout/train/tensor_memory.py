"""Peak tensor memory on the CPU, and a memory budget that fails the way a full GPU does.

CUDA's allocator counts what tensors hold (``torch.cuda.max_memory_allocated``) and raises
``torch.OutOfMemoryError`` when the device is full. The CPU has neither: process RSS mixes in Python, libraries and
pages malloc keeps after a free. :class:`TensorMemory` counts what CUDA would count, the bytes of live tensor
storages: a dispatch mode sees every storage an op creates, and a weak reference on the storage sees it freed
(torch keeps a storage's Python object alive exactly as long as the storage). Past ``limit`` bytes it raises
``torch.OutOfMemoryError``, so the batch finder and OOM recovery run the same code on a CPU as on a GPU.

It sees tensors created while it is active; what existed before (weights, optimizer state) is passed as
``baseline``. Every op goes through Python while it is on, so it is for probes and tests, not for timed training.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

GIB = 2.0**30


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class TensorMemory(TorchDispatchMode):
    """``with TensorMemory(limit_bytes, baseline=tensors) as mem: ...``; then ``mem.peak`` (bytes)."""

    def __init__(self, limit_bytes: Optional[float] = None, baseline: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.limit = limit_bytes
        self._live: dict[int, int] = {}  # storage data_ptr -> bytes, for storages created inside the mode
        self._refs: dict[int, weakref.ref] = {}
        self.baseline = sum({_storage_key(t): t.untyped_storage().nbytes() for t in baseline
                             if t.device.type == "cpu"}.values())
        self.current = self.baseline
        self.peak = self.baseline

    def _freed(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)
        self._refs.pop(key, None)

    def _created(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if not size or key in self._live:
            return
        self._live[key] = size
        self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._freed(key))
        self.current += size
        self.peak = max(self.peak, self.current)
        if self.limit is not None and self.current > self.limit:
            raise torch.OutOfMemoryError(
                f"CPU memory budget exceeded: {self.current / GIB:.3f} GiB of tensors live, budget "
                f"{self.limit / GIB:.3f} GiB")

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # In-place ops, out= ops and views return storages that already existed: only new storages count.
        inputs = {_storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and _storage_key(t) not in inputs:
                self._created(t)
        return out


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Tensors a training step finds already allocated: weights, buffers, gradients, optimizer state."""
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors

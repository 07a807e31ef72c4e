"""Packing into bins (``data.padding=packed`` with ``data.packing_attention=bins``): each micro-batch is a fixed
number of rows ("bins") of ``data.max_length`` tokens, each bin holding several whole samples one after another,
their position ids restarting at every sample, and each bin's samples kept apart by a block-diagonal mask of the
bin's width. It is the packing of Graphcore's packed BERT (Krell et al., 2021, "Efficient sequence packing without
cross-contamination"), with first-fit in place of their histogram packing.

Why, beside the flattened packing of packing.py:
- the mask is a bin's, not the batch's: attention costs each bin's width squared, where packing.py's mask mode spans
  the whole flattened row (its token budget squared), so bins are the mask path's padding-free layout on every
  device;
- on a GPU, attention kernels work in tiles of 64 to 128 tokens a side. A sample of ~62 tokens, alone in its row
  (bucketing) or alone in its tile (varlen), leaves most of a tile empty: in run 7 (2026-11-28, the H200,
  BERT-base at micro-batch 1024 of <= 128 tokens) attention did its real work at ~27 TFLOP/s, a thirtieth of the
  matmuls' rate. In a bin, samples share tiles: fewer tiles than bucketed rows of 65-128 tokens, more than rows of
  64 or fewer (whose tiles are smaller); which way a mix nets out is the GPU report's mfu case to say;
- the SDPA kernels with masks keep BERT's attention-probability dropout, which torch's varlen kernel has not got;
- every batch but an epoch's last has one shape, [bins, max_length] (only the samples a batch holds vary).

What it costs: a bin's free tail is padding (first-fit over the shuffled order fills ~96% of the demo mix's bins at
128 tokens; ``perf/padding_efficiency`` says it), and a bin's mask spans samples that do not attend to each other.

The pieces:
- ``first_fit``: each row, in order, into the first bin with room, a new bin where none has (the sampler and the
  collator run the same one, so the collator rebuilds exactly the sampler's bins from the rows' order alone);
- ``BinSampler``: each epoch, the rows in the seeded random order length bucketing starts from, placed into batches
  of ``max_tokens // width`` bins; a row that fits none of a full batch's bins waits for the next batch, and a batch
  closes after ``LOOKAHEAD`` rows in a row found no room. A pure function of (seed, epoch), dealt out by rank as
  the token-budget batches are;
- ``BinnedCollator``: rows -> ``input_ids``, ``position_ids``, ``token_type_ids`` [bins, width], ``labels`` one per
  sample (numbered bin by bin), and a ``BinnedLayout``, which serving/pooling.py reads to build the bins' masks and
  to pool one vector per sample;
- ``split``: a binned batch as chunks of whole bins (out-of-memory recovery).
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from .bucketing import epoch_order
from .packing import TokenBudgetSampler

LOOKAHEAD = 64  # rows in a row that found no room in a full batch's bins before the batch closes


class Bins:
    """First-fit bins of ``width`` tokens, at most ``limit`` of them: ``place(n)`` puts a row of ``n`` tokens into
    the first open bin with room, else into a new one, and says where (bin, offset), or None where no bin may take
    it. ``most``: the most room an open bin has, so that a row no bin can take costs no array scan."""

    def __init__(self, width: int, limit: Optional[int] = None):
        self.width, self.limit = width, limit
        self.room = np.zeros(limit or 64, dtype=np.int64)
        self.opened, self.most = 0, 0

    def place(self, n: int) -> Optional[tuple[int, int]]:
        if n <= self.most:
            b = int(np.argmax(self.room[:self.opened] >= n))
        elif self.limit is None or self.opened < self.limit:
            b = self.opened
            if b == self.room.size:
                self.room = np.concatenate([self.room, np.zeros_like(self.room)])
            self.room[b], self.opened = self.width, b + 1
        else:
            return None
        before = int(self.room[b])
        self.room[b] = before - n
        if b == self.opened - 1 and before == self.width and before - n > self.most:  # a new bin has the most room
            self.most = before - n
        elif before == self.most:
            self.most = int(self.room[:self.opened].max())
        return b, self.width - before


def first_fit(lengths: list[int], width: int, bins: Optional[int] = None) -> tuple[list[int], list[int]]:
    """Each row's bin and its offset in the bin, the rows placed in order (``Bins``). ``bins``: at most that many; a
    row that fits none of them gets bin -1 (it is left for later)."""
    placer = Bins(width, bins)
    placed = [placer.place(n) or (-1, -1) for n in lengths]
    return [b for b, _ in placed], [o for _, o in placed]


class BinSampler(TokenBudgetSampler):
    """Batches of row indices that fill at most ``max_tokens // width`` bins of ``width`` tokens each, in the order
    the rows were placed (``first_fit`` over it gives the same bins)."""

    def __init__(self, lengths: list[int], max_tokens: int, width: int, seed: int, rank: int = 0,
                 world_size: int = 1):
        super().__init__(lengths, max_tokens, seed, rank, world_size)
        self.width, self.bins = width, max(1, max_tokens // width)
        self._planned: dict[int, list[list[int]]] = {}  # epoch -> its batches: planning the run counts every epoch's

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        if epoch not in self._planned:
            if len(self._planned) > 2:  # the epochs planned ahead are counted once; keep only a few
                self._planned.pop(next(iter(self._planned)))
            self._planned[epoch] = self._place(epoch)
        return self._planned[epoch]

    def _place(self, epoch: int) -> list[list[int]]:
        order, _ = epoch_order(len(self.lengths), self.seed, epoch)
        pending = collections.deque(int(i) for i in order)
        shortest = min(self.lengths)
        batches = []
        while pending:
            bins, batch, waiting, misses = Bins(self.width, self.bins), [], [], 0
            while pending and misses < LOOKAHEAD:
                i = pending.popleft()
                if bins.place(self.lengths[i]) is not None:
                    batch.append(i)
                    misses = 0
                    continue
                waiting.append(i)
                misses += 1
                if bins.most < shortest:  # every bin is open and no row can fit any more
                    break
            pending.extendleft(reversed(waiting))  # the rows that waited start the next batch, in their order
            batches.append(batch)
        return batches

    def tokens(self, batch: list[int]) -> int:
        """The tokens a batch costs: its bins, padding included."""
        return len(set(first_fit([self.lengths[i] for i in batch], self.width)[0])) * self.width


@dataclass
class BinnedLayout:
    """Where each sample sits in a binned batch."""

    seq_idx: torch.Tensor  # [bins, width] int32: each token's sample (numbered bin by bin); padding is ``samples``
    starts: torch.Tensor  # [bins + 1] int64, host: bin b holds samples starts[b] .. starts[b + 1] - 1
    samples: int

    def to(self, device: Any, non_blocking: bool = False) -> "BinnedLayout":
        return BinnedLayout(self.seq_idx.to(device, non_blocking=non_blocking), self.starts, self.samples)

    def pin_memory(self) -> "BinnedLayout":  # the DataLoader's pin_memory calls this on objects that have it
        return BinnedLayout(self.seq_idx.pin_memory(), self.starts, self.samples)


class BinnedCollator:
    """Rows (in the order BinSampler placed them) -> one binned micro-batch: ``input_ids``, ``position_ids`` and
    ``token_type_ids`` (when the rows have them) [bins, width], ``labels`` [samples] in bin order, ``packing`` (a
    BinnedLayout) and the token counts (the bins' free tails are padding)."""

    def __init__(self, width: int, pad_token_id: int, position_ids_start: int = 0):
        self.width, self.pad_token_id, self.position_ids_start = width, pad_token_id, position_ids_start

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        lengths = [len(r["input_ids"]) for r in rows]
        if max(lengths) > self.width:  # rows are cut to data.max_length, which the width is at least
            raise ValueError(f"a row of {max(lengths)} tokens does not fit a bin of {self.width}")
        where, offsets = first_fit(lengths, self.width)
        order = sorted(range(len(rows)), key=lambda i: (where[i], offsets[i]))  # samples numbered bin by bin
        rows = [rows[i] for i in order]
        length = torch.tensor([lengths[i] for i in order], dtype=torch.long)
        bin_of = torch.tensor([where[i] for i in order], dtype=torch.long)
        bins, tokens = max(where) + 1, sum(lengths)  # host ints: reading a tensor would count as a host sync
        starts = torch.zeros(bins + 1, dtype=torch.long)
        starts[1:] = torch.bincount(bin_of, minlength=bins).cumsum(0)
        sample_of_token = torch.repeat_interleave(torch.arange(len(rows)), length)  # [tokens]
        first_token = torch.cumsum(length, 0) - length  # each sample's first token among the joined tokens
        place = torch.tensor([offsets[i] for i in order], dtype=torch.long) + bin_of * self.width
        position_in_sample = torch.arange(tokens) - first_token[sample_of_token]
        slot = place[sample_of_token] + position_in_sample  # each token's place in the [bins * width] batch
        seq_idx = torch.full((bins * self.width,), len(rows), dtype=torch.int32)
        seq_idx[slot] = sample_of_token.to(torch.int32)
        positions = torch.full((bins * self.width,), self.position_ids_start, dtype=torch.long)
        positions[slot] = position_in_sample + self.position_ids_start
        shape = (bins, self.width)
        batch = {"input_ids": _scattered((r["input_ids"] for r in rows), tokens, slot, shape, self.pad_token_id),
                 "position_ids": positions.view(shape),
                 "labels": torch.tensor([r["labels"] for r in rows], dtype=torch.long),
                 "packing": BinnedLayout(seq_idx.view(shape), starts, len(rows)),
                 "num_real_tokens": tokens, "num_tokens": bins * self.width}
        if "token_type_ids" in rows[0]:
            batch["token_type_ids"] = _scattered((r["token_type_ids"] for r in rows), tokens, slot, shape, 0)
        return batch


def _scattered(values: Any, count: int, slot: torch.Tensor, shape: tuple[int, int], fill: int) -> torch.Tensor:
    """[bins, width] long: the rows' values at their slots, ``fill`` elsewhere."""
    joined = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(values), dtype=np.int64, count=count))
    out = torch.full((shape[0] * shape[1],), fill, dtype=torch.long)
    out[slot] = joined
    return out.view(shape)


def split(batch: dict[str, Any], rows_per_chunk: int) -> list[tuple[dict[str, Any], float]]:
    """A binned micro-batch as chunks of whole bins holding about ``rows_per_chunk`` samples each, each with its
    share of the samples (the weight of its mean loss): how out-of-memory recovery (train/oom.py) splits it."""
    layout: BinnedLayout = batch["packing"]
    bins = layout.seq_idx.shape[0]
    per_chunk = max(1, -(-bins * rows_per_chunk // layout.samples))  # bins, rounded up
    chunks = []
    for first in range(0, bins, per_chunk):
        last = min(first + per_chunk, bins)
        low, high = int(layout.starts[first]), int(layout.starts[last])
        seq = layout.seq_idx[first:last]
        seq = torch.where(seq == layout.samples, high - low, seq - low).to(layout.seq_idx.dtype)
        chunk = {k: batch[k][first:last] for k in ("input_ids", "position_ids", "token_type_ids") if k in batch}
        chunk.update(labels=batch["labels"][low:high], packing=BinnedLayout(seq, layout.starts[first:last + 1] - low,
                                                                          high - low),
                     num_real_tokens=int((seq < high - low).sum()), num_tokens=seq.numel())
        chunks.append((chunk, (high - low) / layout.samples))
    return chunks


def apply(lengths: list[int], max_tokens: int, width: int, seed: int, pad_token_id: int, position_ids_start: int = 0,
          rank: int = 0, world_size: int = 1) -> tuple[BinSampler, BinnedCollator]:
    """The batch sampler (this ``rank``'s share) and the collate function of binned training batches."""
    return (BinSampler(lengths, max_tokens, width, seed, rank, world_size),
            BinnedCollator(width, pad_token_id, position_ids_start))

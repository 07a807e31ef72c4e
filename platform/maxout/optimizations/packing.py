"""Padding-free packing (``data.padding=packed``): each micro-batch is one flattened sequence of whole rows, its
position ids restarting at every row, and batches are formed by a token budget (``data.max_tokens_per_batch``),
so every step carries about the same work and not one token is padding.

The pieces:
- ``TokenBudgetSampler``: each epoch, the rows in a seeded random order (the same order length bucketing starts
  from), cut greedily into batches of at most ``max_tokens`` tokens; the fullest batch goes first (an out-of-memory
  error shows at step one). The order is a pure function of (seed, epoch), so a resumed run replays it exactly, and
  ``batches()`` is a plain list that a distributed run can deal out by rank (``batches()[rank::world]``).
- ``PackedCollator``: what transformers' ``DataCollatorWithFlattening`` gives (input ids, restarting position ids,
  ``cu_seq_lens`` and ``max_length`` for flash-attention's varlen kernel, ``seq_idx``), vectorized, plus what it does
  not carry for classification: one label per row and BERT's token type ids.
- ``PackedLayout``: where each row sits in the packed sequence; ``serving/pooling.py`` reads it to keep the rows
  apart in attention and to pool one vector per row.

``supported()`` allows the model types whose attention was checked to keep packed rows apart (tests/test_packing.py:
the logits of a packed batch equal those of each row alone) on every attention implementation maxout uses. Any other
model type falls back to dynamic padding with length bucketing.

How rows are kept apart in attention is the ``packing`` decision (``data.packing_attention``, logged as
``opt.packing.*``), ``resolve_attention()``:
- ``varlen`` (auto's pick on a GPU in bf16/fp16): torch's variable-length flash kernel through maxout's attention
  function (optimizations/varlen.py), given the rows' boundaries (``cu_seq_lens``) and no mask: attention costs each
  row's length squared, which is what makes packing worth it on a GPU. Attention-probability dropout is not applied
  (the kernel has none).
- ``flash_attention_2`` (where hardware.attn_implementation is flash-attention 2, flash_attn installed):
  transformers' own varlen path takes the same boundaries.
- ``mask`` (auto's pick on a CPU, in fp32, or where the kernel is missing): SDPA or eager with a block-diagonal mask
  (serving/pooling.py builds it from the layout, for decoders and encoders alike). The mask is dense, so attention
  spans the whole packed row, quadratic in the token budget rather than in each row's length: on a GPU it cannot beat
  bucketing.
- ``bins`` (asked for by name): not one flattened row but rows of ``data.max_length`` tokens ("bins"), each holding
  several whole samples, with a block-diagonal mask per bin (bin_packing.py): SDPA or eager, attention quadratic in
  the bin's width, attention dropout kept, one batch shape.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np
import torch

from . import varlen
from .base import Decision
from .bucketing import EpochBatchSampler, epoch_order

# Decoders: their causal mask builder (masking_utils) finds packed rows from position ids that restart at 0.
PACKABLE_DECODERS = ("gemma", "gemma2", "gemma3_text", "llama", "mistral", "qwen2", "qwen3")
# Encoders: their bidirectional mask ignores position ids, so serving/pooling.py passes a block-diagonal one.
PACKABLE_ENCODERS = ("bert", "roberta", "xlm-roberta", "electra", "modernbert")
KEEPS_APART = ("flash_attention_2", varlen.NAME, "sdpa", "eager")  # varlen boundaries, or a block-diagonal mask
# Their embeddings number positions from padding_idx + 1, not 0 (see DataCollatorWithFlattening's docstring).
POSITIONS_AFTER_PAD = ("roberta", "xlm-roberta")


def supported(model_type: str, attn_implementation: str) -> tuple[bool, str]:
    if model_type not in PACKABLE_DECODERS + PACKABLE_ENCODERS:
        return False, (f"model type {model_type!r} has no checked way to keep packed rows apart in attention "
                       f"(packable: {', '.join(PACKABLE_DECODERS + PACKABLE_ENCODERS)})")
    if attn_implementation not in KEEPS_APART:
        return False, (f"attention {attn_implementation!r} takes neither varlen boundaries nor a block-diagonal "
                       f"mask")
    return True, ""


def resolve(padding: str, model_type: str, attn_implementation: str) -> Decision:
    """The ``padding`` decision: packed where the model keeps packed rows apart, else dynamic padding (with length
    bucketing, which the caller switches on)."""
    if padding != "packed":
        return Decision("padding", padding, padding)
    ok, reason = supported(model_type, attn_implementation)
    if ok:
        return Decision("padding", padding, padding)
    return Decision("padding", padding, "dynamic", reason + " -> dynamic padding with length bucketing")


def resolve_attention(requested: str, padding: str, attn_implementation: str, model_class: type, device: Any,
                      precision: str) -> Decision:
    """The ``packing`` decision: how a packed row's samples are kept apart in attention (module docstring).
    ``padding`` is the padding decision's effective value, ``attn_implementation`` the attention decision's."""
    if padding != "packed":
        return Decision("packing", requested, "none", f"batches are not packed (data.padding={padding})")
    if attn_implementation == "flash_attention_2":
        return Decision("packing", requested, "flash_attention_2",
                        "attention is flash_attention_2: transformers' own varlen path takes the rows' boundaries")
    if requested in ("mask", "bins"):
        return Decision("packing", requested, requested)
    ok, why = varlen.supported(device, precision)
    if ok:
        ok, why = varlen.model_supported(model_class)
    if ok:
        return Decision("packing", requested, "varlen",
                        "torch's variable-length flash kernel (torch.nn.attention.varlen), the rows' boundaries and "
                        "no mask: attention costs each row's length squared; attention-probability dropout is not "
                        "applied to packed batches (the kernel has none)")
    return Decision("packing", requested, "mask", f"{why} -> a block-diagonal mask over the packed row "
                                                  f"({attn_implementation})")


def token_budget(setting: Any, micro_batch: int, lengths: list[int]) -> int:
    """``data.max_tokens_per_batch``: an int as given; ``auto`` (or unset) = micro-batch x the mean row length, so a
    step carries as many samples on average as a padded micro-batch does (never less than the longest row)."""
    if setting in (None, "auto"):
        return max(round(micro_batch * statistics.fmean(lengths)), max(lengths))
    return int(setting)


def position_start(model_type: str, pad_token_id: Optional[int]) -> int:
    return (pad_token_id or 0) + 1 if model_type in POSITIONS_AFTER_PAD else 0


class TokenBudgetSampler(EpochBatchSampler):
    """Batches of row indices holding at most ``max_tokens`` tokens each (a row longer than that is its own batch;
    config validation keeps ``max_tokens >= data.max_length``). With ``world_size > 1`` the epoch's batches are
    dealt out round-robin (``rank``, ``rank + world_size``, ...), the last ``len % world_size`` left out, so every
    rank runs the same number of steps; each batch carries about the same tokens, so the ranks stay balanced."""

    def __init__(self, lengths: list[int], max_tokens: int, seed: int, rank: int = 0, world_size: int = 1):
        super().__init__(lengths, batch_size=1, seed=seed, bucketing=False, rank=rank, world_size=world_size)
        self.max_tokens = max_tokens
        self._counts: dict[int, int] = {}  # epoch -> number of batches (the planned steps need every epoch's)

    def batches(self, epoch: Optional[int] = None, rank: Optional[int] = None) -> list[list[int]]:
        """``rank``'s batches (default: this sampler's) in ``epoch`` (default: the current one)."""
        every = self._epoch_batches(self.epoch if epoch is None else epoch)
        if self.world_size == 1:
            return every
        kept = len(every) - len(every) % self.world_size
        return every[(self.rank if rank is None else rank):kept:self.world_size]

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        order, _ = epoch_order(len(self.lengths), self.seed, epoch)
        batches: list[list[int]] = []
        current: list[int] = []
        tokens = 0
        for i in order:
            if current and tokens + self.lengths[i] > self.max_tokens:
                batches.append(current)
                current, tokens = [], 0
            current.append(i)
            tokens += self.lengths[i]
        if current:
            batches.append(current)
        fullest = max(range(len(batches)), key=lambda b: sum(self.lengths[i] for i in batches[b]))
        batches[0], batches[fullest] = batches[fullest], batches[0]
        return batches

    def batches_in_epoch(self, epoch: int) -> int:
        if epoch not in self._counts:
            self._counts[epoch] = len(self.batches(epoch=epoch))
        return self._counts[epoch]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches()[self.skip:])

    def __len__(self) -> int:
        return self.batches_in_epoch(self.epoch)

    def tokens(self, batch: list[int]) -> int:
        return sum(self.lengths[i] for i in batch)  # packed: no padding


@dataclass
class PackedLayout:
    """Where each row sits in a packed sequence of ``tokens`` tokens."""

    cu_seq_lens: torch.Tensor  # [rows + 1] int32: row i spans tokens cu_seq_lens[i] .. cu_seq_lens[i + 1] - 1
    seq_idx: torch.Tensor  # [1, tokens] int32: the row each token belongs to
    max_length: int  # the longest row, or a bound above it (the varlen kernels' max_length_q / max_length_k)

    def to(self, device: Any, non_blocking: bool = False) -> "PackedLayout":
        return PackedLayout(self.cu_seq_lens.to(device, non_blocking=non_blocking),
                            self.seq_idx.to(device, non_blocking=non_blocking), self.max_length)

    def pin_memory(self) -> "PackedLayout":  # the DataLoader's pin_memory calls this on objects that have it
        return PackedLayout(self.cu_seq_lens.pin_memory(), self.seq_idx.pin_memory(), self.max_length)

    @property
    def samples(self) -> int:
        return self.cu_seq_lens.shape[0] - 1

    def flash_kwargs(self) -> dict[str, Any]:
        """The varlen boundaries transformers' flash-attention path takes (FlashAttentionKwargs)."""
        return {"cu_seq_lens_q": self.cu_seq_lens, "cu_seq_lens_k": self.cu_seq_lens,
                "max_length_q": self.max_length, "max_length_k": self.max_length}


class PackedCollator:
    """Rows -> one packed micro-batch: ``input_ids`` and ``position_ids`` [1, tokens], ``labels`` [rows],
    ``packing`` (a PackedLayout), ``token_type_ids`` when the rows have them, and the token counts (all real).

    The same tensors as transformers' ``DataCollatorWithFlattening`` (return_position_ids, return_flash_attn_kwargs,
    return_seq_idx; tests/test_packing.py compares them), built from the rows' lengths in a few vectorized ops
    instead of its per-token Python lists: that collator took ~30 ms per 1024 demo rows on the 2-core CPU, and on the
    H200 the packed MFU case waited 52.6 ms a step for its batch against bucketing's 14.5 (2026-11-28, run 7), which
    made packing 0.94x bucketing at micro-batch 1024 (benchmarks/collator_speed.py)."""

    def __init__(self, position_ids_start: int = 0, longest: Optional[int] = None):
        self.position_ids_start = position_ids_start
        # The varlen kernels' max_length: a bound (data.max_length) instead of each batch's longest row, so a compiled
        # graph sees one constant, not a new one (and a recompile) every batch; a bound only sizes their launch grid.
        self.longest = longest

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        counts = [len(r["input_ids"]) for r in rows]
        lengths, tokens = torch.tensor(counts, dtype=torch.long), sum(counts)  # host ints: no tensor read
        cu_seq_lens = torch.zeros(len(rows) + 1, dtype=torch.int32)
        torch.cumsum(lengths, 0, out=cu_seq_lens[1:])
        row_of_token = torch.repeat_interleave(torch.arange(len(rows)), lengths)  # [tokens]
        # each token's offset in its row: its index in the packed sequence minus where its row starts
        positions = torch.arange(tokens) - cu_seq_lens[:-1].long()[row_of_token] + self.position_ids_start
        batch = {"input_ids": _joined((r["input_ids"] for r in rows), tokens), "position_ids": positions[None],
                 "labels": torch.tensor([r["labels"] for r in rows], dtype=torch.long),
                 "packing": PackedLayout(cu_seq_lens, row_of_token.to(torch.int32)[None],
                                         max(max(counts), self.longest or 0)),
                 "num_real_tokens": tokens, "num_tokens": tokens}
        if "token_type_ids" in rows[0]:
            batch["token_type_ids"] = _joined((r["token_type_ids"] for r in rows), tokens)
        return batch


def _joined(rows: Iterator[Any], count: int) -> torch.Tensor:
    """[1, count] long: the rows' values one after another (numpy reads the joined lists 3.5x faster than
    torch.tensor(list), as data._scatter found)."""
    return torch.from_numpy(np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=count))[None]


def apply(lengths: list[int], max_tokens: int, seed: int, position_ids_start: int = 0, rank: int = 0,
          world_size: int = 1, longest: Optional[int] = None) -> tuple[TokenBudgetSampler, PackedCollator]:
    """The batch sampler (this ``rank``'s share) and the collate function of packed training batches (``longest``:
    the bound PackedCollator reports as every batch's longest row)."""
    return (TokenBudgetSampler(lengths, max_tokens, seed, rank, world_size),
            PackedCollator(position_ids_start, longest))


def split(batch: dict[str, Any], rows_per_chunk: int) -> list[tuple[dict[str, Any], float]]:
    """A packed micro-batch as packed chunks of ``rows_per_chunk`` whole rows, each with its share of the rows (the
    weight of its mean loss): how out-of-memory recovery (train/oom.py) splits a packed batch."""
    bounds = batch["packing"].cu_seq_lens.tolist()
    rows = len(bounds) - 1
    chunks = []
    for first in range(0, rows, rows_per_chunk):
        last = min(first + rows_per_chunk, rows)
        start, end = bounds[first], bounds[last]
        cu = torch.tensor([b - start for b in bounds[first:last + 1]], dtype=batch["packing"].cu_seq_lens.dtype)
        chunk = {"input_ids": batch["input_ids"][:, start:end], "position_ids": batch["position_ids"][:, start:end],
                 "labels": batch["labels"][first:last],
                 "packing": PackedLayout(cu, batch["packing"].seq_idx[:, start:end] - first,
                                         int((cu[1:] - cu[:-1]).max())),
                 "num_real_tokens": end - start, "num_tokens": end - start}
        if "token_type_ids" in batch:
            chunk["token_type_ids"] = batch["token_type_ids"][:, start:end]
        chunks.append((chunk, (last - first) / rows))
    return chunks

"""Length bucketing: batches of similar-length rows, so dynamic padding pads little.

Uses transformers' megabatch grouping (shuffle, cut into megabatches of 50 batches, sort each by length), which
keeps batches random across the epoch while padding little within each; the longest batch comes first, so an
out-of-memory shows at step one. The order is a pure function of (seed, epoch), so a resumed run replays it.
"""

from __future__ import annotations

from typing import Iterator

import torch


def supported(padding: str) -> tuple[bool, str]:
    if padding != "dynamic":
        return False, "data.padding=max_length pads every row to the same length: bucketing cannot save anything"
    return True, ""


class EpochSampler(torch.utils.data.Sampler):
    """Random order (or length-grouped order) that depends only on (seed, epoch)."""

    def __init__(self, lengths: list[int], batch_size: int, seed: int, bucketing: bool):
        self.lengths, self.batch_size, self.seed, self.bucketing = lengths, batch_size, seed, bucketing
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def indices(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        if self.bucketing:
            from transformers.trainer_pt_utils import get_length_grouped_indices

            return list(get_length_grouped_indices(self.lengths, self.batch_size, generator=generator))
        return torch.randperm(len(self.lengths), generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices())

    def __len__(self) -> int:
        return len(self.lengths)


def apply(lengths: list[int], batch_size: int, seed: int, enabled: bool = True) -> EpochSampler:
    return EpochSampler(lengths, batch_size, seed, bucketing=enabled)


def padding_efficiency(lengths: list[int], batch_size: int, order: list[int]) -> float:
    """Real tokens / processed tokens for batches taken in ``order`` with dynamic padding."""
    real = processed = 0
    for start in range(0, len(order), batch_size):
        batch = [lengths[i] for i in order[start:start + batch_size]]
        real += sum(batch)
        processed += max(batch) * len(batch)
    return real / processed if processed else 1.0

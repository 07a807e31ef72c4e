"""The vectorized collator pads exactly as the row-by-row loop it replaced (issue 37), and rounds widths to the
allowed set. Its speed is a benchmark (benchmarks/collator_speed.py), not a test."""

from __future__ import annotations

import random
from typing import Any, Optional

import pytest
import torch

from maxout.data import Collator


def loop_collate(rows: list[dict[str, Any]], pad_id: int, pad_to: Optional[int] = None,
                 multiple_of: Optional[int] = None) -> dict[str, Any]:
    """The collator as it was before vectorizing (maxout ac83f3c): one tensor write per row and field."""
    lengths = [len(r["input_ids"]) for r in rows]
    width = pad_to or max(lengths)
    if multiple_of:
        width = -(-width // multiple_of) * multiple_of
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    types = torch.zeros((len(rows), width), dtype=torch.long) if "token_type_ids" in rows[0] else None
    for i, (row, n) in enumerate(zip(rows, lengths)):
        ids[i, :n] = torch.as_tensor(row["input_ids"])
        mask[i, :n] = 1
        if types is not None:
            types[i, :n] = torch.as_tensor(row["token_type_ids"])
    batch = {"input_ids": ids, "attention_mask": mask,
             "labels": torch.tensor([r["labels"] for r in rows], dtype=torch.long),
             "num_real_tokens": sum(lengths), "num_tokens": len(rows) * width}
    if types is not None:
        batch["token_type_ids"] = types
    return batch


def random_rows(rng: random.Random, count: int, longest: int, pairs: bool) -> list[dict[str, Any]]:
    rows = []
    for _ in range(count):
        n = rng.randint(1, longest)
        row = {"input_ids": [rng.randint(1, 30000) for _ in range(n)], "labels": rng.randint(0, 2)}
        if pairs:
            cut = rng.randint(0, n)
            row["token_type_ids"] = [0] * cut + [1] * (n - cut)
        rows.append(row)
    return rows


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


@pytest.mark.parametrize("pad_to, multiple_of", [(None, None), (None, 8), (64, None), (64, 8), (100, 8)])
@pytest.mark.parametrize("pairs", [False, True])
def test_the_vectorized_collator_pads_as_the_row_loop_did(pad_to, multiple_of, pairs):
    rng = random.Random(f"{pad_to}-{multiple_of}-{pairs}")
    for count in (1, 2, 7, 64):
        rows = random_rows(rng, count, 60, pairs)
        assert_same(Collator(0, pad_to, multiple_of)(rows), loop_collate(rows, 0, pad_to, multiple_of))
    rows = [{"input_ids": [5, 6, 7], "labels": 1}] * 3  # every row the same length: no padding at all
    assert_same(Collator(3)(rows), loop_collate(rows, 3))


def test_widths_round_each_batch_up_to_the_first_allowed_width():
    collate = Collator(0, multiple_of=8, widths=[64, 16, 32])
    widths = {n: collate([{"input_ids": [1] * n, "labels": 0}])["input_ids"].shape[1] for n in (1, 16, 17, 33, 64)}
    assert widths == {1: 16, 16: 16, 17: 32, 33: 64, 64: 64}
    # a row longer than the set (another split's) pads to its own length, rounded as without widths
    assert collate([{"input_ids": [1] * 70, "labels": 0}])["input_ids"].shape[1] == 72
    rows = random_rows(random.Random(1), 9, 30, pairs=True)
    got = collate(rows)
    want = loop_collate(rows, 0, pad_to=got["input_ids"].shape[1])  # the same tensors, at the rounded width
    assert_same(got, want)

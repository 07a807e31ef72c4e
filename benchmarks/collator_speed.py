"""Time of maxout's collators per 1024 rows (issue 37): what each epoch's first batch and every batch a DataLoader
worker prepares costs on the host; the GPU profiles collate in the training process, so there it is host time
every step.

    .venv/bin/python -m benchmarks.collator_speed [--rows 1024] [--repeats 50] [--max-length 128]

Rows: the demo's training rows (projects/nli_demo), tokenized with the bundled BERT tokenizer, drawn with
replacement up to --rows. Timed, their calls interleaved round by round: the padded collator (the batch's longest
row, pad_to_multiple_of=8, the CUDA default), maxout's packed collator (data.padding=packed) and transformers'
DataCollatorWithFlattening with the labels maxout adds, which the packed one replaced. Prints the median over
--repeats calls of each, in ms, with one torch thread (like a DataLoader worker).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from transformers import DataCollatorWithFlattening

from maxout import data, loading, modeling
from maxout.optimizations import packing


def rows(count: int, max_length: int) -> list[dict]:
    cfg = loading.load(["hardware=cpu", "model=tiny", "tracking=none", f"data.max_length={max_length}"])
    table = data.load(cfg.data).train
    encoded = data.encode(modeling.load_tokenizer(cfg.model), table, max_length)
    pick = random.Random(0).choices(range(len(encoded)), k=count)
    return [encoded[i] for i in pick]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--max-length", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    batch = rows(args.rows, args.max_length)
    flatten = DataCollatorWithFlattening(return_position_ids=True, return_flash_attn_kwargs=True, return_seq_idx=True)

    def flattening(rows: list[dict]) -> dict:  # the packed collator before 2026-11-28
        out = flatten([{"input_ids": r["input_ids"]} for r in rows], return_tensors="pt")
        out["labels"] = torch.tensor([r["labels"] for r in rows], dtype=torch.long)
        out["token_type_ids"] = torch.tensor([[t for r in rows for t in r["token_type_ids"]]])
        return out

    contenders = {"padded (data.Collator)": data.Collator(pad_id=0, multiple_of=8),
                  "packed (packing.PackedCollator)": packing.PackedCollator(longest=args.max_length),
                  "packed by transformers' DataCollatorWithFlattening": flattening}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for collate in contenders.values():
        collate(batch)  # warm-up
    for round_ in range(args.repeats):
        # each round in the other order, so that none is always first
        for name, collate in (contenders.items() if round_ % 2 == 0 else reversed(contenders.items())):
            started = time.perf_counter()
            collate(batch)
            times[name].append(time.perf_counter() - started)
    for name, spent in times.items():
        print(f"{name}: {statistics.median(spent) * 1e3:.2f} ms per {args.rows} rows (median of {args.repeats} "
              f"calls, 1 torch thread)")

if __name__ == "__main__":
    main()

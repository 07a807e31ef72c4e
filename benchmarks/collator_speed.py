"""Time of maxout's collator per 1024 rows (issue 37): what each epoch's first batch and every batch a DataLoader
worker prepares costs on the host.

    .venv/bin/python -m benchmarks.collator_speed [--rows 1024] [--repeats 50] [--max-length 128]

Rows: the demo's training rows (projects/nli_demo), tokenized with the bundled BERT tokenizer, drawn with
replacement up to --rows; padded to the batch's longest row with pad_to_multiple_of=8 (the CUDA default). Prints
the median over --repeats calls, in ms, with the torch threads it ran with (one, like a DataLoader worker).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from maxout import data, loading, modeling


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
    collate = data.Collator(pad_id=0, multiple_of=8)
    collate(batch)  # warm-up
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        collate(batch)
        times.append(time.perf_counter() - started)
    median = statistics.median(times) * 1e3
    print(f"collator: {median:.2f} ms per {args.rows} rows (median of {args.repeats} calls, 1 torch thread)")


if __name__ == "__main__":
    main()

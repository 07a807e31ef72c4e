"""A compiled step with dynamo's guards run every call, against maxout's forward that skips them for inputs already
seen (``hardware.skip_guards``, optimizations/skip_guards.py): milliseconds per forward + backward, in one process,
the two interleaved (A B B A per round), on a model small enough that the host sets the pace, as a CUDA-graph step
of BERT-base at batch 64 does on a GPU (run 7: 13.7 ms of host time a step, 1.81 ms of it dynamo's cache lookup).

    python -m benchmarks.skip_guards --layers 12 --rounds 4 --steps 200
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--scope", choices=("model", "layers"), default="model")
    args = ap.parse_args(argv)

    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from maxout.optimizations import compile as compile_opt, skip_guards

    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = BertConfig(hidden_size=32, num_hidden_layers=args.layers, num_attention_heads=2, intermediate_size=64,
                        vocab_size=100, num_labels=3, problem_type="single_label_classification")
    model = BertForSequenceClassification(config).train()
    compiled = compile_opt.apply(model, "default", dynamic=True, scope=args.scope)
    skipping = skip_guards.apply(compiled, model)
    batches = [dict(input_ids=torch.randint(0, 100, (8, width)), attention_mask=torch.ones(8, width, dtype=torch.long),
                    labels=torch.randint(0, 3, (8,))) for width in (16, 24, 32, 40)]

    def ms_per_step(forward) -> float:
        began = time.perf_counter()
        for i in range(args.steps):
            forward(**batches[i % len(batches)]).loss.backward()
        return 1e3 * (time.perf_counter() - began) / args.steps

    for forward in (compiled, skipping, skipping):  # compile, then every width seen by the skipping forward
        for batch in batches:
            forward(**batch).loss.backward()
    times: dict[str, list[float]] = {"guards every call": [], "skipped for seen inputs": []}
    for r in range(args.rounds):
        order = ((compiled, skipping), (skipping, compiled))[r % 2]
        for forward in (*order, *reversed(order)):
            times["skipped for seen inputs" if forward is skipping else "guards every call"].append(ms_per_step(forward))
    guarded, skipped = (statistics.median(v) for v in times.values())
    for name, values in times.items():
        print(f"{name:>24}: median {statistics.median(values):.3f} ms/step  ({', '.join(f'{v:.3f}' for v in values)})")
    print(f"skipped / guards every call: {guarded / skipped:.3f}x steps/s; graphs {compile_opt.compiled_graphs()}; "
          f"skipped calls {skipping.skipped}, guarded {skipping.guarded}")


if __name__ == "__main__":
    main()

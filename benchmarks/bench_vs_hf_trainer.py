"""maxout vs the Hugging Face Trainer: steady-state training samples/s, same model, data, batch, precision, machine.

    python benchmarks/bench_vs_hf_trainer.py                 # MiniLM on projects/nli_demo, two epochs each
    python benchmarks/bench_vs_hf_trainer.py --compile        # both compile (maxout: hardware.compile=true)
    python benchmarks/bench_vs_hf_trainer.py --rounds 2 --maxout-override hardware.fast_dropout=false
    python benchmarks/bench_vs_hf_trainer.py --override model.architecture.hidden_size=768 ...   # both sides
    python benchmarks/bench_vs_hf_trainer.py --contenders maxout,trainer_best,trainer_best_compiled

Three contenders, run in one process, in the order A B C then C B A (both orders, so drift and warm caches do
not favour one side; `--rounds N` repeats that pattern), each for the same number of full epochs of the demo's
training set, so every contender processes exactly the same rows:

- maxout: its defaults for the device (`hardware=auto`), with the micro-batch and precision given here; on CPU
  that includes fast dropout (`--maxout-override hardware.fast_dropout=false` measures it without).
- Trainer, best flags: the same precision (bf16 where supported), `train_sampling_strategy="group_by_length"`,
  fused AdamW (`optim="adamw_torch_fused"`), `torch_compile` when maxout compiles, dynamic padding
  (DataCollatorWithPadding), no evaluation, no checkpoints, no reporting. Its model gets transformers' default
  attention (sdpa); `--trainer-attention same` gives it the implementation maxout's profile picked instead (the CPU
  profile picks eager, measured faster there), which separates that choice from the rest of the gap.
- Trainer, defaults: `TrainingArguments` defaults (fp32, random batches, fused AdamW since transformers 5), the
  same collator and batch size.
- Trainer, best flags compiled (`trainer_best_compiled`, asked for with `--contenders`): the best flags with
  `torch_compile=True` whatever maxout does (the GPU report's "torch_compile on and off").

On a GPU the best flags add `tf32=True` where maxout's device check turned TF32 on, and `--trainer-workers N` gives
the Trainer DataLoader workers (maxout's profile picks its own). Besides samples/s each contender reports tokens/s
(samples/s x the mean real length of the training rows: both sides process the same rows) and, on a GPU, torch's
peak allocated memory. `benchmarks/gpu_report.py` runs this comparison on random BERT-base models through
``measure()``.

Steady state = samples / seconds between the end of optimizer step `--warmup` of the last epoch and the end of
training, timed at step ends by a callback on each side (maxout's own `perf/steady_samples_per_s` is the same
definition). Each contender trains `--epochs` (default 2) and only the last epoch counts: on a CPU, oneDNN builds
and caches a kernel for every new matrix shape, and with dynamic padding the first epoch meets most sequence
lengths for the first time. Measured in one process (2026-11-22), maxout's first epoch ran at 57-59 samples/s
cold, 64-67 right after another maxout run, 57 again after a Trainer run, and 68 after a Trainer run when
ONEDNN_PRIMITIVE_CACHE_CAPACITY=65536 kept its kernels from being evicted (the default holds 1024): a one-epoch
measurement rewarded whichever side happened to run twice in a row.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def step_sizes(rows: int, args) -> list[int]:
    """Rows per optimizer step over all epochs (the same on both sides: no accumulation, last batch kept)."""
    per_epoch = [args.batch] * (rows // args.batch) + ([rows % args.batch] if rows % args.batch else [])
    return per_epoch * args.epochs


def excluded_steps(args) -> int:
    """Every step before the last epoch, plus its first --warmup steps."""
    return math.ceil(args.train_rows / args.batch) * (args.epochs - 1) + args.warmup


def maxout_run(args, after=None) -> dict:
    """One maxout training run of ``args``; ``after(result)``, if given, runs on the trained set-up before it is
    dropped (its figures go in the returned dict as ``after``)."""
    from maxout import loading
    from maxout.tracking.tracker import NullTracker
    from maxout.train import train

    overrides = [f"model={args.model}", "tracking=none", f"train.batch_size={args.batch}",
                 f"train.target_effective_batch={args.batch}", f"train.epochs={args.epochs}",
                 f"train.warmup_steps_excluded={excluded_steps(args)}", f"hardware.precision={args.precision}",
                 "checkpoint.enabled=false",  # as the Trainer's save_strategy="no" (saves are outside the window)
                 *([] if args.compile is None else [f"hardware.compile={str(args.compile).lower()}"]),
                 *args.override, *args.maxout_override]
    cfg = loading.load(overrides)
    result = train(cfg, tracker=NullTracker(), progress=False, verbose=False)
    m = result.metrics
    return {"samples_per_s": m["perf/steady_samples_per_s"], "samples": m["train/samples"],
            "tokens_per_s": m["perf/steady_samples_per_s"] * args.mean_length,
            "peak_memory_gb": m.get("mem/peak_allocated_gb"), "compile_s": m.get("time/compile_s"),
            "compile_graphs": m.get("time/compile_graphs"), "padding_efficiency": m["perf/padding_efficiency"],
            "busy_share": m.get("gpu/busy_share"),
            "gpu_utilization": m.get("gpu/utilization_mean"),
            "precision": result.setup.decision("precision").effective, "profile": cfg.hardware.name,
            "attention": result.setup.decision("attention").effective,
            "tf32": result.setup.decision("tf32").effective, "compile": result.setup.decision("compile").effective,
            "compile_mode": result.setup.decision("compile_mode").effective,
            "after": after(result) if after is not None else None}


def trainer_run(args, best: bool, precision: str, attention: str, compile: bool = False, tf32: bool = False) -> dict:
    from transformers import DataCollatorWithPadding, Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    from maxout import data as data_mod, loading, modeling

    hf_logging.set_verbosity_error()
    cfg = loading.load([f"model={args.model}", "hardware=cpu" if not torch.cuda.is_available() else "hardware=auto",
                        *args.override])
    ds = data_mod.load(cfg.data)
    tok = modeling.load_tokenizer(cfg.model)
    enc = tok(ds.train.texts, ds.train.pairs, truncation="longest_first", max_length=cfg.data.max_length)
    rows = [{**{k: enc[k][i] for k in enc.keys()}, "labels": ds.train.labels[i]} for i in range(len(ds.train))]
    torch.manual_seed(42)
    model_cfg = modeling.build_config(cfg.model, ds.label_names, len(tok))
    model = modeling.load_model(cfg.model, model_cfg, attention)

    class Clock(TrainerCallback):
        """Step ends (after a sync), and on a GPU each step's CUDA-event time: the device's busy share over the
        timed window, as maxout's gpu/busy_share measures it (an event before the step's first kernel is queued,
        one after its last)."""

        def __init__(self):
            self.marks, self.busy_ms, self._begun = [], [], None

        def on_step_begin(self, targs, state, control, **kw):
            if torch.cuda.is_available():
                self._begun = torch.cuda.Event(enable_timing=True)
                self._begun.record()

        def on_step_end(self, targs, state, control, **kw):
            if torch.cuda.is_available():
                done = torch.cuda.Event(enable_timing=True)
                done.record()
                torch.cuda.synchronize()
                self.busy_ms.append(self._begun.elapsed_time(done) if self._begun is not None else 0.0)
            self.marks.append(time.perf_counter())

    clock = Clock()
    flags = dict(output_dir=str(ROOT / "benchmarks" / "out" / "hf"), per_device_train_batch_size=args.batch,
                 num_train_epochs=args.epochs, save_strategy="no", eval_strategy="no", report_to=[], logging_steps=10_000,
                 disable_tqdm=True, seed=42, use_cpu=not torch.cuda.is_available(),
                 dataloader_num_workers=args.trainer_workers)
    if best:
        flags.update(bf16=precision == "bf16", fp16=precision == "fp16",
                     train_sampling_strategy="group_by_length", optim="adamw_torch_fused", torch_compile=compile)
        if tf32:
            flags["tf32"] = True
        if args.trainer_workers:  # no respawn per epoch, as maxout's profiles do
            flags["dataloader_persistent_workers"] = True
    trainer = Trainer(model=model, args=TrainingArguments(**flags), train_dataset=rows,
                      data_collator=DataCollatorWithPadding(tok), callbacks=[clock])
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    steps = len(clock.marks)
    skip = excluded_steps(args)
    samples_after = sum(step_sizes(len(rows), args)[skip:])
    seconds = clock.marks[-1] - clock.marks[skip - 1]
    busy = sum(clock.busy_ms[skip:]) / 1e3 / seconds if clock.busy_ms else None  # the steps after the window opens
    return {"samples_per_s": samples_after / seconds, "samples": len(rows), "steps": steps, "busy_share": busy,
            "tokens_per_s": samples_after / seconds * args.mean_length,
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
            "precision": precision if best else "fp32", "attention": attention, "compile": bool(best and compile),
            "flags": {k: v for k, v in flags.items() if k not in ("output_dir",)}}


TRAINERS = ("trainer_best", "trainer_best_compiled", "trainer_default")


def measure(args, contenders=("maxout", "trainer_best", "trainer_default"), log=print) -> dict:
    """Every contender in one process, in the order given and then reversed (``args.rounds`` times), each timed on
    its last epoch; the first maxout run tells the Trainer the precision, attention and TF32 maxout's device check
    chose. ``args`` holds the fields main()'s parser defines."""
    from maxout import data as data_mod, loading, modeling

    cfg = loading.load([f"model={args.model}", *args.override])
    table = data_mod.load(cfg.data).train
    enc = modeling.load_tokenizer(cfg.model)(table.texts, table.pairs, truncation="longest_first",
                                             max_length=cfg.data.max_length)
    args.train_rows, args.mean_length = len(table), sum(map(len, enc["input_ids"])) / len(table)

    results: dict[str, list] = {name: [] for name in contenders}
    first = maxout_run(args)
    results["maxout"].append(first)
    log(f"maxout: {first['samples_per_s']:.2f} samples/s")
    precision, tf32 = first["precision"], first["tf32"]
    attention = first["attention"] if args.trainer_attention == "same" else "sdpa"
    runs = {"maxout": lambda: maxout_run(args),
            "trainer_best": lambda: trainer_run(args, True, precision, attention, bool(args.compile), tf32),
            "trainer_best_compiled": lambda: trainer_run(args, True, precision, attention, True, tf32),
            "trainer_default": lambda: trainer_run(args, False, precision, attention)}
    pattern = [*contenders, *reversed(contenders)]  # maxout first, then maxout last: both orders
    for name in (pattern * args.rounds)[1:]:  # the first maxout run is above: it tells the Trainer the precision
        results[name].append(runs[name]())
        log(f"{name}: {results[name][-1]['samples_per_s']:.2f} samples/s")

    mean = {k: sum(r["samples_per_s"] for r in v) / len(v) for k, v in results.items()}
    trainers = [c for c in contenders if c in TRAINERS]
    return {
        "date": date.today().isoformat(), "device": torch.cuda.get_device_name(0) if torch.cuda.is_available()
        else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "torch": torch.__version__, "model": args.model, "overrides": args.override, "batch": args.batch,
        "rows": args.train_rows, "mean_length": args.mean_length, "precision": precision, "tf32": tf32,
        "compile": {"maxout": first["compile"], "asked": args.compile}, "epochs": args.epochs,
        "timed": f"last epoch after step {args.warmup}",
        "attention": {"maxout": first["attention"], "trainer": attention},
        "samples_per_s": mean, "runs": results,
        **{f"ratio_vs_{t}": mean["maxout"] / mean[t] for t in trainers},
        # Pairs run next to each other: maxout's i-th run against each Trainer's i-th run (orders alternate).
        "ratios_per_order": [{"order": "maxout first" if i % 2 == 0 else "maxout last",
                              **{t.removeprefix("trainer_"): results["maxout"][i]["samples_per_s"]
                                 / results[t][i]["samples_per_s"] for t in trainers}}
                             for i in range(len(results["maxout"]))],
        "maxout_overrides": args.maxout_override,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="minilm")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--precision", default="bf16", help="what maxout is asked for; the Trainer gets what "
                                                        "maxout's device check made of it")
    p.add_argument("--compile", action="store_true", default=None,
                   help="both compile (maxout: hardware.compile=true); without it neither does")
    p.add_argument("--epochs", type=int, default=2, help="epochs per contender; only the last one is timed")
    p.add_argument("--warmup", type=int, default=3, help="optimizer steps of the last epoch left out too")
    p.add_argument("--trainer-attention", choices=("default", "same"), default="default",
                   help="default: the Trainer's model gets transformers' default attention (sdpa); same: it gets "
                        "the implementation maxout's profile picked, to separate that choice from the rest")
    p.add_argument("--trainer-workers", type=int, default=0, help="the Trainer's DataLoader workers")
    p.add_argument("--rounds", type=int, default=1, help="repeat the A B C C B A pattern this many times")
    p.add_argument("--contenders", default="maxout,trainer_best,trainer_default",
                   help=f"comma-separated, maxout first, from {', '.join(TRAINERS)}")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a Hydra override for both sides (model architecture, data files), repeatable")
    p.add_argument("--maxout-override", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra Hydra override for maxout only, e.g. hardware.fast_dropout=false to measure "
                        "what one optimization contributes (repeatable)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "vs_hf_trainer.json"))
    return p


def main() -> None:
    args = parser().parse_args()
    args.compile = bool(args.compile)  # the CLI's default: neither side compiles
    contenders = tuple(args.contenders.split(","))
    if contenders[0] != "maxout" or not set(contenders[1:]) <= set(TRAINERS):
        parser().error(f"--contenders must start with maxout and name only {', '.join(TRAINERS)}")
    os.chdir(ROOT)
    report = measure(args, contenders, log=lambda line: print(line, file=sys.stderr))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps({k: v for k, v in report.items() if k not in ("runs", "date", "torch", "overrides")}, indent=2,
                     default=str))


if __name__ == "__main__":
    main()

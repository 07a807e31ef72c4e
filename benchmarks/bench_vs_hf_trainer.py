"""maxout vs the Hugging Face Trainer: steady-state training samples/s, same model, data, batch, precision, machine.

    python benchmarks/bench_vs_hf_trainer.py                 # MiniLM on projects/nli_demo, one epoch each
    python benchmarks/bench_vs_hf_trainer.py --compile        # both compile (maxout: hardware.compile=true)

Three contenders, run in one process, in the order A B C then C B A (both orders, so drift and warm caches do
not favour one side), each for one full epoch of the demo's training set, so every contender processes exactly
the same rows:

- maxout: its defaults for the device (`hardware=auto`), with the micro-batch and precision given here.
- Trainer, best flags: the same precision (bf16 where supported), `train_sampling_strategy="group_by_length"`,
  fused AdamW (`optim="adamw_torch_fused"`), `torch_compile` when maxout compiles, dynamic padding
  (DataCollatorWithPadding), no evaluation, no checkpoints, no reporting. Its model gets transformers' default
  attention (sdpa); `--trainer-attention same` gives it the implementation maxout's profile picked instead (the CPU
  profile picks eager, measured faster there), which separates that choice from the rest of the gap.
- Trainer, defaults: `TrainingArguments` defaults (fp32, random batches, fused AdamW since transformers 5), the
  same collator and batch size.

Steady state = samples / seconds between the end of optimizer step `--warmup` and the end of the epoch, timed at
step ends by a callback on each side (maxout's own `perf/steady_samples_per_s` is the same definition).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def maxout_run(args) -> dict:
    from maxout import config
    from maxout.tracking import NullTracker
    from maxout.train import train

    overrides = [f"model={args.model}", "tracking=none", "train.epochs=1", f"train.batch_size={args.batch}",
                 f"train.target_effective_batch={args.batch}", f"train.warmup_steps_excluded={args.warmup}",
                 f"hardware.precision={args.precision}", f"hardware.compile={str(args.compile).lower()}"]
    cfg = config.load(overrides)
    result = train(cfg, tracker=NullTracker(), progress=False, verbose=False)
    m = result.metrics
    return {"samples_per_s": m["perf/steady_samples_per_s"], "samples": m["train/samples"],
            "padding_efficiency": m["perf/padding_efficiency"],
            "precision": result.setup.decision("precision").effective, "profile": cfg.hardware.name,
            "attention": result.setup.decision("attention").effective}


def trainer_run(args, best: bool, precision: str, attention: str) -> dict:
    from transformers import DataCollatorWithPadding, Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    from maxout import config, data as data_mod, modeling

    hf_logging.set_verbosity_error()
    cfg = config.load([f"model={args.model}", "hardware=cpu" if not torch.cuda.is_available() else "hardware=auto"])
    ds = data_mod.load(cfg.data)
    tok = modeling.load_tokenizer(cfg.model)
    enc = tok(ds.train.texts, ds.train.pairs, truncation="longest_first", max_length=cfg.data.max_length)
    rows = [{**{k: enc[k][i] for k in enc.keys()}, "labels": ds.train.labels[i]} for i in range(len(ds.train))]
    torch.manual_seed(42)
    model_cfg = modeling.build_config(cfg.model, ds.label_names, len(tok))
    model = modeling.load_model(cfg.model, model_cfg, attention)

    class Clock(TrainerCallback):
        def __init__(self):
            self.marks = []

        def on_step_end(self, targs, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.marks.append(time.perf_counter())

    clock = Clock()
    flags = dict(output_dir=str(ROOT / "benchmarks" / "out" / "hf"), per_device_train_batch_size=args.batch,
                 num_train_epochs=1, save_strategy="no", eval_strategy="no", report_to=[], logging_steps=10_000,
                 disable_tqdm=True, seed=42, use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0)
    if best:
        flags.update(bf16=precision == "bf16", fp16=precision == "fp16",
                     train_sampling_strategy="group_by_length", optim="adamw_torch_fused",
                     torch_compile=args.compile)
    trainer = Trainer(model=model, args=TrainingArguments(**flags), train_dataset=rows,
                      data_collator=DataCollatorWithPadding(tok), callbacks=[clock])
    trainer.train()
    steps = len(clock.marks)
    # Every step has `batch` rows except possibly the last one.
    samples_after = len(rows) - args.batch * args.warmup
    seconds = clock.marks[-1] - clock.marks[args.warmup - 1]
    return {"samples_per_s": samples_after / seconds, "samples": len(rows), "steps": steps,
            "precision": precision if best else "fp32", "attention": attention, "flags": {k: v for k, v in flags.items()
                                                                  if k not in ("output_dir",)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--precision", default="bf16", help="what maxout is asked for; the Trainer gets what "
                                                             "maxout's device check made of it")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--trainer-attention", choices=("default", "same"), default="default",
                        help="default: the Trainer's model gets transformers' default attention (sdpa); same: it gets "
                             "the implementation maxout's profile picked, to separate that choice from the rest")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "vs_hf_trainer.json"))
    args = parser.parse_args()
    os.chdir(ROOT)

    results: dict[str, list] = {"maxout": [], "trainer_best": [], "trainer_default": []}
    first = maxout_run(args)
    results["maxout"].append(first)
    precision = first["precision"]
    attention = first["attention"] if args.trainer_attention == "same" else "sdpa"
    order = [("trainer_best", lambda: trainer_run(args, True, precision, attention)),
             ("trainer_default", lambda: trainer_run(args, False, precision, attention)),
             ("trainer_default", lambda: trainer_run(args, False, precision, attention)),
             ("trainer_best", lambda: trainer_run(args, True, precision, attention)),
             ("maxout", lambda: maxout_run(args))]
    for name, run in order:
        results[name].append(run())
        print(f"{name}: {results[name][-1]['samples_per_s']:.2f} samples/s", file=sys.stderr)

    mean = {k: sum(r["samples_per_s"] for r in v) / len(v) for k, v in results.items()}
    report = {
        "date": date.today().isoformat(), "device": torch.cuda.get_device_name(0) if torch.cuda.is_available()
        else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "torch": torch.__version__, "model": args.model, "batch": args.batch, "precision": precision,
        "compile": args.compile, "attention": {"maxout": first["attention"], "trainer": attention},
        "samples_per_s": mean, "runs": results,
        "ratio_vs_trainer_best": mean["maxout"] / mean["trainer_best"],
        "ratio_vs_trainer_default": mean["maxout"] / mean["trainer_default"],
        "ratios_per_order": {
            "first_order": {"best": results["maxout"][0]["samples_per_s"] / results["trainer_best"][0]["samples_per_s"],
                            "default": results["maxout"][0]["samples_per_s"] / results["trainer_default"][0]["samples_per_s"]},
            "reversed_order": {"best": results["maxout"][1]["samples_per_s"] / results["trainer_best"][1]["samples_per_s"],
                               "default": results["maxout"][1]["samples_per_s"] / results["trainer_default"][1]["samples_per_s"]},
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps({k: report[k] for k in ("device", "precision", "compile", "attention", "samples_per_s",
                                             "ratio_vs_trainer_best", "ratio_vs_trainer_default",
                                             "ratios_per_order")}, indent=2))


if __name__ == "__main__":
    main()

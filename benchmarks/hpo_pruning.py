"""Benchmark: what pruning saves in an HPO study, and what a warm compile cache saves a trial.

    .venv/bin/python benchmarks/hpo_pruning.py                  # 6 trials x 3 epochs x 256 rows; ~35 min on the
                                                                # shared 2-core CPU (pruning ~30, compile ~5)
    .venv/bin/python benchmarks/hpo_pruning.py --skip-compile --trials 12 --train-rows 128

1. Pruning. The same study three times on the demo project (MiniLM, a stratified subset of the training table,
   the full validation table): without pruning, with the shipped pruner (HyperbandPruner wrapped in
   PatientPruner, hpo/default.yaml), and with Hyperband alone (hpo.pruner.patience=null). The random sampler
   with one seed draws the same configurations in all three, and training is seeded, so the studies differ only
   in what pruning stopped: compute saved = 1 - trial-epochs run / trial-epochs without pruning, and the best
   score must be equal or better.
2. Compile cache. The tiny model with hardware.compile=true, tuning only optimizer-side hyper-parameters (the
   model's graph stays the same): a study's first trial compiles into an empty TorchInductor cache (cold), its
   second trial runs in the same process, and a second invocation (a new process, as another worker on the
   machine would be) runs a third trial on the now warm on-disk cache. time/compile_s and the FX-graph cache
   hits / misses per trial, from the trials' MLflow runs.

Everything lands in a temporary MLflow store and journal (printed at the end). Ratios come from one run each:
the machine is shared, so absolute seconds are noisy.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "none": ["hpo.pruner.name=none"],
    "patient+hyperband (default)": [],
    "hyperband only": ["hpo.pruner.patience=null"],
}


def subset(rows: int, seed: int, out: Path) -> list[str]:
    from maxout.data import read_table

    train = read_table("projects/nli_demo/data/train.csv")
    if rows < len(train):
        train = train.groupby("label", group_keys=False).sample(frac=rows / len(train), random_state=seed)
    train.to_csv(out / "train.csv", index=False)
    return [f"data.train_path={out / 'train.csv'}"]


def store(out: Path) -> list[str]:
    return [f"tracking.uri=sqlite:///{out / 'mlflow.db'}", f"tracking.artifact_location={(out / 'art').as_uri()}",
            "tracking.system_metrics=false", f"hpo.storage={out / 'optuna.journal'}"]


def pruning(args: argparse.Namespace, out: Path) -> list[dict]:
    from maxout.hpo import study

    base = ["hardware=cpu", f"model={args.model}", "hpo=default", f"train.epochs={args.epochs}",
            f"hpo.n_trials={args.trials}", "hpo.sampler.name=random", f"hpo.sampler.seed={args.seed}",
            "hpo.log_models=none", "~hpo.search_space.train.target_effective_batch",
            "hpo.search_space.train.lr.low=1e-6", "hpo.search_space.train.lr.high=5e-4",
            *subset(args.train_rows, args.seed, out), *store(out)]
    rows = []
    for name, overrides in VARIANTS.items():
        start = time.perf_counter()
        result = study.run([*base, *overrides, f"hpo.study_name=pruning-{len(rows)}"])
        c = result.counts
        rows.append({"pruner": name, "best": result.best.value if result.best else float("nan"),
                     "run": c["hpo/trial_epochs_run"], "planned": c["hpo/trial_epochs_without_pruning"],
                     "saved": c["hpo/compute_saved"], "pruned": c["hpo/trials_pruned"],
                     "wall_s": time.perf_counter() - start})
    return rows


def compile_cache(out: Path, threads: int) -> dict:
    """Two invocations as separate processes (a fresh process has no in-memory caches) on one cache dir."""
    import mlflow

    cache = out / "inductor-cache"
    # Only optimizer-side hyper-parameters: they leave the model's graph as it is, so a warm cache can serve it
    # (a sampled dropout or batch size is a different graph and compiles anew).
    base = ["hardware=cpu", "model=tiny", "hardware.compile=true", "hpo=default", "hpo.pruner.name=none",
            "train.max_steps=6", "train.epochs=1", "hpo.log_models=none", "hpo.study_name=compile",
            "~hpo.search_space.model.dropout", "~hpo.search_space.train.target_effective_batch",
            f"hpo.compile_cache_dir={cache}", *store(out)]
    env = {**{k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"},
           "OMP_NUM_THREADS": str(threads)}
    for n_trials in (2, 3):  # the first invocation runs 2 trials, the second one more
        done = subprocess.run([sys.executable, "-m", "maxout", "hpo", *base, f"hpo.n_trials={n_trials}",
                               "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"maxout hpo failed ({done.returncode}): {done.stderr[-2000:]}")
    client = mlflow.MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("maxout").experiment_id],
                              "tags.`maxout.hpo.study` = 'compile' and tags.`maxout.command` = 'hpo-trial'")
    by_trial = {int(r.data.tags["maxout.hpo.trial_number"]): r.data.metrics for r in runs}
    return {name: (by_trial[n]["time/compile_s"], by_trial[n]["compile/fxgraph_cache_hit"],
                   by_trial[n]["compile/fxgraph_cache_miss"])
            for n, name in enumerate(("cold, first process (trial 0)", "same process (trial 1)",
                                      "warm disk cache, second process (trial 2)"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-rows", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: on a shared 2-core machine more threads spin against other jobs)")
    parser.add_argument("--skip-pruning", action="store_true")
    parser.add_argument("--skip-compile", action="store_true")
    args = parser.parse_args()
    os.chdir(ROOT)
    import torch

    torch.set_num_threads(args.threads)
    out = Path(tempfile.mkdtemp(prefix="maxout-bench-hpo-"))
    if not args.skip_pruning:
        rows = pruning(args, out)
        print(f"\n## Pruning: {args.model}, {args.trials} trials x {args.epochs} epochs, {args.train_rows} training "
              f"rows, random sampler seed {args.seed}\n")
        print("| pruner | best eval/macro_f1 | trial-epochs run | without pruning | compute saved | pruned | wall s |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['pruner']} | {r['best']:.4f} | {r['run']:.0f} | {r['planned']:.0f} | {r['saved']:.0%} | "
                  f"{r['pruned']:.0f} | {r['wall_s']:.0f} |")
    if not args.skip_compile:
        times = compile_cache(out, args.threads)
        print("\n## Compile cache: tiny model, hardware.compile=true, time/compile_s per trial\n")
        print("| trial | compile s | vs cold | FX-graph cache hits / misses |\n|---|---|---|---|")
        cold = times["cold, first process (trial 0)"][0]
        for name, (seconds, hits, misses) in times.items():
            print(f"| {name} | {seconds:.1f} | {seconds / cold:.2f}x | {hits:.0f} / {misses:.0f} |")
    print(f"\nMLflow store and journal: {out}")


if __name__ == "__main__":
    main()

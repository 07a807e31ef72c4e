"""The end of a run: logging the model the old way (commit 81899d2) against models from code (issue 28).

The old way (a copy of that commit's ``pyfunc.log_model``) loaded the saved model a second time and predicted on two
real validation rows to infer the signature, pickled ``TextClassifier()``, and, because it gave an input example,
MLflow's ``Model.log`` loaded the model a third time and predicted again to check that the example serves. The new
way (``maxout.serving.pyfunc.log_model``) logs ``model_code.py``, declares the signature from ``maxout.json`` and a
synthetic example, and loads nothing. Both copy the same weights into the same kind of store (SQLite, local
artifact folder).

The model is the largest that fits this 2-core, 24 GiB machine beside other jobs: a Gemma 3 1B-shaped decoder
classifier (26 layers, 1152 hidden, 262k vocabulary, last-token pooling: the RTX 3090 review's model,
conf/model/gemma3_1b.yaml) with random weights, built from its config (no download), saved in float32 as the trainer
saves a full fine-tune (about 4 GB); ``--shape bert_base`` is BERT-base. Each log runs in a fresh process (so one
way's memory cannot help the other), the two ways interleaved in both orders (A B B A ...); the time is the
``log_model`` call alone, the memory the process's peak RSS above what it held before the call.

    .venv/bin/python -m benchmarks.log_model_time [--shape gemma3_1b|bert_base] [--reps 2] [--workdir /tmp/x]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

SHAPES = {
    # google/gemma-3-1b-pt's config.json: 26 layers, 5 sliding-window layers to each global one.
    "gemma3_1b": dict(model_type="gemma3_text", hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
                      query_pre_attn_scalar=256, sliding_window=512,
                      layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2),
    "bert_base": dict(model_type="bert", hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                      num_attention_heads=12, max_position_embeddings=512),
}
VOCAB = {"gemma3_1b": 262144, "bert_base": 30522}
POOLING = {"gemma3_1b": "last", "bert_base": None}
VALIDATION = Path(__file__).resolve().parents[1] / "projects" / "nli_demo" / "data" / "validation.csv"


def build(shape: str, model_dir: Path) -> int:
    """Save a random model of ``shape`` as the trainer does (inference.save); returns its parameter count."""
    from maxout import loading, modeling
    from maxout.serving import inference

    cfg = loading.load(["hardware=cpu", "model=tiny_gemma", "model.tokenizer=bundled"])
    model_cfg = dataclasses.replace(cfg.model, architecture=SHAPES[shape], pooling=POOLING[shape],
                                    attention="causal" if POOLING[shape] else None)
    tokenizer = modeling.load_tokenizer(model_cfg)
    config = modeling.build_config(model_cfg, ["0", "1"], vocab_size=VOCAB[shape],
                                   pad_token_id=tokenizer.pad_token_id)
    model = modeling.load_model(model_cfg, config, "sdpa")
    meta = inference.ModelMeta("post", "criterion", ["0", "1"], 256, POOLING[shape])
    inference.save(model, tokenizer, meta, model_dir)
    return sum(p.numel() for p in model.parameters())


def old_log_model(model_dir: str, example: Any) -> Any:
    """serving/pyfunc.py's log_model at commit 81899d2, verbatim but for the imports."""
    import mlflow
    from mlflow.models import infer_signature

    from maxout.serving.inference import META_FILE, Predictor
    from maxout.serving.pyfunc import PACKAGE_DIR, TextClassifier, requirements

    signature = None
    if example is not None:
        predictor = Predictor.from_dir(model_dir, device="cpu")
        signature = infer_signature(example, predictor.predict(example),
                                    params={"batch_size": 64, "on_missing": "error"})
    meta = json.loads((Path(model_dir) / META_FILE).read_text())
    base = {f"maxout.{key}": meta[key] for key in ("base_model", "base_commit") if meta.get(key)}
    return mlflow.pyfunc.log_model(
        name="model", python_model=TextClassifier(), artifacts={"model": str(model_dir)},
        code_paths=[str(PACKAGE_DIR)], signature=signature, input_example=example, pip_requirements=requirements(),
        metadata=base or None)


def memory_gb(field: str) -> float:
    """VmRSS (now) or VmHWM (the peak) of this process from /proc. Not getrusage's ru_maxrss: Linux carries that
    over from the parent across fork and exec, so a child would report the parent's peak (the built model)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 2**20  # kB -> GiB


def one(way: str, model_dir: str, store: str) -> dict:
    """In a fresh process: log ``model_dir`` one way into ``store``; the call's seconds and peak RSS above before."""
    import mlflow
    import pandas as pd

    from maxout.serving import inference, pyfunc

    mlflow.set_tracking_uri(f"sqlite:///{store}/mlflow.db")
    client = mlflow.MlflowClient()
    name = "bench"
    experiment = client.get_experiment_by_name(name)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(
        name, artifact_location=Path(store, "art").as_uri())
    real = pd.read_csv(VALIDATION)[["post", "criterion"]].head(2)  # what run.py passed: two validation rows
    with mlflow.start_run(experiment_id=experiment_id):
        before = memory_gb("VmRSS")
        started = time.perf_counter()
        if way == "old":
            info = old_log_model(model_dir, real)
        else:
            info = pyfunc.log_model(model_dir, inference.synthetic_example(inference.read_meta(model_dir)))
        seconds = time.perf_counter() - started
    peak = memory_gb("VmHWM")
    shutil.rmtree(Path(store, "art", "models", info.model_id), ignore_errors=True)  # keep the disk free
    return {"way": way, "seconds": seconds, "peak_above_gb": peak - before}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gemma3_1b")
    parser.add_argument("--reps", type=int, default=2, help="rounds; each round is A B or B A")
    parser.add_argument("--workdir", default=None, help="where the model and the store go (default: a temp dir)")
    parser.add_argument("--one", choices=["old", "new"], help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, args.model_dir, args.store)))
        return 0
    work = Path(args.workdir or tempfile.mkdtemp(prefix="maxout-logbench-"))
    model_dir, store = work / "model", work / "store"
    store.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    params = build(args.shape, model_dir)
    size = sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file()) / 2**30
    print(f"{args.shape}: {params / 1e6:.0f}M params, {size:.2f} GiB saved, built in "
          f"{time.perf_counter() - started:.0f} s; {args.reps} rounds, interleaved (ABBA)", flush=True)
    results: dict[str, list[dict]] = {"old": [], "new": []}
    try:
        for rep in range(args.reps):
            for way in (("old", "new") if rep % 2 == 0 else ("new", "old")):
                done = subprocess.run([sys.executable, "-m", "benchmarks.log_model_time", "--one", way,
                                       "--model-dir", str(model_dir), "--store", str(store)],
                                      capture_output=True, text=True)
                if done.returncode != 0:
                    print(done.stderr[-3000:], file=sys.stderr)
                    return 1
                result = json.loads(done.stdout.strip().splitlines()[-1])
                results[way].append(result)
                print(f"  round {rep + 1} {way}: {result['seconds']:6.1f} s, peak RSS +{result['peak_above_gb']:.2f} "
                      f"GiB", flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print("log_model, median over rounds (min-max):")
    for way, rows in results.items():
        secs, mem = [r["seconds"] for r in rows], [r["peak_above_gb"] for r in rows]
        print(f"  {way}: {statistics.median(secs):6.1f} s ({min(secs):.1f}-{max(secs):.1f}), peak RSS "
              f"+{statistics.median(mem):.2f} GiB ({min(mem):.2f}-{max(mem):.2f})")
    old, new = (statistics.median(r["seconds"] for r in results[w]) for w in ("old", "new"))
    print(f"  saved {old - new:.1f} s per logged model ({old / new:.1f}x faster); load average "
          f"{os.getloadavg()[0]:.1f}; benchmark wall {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

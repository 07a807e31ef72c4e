"""What compiling the layers alone (``hardware.compile_scope=layers``, optimizations/regional_compile.py) buys and
costs against compiling the whole model: compile seconds, graphs, the first step's wall time and steady samples/s.

Each run is ``maxout train`` with compile on, in a fresh process with an empty inductor cache of its own (a cold
compile: what an HPO trial with a newly sampled dropout pays, since the dropout is a constant in its graph), the two
scopes interleaved in both orders (model layers layers model ...), with SDPA attention. The model is random
(``model=tiny`` with another architecture: MiniLM's shape by default, the maxout default model's, or BERT-base's,
or Qwen3-0.6B's decoder shape, cut to ``--layers``), batches of the demo's rows, bucketed.

    .venv/bin/python -m benchmarks.compile_scope [--arch minilm|bert_base|qwen3_0_6b] [--layers N] [--reps 1]
                                                 [--steps 30] [--batch 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.gpu import workloads

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("time/compile_s", "time/compile_graphs", "time/first_step_s", "perf/steady_samples_per_s")


def one_run(scope: str, args: argparse.Namespace, work: Path) -> dict:
    """One training run in a fresh process with a cold inductor cache; its metrics."""
    # SDPA (not the CPU profile's eager attention): prepared masks then hand compiled layers a mask for every batch,
    # as on a GPU; with eager attention an unpadded batch's missing mask compiles a second layer graph mid-run
    overrides = [*workloads.model(args.arch), *workloads.demo(work), "hardware=cpu", "hardware.compile=true",
                 "hardware.attn_implementation=sdpa",
                 f"hardware.compile_scope={scope}", "tracking=none", "checkpoint.enabled=false",
                 f"train.batch_size={args.batch}", f"train.target_effective_batch={args.batch}",
                 f"train.max_steps={args.steps}", "train.epochs=100", "train.eval_every_epochs=100",
                 f"train.warmup_steps_excluded={max(3, args.steps // 5)}", "train.log_every=10"]
    if args.layers:
        overrides.append(f"model.architecture.num_hidden_layers={args.layers}")
    code = ("import json, sys; from maxout import loading; from maxout.train import train; "
            "from maxout.tracking.tracker import NullTracker; "
            "r = train(loading.load(sys.argv[1:]), tracker=NullTracker(), progress=False, verbose=False); "
            f"print('RESULT', json.dumps({{k: r.metrics.get(k) for k in {KEYS!r}}}))")
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(ROOT / "platform")}
        out = subprocess.run([sys.executable, "-c", code, *overrides], env=env, capture_output=True, text=True,
                             check=False, cwd=ROOT)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{scope} run failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="minilm", choices=sorted(workloads.ARCHITECTURES))
    parser.add_argument("--layers", type=int, default=0, help="cut the architecture to this many layers (0: its own)")
    parser.add_argument("--reps", type=int, default=1, help="rounds of (model, layers, layers, model)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict]] = {"model": [], "layers": []}
    with tempfile.TemporaryDirectory(prefix="compile-scope-") as work:
        for _ in range(args.reps):
            for scope in ("model", "layers", "layers", "model"):
                result = one_run(scope, args, Path(work))
                runs[scope].append(result)
                print(scope, " ".join(f"{k}={v:.2f}" for k, v in result.items() if v is not None), flush=True)
    print(f"\n{args.arch}{f' cut to {args.layers} layers' if args.layers else ''}, batch {args.batch}, "
          f"{args.steps} steps, cold inductor cache each run, {2 * args.reps} runs a scope (interleaved)\n")
    print("| scope | compile s | graphs | first step s | steady samples/s |")
    print("|---|---|---|---|---|")
    for scope, results in runs.items():
        cells = [" / ".join(f"{r[k]:.1f}" if k != "time/compile_graphs" else str(int(r[k])) for r in results)
                 for k in KEYS]
        print(f"| {scope} | {' | '.join(cells)} |")
    median = {scope: {k: statistics.median(r[k] for r in results) for k in KEYS} for scope, results in runs.items()}
    ratio = {k: median["layers"][k] / median["model"][k] for k in ("time/compile_s", "perf/steady_samples_per_s")}
    print(f"\nlayers ÷ model: compile s {ratio['time/compile_s']:.2f}×, "
          f"steady samples/s {ratio['perf/steady_samples_per_s']:.2f}×")


if __name__ == "__main__":
    main()

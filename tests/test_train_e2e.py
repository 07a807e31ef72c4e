"""End-to-end: `maxout train` into a temporary MLflow store, then the run's params, metrics, artifacts and model."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import mlflow
import pandas as pd
import pytest

from maxout import cli
from maxout.optimizations import NAMES
from maxout.paths import CPU_BF16_VAR
from maxout.train import Callback

from . import warm_maxout
from .conftest import ROOT, TINY, load_pyfunc, runs_in

CORE_METRICS = ["train/loss", "eval/loss", "eval/accuracy", "eval/macro_f1", "perf/it_per_s", "perf/samples_per_s",
                "perf/tokens_per_s", "perf/padding_efficiency", "mem/peak_rss_gb", "time/compile_s",
                "time/first_step_s", "time/wall_s", "time/train_window_s", "train/samples"]


def only_run(uri):
    runs = runs_in(uri)
    assert len(runs) == 1, [r.info.status for r in runs]
    return runs[0]


def check_run(run, expected_samples: int, outer_wall_s: float):
    params, metrics = run.data.params, run.data.metrics
    assert run.info.status == "FINISHED"
    for name in NAMES:  # every optimization: requested and effective
        assert f"opt.{name}.requested" in params and f"opt.{name}.effective" in params, name
    assert params["opt.tf32.effective"] == "false" and "no CUDA device" in params["opt.tf32.reason"]
    assert params["opt.pin_memory.effective"] == "false" and "no CUDA device" in params["opt.pin_memory.reason"]
    missing = [k for k in CORE_METRICS if k not in metrics]
    assert not missing, missing
    assert "perf/mfu" not in metrics  # no meaningful peak on CPU
    # samples/s is a real measurement: the sample count is known independently, and the window fits inside
    # the wall time measured out here.
    assert metrics["train/samples"] == expected_samples
    window = metrics["time/train_window_s"]
    assert 0 < window < metrics["time/wall_s"] < outer_wall_s
    assert metrics["perf/samples_per_s"] == pytest.approx(expected_samples / window, rel=0.05)
    assert 0 < metrics["perf/padding_efficiency"] <= 1
    return params, metrics


def test_tiny_run_is_fully_tracked_and_its_model_predicts(mlflow_store):
    start = time.perf_counter()
    code = cli.main(["train", *TINY, *mlflow_store["overrides"], "--no-progress"])
    wall = time.perf_counter() - start
    assert code == 0
    run = only_run(mlflow_store["uri"])
    params, _ = check_run(run, expected_samples=3 * 16, outer_wall_s=wall)
    assert params["derived.effective_batch"] == "16" and params["cfg.model.name"] == "tiny"
    client = mlflow.MlflowClient(mlflow_store["uri"])
    assert {"config.yaml", "hardware.json", "versions.json"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    hw = mlflow.artifacts.load_dict(f"{run.info.artifact_uri}/hardware.json")
    assert hw["kind"] == "cpu" and hw["profile"] == "cpu"
    mlflow.set_tracking_uri(mlflow_store["uri"])
    model = load_pyfunc(run.data.tags["maxout.model_uri"])
    out = model.predict(pd.DataFrame({"post": ["I lie awake every night.", "We painted the fence."],
                                      "criterion": ["Sleep disturbance", "Fatigue"]}))
    assert list(out.columns) == ["label", "prob_0", "prob_1"] and len(out) == 2
    assert (out[["prob_0", "prob_1"]].sum(axis=1) - 1).abs().max() < 1e-5
    assert set(out["label"]) <= {"0", "1"}
    # The input example is made up (tracking.input_example=synthetic): no validation row is in the model's files.
    local = mlflow.artifacts.download_artifacts(run.data.tags["maxout.model_uri"],
                                                dst_path=str(mlflow_store["dir"] / "dl"))
    assert json.loads((Path(local) / "input_example.json").read_text())["data"][0][0] == "An example text to classify."
    assert not any(text in blob for text in first_validation_texts() for blob in model_files(local))


def first_validation_texts(n: int = 2) -> list[str]:
    """The rows tracking.input_example=real copies: the first validation posts, as they read in any file."""
    posts = pd.read_csv(ROOT / "projects" / "nli_demo" / "data" / "validation.csv")["post"].tolist()[:n]
    return [text[:80] for text in posts] + [json.dumps(text)[1:81] for text in posts]


def model_files(folder) -> list[str]:
    return [p.read_bytes().decode("utf-8", "replace") for p in Path(folder).rglob("*") if p.is_file()]


@pytest.mark.slow
def test_real_rows_as_the_input_example_are_opt_in(mlflow_store):
    assert cli.main(["train", *TINY, *mlflow_store["overrides"], "tracking.input_example=real", "--no-progress"]) == 0
    run = only_run(mlflow_store["uri"])
    mlflow.set_tracking_uri(mlflow_store["uri"])
    local = mlflow.artifacts.download_artifacts(run.data.tags["maxout.model_uri"],
                                                dst_path=str(mlflow_store["dir"] / "dl"))
    example = json.loads((Path(local) / "input_example.json").read_text())
    assert [row[0][:80] for row in example["data"]] == first_validation_texts()[:2]


class Boom(Callback):
    def on_step_end(self, state):
        if state.step == 2:
            raise RuntimeError("injected failure at step 2")


def test_a_failure_after_the_run_started_marks_it_failed_with_the_reason(mlflow_store):
    from maxout import loading
    from maxout.train import train

    cfg = loading.load([*TINY, *mlflow_store["overrides"]])
    with pytest.raises(RuntimeError, match="injected"):
        train(cfg, callbacks=[Boom()], progress=False, verbose=False)
    run = only_run(mlflow_store["uri"])
    assert run.info.status == "FAILED"
    assert "injected failure at step 2" in run.data.tags["maxout.status_reason"]


def test_overrides_string_is_split_like_the_mlproject_passes_it(mlflow_store):
    code = cli.main(["train", "hardware=cpu", "--overrides", " ".join(TINY[1:] + mlflow_store["overrides"]),
                     "--no-progress"])
    assert code == 0
    assert only_run(mlflow_store["uri"]).data.params["cfg.model.name"] == "tiny"


def native_precision_env() -> dict:
    """The environment without CI's MAXOUT_CPU_BF16=0 (.ci/run): the process picks its precision from this CPU, as
    `make run` does on it."""
    return {k: v for k, v in os.environ.items() if k != CPU_BF16_VAR}


@pytest.mark.slow
def test_demo_project_with_minilm_learns_and_its_model_predicts_new_text(mlflow_store):
    """What `make run` does on this CPU machine: MiniLM on projects/nli_demo, hardware=auto, as a real process, for
    two epochs of its three, in the precision this CPU resolves to. Measured on 2026-11-26/27 (AMD EPYC, 2 cores):
    - fp32 (a CPU without bf16 instructions, or CI's MAXOUT_CPU_BF16=0): eval accuracy 0.73, 0.76, 0.795 after
      epochs 1-3 against a majority baseline of 0.565; 95 s for two epochs on one core;
    - bf16 autocast (AVX512-BF16 or AMX): eval accuracy 0.73, 0.755 after epochs 1-2; 44 s for two epochs on one
      core.
    The test asserts learning, not a precision, so it does not take CI's MAXOUT_CPU_BF16=0: that variant is for the
    tests whose outcome could depend on the precision, and both sides of the decision are trained explicitly in
    test_optimizations. The third epoch shows nothing the second does not."""
    sys.path.insert(0, str(ROOT / "projects" / "nli_demo"))
    import generate

    start = time.perf_counter()
    proc = warm_maxout.run(["train", "hardware=auto", *mlflow_store["overrides"], "tracking.system_metrics=true",
                            "train.epochs=2", "--no-progress"], env=native_precision_env())  # forked warm
    wall = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = only_run(mlflow_store["uri"])
    params, metrics = check_run(run, expected_samples=800 * 2, outer_wall_s=wall)
    assert params["cfg.hardware.name"] == "cpu" and params["cfg.model.name"] == "minilm"
    assert metrics["eval/accuracy"] >= metrics["eval/majority_baseline"] + 0.15, metrics
    assert any(k.startswith("system/") for k in metrics)  # MLflow's own sampler ran for the timeline
    # New text, never seen in training: a fresh draw from the generator with another seed.
    import random

    rng = random.Random(99)
    fresh = pd.DataFrame([generate.make_example(rng) for _ in range(120)])
    mlflow.set_tracking_uri(mlflow_store["uri"])
    model = load_pyfunc(run.data.tags["maxout.model_uri"])
    predicted = model.predict(fresh[["post", "criterion"]])
    accuracy = (predicted["label"].astype(int) == fresh["label"]).mean()
    majority = max(fresh["label"].mean(), 1 - fresh["label"].mean())
    assert accuracy >= majority + 0.1, (accuracy, majority)

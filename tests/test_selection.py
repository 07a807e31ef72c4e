"""Results a practitioner trusts: the logged model is the best evaluation's (train.select_best), early stopping
stops at the right evaluation, per-class metrics agree with scikit-learn, the confusion-matrix and report
artifacts describe the logged model, and the test split (data.test_path) never chooses anything.

The runs are crafted so that the metric peaks mid-way: a callback wrecks the classifier's bias after a chosen
step (on every later step, so training cannot repair it), which makes every later evaluation worse."""

from __future__ import annotations

import math
import random
from pathlib import Path

import mlflow
import pandas as pd
import pytest
import torch
from sklearn.metrics import accuracy_score, f1_score, precision_recall_fscore_support

from maxout import loading
from maxout.config import TrainConfig
from maxout.metrics import classification_scores, confusion_matrix
from maxout.tracking.tracker import NullTracker
from maxout.train import Callback, TrainState, train
from maxout.train.selection import ModelSelection

from .conftest import ROOT, runs_in

# 48 training / 32 validation rows of the demo, micro-batch 16: 3 optimizer steps per epoch.
BASE = ["hardware=cpu", "model=tiny", "train.log_every=1", "train.batch_size=16", "tracking.system_metrics=false"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture
def small_data(tmp_path):
    rows = pd.read_csv(ROOT / "projects/nli_demo/data/train.csv")
    rows.iloc[:48].to_csv(tmp_path / "train.csv", index=False)
    validation = pd.read_csv(ROOT / "projects/nli_demo/data/validation.csv").iloc[:32]
    validation.to_csv(tmp_path / "validation.csv", index=False)
    flipped = validation.assign(label=1 - validation["label"])  # every test label is the other class
    flipped.to_csv(tmp_path / "test_flipped.csv", index=False)
    return [f"data.train_path={tmp_path / 'train.csv'}", f"data.validation_path={tmp_path / 'validation.csv'}",
            f"checkpoint.dir={tmp_path / 'ckpt'}"]


class Wreck(Callback):
    """From step ``after`` on, the head's bias says "class 0" with certainty: the loss soars and stays high."""

    def __init__(self, model_of, after: int):
        self.model_of, self.after = model_of, after

    def on_step_end(self, state: TrainState) -> None:
        if state.step >= self.after:
            with torch.no_grad():
                self.model_of().classifier.bias.copy_(torch.tensor([8.0, -8.0]))


class Snapshots(Callback):
    """The model's weights at every evaluation, by step."""

    def __init__(self, model_of):
        self.model_of, self.at = model_of, {}

    def on_evaluate(self, state: TrainState, metrics: dict) -> None:
        self.at[state.step] = {k: v.detach().clone() for k, v in self.model_of().state_dict().items()}


class Holder:
    """train() builds the model; callbacks reach it through the Setup the run keeps (set on_train_start)."""

    model = None

    def __call__(self):
        return self.model


def crafted(holder: Holder, after: int) -> list[Callback]:
    return [Wreck(holder, after), Snapshots(holder)]


@pytest.fixture
def holder(monkeypatch):
    """Hands the model train() builds to the callbacks (train/run.py's build, wrapped)."""
    from maxout.train import run as run_mod

    held = Holder()
    real = run_mod.build

    def build(*args, **kwargs):
        setup = real(*args, **kwargs)
        held.model = setup.model
        return setup

    monkeypatch.setattr(run_mod, "build", build)
    return held


def history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """In the order logged (step, then time)."""
    found = mlflow.MlflowClient(uri).get_metric_history(run_id, key)
    return [(m.step, m.value) for m in sorted(found, key=lambda m: (m.step, m.timestamp))]


def logged_weights(uri: str, model_uri: str, tmp_path: Path) -> dict:
    from transformers import AutoModelForSequenceClassification

    mlflow.set_tracking_uri(uri)
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(tmp_path / "model")))
    folder = next(p.parent for p in local.rglob("config.json"))
    return AutoModelForSequenceClassification.from_pretrained(folder).state_dict()


# ------------------------------------------------------------------------------------------------ metrics


def test_per_class_scores_from_a_confusion_matrix_agree_with_scikit_learn():
    rng = random.Random(3)
    labels = [rng.choice([0, 1, 2]) for _ in range(300)]  # class 3 is never true ...
    preds = [rng.choice([0, 1, 2, 3]) if rng.random() < 0.5 else y for y in labels]  # ... but sometimes predicted
    names = ["entail", "neutral", "contra/dict", "other"]
    counts = confusion_matrix(torch.tensor(preds), torch.tensor(labels), 4).tolist()
    scores = classification_scores(counts, names)
    p, r, f, _ = precision_recall_fscore_support(labels, preds, labels=[0, 1, 2, 3], zero_division=0)
    for c, name in enumerate(["entail", "neutral", "contra_dict", "other"]):  # '/' would nest the metric name
        assert scores[f"eval/precision/{name}"] == pytest.approx(p[c])
        assert scores[f"eval/recall/{name}"] == pytest.approx(r[c])
        assert scores[f"eval/f1/{name}"] == pytest.approx(f[c])
    assert scores["eval/accuracy"] == pytest.approx(accuracy_score(labels, preds))
    assert scores["eval/macro_f1"] == pytest.approx(f1_score(labels, preds, labels=[0, 1, 2, 3], average="macro",
                                                             zero_division=0))


def test_evaluate_counts_on_the_device_what_scikit_learn_finds_on_the_predictions(small_data, cpu_device):
    from maxout.data import MODEL_INPUTS, load
    from maxout.modeling import load_tokenizer
    from maxout.train.evaluate import evaluate
    from maxout.train.setup import build

    cfg = loading.load([*BASE, *small_data, "tracking=none"], device=cpu_device)
    dataset = load(cfg.data)
    setup = build(cfg, cpu_device, dataset, load_tokenizer(cfg.model))
    setup.model.eval()
    with torch.no_grad(), setup.precision.autocast():  # the head shifted to the median logit gap: both classes
        gaps = [row for batch in setup.eval_loader for row in torch.diff(
            setup.model(**{k: batch[k] for k in MODEL_INPUTS if k in batch}).logits, dim=-1).flatten().tolist()]
        setup.model.classifier.bias[1] -= torch.tensor(gaps).median() + 1e-4
    result = evaluate(setup)
    preds, labels, loss = [], [], 0.0
    setup.model.eval()
    with torch.no_grad(), setup.precision.autocast():  # the same numbers evaluate() computes, read row by row
        for batch in setup.eval_loader:
            out = setup.model(**{k: batch[k] for k in MODEL_INPUTS if k in batch})
            preds += out.logits.argmax(-1).tolist()
            labels += batch["labels"].tolist()
            loss += out.loss.item() * len(batch["labels"])
    assert len(set(preds)) == 2, "the crafted head should predict both classes"
    p, r, f, _ = precision_recall_fscore_support(labels, preds, labels=[0, 1], zero_division=0)
    m = result.metrics
    assert [m["eval/precision/0"], m["eval/precision/1"]] == pytest.approx(list(p))
    assert [m["eval/recall/0"], m["eval/recall/1"]] == pytest.approx(list(r))
    assert [m["eval/f1/0"], m["eval/f1/1"]] == pytest.approx(list(f))
    assert m["eval/macro_f1"] == pytest.approx(f1_score(labels, preds, average="macro"))
    assert m["eval/accuracy"] == pytest.approx(accuracy_score(labels, preds))
    assert m["eval/loss"] == pytest.approx(loss / len(labels), rel=1e-3)
    assert sum(map(sum, result.confusion)) == len(dataset.validation) == 32


# ------------------------------------------------------------------------------------------------ selection


def test_logged_model_is_the_best_evaluations_not_the_last(small_data, mlflow_store, holder, tmp_path):
    """Evaluations at steps 3, 6, 9, 12; the head is wrecked from step 7 on, so eval/loss is best at 3 or 6."""
    callbacks = crafted(holder, after=7)
    cfg = loading.load([*BASE, *small_data, *mlflow_store["overrides"], "train.epochs=4",
                        "train.select_best=eval/loss"])
    result = train(cfg, callbacks=callbacks, progress=False, verbose=False)
    uri = mlflow_store["uri"]
    [run] = runs_in(uri)
    losses = history(uri, run.info.run_id, "eval/loss")
    by_step = dict(losses[:4])  # the four evaluations, in order (the selected values come again at the end)
    assert sorted(by_step) == [3, 6, 9, 12]
    best = min(by_step, key=by_step.get)
    assert best in (3, 6) and by_step[12] > by_step[best] + 1  # a crafted peak mid-way, not at the end
    m = run.data.metrics
    assert m["best/step"] == best and m["best/epoch"] == best / 3 and m["best/eval/loss"] == by_step[best]
    # The final eval/* describe the logged model: the best evaluation's values, the latest in the history.
    assert m["eval/loss"] == by_step[best] and losses[-1] == (12, by_step[best])
    best_accuracy = dict(history(uri, run.info.run_id, "eval/accuracy")[:4])[best]
    assert m["eval/accuracy"] == best_accuracy == result.metrics["eval/accuracy"]
    assert run.data.tags["maxout.stop_reason"] == "completed: 12 of 12 steps"
    assert run.data.tags["maxout.best_state"].startswith("memory (")
    # The logged model's weights are the best evaluation's, not the last one's.
    snapshots = callbacks[1].at
    logged = logged_weights(uri, run.data.tags["maxout.model_uri"], tmp_path)
    assert all(torch.equal(logged[k], snapshots[best][k]) for k in logged)
    assert not torch.equal(logged["classifier.bias"], snapshots[12]["classifier.bias"])
    # The confusion matrix and the report are the logged model's, on the whole validation set.
    store = run.info.artifact_uri
    matrix = mlflow.artifacts.load_dict(f"{store}/eval/confusion_matrix.json")
    assert matrix["labels"] == ["0", "1"] and matrix["step"] == best
    assert sum(map(sum, matrix["matrix"])) == 32 and matrix["total"] == 32
    assert sum(matrix["matrix"][c][c] for c in range(2)) / 32 == pytest.approx(best_accuracy)
    artifacts = {a.path for a in mlflow.MlflowClient(uri).list_artifacts(run.info.run_id, "eval")}
    assert {"eval/confusion_matrix.json", "eval/confusion_matrix.png", "eval/classification_report.txt"} <= artifacts
    report = mlflow.artifacts.load_text(f"{store}/eval/classification_report.txt")
    assert "precision" in report and "macro avg" in report and f"{best_accuracy:.4f}" in report


@pytest.mark.parametrize("keep_in", ["memory", "disk"])
def test_early_stopping_stops_at_the_right_evaluation_with_its_tag(small_data, holder, keep_in, tmp_path):
    """Evaluations every step; the head is wrecked from step 1 on: evaluations 2 and 3 do not improve on step 1's,
    so patience 2 stops the run after step 3 of 12."""
    callbacks = crafted(holder, after=1)
    tracker = NullTracker()
    cfg = loading.load([*BASE, *small_data, "tracking=none", "train.epochs=4", "train.eval_interval=1",
                        "train.select_best=eval/loss", "train.early_stopping.patience=2", f"train.keep_best_in={keep_in}"])
    result = train(cfg, tracker=tracker, callbacks=callbacks, progress=False, verbose=False)
    assert [step for step, _ in tracker.metrics["eval/loss"]] == [1, 2, 3, 3]  # + the selected values at the end
    assert tracker.tags["maxout.stop_reason"].startswith("early stopping at step 3: eval/loss did not improve by "
                                                         "more than 0 in 2 evaluations (best ")
    assert tracker.last("best/step") == 1 and tracker.last("train/steps_saved") == 9
    assert tracker.last("train/epochs_saved") == pytest.approx(3.0)
    assert tracker.last("eval/loss") == tracker.metrics["eval/loss"][0][1]
    assert tracker.tags["maxout.best_state"].startswith(keep_in)
    snapshots = callbacks[1].at
    final = result.setup.model.state_dict()
    assert all(torch.equal(final[k], snapshots[1][k]) for k in final)  # the best (step 1) weights are back
    assert not list((tmp_path / "ckpt").rglob("best.pt"))  # the working copy is gone


def test_min_delta_counts_small_gains_as_no_improvement_but_the_best_still_wins():
    model = torch.nn.Linear(2, 2)
    cfg = TrainConfig(select_best="eval/macro_f1")
    cfg.early_stopping.patience, cfg.early_stopping.min_delta = 3, 0.01
    selection = ModelSelection(model, cfg, Path("/nonexistent"), keep_in="memory")
    state = TrainState(total_steps=100, steps_per_epoch=10)
    for step, value in enumerate([0.5, 0.6, math.nan, 0.605, 0.607, 0.9], 1):
        state.step = step
        with torch.no_grad():
            model.weight.fill_(step)
        selection.on_evaluate(state, {"eval/macro_f1": value})
        if state.stop_reason:
            break
    # NaN beats nothing, 0.605 and 0.607 beat 0.6 by less than 0.01: patience 3 runs out at step 5.
    assert state.step == 5 and state.stop_reason.startswith("early stopping at step 5")
    assert selection.best.step == 5 and selection.value == 0.607  # selection itself takes every gain
    selection.last_step = 6
    selection.finish()
    assert torch.all(model.weight == 5)


def test_under_lora_only_the_adapter_and_head_are_kept(small_data, cpu_device):
    from maxout import modeling
    from maxout.data import load
    from maxout.train.setup import build_model, plan_decisions

    cfg = loading.load([*BASE, *small_data, "tracking=none", "model.adapter=lora"], device=cpu_device)
    dataset = load(cfg.data)
    tokenizer = modeling.load_tokenizer(cfg.model)
    config = modeling.build_config(cfg.model, dataset.label_names, len(tokenizer), tokenizer.pad_token_id)
    model, _ = build_model(cfg, cpu_device, config, plan_decisions(cfg, cpu_device, modeling.model_class(config)))
    selection = ModelSelection(model, cfg.train, Path("/nonexistent"), keep_in="memory")
    assert selection.names and all("lora_" in n or "classifier" in n for n in selection.names)
    assert selection.nbytes < 0.2 * sum(p.numel() * p.element_size() for p in model.parameters())


def test_the_test_split_is_scored_once_by_the_selected_model_and_never_selects(small_data, mlflow_store, holder,
                                                                              tmp_path):
    """The test file is the validation file with every label flipped: whatever a model scores on validation, it
    scores the opposite on test, so selecting on test would pick the worst validation evaluation."""
    cfg = loading.load([*BASE, *small_data, *mlflow_store["overrides"], "train.epochs=4",
                        "train.select_best=eval/loss", f"data.test_path={tmp_path / 'test_flipped.csv'}"])
    result = train(cfg, callbacks=crafted(holder, after=7), progress=False, verbose=False)
    uri = mlflow_store["uri"]
    [run] = runs_in(uri)
    by_step = dict(history(uri, run.info.run_id, "eval/loss")[:4])
    best = min(by_step, key=by_step.get)
    m = run.data.metrics
    assert m["best/step"] == best  # chosen on validation
    assert m["test/accuracy"] == pytest.approx(1 - m["eval/accuracy"])  # scored by the selected model
    assert m["test/loss"] > m["eval/loss"]
    assert history(uri, run.info.run_id, "test/accuracy") == [(12, m["test/accuracy"])]  # once, at the end
    assert result.metrics["test/macro_f1"] == m["test/macro_f1"]
    matrix = mlflow.artifacts.load_dict(f"{run.info.artifact_uri}/test/confusion_matrix.json")
    assert sum(map(sum, matrix["matrix"])) == 32 and matrix["split"] == "test"
    assert run.data.params["derived.test_samples"] == "32"


def test_a_resumed_run_keeps_the_best_it_had_before_the_crash(tmp_path, holder):
    """Checkpoints at steps 3, 4 (epoch end) and 6; evaluations at 4 and 8; the head is wrecked from step 5 on, so
    the best is step 4's. A crash at step 7 resumes from step 6's checkpoint, which must carry step 4's weights."""
    from .test_checkpointing import CrashAt, small

    overrides = small(tmp_path, "tracking=none", "train.select_best=eval/loss")
    reference = NullTracker()
    expected = train(loading.load(overrides), tracker=reference, callbacks=crafted(holder, after=5), progress=False,
                     verbose=False)
    assert reference.last("best/step") == 4
    with pytest.raises(RuntimeError, match="crash at step 7"):
        train(loading.load(overrides), callbacks=[*crafted(holder, after=5), CrashAt(7)], progress=False,
              verbose=False)
    resumed = NullTracker()
    result = train(loading.load([*overrides, "resume=auto"]), tracker=resumed, callbacks=crafted(holder, after=5),
                   progress=False, verbose=False)
    assert resumed.tags["maxout.resumed_from_step"] == "6" and resumed.last("best/step") == 4
    assert [s for s, _ in resumed.metrics["eval/loss"]] == [8, 8]  # evaluated once after the resume, + the best's
    assert resumed.last("eval/loss") == pytest.approx(reference.last("eval/loss"), abs=1e-6)
    final, uninterrupted = result.setup.model.state_dict(), expected.setup.model.state_dict()
    assert all(torch.allclose(final[k], uninterrupted[k], atol=1e-6) for k in uninterrupted)

"""The logged model (serving/pyfunc.py): logged from code with no pickle, its signature from what the model declares
(equal to what MLflow inferred from a prediction before), nothing loaded or predicted while logging, and models
logged the old way (tests/data/pickled_model, a pickled pyfunc logged by commit 81899d2) still loading, predicting
as they did, and serving through the registry and `maxout predict`."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import mlflow
import pandas as pd
import pytest
from mlflow.entities import LoggedModelStatus
from mlflow.models import Model, infer_signature
from transformers import BertConfig, BertForSequenceClassification

from maxout import cli, loading, modeling
from maxout.registry import promotion
from maxout.serving import inference, pyfunc

from .conftest import ROOT, load_pyfunc

OLD_MODEL = ROOT / "tests" / "data" / "pickled_model"
OLD_ROWS = ROOT / "tests" / "data" / "pickled_model_rows.csv"
OLD_PREDICTIONS = ROOT / "tests" / "data" / "pickled_model_predictions.csv"
PROBS = ["prob_0", "prob_1"]


def tiny_model_dir(path: Path, pair: bool, labels: list[str]) -> Path:
    """A saved model folder as the trainer writes it: a 1-layer BERT with random weights, the bundled tokenizer."""
    tokenizer = modeling.load_tokenizer(loading.load(["hardware=cpu", "model=tiny"]).model)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=16, max_position_embeddings=64, num_labels=len(labels))
    meta = inference.ModelMeta("post", "criterion" if pair else None, labels, 32)
    return inference.save(BertForSequenceClassification(config), tokenizer, meta, path)


def old_way_signature(model_dir: Path, example: pd.DataFrame):
    """What pyfunc.log_model did until commit 81899d2: load the model again and infer from a prediction."""
    predicted = inference.Predictor.from_dir(model_dir, device="cpu").predict(example)
    return infer_signature(example, predicted, params={"batch_size": 64, "on_missing": "error"})


@pytest.mark.parametrize("pair,labels", [(True, ["0", "1"]), (False, ["negative", "neutral", "positive"])])
def test_the_declared_signature_equals_the_one_inferred_from_a_prediction(tmp_path, pair, labels):
    model_dir = tiny_model_dir(tmp_path / "model", pair, labels)
    meta = inference.read_meta(model_dir)
    declared = pyfunc.signature(meta)
    assert declared == old_way_signature(model_dir, inference.synthetic_example(meta))
    assert declared.inputs.input_names() == (["post", "criterion"] if pair else ["post"])
    assert declared.outputs.input_names() == ["label"] + [f"prob_{name}" for name in labels]


def test_the_declared_signature_equals_the_one_the_old_code_logged():
    logged = Model.load(OLD_MODEL).signature  # inferred by MLflow from two real rows when it was logged
    [folder] = (OLD_MODEL / "artifacts").iterdir()
    assert pyfunc.signature(inference.read_meta(folder)) == logged


def experiment(uri: str, tmp_path: Path, name: str) -> str:
    client = mlflow.MlflowClient(uri)
    return client.create_experiment(name, artifact_location=(tmp_path / "art").as_uri())


def test_log_model_pickles_nothing_loads_nothing_and_the_model_predicts(mlflow_store, tmp_path, monkeypatch, caplog):
    model_dir = tiny_model_dir(tmp_path / "model", pair=True, labels=["0", "1"])
    loads = []
    from_dir = inference.Predictor.from_dir.__func__
    monkeypatch.setattr(inference.Predictor, "from_dir",
                        classmethod(lambda cls, *a, **k: loads.append(a) or from_dir(cls, *a, **k)))
    mlflow.set_tracking_uri(mlflow_store["uri"])
    with caplog.at_level(logging.INFO, logger="mlflow"), \
            mlflow.start_run(experiment_id=experiment(mlflow_store["uri"], tmp_path, "fromcode")):
        info = pyfunc.log_model(str(model_dir), inference.synthetic_example(inference.read_meta(model_dir)),
                                name="tiny-run")
    assert loads == []  # neither a signature inference nor MLflow's serving check loaded the weights
    assert not [r for r in caplog.records if "CloudPickle" in r.getMessage()]
    assert info.name == "tiny-run" and info.signature == pyfunc.signature(inference.read_meta(model_dir))
    local = Path(mlflow.artifacts.download_artifacts(info.model_uri, dst_path=str(tmp_path / "dl")))
    assert not list(local.rglob("*.pkl"))
    flavor = Model.load(local).flavors["python_function"]
    assert flavor["loader_module"] == "mlflow.pyfunc.loaders.code_model" and (local / "model_code.py").is_file()
    assert (local / "code" / "maxout" / "serving" / "pyfunc.py").is_file()  # the package travels inside
    example = json.loads((local / "input_example.json").read_text())
    assert example["columns"] == ["post", "criterion"] and example["data"][0][0] == "An example text to classify."
    out = load_pyfunc(info.model_uri).predict(pd.read_csv(OLD_ROWS), params={"batch_size": 2})
    assert loads and list(out.columns) == ["label", *PROBS] and len(out) == 3
    assert (out[PROBS].sum(axis=1) - 1).abs().max() < 1e-5


@pytest.mark.slow
def test_a_model_from_code_loads_where_maxout_is_not_installed(mlflow_store, tmp_path):
    """A consumer with torch, transformers, pandas and mlflow but no maxout: the package comes from the model."""
    model_dir = tiny_model_dir(tmp_path / "model", pair=True, labels=["0", "1"])
    mlflow.set_tracking_uri(mlflow_store["uri"])
    with mlflow.start_run(experiment_id=experiment(mlflow_store["uri"], tmp_path, "consumer")):
        info = pyfunc.log_model(str(model_dir))
    local = mlflow.artifacts.download_artifacts(info.model_uri, dst_path=str(tmp_path / "dl"))
    platform = str(ROOT / "platform")  # where the editable install puts maxout on sys.path
    script = (f"import sys; sys.path = [p for p in sys.path if p.rstrip('/') != {platform!r}]\n"
              "import importlib.util; assert importlib.util.find_spec('maxout') is None, 'maxout is importable'\n"
              "import mlflow, pandas as pd\n"
              f"model = mlflow.pyfunc.load_model({local!r})\n"
              "out = model.predict(pd.DataFrame({'post': ['a text'], 'criterion': ['a criterion']}))\n"
              "import maxout; print(maxout.__file__); print(list(out.columns))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    where, columns = done.stdout.strip().splitlines()[-2:]
    assert where.startswith(str(Path(local) / "code" / "maxout")) and columns == "['label', 'prob_0', 'prob_1']"


def test_a_model_logged_the_old_way_still_loads_and_predicts_as_it_did():
    assert (OLD_MODEL / "python_model.pkl").is_file()  # really the old, pickled way
    model = mlflow.pyfunc.load_model(str(OLD_MODEL))
    assert type(model.unwrap_python_model()) is pyfunc.TextClassifier  # the pickle's class path still resolves
    out = model.predict(pd.read_csv(OLD_ROWS))
    expected = pd.read_csv(OLD_PREDICTIONS, dtype={"label": str})
    assert out["label"].tolist() == expected["label"].tolist()
    assert (out[PROBS] - expected[PROBS]).abs().max().max() < 1e-6


def test_a_model_logged_the_old_way_serves_from_the_registry_and_maxout_predict(mlflow_store, tmp_path):
    """The old model as it sits in a user's store: a READY logged model of a run, registered, champion."""
    uri = mlflow_store["uri"]
    mlflow.set_tracking_uri(uri)  # the registry resolves a models:/m-... source through the fluent store
    client = mlflow.MlflowClient(uri)
    experiment_id = experiment(uri, tmp_path, "old")
    run = client.create_run(experiment_id)
    logged = client.create_logged_model(experiment_id, name="model", source_run_id=run.info.run_id)
    client.log_model_artifacts(logged.model_id, str(OLD_MODEL))
    client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    client.set_terminated(run.info.run_id)
    version = promotion.register(client, "old-clf", f"models:/{logged.model_id}", run.info.run_id)
    promotion.promote(client, "old-clf", version)
    target = tmp_path / "out.csv"
    assert cli.main(["predict", "--model", "models:/old-clf@champion", "--input", str(OLD_ROWS), "--output",
                     str(target), "--tracking-uri", uri, "--no-progress"]) == 0
    out, expected = pd.read_csv(target), pd.read_csv(OLD_PREDICTIONS)
    assert out["label"].tolist() == expected["label"].tolist()
    assert (out[PROBS] - expected[PROBS]).abs().max().max() < 1e-6

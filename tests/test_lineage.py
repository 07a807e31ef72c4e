"""Lineage in MLflow 3's terms: every run that trains logs its train, validation and test splits as dataset inputs
(the same MLflow datasets across `maxout train`, HPO trials and the audit), and each logged model carries its final
scores, tied to the dataset they were measured on, under a readable name. A consumer who holds only
``models:/NAME@champion`` finds which data trained it."""

from __future__ import annotations

import mlflow
import pytest

from maxout import cli, loading
from maxout.data import Dataset, Origin, Table, load
from maxout.hpo import study as hpo_study
from maxout.hpo.folds import kfold
from maxout.tracking.datasets import model_name, scored_on
from maxout.tracking.tracker import NullTracker, model_id
from maxout.train import lineage

from .conftest import TINY, runs_in

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture
def small_data(tmp_path):
    from maxout.data import read_table

    train = read_table("projects/nli_demo/data/train.csv").head(48)
    val = read_table("projects/nli_demo/data/validation.csv")
    train.to_csv(tmp_path / "train.csv", index=False)
    val.head(32).to_csv(tmp_path / "val.csv", index=False)
    val.tail(32).to_csv(tmp_path / "test.csv", index=False)
    return [f"data.train_path={tmp_path / 'train.csv'}", f"data.validation_path={tmp_path / 'val.csv'}",
            f"data.test_path={tmp_path / 'test.csv'}"]


@pytest.mark.parametrize("run_name, expected", [
    ("tiny-cpu", "tiny-cpu"),
    ("tiny-cpu precision=fp32 bucketing=off", "tiny-cpu-precision-fp32-bucketing-off"),
    ("a.b/c: 'd' \"e\" 50%", "a-b-c-d-e-50"),  # every character MLflow refuses in a model name: / : . % " '
    ("...", "model"), ("", "model"), (None, "model"),
])
def test_a_run_name_becomes_a_valid_model_name(run_name, expected):
    from mlflow.utils.validation import _validate_logged_model_name

    assert model_name(run_name) == expected
    _validate_logged_model_name(model_name(run_name))  # MLflow's own check accepts it
    assert len(model_name("x" * 1000)) == 200


def test_each_split_has_its_own_digest_where_it_is_part_of_a_file(tmp_path):
    cfg = loading.load([*TINY, "data.validation_path=null", "data.validation_split=0.25"]).data
    split_off = load(cfg)
    whole = load(loading.load(TINY).data)
    # A split-off validation set is part of the training file: the same fingerprint (the files did not change),
    # but train and validation are told apart, and so is another split of the same file.
    assert whole.digest("train") == whole.digest("validation") == whole.fingerprint
    assert split_off.origins["validation"].path == split_off.origins["train"].path == cfg.train_path
    assert len({split_off.digest("train"), split_off.digest("validation"), split_off.fingerprint}) == 3
    other = load(loading.load([*TINY, "data.validation_path=null", "data.validation_split=0.3"]).data)
    assert other.digest("validation") != split_off.digest("validation")
    assert all(split_off.digest(s).startswith(split_off.fingerprint) for s in ("train", "validation"))
    # k-fold: each fold's two tables come from the training file, and no two share a digest.
    folds = kfold(whole, 3, seed=0)
    digests = {f.digest(s) for f in folds for s in ("train", "validation")}
    assert len(digests) == 6 and all(len(d) <= 36 for d in digests)  # MLflow keeps 36 characters of a digest
    assert {f.origins["validation"].path for f in folds} == {whole.origins["train"].path}


def test_inputs_name_their_file_role_and_rows_and_scores_go_to_the_model():
    cfg = loading.load(TINY)
    table = Table(["a", "b", "c"], None, [0, 1, 0])
    dataset = Dataset(table, table.subset([0, 1]), ["no", "yes"], "f" * 16, test=table,
                      origins={"train": Origin("t.csv"), "validation": Origin("t.csv", "the first 2 rows")})
    inputs = lineage.data_inputs(cfg, dataset)
    assert [(i.name, i.context, i.source, i.rows) for i in inputs] == [
        (f"{cfg.data.name}-train", "training", "t.csv", 3), (f"{cfg.data.name}-validation", "validation", "t.csv", 2),
        (f"{cfg.data.name}-test", "test", cfg.data.test_path or "", 3)]
    assert inputs[1].profile["rows_of_file"] == "the first 2 rows" and inputs[0].digest == "f" * 16
    assert scored_on("eval/macro_f1") == "validation" and scored_on("test/loss") == "test"
    assert scored_on("eval/majority_baseline") is None and scored_on("perf/mfu") is None
    tracker = NullTracker()
    tracker.log_metrics({"eval/accuracy": 0.5}, step=3)
    lineage.log_scores(tracker, "models:/m-1", {"eval/accuracy": 0.5, "test/accuracy": 0.25, "perf/mfu": 0.1,
                                                "eval/majority_baseline": 0.5}, inputs)
    assert tracker.model_metrics == {"m-1": {"eval/accuracy": (0.5, f"{cfg.data.name}-validation"),
                                             "test/accuracy": (0.25, f"{cfg.data.name}-test")}}
    assert tracker.metrics["eval/accuracy"] == [(3, 0.5)]  # a score the run has already: not logged again
    assert model_id("models:/m-1") == "m-1" and model_id("models:/name@champion") is None
    assert model_id("runs:/abc/model") is None and model_id(None) is None


def lineage_of(uri: str, registry_uri: str) -> dict:
    """What a consumer holding only a registry URI (``models:/NAME@alias``) finds out, through the registry."""
    name, alias = uri[len("models:/"):].split("@")
    client = mlflow.MlflowClient(registry_uri)
    version = client.get_model_version_by_alias(name, alias)
    run = client.get_run(version.run_id)
    datasets = {i.tags[0].value if i.tags else "": i.dataset for i in run.inputs.dataset_inputs}
    model = client.get_logged_model(model_id(version.source))
    return {"version": version, "datasets": datasets, "model": model}


@pytest.mark.slow
def test_the_champion_names_the_data_that_trained_it(mlflow_store, small_data):
    """`maxout train` (a run name MLflow would refuse as a model name) and a two-trial `maxout hpo` on one store:
    the same three datasets in every run, each model named after its run and scored on its datasets, and the
    champion's training data found from ``models:/lineage@champion`` alone."""
    store = mlflow_store["overrides"]
    assert cli.main(["train", *TINY, *small_data, *store, "tracking.run_name=\"first: v0.1 'baseline'\"",
                     "registry.name=lineage", "--no-progress"]) == 0
    hpo_study.run(["hardware=cpu", "model=tiny", "hpo=default", "hpo.workers=1", "train.epochs=1", "hpo.n_trials=2",
                   "hpo.pruner.name=none", "hpo.sampler.seed=7", *small_data, *store,
                   f"hpo.storage={mlflow_store['dir'] / 'optuna.journal'}", "registry.name=lineage"])
    uri = mlflow_store["uri"]
    runs = [r for r in runs_in(uri) if r.data.tags.get("maxout.command") in ("train", "hpo-trial")]
    assert len(runs) == 3
    inputs = {r.info.run_id: {i.tags[0].value: (i.dataset.name, i.dataset.digest) for i in r.inputs.dataset_inputs}
              for r in runs}
    assert len({tuple(sorted(v.items())) for v in inputs.values()}) == 1  # every run: the same datasets
    client = mlflow.MlflowClient(uri)
    experiment = runs[0].info.experiment_id
    models = client.search_logged_models([experiment])
    names = sorted(m.name for m in models)
    assert names[0] == "first-v0-1-baseline" and all(n.startswith("trial-") for n in names[1:]), names
    for model in models:  # each with the scores of its run's selected model, on the validation and test datasets
        run = client.get_run(model.source_run_id)
        scores = {m.key: m for m in model.metrics}
        assert scores["eval/macro_f1"].value == run.data.metrics["eval/macro_f1"]
        assert scores["test/accuracy"].value == run.data.metrics["test/accuracy"]
        assert scores["eval/macro_f1"].dataset_name.endswith("-validation")
        assert scores["test/accuracy"].dataset_name.endswith("-test")
        assert "eval/majority_baseline" not in scores
        # The run's history holds each final score once: the model's copy is the same point.
        assert len(client.get_metric_history(run.info.run_id, "test/accuracy")) == 1

    found = lineage_of("models:/lineage@champion", uri)
    training = found["datasets"]["training"]
    assert training.source == f'{{"uri": "{small_data[0].split("=", 1)[1]}"}}'
    assert training.digest == found["version"].tags["maxout.data_fingerprint"]
    assert training.name.endswith("-train") and '"num_rows": 48' in training.profile
    assert {"training", "validation", "test"} == set(found["datasets"])
    assert {m.dataset_digest for m in found["model"].metrics} == {found["datasets"]["validation"].digest,
                                                                  found["datasets"]["test"].digest}

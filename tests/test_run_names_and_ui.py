"""What the MLflow UI shows: runs named after what differs, the address of a run or runs table in the
model-training view (MLflow 3 opens on its GenAI view otherwise), and children filed under any open run."""

from __future__ import annotations

import mlflow
import pytest

from maxout import cli, loading
from maxout.tracking import params, store
from maxout.tracking.tracker import closing, start

from .conftest import TINY, runs_in


@pytest.mark.parametrize("overrides,name", [
    ([], "tiny-cpu"),
    (["hardware.precision=fp32", "data.bucketing=false", "hardware.fused_adamw=false"],
     "tiny-cpu precision=fp32 fused_adamw=off bucketing=off"),
    (["hardware.compile=true", "hardware.compile_mode=max-autotune", "train.batch_size=8"],
     "tiny-cpu compile=on compile_mode=max-autotune batch_size=8"),
    (["hardware.compile_mode=max-autotune"], "tiny-cpu"),  # a mode without compile changes nothing
    (["hardware.attn_implementation=sdpa", "tracking.run_name=mine"], "mine"),  # the user's name wins
])
def test_a_run_is_named_after_its_profile_and_the_speed_ups_it_changes(overrides, name, cpu_device):
    cfg = loading.load(["hardware=cpu", "model=tiny", *overrides], device=cpu_device)
    assert params.run_name(cfg) == name


def test_ui_addresses_open_the_model_training_view():
    assert store.ui_url("sqlite:////x/mlflow.db", "3", "abc") == \
        "http://127.0.0.1:5000/#/experiments/3/runs/abc?workflowType=machine_learning"
    assert store.ui_url("https://alice:secret@mlflow.example:5000/", "3") == \
        "https://mlflow.example:5000/#/experiments/3/runs?workflowType=machine_learning"  # no login in a link
    assert store.ui_url("sqlite:///mlflow.db") == "http://127.0.0.1:5000/#/?workflowType=machine_learning"


def test_children_are_filed_under_any_open_run(mlflow_store, cpu_device):
    cfg = loading.load(["hardware=cpu", "model=tiny", *mlflow_store["overrides"]], device=cpu_device).tracking
    parent = start(cfg, run_name="parent")
    with closing(parent):
        first = start(cfg, run_name="first", parent_run_id=parent.run_id)
        second = start(cfg, run_name="second", parent_run_id=parent.run_id)
        with closing(first):
            with closing(start(cfg, run_name="first's child", parent_run_id=first.run_id)):
                pass
        with closing(second):  # closed after its elder sibling: not in the order they were opened
            assert mlflow.active_run().info.run_id == parent.run_id
    runs = {r.info.run_name: r for r in runs_in(mlflow_store["uri"])}
    assert runs["first"].data.tags["mlflow.parentRunId"] == runs["second"].data.tags["mlflow.parentRunId"] == \
        parent.run_id
    assert runs["first's child"].data.tags["mlflow.parentRunId"] == runs["first"].info.run_id
    assert {r.info.status for r in runs.values()} == {"FINISHED"} and len(runs) == 4
    assert mlflow.active_run() is None


def test_tracking_url_prints_the_experiments_runs_table(mlflow_store, capsys, tmp_path):
    assert cli.main(["train", *TINY, *mlflow_store["overrides"], "train.max_steps=1", "data.bucketing=false",
                     "--no-progress"]) == 0
    (run,) = runs_in(mlflow_store["uri"])
    assert run.info.run_name == "tiny-cpu bucketing=off"
    page = f"#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}?workflowType=machine_learning"
    assert f"browse it with `make ui`, then http://127.0.0.1:5000/{page}" in capsys.readouterr().out
    assert cli.main(["tracking", "url", "--tracking-uri", mlflow_store["uri"]]) == 0
    assert capsys.readouterr().out.strip() == \
        f"http://127.0.0.1:5000/#/experiments/{run.info.experiment_id}/runs?workflowType=machine_learning"
    missing = tmp_path / "none" / "mlflow.db"
    assert cli.main(["tracking", "url", "--tracking-uri", f"sqlite:///{missing}"]) == 0
    assert capsys.readouterr().out.strip() == "http://127.0.0.1:5000/#/?workflowType=machine_learning"
    assert not missing.exists()  # nothing created just to say there is nothing

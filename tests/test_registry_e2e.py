"""End-to-end against a real `mlflow server` (SQLite backend, proxied artifacts), as separate machines would use it:
`maxout train registry.name=...` twice, `maxout predict` vs the pyfunc, `mlflow models serve` vs `maxout predict`,
8 concurrent promoters, and bad input that leaves the registry as it was."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import mlflow
import pandas as pd
import pytest
import requests

from maxout import cli
from maxout.registry import client as registry_client

from . import warm_maxout
from .conftest import MLFLOW_VARS, ROOT, TINY, load_pyfunc
from .services import free_port, mlflow_server, stop, wait_http
from .test_registry import candidate, lock_leftovers
from .test_registry_race import race

pytestmark = pytest.mark.slow
NAME = "nli-tiny"
CHAMPION_URI = f"models:/{NAME}@champion"
TEXTS = pd.DataFrame({"post": ["I lie awake every night and can't fall asleep.", "We painted the fence on Sunday."],
                      "criterion": ["Sleep disturbance", "Fatigue or loss of energy"]})


@pytest.fixture(scope="module")
def env():
    """Module fixtures run before conftest's per-test isolation: do the same here."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        for var in MLFLOW_VARS:
            mp.delenv(var, raising=False)
        yield mp


@pytest.fixture(scope="module")
def server(env, tmp_path_factory):
    root = tmp_path_factory.mktemp("registry-server")
    # No job executor (GenAI scoring, trace archival): its huey workers start ~40 s in and take ~12 s to stop.
    with mlflow_server(f"sqlite:///{root / 'mlflow.db'}", artifacts_destination=str(root / "artifacts"),
                       env={"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}) as url:
        yield url


def snapshot(client, name: str) -> dict:
    model = client.get_registered_model(name)
    versions = {v.version: dict(v.tags) for v in client.search_model_versions(f"name='{name}'")}
    return {"versions": versions, "aliases": {a: int(v) for a, v in model.aliases.items()},
            "history": json.loads(model.tags.get(registry_client.HISTORY_TAG, "[]")),
            "lock": lock_leftovers(client, name)}


@pytest.fixture(scope="module")
def trained(server):
    """Two tiny trainings with different results, each registered by `maxout train registry.name=...`."""
    client = registry_client.connect(server)
    common = [*TINY, "tracking=server", f"tracking.uri={server}", "tracking.system_metrics=false",
              f"registry.name={NAME}", "registry.metric=eval/loss", "registry.direction=minimize"]
    runs = [["train.lr=1e-6", "train.max_steps=2", "train.seed=1"],  # barely moves from the random init
            ["train.lr=2e-3", "train.max_steps=12", "train.seed=2"]]
    after = []
    for extra in runs:
        assert cli.main(["train", *common, *extra, "--no-progress"]) == 0
        after.append(snapshot(client, NAME))
    return {"client": client, "after": after}


def test_two_trainings_only_the_better_is_champion_and_both_were_challenger(trained):
    client, (first, second) = trained["client"], trained["after"]
    assert first["aliases"] == {"champion": 1, "challenger": 1}  # the first version: both aliases
    assert second["aliases"]["challenger"] == 2
    tags = {int(v): t for v, t in second["versions"].items()}
    losses = {v: float(t["maxout.metric_value"]) for v, t in tags.items()}
    assert losses[1] != losses[2], losses  # the two trainings really differ
    best = min(losses, key=losses.get)  # eval/loss, minimized
    assert second["aliases"]["champion"] == best and second["history"] == sorted({1, best})
    for version, tag in tags.items():
        run = client.get_run(tag["maxout.run_id"])
        assert run.data.metrics["eval/loss"] == pytest.approx(losses[version])  # the tag is the run's metric
        assert tag["maxout.data_fingerprint"] == run.data.params["derived.data_fingerprint"]
        assert tag["maxout.hardware_profile"] == "cpu" and tag["maxout.metric"] == "eval/loss"
        assert run.data.tags["maxout.promotion"] == tag["maxout.promotion"]  # the run says why, too
        assert client.get_model_version(NAME, str(version)).source == run.data.tags["maxout.model_uri"]
    expected = ("champion: eval/loss" if best == 2 else "kept v1: eval/loss")
    assert tags[2]["maxout.promotion"].startswith(expected), tags[2]["maxout.promotion"]
    assert second["lock"] == []


def fresh_rows(n: int, seed: int) -> pd.DataFrame:
    """New text, never seen in training: the demo generator with another seed."""
    sys.path.insert(0, str(ROOT / "projects" / "nli_demo"))
    import generate

    rng = random.Random(seed)
    return pd.DataFrame([generate.make_example(rng) for _ in range(n)])


def predict_cli(server: str, frame: pd.DataFrame, tmp_path: Path, *extra: str) -> pd.DataFrame:
    source, out = tmp_path / "input.csv", tmp_path / "predictions.csv"
    frame.to_csv(source, index=False)
    assert cli.main(["predict", "--model", CHAMPION_URI, "--input", str(source), "--output", str(out),
                     "--tracking-uri", server, "--no-progress", *extra]) == 0
    return pd.read_csv(out, dtype={"label": str})


def test_predict_on_a_new_csv_matches_the_champion_pyfunc(server, trained, tmp_path, monkeypatch):
    rows = fresh_rows(40, seed=7)  # has a label column too: extra columns are ignored
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where MLflow downloads a model it is not told where
    ours = predict_cli(server, rows, tmp_path, "--batch-size", "8")
    assert list(scratch.iterdir()) == []  # the model's downloaded files went with the command
    monkeypatch.undo()
    mlflow.set_tracking_uri(server)
    theirs = load_pyfunc(CHAMPION_URI).predict(rows[["post", "criterion"]])
    assert list(ours.columns) == ["label", "prob_0", "prob_1"] and len(ours) == len(rows)
    assert ours["label"].tolist() == theirs["label"].tolist()
    assert (ours[["prob_0", "prob_1"]] - theirs[["prob_0", "prob_1"]].to_numpy()).abs().max().max() < 1e-5


BAD_INPUTS = {
    "unknown_model": ("models:/no-such-model@champion", "post,criterion\na,b\n",
                      f"no registered model 'no-such-model' in the registry (registered: {NAME}"),
    "unknown_alias": (f"models:/{NAME}@production", "post,criterion\na,b\n",
                      f"registered model '{NAME}' has no alias 'production' (aliases: challenger (v2), champion"),
    "missing_columns": (CHAMPION_URI, "text,label\na,1\n",
                        "input is missing column(s) ['post', 'criterion']; the model needs ['post', 'criterion'] "
                        "(got ['text', 'label'])"),
    "header_only": (CHAMPION_URI, "post,criterion\n", "has no rows to predict"),
    "empty_file": (CHAMPION_URI, "", "is empty"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_predict_input_is_one_line_and_leaves_the_registry_as_it_was(case, server, trained, tmp_path, capsys):
    model_uri, content, message = BAD_INPUTS[case]
    source = tmp_path / "input.csv"
    source.write_text(content)
    before = snapshot(trained["client"], NAME)
    code = cli.main(["predict", "--model", model_uri, "--input", str(source), "--tracking-uri", server,
                     "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # MLflow may warn about versions before it
    assert code == 1 and err.startswith("maxout: error: ") and message in err, err
    assert snapshot(trained["client"], NAME) == before


@pytest.fixture(scope="module")
def served(server, trained, tmp_path_factory):
    """`mlflow models serve` for the champion, as a process of its own, started once for the module: MLflow's CLI
    and its uvicorn scoring server forked warm (tests/warm_maxout.py), in one process as `--workers 1` runs them."""
    port = free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": server}
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log_path, "w") as log:
        proc = warm_maxout.popen(["models", "serve", "-m", CHAMPION_URI, "--env-manager", "local", "--workers", "1",
                                  "-h", "127.0.0.1", "-p", str(port)], program="mlflow",
                                 env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_http(url + "/ping", timeout_s=240, proc=proc)
        except (RuntimeError, TimeoutError) as err:
            pytest.fail(f"mlflow models serve did not start ({err}): {log_path.read_text()[-2000:]}")
        yield url
    finally:
        stop(proc)


def invoke(url: str, payload: dict) -> requests.Response:
    return requests.post(url + "/invocations", json=payload, timeout=60)


def test_served_champion_answers_like_maxout_predict(served, server, tmp_path):
    ours = predict_cli(server, TEXTS, tmp_path)
    split = invoke(served, {"dataframe_split": TEXTS.to_dict(orient="split", index=False)})
    records = invoke(served, {"dataframe_records": TEXTS.to_dict(orient="records")})
    for response in (split, records):
        assert response.status_code == 200, response.text
        answers = pd.DataFrame(response.json()["predictions"])
        assert answers["label"].tolist() == ours["label"].tolist()
        assert (answers[["prob_0", "prob_1"]] - ours[["prob_0", "prob_1"]].to_numpy()).abs().max().max() < 1e-5


def test_served_champion_answers_a_wrong_payload_with_400_and_a_message(served):
    missing = invoke(served, {"dataframe_records": [{"post": "I can't sleep."}]})
    assert missing.status_code == 400 and "missing inputs ['criterion']" in missing.json()["message"]
    empty = invoke(served, {"dataframe_split": {"columns": ["post", "criterion"], "data": []}})
    assert empty.status_code == 400 and "input has no rows" in empty.json()["message"]
    assert invoke(served, {"rows": []}).status_code == 400


def test_served_champion_answers_rows_without_text_like_maxout_predict(served):
    """One policy for rows without text (serving/inference.py): a 400 naming the rows by default, and the
    request's params choose skip (null answers, row for row) or empty (predicted as empty text)."""
    rows = [{"post": "I can't sleep.", "criterion": "Sleep disturbance"}, {"post": None, "criterion": "Fatigue"},
            {"post": "  ", "criterion": "Fatigue"}, {"criterion": "Fatigue"}]
    refused = invoke(served, {"dataframe_records": rows})
    assert refused.status_code == 400, refused.text
    assert ("3 input rows have no text to predict from ('post': 3 empty or null; rows 2, 3 and 4); fix them, or "
            'use params {"on_missing": "skip"}') in refused.json()["message"]
    not_text = invoke(served, {"dataframe_split": {"columns": ["post", "criterion"], "data": [[5, "Fatigue"]]}})
    assert not_text.status_code == 400 and "'post': 1 not a string; row 1" in not_text.json()["message"]
    skipped = invoke(served, {"dataframe_records": rows, "params": {"on_missing": "skip"}})
    assert skipped.status_code == 200, skipped.text
    # Strict JSON: null, never NaN (which browsers' JSON.parse refuses), for the skipped rows.
    answers = json.loads(skipped.text, parse_constant=lambda c: pytest.fail(f"{c} in the answer"))["predictions"]
    assert [a["label"] is None for a in answers] == [False, True, True, True]
    assert all(a["prob_0"] is None for a in answers[1:]) and answers[0]["prob_0"] > 0
    emptied = invoke(served, {"dataframe_records": rows, "params": {"on_missing": "empty"}})
    assert emptied.status_code == 200 and all(a["label"] in ("0", "1") for a in emptied.json()["predictions"])


def test_eight_concurrent_promoters_through_a_server_leave_exactly_one_champion_the_best(server):
    """Separate processes through one tracking server (the tag lock); each offers a different value at once."""
    race(server)

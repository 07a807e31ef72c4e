"""Models by name from a real Hub-protocol server on loopback (olah, tests/hub_server.py): the first download, the
cache with the server gone, a pinned revision, a download cut short, an unreachable or silent Hub, and a gated repo
behind nginx. Each failure is one line, exit 1 and no run; the commit of the base weights is logged as
``derived.model_commit`` and recorded with the logged model; an HF token reaches no param, tag, artifact or log.

conftest.py keeps every other test offline; these unset HF_HUB_OFFLINE and point HF_ENDPOINT at their own server.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import mlflow
import pytest

from maxout import cli, hub, loading, modeling
from maxout.tracking.redact import redact

from .conftest import TINY, runs_in
from .hub_server import cutting_proxy, gated, hub_server, make_model_repo, silent_server

REPO = "maxout-test/tiny-bert"
TOKEN = "hf_" + "Zx9" * 11  # the form of a real token (hf_ and 33 letters and digits), granted by the gate alone
BY_NAME = ["model=bert_base", f"model.name_or_path={REPO}"]
TRAIN = ["train", *[o for o in TINY if not o.startswith(("model=", "tracking="))], "train.max_steps=2",
         "data.max_length=64", *BY_NAME]


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """The tiny repo (tag v1, then a second commit on main), made once for the module; returns (root, commits)."""
    root = tmp_path_factory.mktemp("hub")
    return root, make_model_repo(root, REPO)


@pytest.fixture
def online(monkeypatch, tmp_path):
    """Hub access on, into an empty cache of this test's own."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    return monkeypatch


def train(argv, store, capsys) -> tuple[int, str, float]:
    """``maxout train`` in this process: (exit code, its last stderr line, seconds)."""
    start = time.perf_counter()
    code = cli.main([*argv, *store["overrides"], "--no-progress"])
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    return code, (lines[-1] if lines else "") if code else err, elapsed


def finished_runs(store, count: int = 1):
    runs = runs_in(store["uri"])
    assert [r.info.status for r in runs] == ["FINISHED"] * count
    return runs


def recorded_base(run, store) -> tuple[dict, dict]:
    """The logged model's MLmodel metadata and its maxout.json, as a registry pull sees them."""
    mlflow.set_tracking_uri(store["uri"])
    uri = run.data.tags["maxout.model_uri"]
    metadata = mlflow.models.get_model_info(uri).metadata or {}
    folder = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(store["dir"] / "pull")))
    [meta] = folder.rglob("maxout.json")
    return metadata, json.loads(meta.read_text())


@pytest.mark.slow
def test_a_model_by_name_downloads_logs_its_commit_then_trains_from_the_cache_with_the_server_gone(
        repo, online, mlflow_store, capsys):
    root, commits = repo
    with hub_server(root) as url:
        online.setenv("HF_ENDPOINT", url)
        code, out, _ = train(TRAIN, mlflow_store, capsys)
        assert code == 0, out
    [run] = finished_runs(mlflow_store)
    assert run.data.params["derived.model_commit"] == commits["main"]
    metadata, meta = recorded_base(run, mlflow_store)
    assert metadata == {"maxout.base_model": REPO, "maxout.base_commit": commits["main"]}
    assert (meta["base_model"], meta["base_commit"]) == (REPO, commits["main"])
    snapshot = Path(hub.cache_dir()) / f"models--{REPO.replace('/', '--')}" / "snapshots" / commits["main"]
    assert (snapshot / "model.safetensors").is_file() and (snapshot / "tokenizer.json").is_file()

    # The server is gone: the same command trains from the cache (the refused connection falls back to the cached
    # snapshot), and so it does with HF_HUB_OFFLINE=1.
    for offline in (False, True):
        hub.forget()  # what a new process knows
        if offline:
            online.setenv("HF_HUB_OFFLINE", "1")
        code, out, _ = train(TRAIN, mlflow_store, capsys)
        assert code == 0, out
    runs = finished_runs(mlflow_store, 3)
    assert {r.data.params["derived.model_commit"] for r in runs} == {commits["main"]}


@pytest.mark.slow
def test_a_pinned_revision_trains_that_revision_and_logs_its_commit_not_mains(repo, online, mlflow_store, capsys):
    root, commits = repo
    with hub_server(root) as url:
        online.setenv("HF_ENDPOINT", url)
        code, out, _ = train([*TRAIN, "model.revision=v1"], mlflow_store, capsys)
        assert code == 0, out
        # a commit pins too, and the tag's weights differ from main's (main's second commit set dropout 0.2)
        by_commit = loading.load(["hardware=cpu", *BY_NAME, f"model.revision={commits['v1']}"]).model
        assert modeling.base_commit(by_commit) == commits["v1"]
        pinned = json.loads((Path(modeling.weights_location(by_commit)) / "config.json").read_text())
        main = loading.load(["hardware=cpu", *BY_NAME]).model
        assert modeling.base_commit(main) == commits["main"]
        latest = json.loads((Path(modeling.weights_location(main)) / "config.json").read_text())
        assert (pinned["hidden_dropout_prob"], latest["hidden_dropout_prob"]) == (0.1, 0.2)
    [run] = finished_runs(mlflow_store)
    assert run.data.params["derived.model_commit"] == commits["v1"] != commits["main"]
    assert run.data.params["cfg.model.revision"] == "v1"
    assert recorded_base(run, mlflow_store)[0]["maxout.base_commit"] == commits["v1"]


def test_an_interrupted_download_is_retried_whole_and_the_model_loads(repo, online):
    """What really happens (huggingface_hub 2.4, olah 0.5.4): the weights' response is cut after 100 kB; the client
    says "Trying to resume download..." but asks again without a Range header, the server sends the whole file
    (200), and the download completes in the same call. Nothing is resumed from the partial bytes."""
    root, commits = repo
    with hub_server(root) as url, cutting_proxy(url, ".safetensors", cut_after=100_000) as proxy:
        online.setenv("HF_ENDPOINT", proxy["url"])
        cfg = loading.load(["hardware=cpu", *BY_NAME]).model
        location = modeling.weights_location(cfg)
    assert proxy["cut"] == 1
    gets = [r for r in proxy["requests"] if r.startswith("GET") and ".safetensors" in r]
    assert len(gets) == 2 and not any("Range" in r for r in gets), gets
    weights = Path(location) / "model.safetensors"
    assert weights.stat().st_size == (root / "mirrors" / "models" / REPO / "model.safetensors").stat().st_size
    config = modeling.build_config(cfg, ["0", "1"], 30522)
    model = modeling.load_model(cfg, config, "sdpa")
    assert modeling.count_parameters(model)["total"] > 1_000_000
    assert modeling.base_commit(cfg) == commits["main"]


@pytest.mark.parametrize("hub_kind", ["nothing_listens", "silent"])
def test_an_unreachable_hub_is_one_line_in_bounded_time_and_no_run(hub_kind, online, mlflow_store, capsys):
    online.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "2")
    with silent_server() as silent:
        url = silent if hub_kind == "silent" else "http://127.0.0.1:9"
        online.setenv("HF_ENDPOINT", url)
        code, line, elapsed = train(TRAIN, mlflow_store, capsys)
    assert code == 1
    assert line.startswith(f"maxout: error: cannot reach the Hugging Face Hub at {url} to download model "
                           f"'bert_base' ({REPO}), and it is not in the local cache (")
    assert line.endswith("check the network and HF_ENDPOINT, or set model.path=/dir/with/config.json")
    assert elapsed < 40  # 2 s per step; without the bound, the silent server would hold the run start forever
    assert runs_in(mlflow_store["uri"]) == []


@pytest.mark.parametrize("override, expected", [
    ("model.name_or_path=maxout-test/no-such-model", "maxout-test/no-such-model is not a model on"),
    ("model.revision=no-such-tag", f"{REPO} at revision 'no-such-tag' is not a model on"),
])
def test_a_wrong_name_or_revision_is_one_line_and_no_run(repo, online, mlflow_store, capsys, override, expected):
    root, _ = repo
    with hub_server(root) as url:
        online.setenv("HF_ENDPOINT", url)
        code, line, _ = train([*TRAIN, override], mlflow_store, capsys)
    assert code == 1 and line.startswith("maxout: error: model 'bert_base': ") and expected in line, line
    assert runs_in(mlflow_store["uri"]) == []


@pytest.mark.slow
def test_a_gated_repo_needs_hf_token_and_the_token_is_stored_nowhere(repo, online, mlflow_store, capsys, tmp_path):
    root, commits = repo
    with hub_server(root) as url, gated(url, TOKEN, tmp_path / "gate") as gate:
        online.setenv("HF_ENDPOINT", gate)
        code, line, _ = train(TRAIN, mlflow_store, capsys)
        assert (code, line) == (1, f"maxout: error: model 'bert_base' ({REPO}) is a gated repo: accept its license "
                                   f"on {gate}/{REPO} while logged in, then set HF_TOKEN to an access token of that "
                                   f"account (HF_TOKEN is not set)")
        assert runs_in(mlflow_store["uri"]) == []
        online.setenv("HF_TOKEN", TOKEN)
        code, out, _ = train(TRAIN, mlflow_store, capsys)
        assert code == 0, out
    [run] = finished_runs(mlflow_store)
    assert run.data.params["derived.model_commit"] == commits["main"]
    recorded_base(run, mlflow_store)  # the model's files, downloaded into the store's folder, are scanned too
    # Nowhere in the store: the SQLite file (params, tags, metrics, logged models), every artifact file, the output.
    store = [p for p in mlflow_store["dir"].rglob("*") if p.is_file() and not {"hf-cache", "gate"} & set(p.parts)]
    assert len(store) > 10 and any(p.name == "mlflow.db" for p in store)
    leaks = [str(p) for p in store if TOKEN.encode() in p.read_bytes()]
    assert not leaks and TOKEN not in out
    assert any(TOKEN in p.read_text() for p in (tmp_path / "gate").glob("*/nginx.conf"))  # the scan can find it


def test_redaction_masks_hugging_face_tokens_and_uri_passwords():
    assert redact(f"token={TOKEN} url=postgresql://u:pw@h/db") == "token=hf_*** url=postgresql://u:***@h/db"
    assert redact("Authorization: Bearer " + TOKEN) == "Authorization: Bearer hf_***"
    assert redact("hf_short and shf_notatoken") == "hf_short and shf_notatoken"


@pytest.mark.parametrize("overrides, expected", [
    (["model=tiny", "model.revision=v1"], "model.revision='v1' pins a Hub revision, but model 'tiny' loads with "
                                          "source=config"),
    (["model=bert_base", "model.path=/tmp", "model.revision=v1"], "loads from model.path"),
    (["model=bert_base", "model.revision=''"], "model.revision='' is not a branch, tag or commit"),
])
def test_a_revision_that_cannot_apply_is_a_usage_error(overrides, expected):
    from maxout.errors import ConfigError

    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(".", r"\.")):
        loading.load(["hardware=cpu", *overrides])

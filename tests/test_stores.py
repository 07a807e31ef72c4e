"""Where runs and maxout's own files go: the embedded store is MLflow's own default (so `mlflow run .`, `mlflow ui`
and `maxout train` meet in one store without being told), MAXOUT_STATE_DIR moves the spool, checkpoints and caches
(the container image points it at a volume), and inside `mlflow run`'s container each store problem names the
`mlflow run` argument that fixes it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from maxout import loading
from maxout.config import TrackingConfig
from maxout.errors import ConfigError, MaxoutError
from maxout.hpo import storage
from maxout.tracking import container, preflight, spool, store
from maxout.train import batch_finder, resume


def test_the_embedded_store_is_mlflows_own_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri, artifacts = store.resolve_uri(TrackingConfig())
    # What `mlflow run .` and `mlflow ui` use in this folder with no tracking URI set (a fresh process: this one's
    # MLflow may have been pointed elsewhere by an earlier test).
    fresh = subprocess.run([sys.executable, "-c", "import mlflow; print(mlflow.get_tracking_uri())"], cwd=tmp_path,
                           env={k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")},
                           capture_output=True, text=True, check=True)
    mlflow_default = fresh.stdout.strip().splitlines()[-1]
    assert mlflow_default.startswith("sqlite:///") and uri.startswith("sqlite:///")
    assert Path(uri.removeprefix("sqlite:///")) == tmp_path / Path(mlflow_default.removeprefix("sqlite:///"))
    assert Path(artifacts) == tmp_path / "mlruns"  # MLflow's default artifact root beside it


def test_state_dir_moves_the_spool_checkpoints_and_caches(tmp_path, monkeypatch):
    cfg = loading.load(["hardware=cpu", "model=tiny", "hpo=default"])
    assert spool.default_dir() == Path.cwd() / "mlruns" / "spool"
    assert resume.checkpoint_root(cfg) == Path.cwd() / "checkpoints"
    monkeypatch.setenv("MAXOUT_STATE_DIR", str(tmp_path / "state"))
    assert spool.default_dir() == tmp_path / "state" / "spool"
    assert resume.checkpoint_root(cfg) == tmp_path / "state" / "checkpoints"
    assert batch_finder.cache_file(cfg) == tmp_path / "state" / "batch_finder.json"
    assert storage.location(cfg.hpo, cfg.tracking) == str(tmp_path / "state" / "optuna.journal")
    # A store of its own (a SQLite file elsewhere) keeps its studies beside it, unless the state dir is set.
    other = TrackingConfig(uri=f"sqlite:///{tmp_path / 'other' / 'mlflow.db'}")
    assert storage.store_dir(other) == tmp_path / "state"
    monkeypatch.delenv("MAXOUT_STATE_DIR")
    assert storage.store_dir(other) == tmp_path / "other"
    assert storage.store_dir(TrackingConfig()) == Path.cwd() / "mlruns"  # the embedded store: not the root folder


@pytest.fixture
def in_mlflow_run_container(monkeypatch):
    monkeypatch.setattr(container, "in_container", lambda: True)
    monkeypatch.setenv("MLFLOW_RUN_ID", "0" * 32)


def test_a_store_file_this_user_cannot_write_says_whose_it_is(tmp_path, monkeypatch):
    database = tmp_path / "mlflow.db"
    database.write_bytes(b"")
    monkeypatch.setattr(preflight.os, "access", lambda path, mode: Path(path) != database)
    (problem,) = preflight.store_problems(TrackingConfig(uri=f"sqlite:///{database}", spool_dir=str(tmp_path)))
    assert isinstance(problem, ConfigError) and "is not writable by this process" in str(problem)
    assert str(problem).endswith(": run as its owner")  # outside a container: no mlflow run advice


def test_inside_mlflow_runs_container_each_problem_names_the_argument(tmp_path, monkeypatch, in_mlflow_run_container):
    database = tmp_path / "mlflow.db"
    database.write_bytes(b"")
    monkeypatch.setattr(preflight.os, "access", lambda path, mode: Path(path) != database)
    (problem,) = preflight.store_problems(TrackingConfig(uri=f"sqlite:///{database}", spool_dir=str(tmp_path)))
    assert "trains as the store's owner: leave out -A user=" in str(problem) and "\n" not in str(problem)

    with pytest.raises(MaxoutError, match="pass -A network=host to mlflow run"):
        store.check_reachable("http://127.0.0.1:9", timeout_s=2)
    with pytest.raises(MaxoutError) as remote:  # a server elsewhere: the network flag would not help
        store.check_reachable("http://192.0.2.1:9", timeout_s=0.5)
    assert "network=host" not in str(remote.value)

    monkeypatch.setattr(preflight.os, "access", lambda path, mode: False)
    with pytest.raises(ConfigError, match="start it in the folder that holds mlflow.db and mlruns/$"):
        preflight.check_artifact_store(f"sqlite:///{database}", str(tmp_path / "mlruns" / "0"))


def test_inside_mlflow_runs_container_the_store_is_named_as_the_host_sees_it(tmp_path, monkeypatch,
                                                                          in_mlflow_run_container):
    """MLproject passes the folder mlflow run starts in (MAXOUT_HOST_DIR, mounted at the same path); its mlflow.db
    is named only when it is the very file mounted as the store (a hard link stands in for the bind mount)."""
    host = tmp_path / "project"
    host.mkdir()
    (host / "mlflow.db").write_bytes(b"")
    mounted = tmp_path / "mlflow-tmp" / "mlruns"
    mounted.parent.mkdir()
    os.link(host / "mlflow.db", mounted)
    monkeypatch.setattr(container, "MOUNTED_STORE", str(mounted))
    uri = f"sqlite:///{mounted}"
    monkeypatch.setenv("MAXOUT_HOST_DIR", str(host))
    assert container.host_store_uri(uri) == f"sqlite:///{host}/mlflow.db"
    assert container.host_store_uri(f"sqlite:///{host}/mlflow.db") is None  # not the container's mount
    monkeypatch.delenv("MLFLOW_RUN_ID")  # MLflow drops it when the run ends, before the last line is printed
    assert container.host_store_uri(uri) == f"sqlite:///{host}/mlflow.db"
    (host / "mlflow.db").unlink()
    (host / "mlflow.db").write_bytes(b"")  # another file of that name: the store lies elsewhere on the host
    assert container.host_store_uri(uri) is None
    monkeypatch.delenv("MAXOUT_HOST_DIR")
    assert container.host_store_uri(uri) is None


def test_outside_a_container_the_hints_stay_out(monkeypatch):
    monkeypatch.setenv("MLFLOW_RUN_ID", "0" * 32)  # `mlflow run` without docker: no container, no -A advice
    monkeypatch.setattr(container, "in_container", lambda: False)
    with pytest.raises(MaxoutError) as err:
        store.check_reachable("http://127.0.0.1:9", timeout_s=2)
    assert "-A network=host" not in str(err.value)
    assert not container.inside_mlflow_run() and os.environ["MLFLOW_RUN_ID"]

"""Reliability end to end, with real processes: `maxout train` killed with SIGKILL and resumed, SIGTERM with
DataLoader workers running, and a real `mlflow server` that goes away mid-run (and comes back, or not)."""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import time
from pathlib import Path

import mlflow
import pytest
import torch

from maxout import cli, loading
from maxout.train import checkpointing
from maxout.tracking import spool
from maxout.tracking.tracker import NullTracker
from maxout.train import Callback, train

from . import services, warm_maxout
from .conftest import runs_in
from .test_checkpointing import history, small

pytestmark = pytest.mark.slow
STEP_KEYS = ("train/loss", "train/lr", "train/epoch", "perf/window_samples_per_s")


def start_train(overrides: list[str]) -> warm_maxout.Process:
    """`maxout train` in a process of its own (SIGKILLed, SIGTERMed, resumed), forked warm (tests/warm_maxout.py)."""
    return warm_maxout.popen(["train", *overrides, "--no-progress"], stdout=warm_maxout.PIPE,
                             stderr=warm_maxout.PIPE, start_new_session=True)


def wait_for_checkpoint(root: Path, proc: warm_maxout.Process, min_step: int, timeout_s: float = 600) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [p for p in root.glob("*/*/step-*.pt") if int(p.stem.split("-")[1]) >= min_step]
        if found:
            return max(found)
        if proc.poll() is not None:
            pytest.fail(f"training ended (rc {proc.returncode}) before a checkpoint at step {min_step}: "
                        f"{proc.stderr.read()[-2000:]}")
        time.sleep(0.02)
    pytest.fail(f"no checkpoint at step >= {min_step} within {timeout_s}s")


def assert_each_step_once(uri: str, run_id: str, steps: int) -> None:
    for key in STEP_KEYS:
        assert [s for s, _ in history(uri, run_id, key)] == list(range(1, steps + 1)), key


def logged_weights(uri: str, run) -> dict:
    from transformers import AutoModelForSequenceClassification

    mlflow.set_tracking_uri(uri)  # models:/ URIs resolve against the current tracking URI
    with tempfile.TemporaryDirectory(prefix="maxout-test-weights-") as folder:  # MLflow's own would stay in /tmp
        local = Path(mlflow.artifacts.download_artifacts(run.data.tags["maxout.model_uri"], dst_path=folder))
        [weights] = local.rglob("model.safetensors")
        return AutoModelForSequenceClassification.from_pretrained(weights.parent).state_dict()


def test_sigkill_then_resume_auto_continues_the_same_run_to_the_same_weights(tmp_path, mlflow_store):
    overrides = small(tmp_path, "train.epochs=6", "checkpoint.every_n_steps=2", *mlflow_store["overrides"],
                      f"tracking.spool_dir={tmp_path / 'spool'}", "tracking.log_model=true")
    steps, uri = 24, mlflow_store["uri"]
    reference = NullTracker()
    expected = train(loading.load(small(tmp_path, "train.epochs=6", "tracking=none")), tracker=reference,
                     progress=False, verbose=False).setup.model.state_dict()

    proc = start_train(overrides)
    wait_for_checkpoint(tmp_path / "ckpt", proc, min_step=6)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    [killed] = runs_in(uri)
    assert killed.info.status == "RUNNING"  # SIGKILL: nothing could close it; resume will

    resumed = start_train([*overrides, "resume=auto"])
    _, err = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, err[-3000:]
    [run] = runs_in(uri)
    assert run.info.run_id == killed.info.run_id and run.info.status == "FINISHED"
    assert 6 <= int(run.data.tags["maxout.resumed_from_step"]) < steps
    assert_each_step_once(uri, run.info.run_id, steps)
    losses = [v for _, v in history(uri, run.info.run_id, "train/loss")]
    assert losses == pytest.approx([v for _, v in reference.metrics["train/loss"]], abs=1e-6)
    final = logged_weights(uri, run)
    assert final.keys() == expected.keys()
    assert all(torch.allclose(final[k], expected[k], atol=1e-6) for k in expected)


def test_sigterm_with_loader_workers_marks_the_run_killed_and_its_checkpoint_resumes(tmp_path, mlflow_store):
    overrides = small(tmp_path, "train.epochs=6", "checkpoint.every_n_steps=2", "hardware.num_workers=1",
                      *mlflow_store["overrides"], f"tracking.spool_dir={tmp_path / 'spool'}")
    uri = mlflow_store["uri"]
    proc = start_train(overrides)
    wait_for_checkpoint(tmp_path / "ckpt", proc, min_step=4)
    os.killpg(proc.pid, signal.SIGTERM)  # the whole group, as a scheduler does: the worker gets it too
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    assert "terminated (SIGTERM)" in err and "DataLoader worker" not in err
    [run] = runs_in(uri)
    assert run.info.status == "KILLED" and run.data.tags["maxout.status_reason"] == "Terminated: interrupted"
    [run_dir] = (tmp_path / "ckpt").glob("*/*")
    last = checkpointing.latest(run_dir)
    assert last is not None and not list(run_dir.glob(".*tmp*"))
    assert checkpointing.load(last)["state"]["step"] >= 4
    assert not list((tmp_path / "spool").glob("*.jsonl"))  # everything reached the store before it ended

    result = train(loading.load([*overrides, "resume=auto"]), progress=False, verbose=False)
    [run] = runs_in(uri)
    assert result.run_id == run.info.run_id and run.info.status == "FINISHED"
    assert_each_step_once(uri, run.info.run_id, 24)


class Server:
    """A real `mlflow server` that a test can stop and start again on the same port and store."""

    def __init__(self, tmp_path: Path):
        self.port = services.free_port()
        self.backend = f"sqlite:///{tmp_path / 'server.db'}"
        self.artifacts = (tmp_path / "server-artifacts").as_uri()
        self._running = None

    def start(self) -> str:
        self._running = services.mlflow_server(self.backend, self.artifacts, port=self.port)
        return self._running.__enter__()

    def stop(self) -> None:
        running, self._running = self._running, None
        if running is not None:
            running.__exit__(None, None, None)


class Outage(Callback):
    def __init__(self, server: Server, down_at: int, up_at: int | None):
        self.server, self.down_at, self.up_at = server, down_at, up_at

    def on_step_end(self, state):
        if state.step == self.down_at:
            self.server.stop()
        if state.step == self.up_at:
            self.server.start()


def outage_run(tmp_path, server: Server, up_at: int | None):
    url = server.start()
    # upload_retry_s: a server away at the end costs the report artifacts one retry window, then a warning
    overrides = small(tmp_path, "train.epochs=3", "checkpoint.every_n_steps=2", "tracking=server",
                      f"tracking.uri={url}", f"tracking.spool_dir={tmp_path / 'spool'}",
                      "tracking.system_metrics=false", "tracking.log_model=false", "tracking.upload_retry_s=2")
    return train(loading.load(overrides), callbacks=[Outage(server, down_at=3, up_at=up_at)], progress=False,
                 verbose=False)


def test_a_server_restart_mid_run_loses_and_doubles_no_metric(tmp_path, caplog):
    server = Server(tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="maxout"):
            result = outage_run(tmp_path, server, up_at=8)
        url = f"http://127.0.0.1:{server.port}"
        assert "tracking server unreachable" in caplog.text and "tracking server back" in caplog.text
        [run] = runs_in(url)
        assert run.info.run_id == result.run_id and run.info.status == "FINISHED"
        assert_each_step_once(url, run.info.run_id, 12)
        assert run.data.params["cfg.train.epochs"] == "3"
        assert not list((tmp_path / "spool").glob("*.jsonl"))
    finally:
        server.stop()


def test_a_server_that_never_returns_leaves_a_spool_that_replay_delivers(tmp_path, capsys):
    server = Server(tmp_path)
    try:
        result = outage_run(tmp_path, server, up_at=None)
        [left] = (tmp_path / "spool").glob("*.jsonl")
        assert left.name == f"{result.run_id}.jsonl" and spool.Spool(left).pending()
        url = server.start()  # back, much later
        [run] = runs_in(url)
        assert run.info.status == "RUNNING"
        assert cli.main(["tracking", "replay", str(left)]) == 0
        assert "replayed" in capsys.readouterr().out
        [run] = runs_in(url)
        assert run.info.status == "FINISHED"
        assert_each_step_once(url, run.info.run_id, 12)
        assert not left.exists()
    finally:
        server.stop()

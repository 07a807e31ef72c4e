"""The fault suite: a user's bad day, tried on purpose, so that the next fault of these kinds is found here and not
by a user. Each section is a row group of the README's reliability table ("Faults and how to recover").

- concurrency: train, hpo and registry commands starting together, on a new store and on an existing one
- corrupt or partial files: checkpoints, the tracking spool, the batch finder's cache, the HPO journal
- full or read-only directories for the spool and checkpoints (a small tmpfs, remounted read-only)
- the tracking server dropping at each phase: start, mid-run, model logging, registration
- signals at each phase

Every case ends the same way: one line that names what failed and what to do, no run left RUNNING, and nothing
already written lost. Tiny model, few steps; the multi-process cases are marked slow.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from pathlib import Path

import mlflow
import pytest
import torch

from maxout import cli, config, loading
from maxout.errors import MaxoutError
from maxout.registry import client as registry_client
from maxout.train import Callback, checkpointing, resume, train

from .conftest import ROOT, runs_in
from .test_checkpointing import STEPS, CrashAt, history, small
from .test_reliability_e2e import Server

TINY = ["hardware=cpu", "model=tiny", "train.max_steps=2", "train.epochs=1", "train.log_every=1"]


def store_overrides(tmp_path) -> tuple[str, list[str]]:
    """A new embedded store under ``tmp_path`` (nothing exists yet), and the overrides that use it."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return uri, ["tracking=local", f"tracking.uri={uri}", f"tracking.artifact_location={(tmp_path / 'art').as_uri()}",
                 "tracking.system_metrics=false", f"tracking.spool_dir={tmp_path / 'spool'}",
                 f"checkpoint.dir={tmp_path / 'ckpt'}"]


# ------------------------------------------------------------------------------------------------ concurrency


def start_together(tmp_path, wave: str, commands: list[list[str]]) -> list[tuple[int, str]]:
    """Each command in its own process (tests/job_race.py), all reaching the store at the same moment."""
    ready = tmp_path / f"ready-{wave}"
    ready.mkdir()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.job_race", str(ready), str(len(commands)), *argv],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv in commands]
    return [(proc.returncode, err) for proc in procs for _, err in [proc.communicate(timeout=900)]]


@pytest.mark.slow
def test_train_hpo_and_registry_commands_starting_together_on_a_new_store_then_on_the_existing_one(tmp_path):
    uri, store = store_overrides(tmp_path)
    common = ["--no-progress", *TINY, *store, "registry.name=race"]
    waves = {"new": ["registry", "list", "--tracking-uri", uri],
             "existing": ["registry", "promote", "race", "1", "--tracking-uri", uri]}
    for wave, registry_command in waves.items():
        results = start_together(tmp_path, wave, [
            ["train", *common, "train.seed=1"], ["train", *common, "train.seed=2"],
            ["hpo", *common, "hpo.n_trials=1", f"hpo.study_name=race-{wave}"], registry_command])
        assert [rc for rc, _ in results] == [0, 0, 0, 0], [err[-2000:] for _, err in results]
        assert not any("Traceback" in err for _, err in results)
    runs = runs_in(uri)
    assert len(runs) == 8 and {r.info.status for r in runs} == {"FINISHED"}  # per wave: 2 trains, hpo parent + trial
    client = registry_client.connect(uri)
    versions = client.search_model_versions("name='race'")
    assert len(versions) == 6  # each wave: both trains and the study's best trial, registered once each
    assert int(client.get_registered_model("race").aliases["champion"]) in {int(v.version) for v in versions}
    assert not client.search_model_versions(f"name='race{config.LOCK_SUFFIX}'")  # every lock ticket released
    assert not (tmp_path / "mlflow.db.lock").exists()


# ---------------------------------------------------------------------------------- corrupt or partial files


def crashed_run(tmp_path, mlflow_store, at: int = 7, *extra: str) -> tuple[list[str], str, Path]:
    """A tracked run that crashed at step ``at``; its overrides, run id and checkpoint folder (keep_last=2 keeps
    steps 4 and 6 of a crash at 7)."""
    overrides = small(tmp_path, *mlflow_store["overrides"], f"tracking.spool_dir={tmp_path / 'spool'}", *extra)
    with pytest.raises(RuntimeError, match="crash at step"):
        train(loading.load(overrides), callbacks=[CrashAt(at)], progress=False, verbose=False)
    [run] = runs_in(mlflow_store["uri"])
    folder = tmp_path / "ckpt" / resume.run_key(loading.load(overrides)) / run.info.run_id
    return overrides, run.info.run_id, folder


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def flip_a_byte(path: Path) -> None:
    """Damage a tensor's bytes (the middle of the file), as a bad disk would: the zip structure stays valid."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_truncated_newest_checkpoint_is_skipped_and_the_same_run_continues_from_the_one_before(
        tmp_path, mlflow_store, caplog):
    overrides, run_id, folder = crashed_run(tmp_path, mlflow_store)
    assert [p.name for p in checkpointing.checkpoints(folder)] == ["step-00000004.pt", "step-00000006.pt"]
    truncate(folder / "step-00000006.pt")  # a bad disk, or a partial copy

    with caplog.at_level(logging.WARNING, logger="maxout"):
        assert cli.main(["train", *overrides, "resume=auto", "--no-progress"]) == 0
    [warning] = [r.getMessage() for r in caplog.records if "damaged checkpoint" in r.getMessage()]
    assert "step-00000006.pt (checksum mismatch" in warning and "resuming from step-00000004.pt" in warning
    [run] = runs_in(mlflow_store["uri"])
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert run.data.tags["maxout.resumed_from_step"] == "4"
    assert [s for s, _ in history(mlflow_store["uri"], run_id, "train/loss")] == list(range(1, STEPS + 1))


def test_a_flipped_byte_loads_but_its_checksum_finds_it(tmp_path):
    path = checkpointing.save_atomic({"format": checkpointing.FORMAT, "w": torch.zeros(100_000)},
                                     tmp_path / checkpointing.file_name(3))
    flip_a_byte(path)
    assert checkpointing.load(path)["w"].abs().sum() > 0  # torch reads the damaged tensor without a word
    with pytest.raises(checkpointing.Damaged, match="checksum mismatch"):
        checkpointing.load_verified(path)
    checkpointing.checksum_file(path).unlink()  # a checkpoint written before checksums: only loaded
    assert checkpointing.load_verified(path)["format"] == checkpointing.FORMAT


def test_no_intact_checkpoint_is_one_line_naming_each_file_and_ends_the_killed_run(tmp_path, mlflow_store, capsys):
    overrides, run_id, folder = crashed_run(tmp_path, mlflow_store)
    client = mlflow.MlflowClient(mlflow_store["uri"])
    client.update_run(run_id, status="RUNNING")  # as SIGKILL leaves it
    truncate(folder / "step-00000006.pt")
    flip_a_byte(folder / "step-00000004.pt")

    assert cli.main(["train", *overrides, "resume=auto", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("maxout: error: no intact checkpoint of run") and "\n" not in err, err
    assert "step-00000006.pt (checksum mismatch" in err and "step-00000004.pt (checksum mismatch" in err
    assert "start a new run without resume" in err
    [run] = runs_in(mlflow_store["uri"])
    assert run.info.status == "FAILED" and "no intact checkpoint" in run.data.tags["maxout.status_reason"]
    assert sorted(p.name for p in checkpointing.checkpoints(folder)) == ["step-00000004.pt", "step-00000006.pt"]


# ------------------------------------------------------------------ a resumed run's figures (issue 19, case 4)


class CrashAfterTheLastCheckpoint(Callback):
    """Dies after the last step's checkpoint (written at the epoch end), before the run logs its final figures."""

    def on_train_end(self, state):
        raise RuntimeError("crash after the last checkpoint")


def final_figures(uri: str, run_id: str) -> dict:
    return mlflow.MlflowClient(uri).get_run(run_id).data.metrics


def window_seconds(uri: str, run_id: str, steps: range, samples_per_step: int) -> float:
    """The training seconds of ``steps``, from their per-interval rates (log_every=1)."""
    rates = dict(history(uri, run_id, "perf/window_samples_per_s"))
    return sum(samples_per_step / rates[step] for step in steps)


def test_a_run_resumed_mid_way_reports_samples_over_the_summed_training_window(tmp_path, mlflow_store):
    overrides, run_id, folder = crashed_run(tmp_path, mlflow_store)
    saved = checkpointing.load(folder / "step-00000006.pt")["state"]["measured"]
    assert saved["meter"]["samples"] == 48  # steps 1-6 of 8 samples each: what the checkpoint carries on
    train(loading.load([*overrides, "resume=auto"]), progress=False, verbose=False)

    got = final_figures(mlflow_store["uri"], run_id)
    assert got["train/samples"] == 64  # 8 steps: each counted once, though step 7 ran twice
    assert got["perf/samples_per_s"] * got["time/train_window_s"] == pytest.approx(64, rel=1e-9)
    resumed_steps = window_seconds(mlflow_store["uri"], run_id, range(8, 9), 8)  # step 7's rate is the crash's
    resumed_wall = got["time/wall_s"] - saved["wall_s"]
    before = saved["meter"]["elapsed"]
    assert before + resumed_steps <= got["time/train_window_s"] <= before + resumed_wall
    assert got["time/wall_s"] > saved["wall_s"] > before > 0


def test_a_run_resumed_after_its_last_step_keeps_its_real_figures(tmp_path, mlflow_store):
    overrides = small(tmp_path, *mlflow_store["overrides"], f"tracking.spool_dir={tmp_path / 'spool'}")
    with pytest.raises(RuntimeError, match="after the last checkpoint"):
        train(loading.load(overrides), callbacks=[CrashAfterTheLastCheckpoint()], progress=False, verbose=False)
    [run] = runs_in(mlflow_store["uri"])
    assert "perf/samples_per_s" not in run.data.metrics
    [last] = (tmp_path / "ckpt").glob("*/*/step-00000008.pt")
    saved = checkpointing.load(last)["state"]["measured"]
    train(loading.load([*overrides, "resume=auto"]), progress=False, verbose=False)  # no step left to train

    got = final_figures(mlflow_store["uri"], run.info.run_id)
    assert got["train/samples"] == 64 and got["train/optimizer_steps"] == STEPS
    assert got["perf/samples_per_s"] == pytest.approx(64 / saved["meter"]["elapsed"], rel=0.05)  # not 0
    assert got["perf/samples_per_s"] * got["time/train_window_s"] == pytest.approx(64, rel=1e-9)
    assert got["time/wall_s"] >= saved["wall_s"] > 0.1  # not the 0.001 s of a segment with nothing to train
    assert got["time/first_step_s"] > 0 and got["eval/accuracy"] == run.data.metrics["eval/accuracy"]


# ------------------------------------------------------------------------- the tracking server dropping out


class ServerAway(Callback):
    """Stops the tracking server when training ends (before the model upload); with ``back_after_s`` it starts
    again that many seconds later, as a restarted server would."""

    def __init__(self, server: Server, back_after_s: float | None = None):
        self.server, self.back_after_s = server, back_after_s

    def on_train_end(self, state):
        drop(self.server, self.back_after_s)


def drop(server: Server, back_after_s: float | None) -> None:
    server.stop()
    if back_after_s is not None:
        threading.Timer(back_after_s, server.start).start()


def server_overrides(tmp_path, url: str, *extra: str) -> list[str]:
    return small(tmp_path, "tracking=server", f"tracking.uri={url}", f"tracking.spool_dir={tmp_path / 'spool'}",
                 "tracking.system_metrics=false", "tracking.log_model=true", *extra)


@pytest.mark.slow
def test_a_server_away_at_model_logging_keeps_the_weights_and_resume_auto_finishes_the_same_run(tmp_path):
    server = Server(tmp_path)
    try:
        url = server.start()
        overrides = server_overrides(tmp_path, url, "tracking.upload_retry_s=2")
        with pytest.raises(MaxoutError) as failure:
            train(loading.load(overrides), callbacks=[ServerAway(server)], progress=False, verbose=False)
        [final] = (tmp_path / "ckpt").glob(f"*/*/{checkpointing.file_name(STEPS)}")
        run_id, message = final.parent.name, str(failure.value)
        assert message.startswith(f"storing artifacts of run {run_id} at mlflow-artifacts:/") and "\n" not in message
        assert "(tried 2 times over 2 s)" in message and "Connection refused" in message
        assert message.endswith(f"; the trained weights are safe in the final checkpoint {final}: when the server "
                                f"is back, run the same command with resume=auto, which logs the model and "
                                f"finishes run {run_id}")

        server.start()  # back
        assert cli.main(["train", *overrides, "resume=auto", "--no-progress"]) == 0
        [run] = runs_in(url)
        assert run.info.run_id == run_id and run.info.status == "FINISHED"
        assert run.data.tags["maxout.model_uri"].startswith("models:/m-")
        assert [s for s, _ in history(url, run_id, "train/loss")] == list(range(1, STEPS + 1))
        got = run.data.metrics
        assert got["train/samples"] == 64 and got["perf/samples_per_s"] > 0
        assert got["perf/samples_per_s"] * got["time/train_window_s"] == pytest.approx(64, rel=1e-9)
        assert not list((tmp_path / "ckpt").glob("*/*/*.pt")) and not list((tmp_path / "spool").glob("*.jsonl"))
    finally:
        server.stop()


@pytest.mark.slow
def test_a_server_that_restarts_during_the_model_upload_gets_the_model_in_the_same_attempt(tmp_path, caplog):
    server = Server(tmp_path)
    try:
        url = server.start()
        with caplog.at_level(logging.WARNING, logger="maxout"):
            result = train(loading.load(server_overrides(tmp_path, url, "tracking.upload_retry_s=300")),
                           callbacks=[ServerAway(server, back_after_s=1)], progress=False, verbose=False)
        assert "failed (MlflowException); trying again every 5 s for up to 300 s" in caplog.text
        [run] = runs_in(url)
        assert run.info.status == "FINISHED" and run.data.tags["maxout.model_uri"] == result.model_uri
    finally:
        server.stop()


@pytest.mark.slow
def test_a_server_that_drops_right_after_the_run_starts_gets_its_config_when_it_is_back(tmp_path, caplog,
                                                                                         monkeypatch):
    from maxout.train import run as run_mod

    server = Server(tmp_path)
    build = run_mod.build

    def build_while_the_server_drops(*args, **kwargs):  # the run exists; config.yaml is not uploaded yet
        drop(server, back_after_s=1)
        return build(*args, **kwargs)

    monkeypatch.setattr(run_mod, "build", build_while_the_server_drops)
    try:
        url = server.start()
        with caplog.at_level(logging.WARNING, logger="maxout"):
            train(loading.load(server_overrides(tmp_path, url, "tracking.log_model=false")), progress=False,
                  verbose=False)
        assert "trying again every 5 s" in caplog.text
        [run] = runs_in(url)
        assert run.info.status == "FINISHED" and run.data.params["cfg.train.epochs"] == "2"
        artifacts = {a.path for a in mlflow.MlflowClient(url).list_artifacts(run.info.run_id)}
        assert {"config.yaml", "hardware.json", "versions.json"} <= artifacts
    finally:
        server.stop()


@pytest.mark.slow
def test_a_server_away_at_registration_leaves_a_finished_run_and_one_command_registers_it(tmp_path, monkeypatch,
                                                                                         capsys):
    from maxout.registry import promotion

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's own retries would take minutes
    server = Server(tmp_path)
    register_and_promote = promotion.register_and_promote

    def after_the_server_dropped(*args, **kwargs):
        server.stop()
        return register_and_promote(*args, **kwargs)

    monkeypatch.setattr(promotion, "register_and_promote", after_the_server_dropped)
    try:
        url = server.start()
        overrides = server_overrides(tmp_path, url, "registry.name=nli", "registry.metric=eval/loss",
                                     "registry.direction=minimize")
        assert cli.main(["train", *overrides, "--no-progress"]) == 1
        err = capsys.readouterr().err.strip().splitlines()[-1]
        server.start()
        [run] = runs_in(url)
        recover = f"maxout registry register nli {run.info.run_id} --metric eval/loss --direction minimize"
        assert err.startswith(f"maxout: error: registering the model of run {run.info.run_id} as 'nli' failed")
        assert err.endswith(f"run {run.info.run_id} is FINISHED with its model; register it when the server is "
                            f"back: {recover}"), err
        assert run.info.status == "FINISHED" and run.data.tags["maxout.model_uri"].startswith("models:/m-")

        monkeypatch.setattr(promotion, "register_and_promote", register_and_promote)
        assert cli.main([*recover.split()[1:], "--tracking-uri", url]) == 0
        assert capsys.readouterr().out.strip() == "maxout: registered nli v1; champion: first champion (eval/loss " \
            f"{run.data.metrics['eval/loss']:.6g})"
        assert cli.main([*recover.split()[1:], "--tracking-uri", url]) == 0  # twice: nothing more to do
        assert capsys.readouterr().out.strip() == f"maxout: run {run.info.run_id} is registered already as nli v1"
        model = registry_client.connect(url).get_registered_model("nli")
        assert model.aliases == {"champion": "1", "challenger": "1"}
    finally:
        server.stop()

"""The fault suite: a user's bad day, tried on purpose, so that the next fault of these kinds is found here and not
by a user. Each section is a row group of the reliability table (docs/how-to/faults.md).

- concurrency: train, hpo and registry commands starting together, on a new store and on an existing one
- corrupt or partial files: checkpoints, the tracking spool, the batch finder's cache, the HPO journal
- full or read-only directories for the spool and checkpoints (a small tmpfs, remounted read-only)
- the tracking server dropping at each phase: start, mid-run, model logging, registration
- signals at each phase

Every case ends the same way: one line that names what failed and what to do, no run left RUNNING, and nothing
already written lost. Tiny model, few steps; the multi-process cases are marked slow.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Iterator

import mlflow
import pytest
import torch
from mlflow.entities import Metric, Param

from maxout import cli, loading
from maxout.errors import MaxoutError
from maxout.registry import client as registry_client
from maxout.tracking import spool
from maxout.train import Callback, checkpointing, resume, train

from . import job_race
from .conftest import runs_in
from .store_template import new_store
from .test_checkpointing import STEPS, CrashAt, history, small, small_data
from .test_registry import lock_leftovers
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
    return job_race.start_together(tmp_path / f"race-{wave}", commands)


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
    assert lock_leftovers(client, "race") == []  # the locks left nothing in the registry
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


@pytest.mark.slow
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


@pytest.mark.slow
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



def test_a_damaged_spool_keeps_its_sound_records_and_replay_delivers_them(tmp_path, caplog):
    store = new_store(tmp_path / "store.db")
    client = mlflow.MlflowClient(store)
    run_id = client.create_run(client.create_experiment("damaged")).info.run_id
    path = tmp_path / f"{run_id}.jsonl"
    journal = spool.Spool(path, run_id, store)
    journal.append(params=[Param("cfg.lr", "0.1")], metrics=metric_steps(range(1, 6)))
    with open(path, "ab") as f:  # a bad disk, a hand edit, a copy gone wrong
        f.write(b'5\n' + "caf\xe9\n".encode("latin-1") + b'{"seq": "x", "metrics": []}\n'
                + b'{"seq": 40, "metrics": [["k"]]}\n' + b"\x00" * 64 + b"\n" + b'["spool"]\n')
    journal.append(metrics=metric_steps(range(6, 11)))
    with open(path, "ab") as f:
        f.write(b'{"seq": 50, "metrics": [["torn')  # and a crash mid-write

    with caplog.at_level(logging.WARNING, logger="maxout"):
        reopened = spool.Spool(path)
    assert [r["seq"] for r in reopened.pending()] == [1, 2, 3]  # params, steps 1-5, steps 6-10
    assert "has 7 damaged lines (4, 5, 6, 7, 8, 9, 11); skipped, the other records are kept" in caplog.text
    assert spool.replay(path, store) == 3
    assert [m.step for m in sorted(client.get_metric_history(run_id, "train/loss"), key=lambda m: m.step)] == \
        list(range(1, 11))
    assert client.get_run(run_id).data.params == {"cfg.lr": "0.1"}


def metric_steps(steps) -> list:
    return [Metric("train/loss", step / 10, 1_700_000_000_000 + step, step) for step in steps]


def finder_config(tmp_path, cache_path: Path) -> tuple:
    from maxout import data, hardware, modeling

    cfg = loading.load(["hardware=cpu", "model=tiny", "tracking=none", "train.batch_size=auto",
                        "train.target_effective_batch=8", "batch_finder.memory_budget_gb=4",
                        f"batch_finder.cache_path={cache_path}", *small_data(tmp_path)])
    return cfg, hardware.detect(), data.load(cfg.data), modeling.load_tokenizer(cfg.model)


@pytest.mark.parametrize("damage", ["not json", "a list", "a bad entry", "unwritable"])
def test_a_damaged_or_unwritable_batch_finder_cache_means_searching_again(tmp_path, caplog, damage):
    from maxout.train import batch_finder

    cache = tmp_path / ("a-file/cache.json" if damage == "unwritable" else "cache.json")
    cfg, device, dataset, tokenizer = finder_config(tmp_path, cache)
    key = batch_finder.search_for(cfg, device, dataset, tokenizer).key
    writes = {"not json": b'{"cpu budget 4.0 GiB | model tiny": {"max_ba', "a list": b"[]",
              "a bad entry": json.dumps({key: {"max_batch": "many", "upper": 8}}).encode(), "unwritable": b"a file"}
    (tmp_path / "a-file" if damage == "unwritable" else cache).write_bytes(writes[damage])
    with caplog.at_level(logging.WARNING, logger="maxout"):
        result = batch_finder.find(cfg, device, dataset, tokenizer)
    assert not result.cache_hit and result.micro_batch >= 1
    if damage == "unwritable":
        assert f"batch finder cache {cache} not written ([Errno 17] File exists: '{cache.parent}')" in caplog.text
        return
    if damage != "a bad entry":
        assert f"batch finder cache {cache} is damaged" in caplog.text
    assert json.loads(cache.read_text())[key]["max_batch"] == result.max_batch  # a sound file again
    assert batch_finder.find(cfg, device, dataset, tokenizer).cache_hit


def test_a_torn_hpo_journal_is_repaired_and_a_damaged_one_is_refused_in_one_line(tmp_path, mlflow_store, caplog,
                                                                                capsys):
    import optuna

    from maxout.hpo import storage

    journal = tmp_path / "optuna.journal"
    cfg = loading.load(["hpo=default", *TINY, *mlflow_store["overrides"], f"hpo.storage={journal}"])
    study = optuna.create_study(study_name="s", storage=storage.open_storage(cfg.hpo, cfg.tracking))
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=2)
    sound = journal.read_bytes()
    with open(journal, "ab") as f:
        f.write(b'{"op_code":4,"worker_id":"dead-')  # a worker killed while writing
    with caplog.at_level(logging.WARNING, logger="maxout"):
        study = optuna.load_study(study_name="s", storage=storage.open_storage(cfg.hpo, cfg.tracking))
    assert "ended in a torn record (31 bytes, a worker died while writing it)" in caplog.text
    assert journal.read_bytes() == sound
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=1)  # Optuna goes on from there
    assert len(study.trials) == 3

    lines = journal.read_bytes().split(b"\n")
    journal.write_bytes(b"\n".join([lines[0], b"\x00\x00garbage", *lines[1:]]))
    assert cli.main(["hpo", *TINY, *mlflow_store["overrides"], f"hpo.storage={journal}", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"maxout: error: HPO journal {journal} is damaged at line 2 of ") and "set hpo.storage" \
        in err
    assert runs_in(mlflow_store["uri"]) == []  # refused before the study's parent run


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


@pytest.mark.slow
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


@pytest.mark.slow
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
    # The rate is the first segment's (not 0): the resumed one, with no step to train, adds next to nothing to the
    # window (microseconds; 0.5 s bounds it on a loaded machine, where a rate held within 5% would fail on a stall
    # of ~50 ms)
    assert 0 <= got["time/train_window_s"] - saved["meter"]["elapsed"] < 0.5
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
        began = time.monotonic()
        with pytest.raises(MaxoutError) as failure:
            train(loading.load(overrides), callbacks=[ServerAway(server)], progress=False, verbose=False)
        # the error comes after the upload window, not after MLflow's own retries of the clean-up's requests, which
        # held it back for about four minutes (a tiny training takes seconds; the bound leaves room for a busy CI)
        assert time.monotonic() - began < 120
        [final] = (tmp_path / "ckpt").glob(f"*/*/{checkpointing.file_name(STEPS)}")
        run_id, message = final.parent.name, str(failure.value)
        assert message.startswith(f"storing artifacts of run {run_id} at mlflow-artifacts:/") and "\n" not in message
        # the evaluation report's artifacts waited out the window first (a warning); the model then tried once
        assert "(away since an earlier upload waited 2 s)" in message and "Connection refused" in message
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


# ---------------------------------------------------------------- full or read-only spool and checkpoint disks


@contextlib.contextmanager
def tmpfs(directory: Path, size: str = "64m") -> Iterator[Path]:
    """A small RAM disk at ``directory``: it fills up like a real one, and can be remounted read-only (root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    directory.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], check=True)
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


class DiskTrouble(Callback):
    """At step ``at`` the state disk fills up, or turns read-only, as another job or a failing disk would do."""

    def __init__(self, disk: Path, kind: str, at: int = 5):
        self.disk, self.kind, self.at = disk, kind, at

    def on_step_end(self, state):
        if state.step != self.at:
            return
        if self.kind == "read-only":
            subprocess.run(["mount", "-o", "remount,ro", str(self.disk)], check=True)
            return
        with open(self.disk / "filler", "wb", buffering=0) as f:
            for chunk in (1 << 20, 4096, 1):
                with contextlib.suppress(OSError):
                    while True:
                        f.write(b"\0" * chunk)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["full", "read-only"])
def test_a_full_or_read_only_state_disk_says_which_directory_and_why_and_loses_nothing(tmp_path, mlflow_store,
                                                                                      kind, caplog):
    with tmpfs(tmp_path / "state") as disk:
        overrides = small(tmp_path, *mlflow_store["overrides"], f"tracking.spool_dir={disk / 'spool'}",
                          f"checkpoint.dir={disk / 'ckpt'}")
        with caplog.at_level(logging.WARNING, logger="maxout"), pytest.raises(RuntimeError, match="crash at step 7"):
            train(loading.load(overrides), callbacks=[DiskTrouble(disk, kind), CrashAt(7)], progress=False,
                  verbose=False)
        why = "No space left on device" if kind == "full" else "Read-only file system"
        [folder] = (disk / "ckpt").glob("*/*")
        assert f"checkpoint step-00000006.pt not written to {folder} ({why}); training goes on" in caplog.text
        if kind == "read-only":  # a full disk may still take a few spool lines in the last page of its file
            assert f"tracking spool {disk / 'spool'}/" in caplog.text and f".jsonl cannot be written ({why})" \
                in caplog.text
        [run] = runs_in(mlflow_store["uri"])
        assert [s for s, _ in history(mlflow_store["uri"], run.info.run_id, "train/loss")] == list(range(1, 8))
        assert [p.name for p in checkpointing.checkpoints(folder)] == ["step-00000003.pt", "step-00000004.pt"]
        assert all(checkpointing.load_verified(p) for p in checkpointing.checkpoints(folder))

        if kind == "read-only":  # the disk is fixed, or space freed: the same run goes on from step 4
            subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
        (disk / "filler").unlink(missing_ok=True)
        train(loading.load([*overrides, "resume=auto"]), progress=False, verbose=False)
        [run] = runs_in(mlflow_store["uri"])
        assert run.info.status == "FINISHED" and run.data.tags["maxout.resumed_from_step"] == "4"
        assert [s for s, _ in history(mlflow_store["uri"], run.info.run_id, "train/loss")] == list(range(1, 9))


# ------------------------------------------------------------------------------------- signals at each phase


def signal_at(monkeypatch, target: object, name: str, signum: int = signal.SIGTERM) -> None:
    """``target.name`` sends this process ``signum`` before it does its work, as a scheduler would at that moment."""
    real = getattr(target, name)

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signum)
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, interrupted)


class SignalAtStep(Callback):
    def __init__(self, step: int, signum: int):
        self.step, self.signum = step, signum

    def on_step_end(self, state):
        if state.step == self.step:
            os.kill(os.getpid(), self.signum)


@pytest.fixture
def sigterm_handler():
    """cli.main installs its SIGTERM handler (which ignores a second SIGTERM once it fired): put the old one back."""
    saved = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, saved)


def _phase(monkeypatch, phase: str) -> None:
    """Make a signal arrive at ``phase`` of `maxout train`."""
    from maxout.registry import promotion
    from maxout.train import loop, run as run_mod

    targets = {"before the run starts": (run_mod.prepare, "check"), "set-up": (run_mod, "build"),
               "evaluation": (loop, "evaluate"), "model logging": (run_mod, "log_model"),
               "registration": (promotion, "promote_if_better")}  # inside the promotion lock, version created
    if phase in targets:
        signal_at(monkeypatch, *targets[phase], signal.SIGINT if phase == "evaluation" else signal.SIGTERM)
    elif phase == "training step":
        fit = run_mod.fit
        monkeypatch.setattr(run_mod, "fit", lambda s, tracker, callbacks, *rest: fit(
            s, tracker, [*callbacks, SignalAtStep(5, signal.SIGTERM)], *rest))
    elif phase == "checkpoint write":  # mid-write of the second checkpoint (step 4), inside torch.save
        saves, save, write = [], checkpointing.save_atomic, checkpointing._Hashing.write

        def counted(payload, path):
            saves.append(path)
            return save(payload, path)

        def interrupted(self, data):
            if len(saves) == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            return write(self, data)

        monkeypatch.setattr(checkpointing, "save_atomic", counted)
        monkeypatch.setattr(checkpointing._Hashing, "write", interrupted)


def test_a_ctrl_c_whose_interrupt_python_drops_in_a_finalizer_still_stops_the_run(tmp_path, mlflow_store, capsys,
                                                                                   sigterm_handler):
    """Python runs a signal handler wherever the main thread is. Inside a finalizer (a weakref callback, __del__)
    the KeyboardInterrupt it raises is printed and dropped ("Exception ignored in ..."), and the run trained on to
    FINISHED with exit 0 (issue 36: a Ctrl-C during evaluation, under load). The stop is kept (errors.py) and
    raised at the next safe point: exit 130, the run KILLED."""
    from maxout.train import loop

    overrides = small(tmp_path, *mlflow_store["overrides"], "tracking.log_model=false")
    evaluate = loop.evaluate

    def ctrl_c_inside_a_finalizer(*args, **kwargs):
        class Doomed:
            pass

        doomed = Doomed()
        weakref.finalize(doomed, os.kill, os.getpid(), signal.SIGINT)
        del doomed  # the finalizer runs here, and the handler inside it
        return evaluate(*args, **kwargs)

    dropped, before = [], signal.getsignal(signal.SIGINT)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "evaluate", ctrl_c_inside_a_finalizer)
        patch.setattr(sys, "unraisablehook", lambda unraisable: dropped.append(unraisable.exc_type))
        code = cli.main(["train", *overrides, "--no-progress"])
    assert dropped.count(KeyboardInterrupt) == 1  # Python dropped it, as described (others' finalizers may add)
    err = capsys.readouterr().err
    assert (code, err.strip().splitlines()[-1]) == (130, "maxout: interrupted"), err[-3000:]
    assert [r.info.status for r in runs_in(mlflow_store["uri"])] == ["KILLED"]
    assert signal.getsignal(signal.SIGINT) is before  # cli.main left Ctrl-C's handler as it found it
    train(loading.load(overrides), progress=False, verbose=False)  # and no stop request behind: a next run runs


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["before the run starts", "set-up", "training step", "evaluation",
                                   "checkpoint write", "model logging", "registration"])
def test_a_signal_at_each_phase_ends_the_run_killed_with_its_checkpoints_intact(tmp_path, mlflow_store, capsys,
                                                                               sigterm_handler, phase):
    """SIGTERM (SIGINT during evaluation, as Ctrl-C): exit 143 (130), one line, no run left RUNNING, every
    checkpoint intact, and where checkpoints exist resume=auto finishes the same run."""
    overrides = small(tmp_path, *mlflow_store["overrides"], f"tracking.spool_dir={tmp_path / 'spool'}",
                      "tracking.log_model=true", "registry.name=signals")
    with pytest.MonkeyPatch.context() as patch:
        _phase(patch, phase)
        code = cli.main(["train", *overrides, "--no-progress"])
    interrupted = "interrupted" if phase == "evaluation" else "terminated (SIGTERM)"
    err = capsys.readouterr().err
    assert (code, err.strip().splitlines()[-1]) == (130 if phase == "evaluation" else 143, f"maxout: {interrupted}"), \
        err[-3000:]
    runs = runs_in(mlflow_store["uri"])
    assert [r.info.status for r in runs] == ({"before the run starts": [], "registration": ["FINISHED"]}
                                             .get(phase, ["KILLED"]))
    if phase == "registration":  # all or nothing: no version, no lock ticket left
        client = registry_client.connect(mlflow_store["uri"])
        assert not client.search_model_versions("name='signals'")
        assert lock_leftovers(client, "signals") == []  # no lock model, no lock tag
    folders = list((tmp_path / "ckpt").glob("*/*"))
    for checkpoint in [p for folder in folders for p in checkpointing.checkpoints(folder)]:
        checkpointing.load_verified(checkpoint)  # intact, whatever the moment
    assert not list((tmp_path / "ckpt").glob("*/*/.*tmp*"))
    if phase in ("checkpoint write", "model logging"):
        assert cli.main(["train", *overrides, "resume=auto", "--no-progress"]) == 0
        [run] = runs_in(mlflow_store["uri"])
        assert run.info.run_id == runs[0].info.run_id and run.info.status == "FINISHED"

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
from pathlib import Path

import mlflow
import pytest
import torch

from maxout import cli, config, loading
from maxout.registry import client as registry_client
from maxout.train import checkpointing, resume, train

from .conftest import ROOT, runs_in
from .test_checkpointing import STEPS, CrashAt, history, small

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

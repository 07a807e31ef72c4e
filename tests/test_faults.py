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

import json
import subprocess
import sys

import mlflow
import pytest

from maxout import config
from maxout.registry import client as registry_client

from .conftest import ROOT, runs_in

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

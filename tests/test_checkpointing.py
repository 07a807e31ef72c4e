"""Checkpoints and resume in process: atomic writes that survive a crash mid-write, keep-last-K, and a run that
dies mid-epoch and continues with resume=auto: one MLflow run, every step logged once, and the same losses and
final weights as a run that was never interrupted (deterministic, CPU)."""

from __future__ import annotations

import hashlib
import time
import subprocess

import mlflow
import pandas as pd
import pytest
import torch

from maxout import loading
from maxout.train import checkpointing, resume
from maxout.errors import ConfigError, DataError, MaxoutError, Terminated
from maxout.tracking.tracker import NullTracker
from maxout.train import Callback, train

from .conftest import ROOT, runs_in

# 32 training rows, micro-batch 4 x accumulation 2: 4 steps per epoch, 8 steps in 2 epochs; a checkpoint every 3
# steps and at each epoch end: steps 3, 4 and 6 (mid-epoch: 4 of epoch 1's 8 micro-batches consumed).
STEPS = 8
SMALL = ["hardware=cpu", "model=tiny", "train.batch_size=4", "train.target_effective_batch=8", "train.epochs=2",
         "train.log_every=1",
         "train.deterministic=true", "checkpoint.every_n_steps=3", "tracking.system_metrics=false",
         "tracking.log_model=false"]


def small_data(directory) -> list[str]:
    """A slice of the demo data, so that a run crosses epochs in a few steps."""
    rows = pd.read_csv(ROOT / "projects/nli_demo/data/train.csv")
    rows.iloc[:32].to_csv(directory / "train.csv", index=False)
    rows.iloc[32:48].to_csv(directory / "validation.csv", index=False)
    return [f"data.train_path={directory / 'train.csv'}", f"data.validation_path={directory / 'validation.csv'}"]


def small(tmp_path, *extra: str) -> list[str]:
    return [*SMALL, *small_data(tmp_path), f"checkpoint.dir={tmp_path / 'ckpt'}", *extra]


class CrashAt(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, state):
        if state.step == self.step:
            raise RuntimeError(f"crash at step {state.step}")


def history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in mlflow.MlflowClient(uri).get_metric_history(run_id, key))


def test_a_run_resumed_after_a_crash_matches_an_uninterrupted_one(tmp_path, mlflow_store):
    reference = NullTracker()
    expected = train(loading.load(small(tmp_path, "tracking=none")), tracker=reference, progress=False, verbose=False)
    overrides = small(tmp_path, *mlflow_store["overrides"], f"tracking.spool_dir={tmp_path / 'spool'}")
    uri = mlflow_store["uri"]

    with pytest.raises(RuntimeError, match="crash at step 7"):
        train(loading.load(overrides), callbacks=[CrashAt(7)], progress=False, verbose=False)
    [crashed] = runs_in(uri)
    assert crashed.info.status == "FAILED"
    key = resume.run_key(loading.load(overrides))
    kept = [p.name for p in checkpointing.checkpoints(tmp_path / "ckpt" / key / crashed.info.run_id)]
    assert kept == ["step-00000004.pt", "step-00000006.pt"]  # keep_last=2 of 3, 4 and 6

    result = train(loading.load([*overrides, "resume=auto"]), progress=False, verbose=False)

    [run] = runs_in(uri)
    assert run.info.run_id == crashed.info.run_id == result.run_id and run.info.status == "FINISHED"
    assert run.data.tags["maxout.resumed_from_step"] == "6" and run.data.tags["maxout.run_key"] == key
    losses = history(uri, run.info.run_id, "train/loss")
    assert [step for step, _ in losses] == list(range(1, STEPS + 1))  # no gap, no repeat
    assert [v for _, v in losses] == pytest.approx([v for _, v in reference.metrics["train/loss"]], abs=1e-6)
    # One evaluation per epoch (when the selected model is step 4's, its values come again at the last step).
    assert sorted({s for s, _ in history(uri, run.info.run_id, "eval/accuracy")}) == [4, 8]
    assert run.data.metrics["best/step"] == reference.last("best/step")
    final, uninterrupted = result.setup.model.state_dict(), expected.setup.model.state_dict()
    assert all(torch.allclose(final[k], uninterrupted[k], atol=1e-6) for k in uninterrupted)
    assert not (tmp_path / "ckpt" / key).exists()  # a finished run keeps no checkpoints
    artifacts = {a.path for a in mlflow.MlflowClient(uri).list_artifacts(run.info.run_id)}
    assert "config.yaml" in artifacts and "checkpoints" not in artifacts  # uploaded only when configured


def test_resume_refuses_a_checkpoint_whose_data_changed(tmp_path):
    overrides = small(tmp_path, "tracking=none")
    with pytest.raises(RuntimeError):
        train(loading.load(overrides), callbacks=[CrashAt(4)], progress=False, verbose=False)
    rows = pd.read_csv(tmp_path / "train.csv")
    rows.loc[0, "post"] = "edited after the checkpoint"
    rows.to_csv(tmp_path / "train.csv", index=False)
    with pytest.raises(DataError, match="the data changed since checkpoint"):
        train(loading.load([*overrides, "resume=auto"]), progress=False, verbose=False)


def test_resume_refuses_a_checkpoint_of_another_micro_batch_before_reopening_the_run(tmp_path, mlflow_store,
                                                                                      monkeypatch):
    """batch_size=auto can choose another micro-batch on another device: the resume fails before the run is
    reopened, so the interrupted run is left exactly as it was."""
    from maxout.train import run as run_mod

    overrides = [*small(tmp_path, *mlflow_store["overrides"]), "tracking.system_metrics=false"]
    with pytest.raises(RuntimeError):
        train(loading.load(overrides), callbacks=[CrashAt(4)], progress=False, verbose=False)
    (before,) = runs_in(mlflow_store["uri"])
    monkeypatch.setattr(run_mod.batch_finder, "resolve", lambda *args, **kwargs: (3, {}))  # the finder's choice
    with pytest.raises(MaxoutError, match=r"was saved with micro-batch \d+ x \d+ accumulation steps, this run "
                                          r"would have 3 x \d+ \(the batch finder's choice here\)"):
        train(loading.load([*overrides, "resume=auto"]), progress=False, verbose=False)
    (after,) = runs_in(mlflow_store["uri"])
    assert after.info.run_id == before.info.run_id and after.info.status == before.info.status == "FAILED"
    assert after.data.tags == before.data.tags  # not reopened: no resumed_from_step, the crash's reason kept


def test_uploaded_checkpoints_and_resume_of_an_unknown_or_differently_configured_run(tmp_path, mlflow_store):
    overrides = small(tmp_path, *mlflow_store["overrides"], f"tracking.spool_dir={tmp_path / 'spool'}",
                      "checkpoint.log_to_mlflow=true")
    with pytest.raises(RuntimeError):
        train(loading.load(overrides), callbacks=[CrashAt(4)], progress=False, verbose=False)
    [run_dir] = (tmp_path / "ckpt").glob("*/*")
    uploaded = mlflow.MlflowClient(mlflow_store["uri"]).list_artifacts(run_dir.name, "checkpoints")
    assert [a.path for a in uploaded] == ["checkpoints/step-00000003.pt", "checkpoints/step-00000003.pt.sha256"]
    with pytest.raises(ConfigError, match="started with another config .* repeat its exact overrides"):
        resume.plan(loading.load([*overrides, "train.lr=1e-3", f"resume={run_dir.name}"]))
    with pytest.raises(ConfigError, match="no checkpoint of that run"):
        resume.plan(loading.load([*overrides, f"resume={'0' * 32}"]))
    assert resume.plan(loading.load([*overrides, f"resume={run_dir.name}"])).checkpoint.name == "step-00000003.pt"


def test_a_crash_while_writing_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    good = checkpointing.save_atomic({"format": checkpointing.FORMAT, "w": torch.ones(3)},
                                     tmp_path / checkpointing.file_name(1))

    def torn(payload, f):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt  # killed mid-write

    monkeypatch.setattr(torch, "save", torn)
    with pytest.raises(KeyboardInterrupt):
        checkpointing.save_atomic({"format": checkpointing.FORMAT}, tmp_path / checkpointing.file_name(2))
    (tmp_path / ".step-00000003.pt.tmp-99").write_bytes(b"a temp file left by SIGKILL")
    assert checkpointing.latest(tmp_path) == good
    assert torch.equal(checkpointing.load(good)["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step-00000003.pt.tmp-99", "step-00000001.pt",
                                                          "step-00000001.pt.sha256"]


@pytest.mark.parametrize("stop", [KeyboardInterrupt, Terminated])
def test_a_signal_inside_torch_save_stops_the_run_with_its_own_exception(tmp_path, monkeypatch, stop):
    """Ctrl-C, SIGTERM or the audit's budget timer landing inside torch.save (in the middle of a record): torch's
    zip writer, closing on the way out, raised "unexpected pos ..." over the stop, and the run ended FAILED on a
    RuntimeError instead of KILLED (a full run failed test_audit's budget test on it). The stop comes through."""
    writes = []
    real = checkpointing._Hashing.write

    def interrupted(self, data):
        writes.append(len(data))
        if len(writes) == 3:  # inside the first tensor's record, as a signal lands
            raise stop()
        return real(self, data)

    monkeypatch.setattr(checkpointing._Hashing, "write", interrupted)
    with pytest.raises(stop):
        checkpointing.save_atomic({"format": checkpointing.FORMAT, "w": torch.zeros(10_000)},
                                  tmp_path / checkpointing.file_name(1))
    assert list(tmp_path.iterdir()) == []  # no checkpoint, no temporary file

    writes.clear()
    stop = ValueError  # an error, not a stop: torch's own RuntimeError over it is what the caller gets, as before
    with pytest.raises(RuntimeError, match="unexpected pos"):
        checkpointing.save_atomic({"format": checkpointing.FORMAT, "w": torch.zeros(10_000)},
                                  tmp_path / checkpointing.file_name(2))


def test_each_checkpoint_has_the_sha256_of_its_bytes_beside_it(tmp_path):
    """Hashed as torch.save writes it (no second read): the digest must be the file's, as sha256sum sees it."""
    payload = {"format": checkpointing.FORMAT, "w": torch.randn(300, 300), "nested": {"b": torch.arange(10)}}
    path = checkpointing.save_atomic(payload, tmp_path / checkpointing.file_name(5))
    sums = checkpointing.checksum_file(path)
    assert sums.read_text() == f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}\n"
    check = subprocess.run(["sha256sum", "-c", sums.name], cwd=tmp_path, capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.strip() == f"{path.name}: OK"
    assert torch.equal(checkpointing.load_verified(path)["w"], payload["w"])


def test_files_and_sharded_folders_are_listed_by_step_and_a_hidden_folder_never_counts(tmp_path):
    for name in ("step-00000010.pt", "step-00000004.dcp", ".step-00000012.dcp.tmp-0123abcd", "step-00000009.dcp"):
        (tmp_path / name).mkdir() if "dcp" in name else (tmp_path / name).write_bytes(b"x")
    assert [p.name for p in checkpointing.checkpoints(tmp_path)] == [
        "step-00000004.dcp", "step-00000009.dcp", "step-00000010.pt"]  # by step, not by name
    assert checkpointing.step_of(tmp_path / "step-00000009.dcp") == 9
    checkpointing.remove(tmp_path / "step-00000004.dcp")
    assert not (tmp_path / "step-00000004.dcp").exists()


@pytest.mark.parametrize("fsdp, sharded, async_save, says", [
    (True, True, False, "sharded: each rank's shard via torch.distributed.checkpoint (step-N.dcp/), synchronous"),
    (True, True, True, "sharded: each rank's shard via torch.distributed.checkpoint (step-N.dcp/), asynchronous"),
    (True, False, False, "one file on rank 0 (step-N.pt): checkpoint.sharded=false"),
    (False, True, True, "one file on rank 0 (step-N.pt): sharded checkpoints are FSDP's (DDP and one process hold "
                        "the whole state); checkpoint.async_save is off with it"),
])
def test_the_run_says_which_checkpoints_it_writes_and_why_a_setting_is_off(fsdp, sharded, async_save, says):
    assert resume.checkpoint_format(fsdp, sharded, async_save) == says


def test_checkpoint_saves_stay_out_of_the_training_window(tmp_path, monkeypatch):
    # A save that takes 1000 s on the clock the meters read: if any of it fell inside the training window, the
    # window would be over 1000 s. (The final checkpoint, after the last step, counted in perf/steady_* before:
    # ~2 s of a 5 s window for BERT-base on an H200.) No real sleep, so no dependence on this machine's speed.
    offset = [0.0]
    real_clock = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + offset[0])
    real_save = checkpointing.save_atomic

    def slow_save(payload, path):
        offset[0] += 1000.0
        return real_save(payload, path)

    monkeypatch.setattr(checkpointing, "save_atomic", slow_save)
    result = train(loading.load(small(tmp_path, "train.warmup_steps_excluded=2")), tracker=NullTracker(),
                   progress=False)
    m = result.metrics
    saves = len([3, 4, 6, 8])  # every 3 steps and at each epoch end (step 8 is the run's last)
    assert offset[0] == 1000.0 * saves
    assert m["time/train_window_s"] < 1000.0 and m["time/steady_window_s"] < 1000.0
    assert m["time/checkpoint_s"] >= 1000.0 * saves
    assert m["perf/steady_samples_per_s"] > 1.0  # 6 steps of 8 rows in well under 1000 s
    assert m["time/wall_s"] >= 1000.0 * saves  # the wall clock still sees them


def test_runs_sharing_a_checkpoint_folder_may_remove_it_or_fill_it_while_one_finishes(tmp_path, monkeypatch):
    """A train, an hpo and a second train started together on one checkpoint.dir (tests/test_faults.py): each finished
    run removes its empty folders, and another run may have removed one first, or just made a folder in it. Neither
    is an error; and a run making its folder again after a neighbour removed the empty parent gets it."""
    import errno
    from pathlib import Path

    from maxout.train.resume import remove_if_empty

    shared = tmp_path / "ckpt"
    real_rmdir = Path.rmdir

    def removed_first(self):  # the neighbour's rmdir lands between this one's look and its own rmdir
        real_rmdir(self)
        real_rmdir(self)

    shared.mkdir()
    monkeypatch.setattr(Path, "rmdir", removed_first)
    remove_if_empty(shared)  # FileNotFoundError from the second rmdir: not an error
    assert not shared.exists()

    def filled_first(self):  # the neighbour makes its run's folder in it just before the rmdir
        (self / "neighbour").mkdir()
        real_rmdir(self)

    shared.mkdir()
    monkeypatch.setattr(Path, "rmdir", filled_first)
    remove_if_empty(shared)  # ENOTEMPTY: the folder is the neighbour's now
    assert (shared / "neighbour").is_dir()

    def read_only(self):
        raise OSError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "rmdir", read_only)
    with pytest.raises(PermissionError):  # any other failure still says so
        remove_if_empty(shared)
    monkeypatch.setattr(Path, "rmdir", real_rmdir)

    real_mkdir, removals = Path.mkdir, []

    def parent_removed_once(self, *args, **kwargs):  # the first try loses its parent to a finishing neighbour
        if not removals:
            removals.append(self)
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(self.parent))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", parent_removed_once)
    saved = checkpointing.save_atomic({"step": 1}, tmp_path / "ckpt" / "key" / "run" / "step-1.pt")
    assert saved.is_file() and len(removals) == 1

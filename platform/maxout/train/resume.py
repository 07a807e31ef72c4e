"""``resume=auto`` or ``resume=<run id>``: which run a training command continues, and from which checkpoint.

Each run's checkpoints live in ``<checkpoint.dir>/<run key>/<run id>/``. The run key is a hash of the whole
config except ``resume``, so the same command gives the same key; it is also the run's ``maxout.run_key`` tag.

- ``resume=auto``: the run of this key whose latest checkpoint is the newest. A run that finishes removes its
  checkpoints, so only an interrupted run (killed, failed, pre-empted) is found; none found: a new run. Under
  ``mlflow run`` (MLFLOW_RUN_ID set) only that run is considered.
- ``resume=<run id>``: that run, which must have a checkpoint and the same config (key).

Either way the run continues from its newest intact checkpoint (checksum verified, checkpointing.load_verified):
a damaged newer one is skipped with a one-line warning; none intact is a one-line error naming each file.

The continued run keeps its MLflow run id; its params are identical (same config and data), and the steps
replayed after the checkpoint do not log again what the run already has (tracking/mlflow_run.MLflowTracker).

Under torchrun every rank plans (same command, same run key), then all take rank 0's choice (``agreed``): the run
to continue and the checkpoint file, which every rank reads itself (on several nodes ``checkpoint.dir`` must be
storage they share). A checkpoint resumes only with the number of processes that saved it (torch.distributed.checkpoint
could reshard FSDP's weights, but not each rank's data position and RNG states). An FSDP checkpoint is a folder
(sharded_checkpoint.py): its manifest is verified here, and every rank reads its own shards in ``Plan.restore``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from ..config import Config, to_dict
from ..errors import ConfigError, DataError, MaxoutError
from ..paths import checkpoint_dir, resolve_path
from ..tracking.tracker import Tracker, fail_if_running
from . import checkpointing, sharded_checkpoint
from .callbacks import Callback, TrainState
from .distributed import World
from .setup import Setup

log = logging.getLogger("maxout")


def run_key(cfg: Config) -> str:
    tree = to_dict(cfg)
    tree.pop("resume", None)
    return hashlib.sha256(json.dumps(tree, sort_keys=True, default=str).encode()).hexdigest()[:16]


def checkpoint_root(cfg: Config) -> Path:
    return resolve_path(cfg.checkpoint.dir) if cfg.checkpoint.dir else checkpoint_dir()


@dataclass
class Plan:
    """What ``train()`` continues: ``run_id`` None and ``checkpoint`` None for a new run."""

    cfg: Config
    run_key: str
    run_id: Optional[str] = None
    checkpoint: Optional[Path] = None
    payload: Optional[dict] = None  # the checkpoint, loaded (memory-mapped) by plan()'s compatibility check

    @property
    def root(self) -> Path:
        return checkpoint_root(self.cfg) / self.run_key

    def directory(self, run_id: Optional[str]) -> Path:
        """Where this run's checkpoints go (an untracked run gets a local id)."""
        self.run_id = self.run_id or run_id or uuid.uuid4().hex
        return self.root / self.run_id

    def check_batch(self, micro_batch: int, accum_steps: int, world_size: int = 1) -> None:
        """Before the run is reopened: the checkpoint's data position counts micro-batches of its own size, per
        process. Only train.batch_size=auto can differ (a configured batch is part of the run key): the finder chose
        another micro-batch on this device; and the number of processes the job was started with."""
        if self.payload is None:
            return
        saved_world = self.payload.get("world_size", 1)
        if saved_world != world_size:
            raise MaxoutError(f"checkpoint {self.checkpoint} was saved by {saved_world} process(es), this job has "
                              f"{world_size}: each process's data position and RNG state are in it; resume with "
                              f"{saved_world} process(es) in all (torchrun --nnodes x --nproc-per-node)")
        saved = (self.payload["micro_batch"], self.payload["accum_steps"])
        if saved != (micro_batch, accum_steps):
            raise MaxoutError(f"checkpoint {self.checkpoint} was saved with micro-batch {saved[0]} x {saved[1]} "
                              f"accumulation steps, this run would have {micro_batch} x {accum_steps} (the batch "
                              f"finder's choice here); resume it on the device it was saved on, or start a new run")

    def restore(self, setup: Setup) -> Optional[TrainState]:
        """The TrainState to continue from (model, optimizer, RNG restored into ``setup``), or None."""
        if self.checkpoint is None:
            return None
        if self.payload.get("dcp"):  # every rank reads its own shards (a collective)
            sharded_checkpoint.restore(setup, self.payload)
        return checkpointing.restore(setup, self.payload)

    def checkpointer(self, setup: Setup, tracker: Tracker,
                     extras: Optional[dict[str, Callable[[TrainState], Any]]] = None) -> list[Callback]:
        """The Checkpointer callback (none with checkpoint.enabled=false); ``extras`` as in checkpointing.capture."""
        if not self.cfg.checkpoint.enabled:
            return []
        directory = self.directory(tracker.run_id)
        meta = {"run_id": self.run_id, "run_key": self.run_key, "data_fingerprint": setup.dataset.fingerprint,
                "micro_batch": setup.micro_batch, "accum_steps": setup.accum_steps, "world_size": setup.world.size}
        cc, writer = self.cfg.checkpoint, None
        fsdp = setup.decision("data_parallel").effective == "fsdp"
        if fsdp and cc.sharded:
            def writer(saver: checkpointing.Checkpointer) -> sharded_checkpoint.ShardedWriter:
                return sharded_checkpoint.ShardedWriter(setup, directory, cc.async_save,
                                                        self.cfg.distributed.timeout_s, saver.kept)
        tracker.set_tags({"maxout.checkpoint_format": checkpoint_format(fsdp, cc.sharded, cc.async_save)})
        return [checkpointing.Checkpointer(setup, tracker, cc, directory, meta, extras, writer)]

    def model_not_stored(self, err: MaxoutError, total_steps: int) -> MaxoutError:
        """``err`` (the model upload failed after training) plus where the trained weights are, and how to finish
        the same run: its final checkpoint stays (finished() is not called), and resume=auto, with no step left to
        train, logs the model and ends the run."""
        last = checkpointing.latest(self.root / self.run_id) if self.run_id and self.cfg.checkpoint.enabled else None
        if last is None:
            return MaxoutError(f"{err}; no checkpoint keeps the trained weights (checkpoint.enabled=false or none "
                               f"could be written)")
        step = checkpointing.step_of(last)
        where = (f"the trained weights are safe in the final checkpoint {last}" if step >= total_steps else
                 f"the newest checkpoint is {last} (step {step} of {total_steps}; the final one could not be written)")
        return MaxoutError(f"{err}; {where}: when the server is back, run the same command with resume=auto, which "
                           f"{'logs' if step >= total_steps else 'trains the rest, logs'} the model and finishes run "
                           f"{self.run_id}")

    def finished(self) -> None:
        """The run completed: its checkpoints have nothing left to resume."""
        if self.run_id:
            shutil.rmtree(self.root / self.run_id, ignore_errors=True)
            for directory in (self.root, self.root.parent):  # no empty folders left behind
                remove_if_empty(directory)


def remove_if_empty(directory: Path) -> None:
    """Remove ``directory`` if it is empty. Other runs share it (runs started together, HPO trials, a Slurm array):
    one may have removed it first, or just created a folder in it; either way it is theirs now, not an error. A
    train, an hpo and a second train command finishing together on one checkpoint.dir failed the hpo on the first
    case (FileNotFoundError, fresh-clone suite, 2026-11-27)."""
    try:
        directory.rmdir()
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as err:
        if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):  # EEXIST: what some filesystems say for "not empty"
            raise


def checkpoint_format(fsdp: bool, sharded: bool, async_save: bool) -> str:
    """The run's ``maxout.checkpoint_format`` tag: what is written, and why a setting that does not apply is off."""
    if fsdp and sharded:
        return ("sharded: each rank's shard via torch.distributed.checkpoint (step-N.dcp/), "
                + ("asynchronous" if async_save else "synchronous"))
    why = ("checkpoint.sharded=false" if fsdp else
           "sharded checkpoints are FSDP's (DDP and one process hold the whole state)")
    return f"one file on rank 0 (step-N.pt): {why}" + ("; checkpoint.async_save is off with it" if async_save else "")


def load_verified(path: Path) -> dict:
    """A checkpoint's payload after its checksums: a sharded folder's small part, or a file's whole payload."""
    return sharded_checkpoint.load_verified(path) if sharded_checkpoint.is_sharded(path) else \
        checkpointing.load_verified(path)


def plan(cfg: Config, dataset: Any = None) -> Plan:
    """Find the checkpoint ``cfg.resume`` asks for; ConfigError when a named run cannot be continued."""
    key = run_key(cfg)
    fresh = Plan(cfg, key)
    if cfg.resume is None or not cfg.checkpoint.enabled:
        if cfg.resume not in (None, "auto"):
            raise ConfigError(f"resume={cfg.resume} needs checkpoints, but checkpoint.enabled=false")
        return fresh
    root = fresh.root
    if cfg.resume == "auto":
        wanted = os.environ.get("MLFLOW_RUN_ID")
        candidates = [root / wanted] if wanted else ([d for d in root.iterdir() if d.is_dir()] if root.is_dir() else [])
        found = [(path, d.name) for d in candidates if (path := checkpointing.latest(d)) is not None]
        if not found:
            return fresh
        _, run_id = max(found, key=lambda item: item[0].stat().st_mtime)
    else:
        run_id = cfg.resume
        if checkpointing.latest(root / run_id) is None:
            raise ConfigError(_not_found(cfg, key))
    path, payload = newest_intact(cfg, run_id, root / run_id)
    return Plan(cfg, key, run_id, path, _check_compatible(path, payload, key, dataset))


def newest_intact(cfg: Config, run_id: str, directory: Path) -> tuple[Path, dict]:
    """The newest checkpoint of ``run_id`` whose checksum matches and that loads (keep_last > 1 is for this), and
    its payload. Skipping a damaged one is said in one line. None intact: the run cannot be continued, so it is
    ended FAILED if its process was killed (it would stay RUNNING), and the error names every file and why."""
    damaged: list[str] = []
    for path in reversed(checkpointing.checkpoints(directory)):
        try:
            payload = load_verified(path)
        except checkpointing.Damaged as err:
            damaged.append(f"{path.name} ({err})")
            continue
        if damaged:
            log.warning("maxout: damaged checkpoint%s %s in %s; resuming from %s, the newest intact one",
                        "s" if len(damaged) > 1 else "", ", ".join(damaged), directory, path.name)
        return path, payload
    message = (f"no intact checkpoint of run {run_id} in {directory}: {', '.join(damaged)}; restore them from a "
               f"copy, or start a new run without resume")
    fail_if_running(cfg.tracking, run_id, message)
    raise MaxoutError(message)


def agreed(world: World, plan: Plan, dataset: Any = None) -> Plan:
    """Rank 0's plan, on every rank: each rank looked at its own disk, but all must continue the same run from the
    same checkpoint (a new run's id comes later, from rank 0's tracker)."""
    if not world.initialized:
        return plan
    mine = (plan.run_id, str(plan.checkpoint) if plan.checkpoint else None)
    run_id, path = world.broadcast(mine)
    if (run_id, path) == mine:
        return plan
    if path is None:
        return Plan(plan.cfg, plan.run_key, run_id)
    if not Path(path).exists():
        raise MaxoutError(f"rank {world.rank} cannot read checkpoint {path}, which rank 0 resumes from: put "
                          f"checkpoint.dir on storage that every node shares")
    try:
        payload = load_verified(Path(path))
    except checkpointing.Damaged as err:
        raise MaxoutError(f"rank {world.rank} cannot read checkpoint {path}, which rank 0 resumes from ({err}): "
                          f"put checkpoint.dir on storage that every node shares") from None
    return Plan(plan.cfg, plan.run_key, run_id, Path(path), _check_compatible(Path(path), payload, plan.run_key,
                                                                               dataset))


def _not_found(cfg: Config, key: str) -> str:
    elsewhere = [d.parent.name for d in checkpoint_root(cfg).glob(f"*/{cfg.resume}") if d.is_dir()]
    if elsewhere:
        return (f"resume={cfg.resume}: that run was started with another config (run key {elsewhere[0]}, this "
                f"command gives {key}); repeat its exact overrides (its config.yaml artifact lists them)")
    return (f"resume={cfg.resume}: no checkpoint of that run under {checkpoint_root(cfg)}; use resume=auto, "
            f"or the id of an interrupted run (a finished run keeps no checkpoints)")


def _check_compatible(path: Path, payload: dict, key: str, dataset: Any) -> dict:
    """The checkpoint's payload, if it belongs to this run key and data."""
    if payload.get("run_key") != key:
        raise ConfigError(f"checkpoint {path} belongs to run key {payload.get('run_key')}, not {key}; "
                          f"resume it with the config it was started with")
    if dataset is not None and payload.get("data_fingerprint") != dataset.fingerprint:
        raise DataError(f"the data changed since checkpoint {path} was saved (fingerprint "
                        f"{payload.get('data_fingerprint')} -> {dataset.fingerprint}); restore the original files "
                        f"or start a new run without resume")
    return payload

"""Training checkpoints: everything needed to continue a run exactly where it stopped.

A checkpoint holds the model, optimizer, scheduler and GradScaler states, every RNG (python, numpy, torch, CUDA),
the data-loader position (epoch and micro-batches consumed in it: the sampler's order is a pure function of
(seed, epoch), so the position is enough), the loop's counters, and what the run measured so far (throughput
counters, wall and compile seconds, peak memory: totals.py, so a resumed run's figures go on from them). The
Checkpointer callback saves one every ``checkpoint.every_n_steps`` steps and at each epoch end, after that step's
metrics are journaled, and keeps the last ``keep_last``. Writes are atomic (temp file in the same directory, fsync,
rename): a kill at any moment leaves the previous checkpoint intact.

Each checkpoint has its SHA-256 beside it (``step-NNNNNNNN.pt.sha256``, the format ``sha256sum -c`` reads), computed
while it is written and renamed into place before it: resume verifies it (``load_verified``), so a truncated or
damaged file (a bad disk, a partial copy) is found instead of loaded. A checkpoint that cannot be written (a full
or read-only disk) is a warning: training goes on, and the checkpoints already written are kept.

Several processes (data parallel): saving is a collective, so every rank runs the Checkpointer; rank 0 alone writes.
The checkpoint holds every rank's RNG states (``rng_ranks``; each rank's dropout differs) and measured counters
(``measured_ranks``: the samples and tokens each rank trained, so the job's summed totals stay exact after a resume),
and with FSDP's ``checkpoint.sharded=false`` the full model and optimizer state gathered from the shards, so the file
is the same as without FSDP. Every rank restores from the checkpoint rank 0 chose, each with its own RNG states and
counters; the data position is per rank (each rank's share of the epoch is a pure function of seed, epoch and rank).

FSDP (``checkpoint.sharded=true``, the default): no gather; each rank writes its shard with
torch.distributed.checkpoint into a folder ``step-NNNNNNNN.dcp/`` with a manifest of checksums, committed by an
atomic rename (sharded_checkpoint.py, which the Checkpointer is handed as its ``writer``). Both kinds are listed,
kept and removed here alike; DDP and one process always write the one file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional, Protocol

import numpy as np
import torch

from ..config import CheckpointConfig
from ..errors import first_line
from ..optimizations import data_parallel
from ..tracking.tracker import Tracker
from .callbacks import Callback, TrainState
from .setup import Setup

log = logging.getLogger("maxout")
FORMAT = 1
NAME = re.compile(r"^step-(\d{8})\.(pt|dcp)$")  # a file, or a sharded checkpoint's folder (sharded_checkpoint.py)


def file_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints in ``directory``, oldest first (temp files and hidden folders of an interrupted write
    are ignored)."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if NAME.match(p.name)), key=lambda p: int(NAME.match(p.name)[1]))


def step_of(path: Path) -> int:
    return int(NAME.match(path.name)[1])


def latest(directory: Path) -> Optional[Path]:
    found = checkpoints(directory)
    return found[-1] if found else None


def checksum_file(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


class Damaged(Exception):
    """A checkpoint that must not be resumed from: its checksum does not match, or it does not load."""


class _Hashing:
    """The file a checkpoint is written to, hashing the bytes on their way (no second read of a large file).
    torch.save writes a file object strictly in order (tests/test_checkpointing.py checks the digest)."""

    def __init__(self, f: BinaryIO):
        self.f, self.sha256, self.error = f, hashlib.sha256(), None

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        try:
            return self.f.write(data)
        except OSError as err:  # torch turns it into a RuntimeError; save_atomic raises this one instead
            self.error = err
            raise

    def flush(self) -> None:
        self.f.flush()


def make_folder(directory: Path, tries: int = 5) -> None:
    """``directory`` and its parents, made again where another run removed an empty parent in between (a finished
    run removes its empty checkpoint folders, and runs share them: resume.remove_if_empty)."""
    for attempt in range(tries):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            return
        except FileNotFoundError:
            if attempt == tries - 1:
                raise


def save_atomic(payload: dict, path: Path) -> Path:
    make_folder(path.parent)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            hashing = _Hashing(f)
            try:
                torch.save(payload, hashing)
            except RuntimeError as err:
                if hashing.error is not None:  # a full or read-only disk: say that, not torch's wrapper
                    raise hashing.error from None
                stop = err.__context__
                if stop is not None and not isinstance(stop, Exception):
                    # A stop that a signal raised inside torch.save (Ctrl-C, SIGTERM, the audit's budget timer):
                    # torch's zip writer, closing on the way out, raised its own error over it ("unexpected pos"),
                    # and the run would end FAILED on that instead of KILLED on the stop.
                    raise stop from None
                raise
            f.flush()
            os.fsync(f.fileno())
        # The checksum goes into place first: a checkpoint never exists without it (a crash in between leaves a
        # checksum without a checkpoint, which nothing reads).
        write_small(checksum_file(path), f"{hashing.sha256.hexdigest()}  {path.name}\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_directory(path.parent)  # the renames themselves survive a power cut
    return path


def fsync_directory(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_small(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="ascii") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
        return
    path.unlink(missing_ok=True)
    checksum_file(path).unlink(missing_ok=True)


def load(path: Path) -> dict:
    """A checkpoint's payload, tensors on the CPU. weights_only: a checkpoint is data, never code."""
    payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if payload.get("format") != FORMAT:
        raise ValueError(f"{path} is not a maxout checkpoint of format {FORMAT}")
    return payload


def load_verified(path: Path) -> dict:
    """``load(path)`` after checking the SHA-256 written with it; Damaged (with the reason) when either fails.
    A checkpoint written before checksums existed is only loaded."""
    sums = checksum_file(path)
    if sums.exists():
        expected = (sums.read_text(encoding="ascii", errors="replace").split() or [""])[0]
        actual = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                actual.update(chunk)
        if actual.hexdigest() != expected:
            raise Damaged(f"checksum mismatch, {path.stat().st_size} bytes: truncated or damaged")
    try:
        return load(path)
    except Exception as err:  # noqa: BLE001 - torch's zip reader, unpickling, a wrong format: all mean unusable
        raise Damaged(f"unreadable: {first_line(err)[:200]}") from None


def rng_states() -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    states = {"python": random.getstate(), "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
              "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    random.setstate(_tuples(states["python"]))
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _tuples(value: Any) -> Any:
    """random.setstate wants the nested tuples it gave out (a round trip may turn them into lists)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def capture(setup: Setup, state: TrainState, position: tuple[int, int], meta: dict,
            extras: Optional[dict[str, Callable[[TrainState], Any]]] = None, weights: bool = True) -> dict:
    """The payload for ``state`` after its step; ``position`` = (epoch, micro-batches consumed in it). ``extras``
    adds what other callbacks need back on resume (model selection: the best so far), each under its key.
    ``weights=False``: without the model and optimizer state (a sharded checkpoint writes those shard by shard)."""
    counters = {"step": state.step, "epoch": position[0], "batches_in_epoch": position[1],
                "train_loss": state.train_loss, "loss_sum": float(state.loss_sum), "loss_steps": state.loss_steps,
                "eval_metrics": dict(state.eval_metrics), "first_step_s": state.first_step_s,
                "measured": state.totals.so_far() if state.totals is not None else dict(state.measured)}
    payload = {"format": FORMAT, **meta, "state": counters, "scheduler": setup.scheduler.state_dict(),
               "scaler": setup.precision.scaler.state_dict(), "rng": rng_states(),
               **{key: get(state) for key, get in (extras or {}).items()}}
    if setup.world.size > 1:  # each rank's own: its dropout RNG, and the samples and tokens it trained so far
        ranks = setup.world.gather({"rng": payload["rng"], "measured": counters["measured"]})
        payload["rng_ranks"] = [r["rng"] for r in ranks]
        payload["measured_ranks"] = [r["measured"] for r in ranks]
    if weights:  # FSDP: gathered on rank 0
        payload["model"], payload["optimizer"] = data_parallel.state_dicts(setup.model, setup.optimizer,
                                                                           _strategy(setup))
    return payload


def restore(setup: Setup, payload: dict) -> TrainState:
    """Load a payload into a freshly built Setup; returns the TrainState that fit() continues from. A sharded
    checkpoint's model and optimizer were loaded already (sharded_checkpoint.restore)."""
    if not payload.get("dcp"):
        data_parallel.load_state_dicts(setup.model, setup.optimizer, payload["model"], payload["optimizer"],
                                       _strategy(setup))
    setup.scheduler.load_state_dict(payload["scheduler"])
    if payload["scaler"]:
        setup.precision.scaler.load_state_dict(payload["scaler"])
    rank = setup.world.rank
    set_rng_states(payload["rng_ranks"][rank] if "rng_ranks" in payload else payload["rng"])
    counters = dict(payload["state"])
    if "measured_ranks" in payload:  # rank 0's counters on every rank would count its share N times
        counters["measured"] = payload["measured_ranks"][rank]
    return TrainState(total_steps=setup.total_steps, **counters)


def _strategy(setup: Setup) -> str:
    return setup.decision("data_parallel").effective


class ShardWriter(Protocol):
    """Writes a checkpoint shard by shard (sharded_checkpoint.ShardedWriter); calls back with each committed one."""

    def save(self, step: int, payload: dict) -> None: ...

    def poll(self) -> None: ...

    def wait(self) -> None: ...


class Checkpointer(Callback):
    """Saves into ``directory`` every N steps and at each epoch end; keeps the last ``keep_last``. With a
    ``writer`` (FSDP, checkpoint.sharded) every rank writes its shard through it, else rank 0 writes one file."""

    def __init__(self, setup: Setup, tracker: Tracker, cfg: CheckpointConfig, directory: Path, meta: dict,
                 extras: Optional[dict[str, Callable[[TrainState], Any]]] = None,
                 writer: Optional[Callable[["Checkpointer"], ShardWriter]] = None):
        self.setup, self.tracker, self.cfg, self.directory, self.meta = setup, tracker, cfg, directory, meta
        self.extras = extras or {}
        self.writer = writer(self) if writer else None

    def on_step_end(self, state: TrainState) -> None:
        if self.writer:
            self.writer.poll()  # an asynchronous checkpoint counts as soon as all of it is written
        every = self.cfg.every_n_steps
        # The last step of an epoch (or of the run) is saved by on_epoch_end, right after its evaluation.
        # len() of the loader is this epoch's count (a token budget packs a different count each epoch).
        ends_epoch = state.batches_in_epoch >= len(self.setup.train_loader) or state.step >= state.total_steps
        if every and state.step % every == 0 and not ends_epoch:
            self.save(state, (state.epoch, state.batches_in_epoch))

    def on_epoch_end(self, state: TrainState) -> None:
        self.save(state, (state.epoch + 1, 0))  # resumes at the start of the next epoch

    def on_train_end(self, state: TrainState) -> None:
        if self.writer:
            self.writer.wait()  # a run never ends with a checkpoint half written

    def save(self, state: TrainState, position: tuple[int, int]) -> Optional[Path]:
        """Write the checkpoint of ``state``; None (and a warning) when the disk refuses it. Every rank calls this
        (gathering FSDP's shards and the ranks' RNG states is a collective); rank 0 writes, or with a writer every
        rank writes its shard (and the path comes later, to ``kept``)."""
        self.setup.divergence.check(self.setup, self.tracker)  # never a diverged state to resume from
        if state.totals is None:
            return self._save(state, position)
        with state.totals.outside_window("checkpoint"):  # saving is not training: time/checkpoint_s counts it
            return self._save(state, position)

    def _save(self, state: TrainState, position: tuple[int, int]) -> Optional[Path]:
        self.tracker.flush()  # the metrics up to this step are journaled before a checkpoint supersedes them
        payload = capture(self.setup, state, position, self.meta, self.extras, weights=self.writer is None)
        if self.writer:
            self.writer.save(state.step, payload)
            return None
        if not self.setup.world.is_main:
            return None
        path = self.directory / file_name(state.step)
        try:
            save_atomic(payload, path)
        except OSError as err:  # a full or read-only disk: the run is worth more than this one checkpoint
            log.warning("maxout: checkpoint %s not written to %s (%s); training goes on and the checkpoints "
                        "already there are kept: free space there or fix its permissions, or set checkpoint.dir",
                        path.name, self.directory, err.strerror or err)
            return None
        self.kept(path)
        return path

    def kept(self, path: Path) -> None:
        """Rank 0, once checkpoint ``path`` is complete: keep the last ``keep_last``, upload it if asked."""
        for old in checkpoints(self.directory)[:-self.cfg.keep_last]:
            remove(old)
        if self.cfg.log_to_mlflow:
            files = ([(p, f"checkpoints/{path.name}") for p in sorted(path.iterdir())] if path.is_dir() else
                     [(path, "checkpoints"), (checksum_file(path), "checkpoints")])
            try:
                for written, where in files:
                    self.tracker.log_artifact(str(written), where)
            except Exception as err:  # noqa: BLE001 - an upload failure must not stop training
                log.warning("maxout: checkpoint %s not uploaded to the run (%s); it is kept locally", path.name, err)

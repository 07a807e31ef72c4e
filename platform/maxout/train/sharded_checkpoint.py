"""FSDP checkpoints written shard by shard with ``torch.distributed.checkpoint`` (DCP): no rank gathers the state.

Without this, an FSDP checkpoint gathered the whole model and optimizer state (about 12 bytes a parameter with
AdamW) onto rank 0's CPU, and one thread wrote it. Here every rank writes its own shard of the model, the optimizer
state and the best weights so far (``dcp.save``, or ``dcp.async_save`` with ``checkpoint.async_save=true``), in
parallel. One checkpoint is a folder, ``step-NNNNNNNN.dcp/``:

    __<r>_0.distcp     rank r's shard (DCP's file)
    .metadata          DCP's index of every shard (written by rank 0 once every rank has written)
    state.pt           the rest, small (rank 0): counters, every rank's RNG states and measured figures, the
                       scheduler and GradScaler, the selection record (checkpointing.capture without the tensors)
    __<r>.sha256       rank r's checksums of the files it wrote, once its write is complete
    MANIFEST.sha256    every file's SHA-256 (``sha256sum -c MANIFEST.sha256`` checks the folder)

The commit, as atomic as a single file's: everything is written into a hidden folder
``.step-NNNNNNNN.dcp.tmp-<job>``; when DCP's metadata, ``state.pt`` and every rank's checksum file are there, rank
0 writes the manifest (fsync) and renames the folder to ``step-NNNNNNNN.dcp`` (fsync of the parent). Only a folder
of that name is a checkpoint, and it is valid only when every file of its manifest is there with its checksum
(``load_verified``): a kill at any moment leaves the previous checkpoint the newest, and a damaged shard is found
before anything loads. Hidden folders of an earlier job are removed by the next job's first checkpoint.

Asynchronous: ``dcp.async_save`` first copies the rank's shard into host memory (DCP's stager: training may change
the weights right after), then writes it in a thread of its own, on a gloo process group of its own so that its
collectives never interleave with FSDP's on the training thread (as torchtitan does). Each rank's checksum file is
written when its own write has finished; rank 0 commits at the first step end that finds them all, and before the
next save and at the end of training every rank waits for its write. A write still running when the job dies never
counts: the previous checkpoint stays the newest.

Resume reads the shards back into a freshly sharded model and optimizer (``dcp.load``, then ``set_state_dict``).
DCP could reshard them onto another number of processes, but a checkpoint also holds each rank's data position and
RNG states, so resume.py keeps its rule: the same number of processes. The logged model is still the full state
(sharded.py gathers it once, at the end).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from ..errors import first_line
from ..optimizations import data_parallel
from .checkpointing import FORMAT, Damaged, file_name, fsync_directory, make_folder, write_small
from .setup import Setup

log = logging.getLogger("maxout")
SUFFIX = ".dcp"
STATE = "state.pt"
MANIFEST = "MANIFEST.sha256"
BEST = ("selection", "weights")  # the extra whose tensors (the best weights so far, sharded too) go to the shards


def folder_name(step: int) -> str:
    return file_name(step).replace(".pt", SUFFIX)


def _own_files(folder: Path, rank: int) -> list[Path]:
    """The files rank ``rank`` wrote: its DCP shard(s), and on rank 0 DCP's metadata and state.pt."""
    own = sorted(folder.glob(f"__{rank}_*.distcp"))
    return own + ([folder / ".metadata", folder / STATE] if rank == 0 else [])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _checksum_lines(files: list[Path]) -> str:
    return "".join(f"{_sha256(p)}  {p.name}\n" for p in files)


@dataclass
class _Pending:
    """A checkpoint being written: its step, its hidden folder, and (async) this rank's write."""

    step: int
    folder: Path
    future: Optional[Future] = None
    error: Optional[str] = None  # why this rank's part failed (then the checkpoint never counts)
    done: threading.Event = field(default_factory=threading.Event)  # this rank's part and its checksums are in


class ShardedWriter:
    """Writes ``step-N.dcp`` checkpoints for checkpointing.Checkpointer under FSDP. Built on every rank at the same
    point (its constructor is a collective: the job's folder suffix, and the async writes' process group)."""

    def __init__(self, setup: Setup, directory: Path, async_save: bool, timeout_s: float,
                 committed: Callable[[Path], None]):
        self.setup, self.world, self.directory = setup, setup.world, directory
        self.async_save, self.timeout_s, self.committed = async_save, timeout_s, committed
        self.job = self.world.broadcast(uuid.uuid4().hex[:12])  # one hidden-folder suffix for the whole job
        # The async writes' collectives (DCP's plan and metadata exchange) get a group of their own: two threads
        # must never issue collectives on one group (gloo pairs them up by order).
        self.group = dist.new_group(backend="gloo") if async_save and self.world.initialized else None
        self.pending: Optional[_Pending] = None
        self._cleaned = False

    # -- saving
    def save(self, step: int, payload: dict) -> None:
        """Write checkpoint ``step``: checkpointing.capture's ``payload`` (without weights) to rank 0's state.pt, and
        each rank's shards of the model, the optimizer and the best weights through DCP. Every rank calls this. A
        disk that refuses the write is a warning (the previous checkpoints stay); training goes on."""
        self.wait()  # one write at a time: the previous one finishes (and counts) first
        small, best = split(payload)
        model_state, optimizer_state = data_parallel.sharded_state_dicts(self.setup.model, self.setup.optimizer)
        shards = {"model": model_state, "optimizer": optimizer_state, **best}
        if self.world.is_main and not self._cleaned:
            self._remove_stale()
        folder = self.directory / f".{folder_name(step)}.tmp-{self.job}"
        pending = self.pending = _Pending(step, folder)
        if self.world.is_main:
            try:  # first, so that it is in before this rank's checksums are taken (async: in the writer thread)
                make_folder(folder)
                with open(folder / STATE, "wb") as f:
                    torch.save({"format": FORMAT, "dcp": True, **small}, f)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as err:  # rank 0 still takes part in DCP's collectives below; the commit is off
                pending.error = _reason(err)
        writer = FileSystemWriter(folder, single_file_per_rank=True, sync_files=True)  # DCP makes the folder
        try:  # a failure on any rank reaches every rank (DCP's CheckpointException), so all take the same path
            if self.async_save:
                future = dcp.async_save(shards, storage_writer=writer, process_group=self.group)
                pending.future = future.upload_completion if isinstance(future, AsyncSaveResponse) else future
            else:
                dcp.save(shards, storage_writer=writer)
        except (OSError, CheckpointException) as err:
            pending.error = pending.error or _reason(err)
        if self.async_save:  # committed later, by poll() or wait(); no collective here
            if pending.future is not None:
                pending.future.add_done_callback(lambda done: self._written(pending, done))
            else:
                self._written(pending, None)
            return
        self._written(pending, None)
        errors = self.world.gather(pending.error)  # every rank's part is written (or failed): rank 0 commits
        if self.world.is_main:  # DCP's failures reach every rank alike: each distinct reason once
            self._finish(pending, "; ".join(dict.fromkeys(e for e in errors if e)) or None)
        self.pending = None

    def _written(self, pending: _Pending, done: Optional[Future]) -> None:
        """This rank's write finished (in the writer thread when async): its checksums go beside its files."""
        try:
            if done is not None and done.exception() is not None:
                pending.error = pending.error or _reason(done.exception())
            if pending.error is None:
                write_small(pending.folder / f"__{self.world.rank}.sha256",
                            _checksum_lines(_own_files(pending.folder, self.world.rank)))
        except OSError as err:
            pending.error = _reason(err)
        finally:
            pending.done.set()

    # -- committing (rank 0)
    def poll(self) -> None:
        """At a step end: commit an async checkpoint whose files are all in (rank 0; a few stat calls, no wait)."""
        pending = self.pending
        if pending is None or not pending.done.is_set():
            return
        if not self.world.is_main:
            self.pending = None  # this rank's part is done; committing is rank 0's
        elif pending.error is not None or self._all_in(pending):
            self._finish(pending, pending.error)

    def wait(self) -> None:
        """Every rank: wait for this rank's write; rank 0 then commits it (waiting up to half the job's collective
        timeout for the other ranks' checksums). Before each save and at the end of training."""
        pending = self.pending
        if pending is None:
            return
        pending.done.wait()  # this rank's write and checksums (the future's callback sets it, failed or not)
        if not self.world.is_main:
            self.pending = None
            return
        # The other ranks' checksums follow their own writes closely; half the collective timeout keeps the ranks
        # waiting for rank 0 at the next collective inside theirs.
        deadline = time.monotonic() + self.timeout_s / 2
        while pending.error is None and not self._all_in(pending) and time.monotonic() < deadline:
            time.sleep(0.05)
        missing = None if self._all_in(pending) else "a rank's checksums did not arrive"
        self._finish(pending, pending.error or missing)

    def _all_in(self, pending: _Pending) -> bool:
        return all((pending.folder / f"__{r}.sha256").exists() for r in range(self.world.size))

    def _finish(self, pending: _Pending, error: Optional[str]) -> None:
        self.pending = None
        if error is None:
            try:
                final = self._commit(pending)
            except OSError as err:
                error = _reason(err)
            else:
                self.committed(final)
                return
        error = _full_disk(self.directory, error)  # before the partial files go (they fill the disk)
        shutil.rmtree(pending.folder, ignore_errors=True)
        log.warning("maxout: checkpoint %s not written to %s (%s); training goes on and the checkpoints already "
                    "there are kept: free space there or fix its permissions, or set checkpoint.dir",
                    folder_name(pending.step), self.directory, error)

    def _commit(self, pending: _Pending) -> Path:
        folder = pending.folder
        lines = "".join((folder / f"__{r}.sha256").read_text(encoding="ascii") for r in range(self.world.size))
        lines += _checksum_lines([folder / f"__{r}.sha256" for r in range(self.world.size)])
        write_small(folder / MANIFEST, lines)
        fsync_directory(folder)  # the files' entries are durable before the folder is renamed into place
        final = self.directory / folder_name(pending.step)
        if final.exists():  # the same step saved again (a resumed run): the new one replaces it
            aside = final.with_name(f".{final.name}.old-{self.job}")
            os.replace(final, aside)
            shutil.rmtree(aside, ignore_errors=True)
        os.replace(folder, final)
        fsync_directory(self.directory)
        return final

    def _remove_stale(self) -> None:
        """Hidden folders an earlier job left (killed mid-save): never a checkpoint, so never read; removed."""
        self._cleaned = True
        for stale in self.directory.glob(f".step-*{SUFFIX}.*"):
            if not stale.name.endswith(self.job):
                shutil.rmtree(stale, ignore_errors=True)


def _full_disk(directory: Path, error: str) -> str:
    """torch's zip writer reports a full disk as ``unexpected pos ...`` (the OSError is lost inside it): say what it
    is when the disk has no space left."""
    try:
        free = shutil.disk_usage(directory if directory.exists() else directory.parent).free
    except OSError:
        return error
    if "No space left" in error or free >= 1 << 20:
        return error
    return f"No space left on device: {free} bytes free; the writer said: {error}"


def _reason(err: BaseException) -> str:
    if isinstance(err, CheckpointException):  # DCP's collective wrapper: the first rank's own error says it
        for rank, failure in sorted(err.failures.items()):
            inner = failure[0] if isinstance(failure, tuple) else failure
            return f"rank {rank}: {_reason(inner)}"
    if isinstance(err, OSError):
        return err.strerror or str(err)
    return first_line(err)[:300]


# ------------------------------------------------------------------------------------------ reading


def is_sharded(path: Path) -> bool:
    return path.name.endswith(SUFFIX)


def load_verified(path: Path) -> dict:
    """The small payload of a ``step-N.dcp`` folder after checking every file of its manifest (present, SHA-256
    matching, a shard for every rank that saved it); Damaged with the reason otherwise. The shards themselves are
    read by :func:`restore`, on every rank."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise Damaged(f"no {MANIFEST}: not a complete checkpoint")
    listed = {}
    for line in manifest.read_text(encoding="ascii", errors="replace").splitlines():
        digest, _, name = line.partition("  ")
        listed[name] = digest
    for name, digest in listed.items():
        file = path / name
        if not file.is_file():
            raise Damaged(f"{name} is missing")
        if _sha256(file) != digest:
            raise Damaged(f"checksum mismatch in {name}, {file.stat().st_size} bytes: truncated or damaged")
    try:
        payload = torch.load(path / STATE, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - unpickling, a wrong format: unusable
        raise Damaged(f"{STATE} unreadable: {first_line(err)[:200]}") from None
    if STATE not in listed or ".metadata" not in listed or payload.get("format") != FORMAT:
        raise Damaged(f"{MANIFEST} does not list DCP's metadata and {STATE}")
    ranks = payload.get("world_size", 1)
    absent = [r for r in range(ranks) if not any(n.startswith(f"__{r}_") for n in listed)]
    if absent:
        raise Damaged(f"{MANIFEST} lists no shard of rank(s) {absent}")
    return {**payload, "dcp_path": str(path)}


def restore(setup: Setup, payload: dict) -> None:
    """Every rank: read its shards of the model, the optimizer and the best weights from the checkpoint
    ``payload`` names and load them; ``payload`` then holds ``model`` (this rank's shards) and the best weights, as
    selection.ModelSelection.restore reads them."""
    model_state, optimizer_state = data_parallel.sharded_state_dicts(setup.model, setup.optimizer)
    shards: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    best_names = _best(payload)
    if isinstance(best_names, list):  # the best weights' shards: loaded into buffers shaped like the parameters
        params = dict(setup.model.named_parameters())
        shards["best"] = {name: torch.empty_like(params[name].detach()) for name in best_names}
    dcp.load(shards, storage_reader=FileSystemReader(payload["dcp_path"]))
    data_parallel.load_sharded_state_dicts(setup.model, setup.optimizer, shards["model"], shards["optimizer"])
    payload["model"] = shards["model"]
    if "best" in shards:
        payload[BEST[0]] = {**payload[BEST[0]], BEST[1]: shards["best"]}


def _best(payload: dict) -> Any:
    return (payload.get(BEST[0]) or {}).get(BEST[1])


def split(payload: dict) -> tuple[dict, dict]:
    """checkpointing.capture's payload (without model and optimizer) -> (state.pt's part, the extra shards): the
    best weights, sharded like the model, go to the shards and state.pt keeps their names."""
    best = _best(payload)
    if not best:
        return payload, {}
    small = {**payload, BEST[0]: {**payload[BEST[0]], BEST[1]: sorted(best)}}
    return small, {"best": best}

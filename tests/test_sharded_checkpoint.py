"""FSDP checkpoints written shard by shard (train/sharded_checkpoint.py), with two real gloo processes on CPU.

One job saves synchronously (step 2) and asynchronously (step 3, the weights changing while the writer thread
writes; committed at a step end), then is SIGKILLed while it commits step 5: the folder layout, the manifest
(`sha256sum -c` reads it; DCP's converter makes one file of it), the previous checkpoints still the newest, and a
damaged or missing shard found by the checksums. A second job, built from another seed, restores step 3 and must
hold exactly the state the first job had then (model, optimizer and best weights), and its first save removes the
hidden folder the killed job left; then a disk too small for the shards (a 4 MiB RAM disk) refuses a sync and an
async save with one warning each on rank 0, and the job goes on. End to end (torchrun, a rank killed, resume=auto
to the same weights): tests/test_distributed_e2e.py.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from maxout.train import checkpointing, resume, sharded_checkpoint

from .conftest import TINY, rank_processes
from .test_faults import tmpfs

FSDP = [*TINY, "train.max_steps=8", "distributed.strategy=fsdp", "hardware.precision=fp32", "train.batch_size=4",
        "train.target_effective_batch=8", "model.dropout=0.0"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(rank: int, port: int, directory: str, phase: str, results) -> None:
    """One rank of a two-process FSDP job (spawned): ``write`` or ``resume`` (see the module docstring)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    from maxout import data, hardware, loading, metrics, modeling
    from maxout.optimizations import data_parallel
    from maxout.tracking.tracker import NullTracker
    from maxout.train import distributed
    from maxout.train.callbacks import TrainState
    from maxout.train.loop import train_step
    from maxout.train.setup import build

    root = Path(directory)
    device = hardware.detect()
    seed = "train.seed=0" if phase == "write" else "train.seed=99"  # the resumed job starts from other weights
    cfg = loading.load([*FSDP, f"checkpoint.dir={root}", seed], device=device)
    out: dict = {}
    with distributed.session(cfg.distributed, device) as world:
        setup = build(cfg, device, data.load(cfg.data), modeling.load_tokenizer(cfg.model), world=world)
        meter = metrics.Throughput("cpu")
        batches = iter(setup.train_loader)

        def step() -> None:
            train_step(setup, [next(batches), next(batches)], meter)

        def full() -> dict:  # the whole state, gathered (a collective): what each checkpoint must give back
            model, optimizer = data_parallel.state_dicts(setup.model, setup.optimizer, "fsdp")
            return {"model": model, "optimizer": optimizer}

        def checkpointer(async_save: bool, where: Path = root) -> checkpointing.Checkpointer:
            cc = loading.load([*FSDP, f"checkpoint.dir={where}", f"checkpoint.async_save={async_save}",
                               "checkpoint.keep_last=2"], device=device)
            plan = resume.Plan(cc, "key", "run")
            return plan.checkpointer(setup, NullTracker(), {"selection": best_so_far})[0]

        def best_so_far(state: TrainState) -> dict:  # a stand-in best: sharded like the model, one value per step
            return {"best": {"step": state.step}, "weights": {
                n: torch.full_like(p.detach(), state.step / 10) for n, p in setup.model.named_parameters()}}

        if phase == "write":
            step(), step()
            sync = checkpointer(False)
            sync.save(TrainState(setup.total_steps, step=2), (0, 4))
            step()
            at_3 = full()
            if rank == 0:  # now: the gathered optimizer state shares its step counters with the live optimizer
                torch.save(at_3, root / "at_3.pt")
            saving = checkpointer(True)
            began = time.perf_counter()
            saving.save(TrainState(setup.total_steps, step=3), (0, 6))
            out["async_returned_s"] = time.perf_counter() - began
            out["pending_after_save"] = saving.writer.pending is not None
            step()  # the weights change while the writer thread writes step 3
            deadline = time.monotonic() + 120
            while saving.writer.pending is not None and time.monotonic() < deadline:  # committed at a step end
                saving.on_step_end(TrainState(setup.total_steps, step=4, batches_in_epoch=2))
                time.sleep(0.05)
            out["committed_by_poll"] = saving.writer.pending is None
            saving.on_train_end(TrainState(setup.total_steps, step=4))  # nothing left to wait for
            results.put((rank, out))
            world.gather(None)
            if rank == 0:
                def hang(self, pending):  # SIGKILLed here: every file is in, the manifest and rename are not
                    (root / "committing").touch()
                    time.sleep(600)
                sharded_checkpoint.ShardedWriter._commit = hang
            sync.save(TrainState(setup.total_steps, step=5), (0, 10))
            world.gather(None)  # rank 1 waits here for the kill
        else:
            before = full()
            payload = resume.load_verified(checkpointing.latest(root / "key" / "run"))
            plan = resume.Plan(cfg, "key", "run", checkpointing.latest(root / "key" / "run"), payload)
            restored = plan.restore(setup)
            now = full()
            if rank == 0:
                expected = torch.load(root / "at_3.pt", weights_only=True)
                out["differed"] = not all(torch.equal(before["model"][k], v) for k, v in expected["model"].items())
                out["model_equal"] = all(torch.equal(now["model"][k], v) for k, v in expected["model"].items())
                out["optimizer_equal"] = _equal(now["optimizer"]["state"], expected["optimizer"]["state"])
                out["keys"] = set(now["model"]) == set(expected["model"])
            out["step"] = restored.step
            best = payload["selection"]["weights"]  # read from the shards into buffers sharded like the model
            out["best"] = (set(best) == {n for n, _ in setup.model.named_parameters()}
                           and all(torch.all(t.to_local() == torch.tensor(0.3)).item() for t in best.values())
                           and payload["selection"]["best"] == {"step": 3})
            checkpointer(False).save(TrainState(setup.total_steps, step=6), (0, 12))
            # A disk too small for the shards (a 4 MiB RAM disk): refused with a warning, on every rank alike, by
            # DCP's write and by the asynchronous one; nothing half-written stays, and the job goes on.
            warned: list[str] = []
            handler = logging.Handler()
            handler.emit = lambda record: warned.append(record.getMessage())
            logging.getLogger("maxout").addHandler(handler)
            small_disk = root / "small-disk"
            for async_save, at in ((False, 7), (True, 8)):
                saver = checkpointer(async_save, small_disk)
                saver.save(TrainState(setup.total_steps, step=at), (0, 14))
                saver.on_train_end(TrainState(setup.total_steps, step=at))
            out["warned"] = [w for w in warned if "not written" in w]
            out["on_small_disk"] = sorted(p.name for p in small_disk.rglob("*") if p.name.startswith((".", "step")))
            out["went_on"] = world.all_reduce(torch.tensor([1.0])).item()
            results.put((rank, out))


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def _results(procs, results, timeout_s: float = 600) -> dict:
    """Each rank's result, waited for while both ranks live: a rank that dies first fails the test at once with its
    exit code (its output is in the captured stderr), not after the whole timeout."""
    import queue

    got, deadline = {}, time.monotonic() + timeout_s
    while len(got) < len(procs):
        try:
            rank, out = results.get(timeout=1)
            got[rank] = out
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)]
            assert not dead, f"rank(s) died before reporting: {dead} (rank, exit code)"
            assert time.monotonic() < deadline, f"no result from ranks {sorted(set(range(len(procs))) - set(got))}"
    return got


def _spawn(directory: Path, phase: str):
    context = rank_processes("tests.test_sharded_checkpoint")
    results, port = context.Queue(), _free_port()
    procs = [context.Process(target=_job, args=(r, port, str(directory), phase, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    return procs, results


@pytest.mark.slow
def test_fsdp_shards_are_written_by_each_rank_committed_whole_verified_and_restored_exactly(tmp_path):
    run_dir = tmp_path / "key" / "run"
    procs, results = _spawn(tmp_path, "write")
    try:
        wrote = _results(procs, results)
        deadline = time.monotonic() + 600
        while not (tmp_path / "committing").exists():
            assert time.monotonic() < deadline and all(p.is_alive() for p in procs), "the job ended before step 5"
            time.sleep(0.05)
        for proc in procs:  # mid-save: every shard of step 5 written, its manifest and rename not yet
            os.kill(proc.pid, signal.SIGKILL)
    finally:
        for proc in procs:
            proc.join(timeout=30)
    assert [p.name for p in checkpointing.checkpoints(run_dir)] == ["step-00000002.dcp", "step-00000003.dcp"]
    hidden = [p for p in run_dir.iterdir() if p.name.startswith(".step-00000005.dcp.tmp-")]
    assert len(hidden) == 1 and {"__0_0.distcp", "__1_0.distcp", "__0.sha256", "__1.sha256"} <= {
        p.name for p in hidden[0].iterdir()} and not (hidden[0] / sharded_checkpoint.MANIFEST).exists()

    newest = checkpointing.latest(run_dir)
    files = {p.name for p in newest.iterdir()}
    assert files == {"__0_0.distcp", "__1_0.distcp", ".metadata", "state.pt", "__0.sha256", "__1.sha256",
                     "MANIFEST.sha256"}
    check = subprocess.run(["sha256sum", "-c", "MANIFEST.sha256"], cwd=newest, capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.count(": OK") == 6, check.stdout
    payload = resume.load_verified(newest)
    assert payload["state"]["step"] == 3 and payload["world_size"] == 2 and len(payload["rng_ranks"]) == 2
    assert "model" not in payload and "optimizer" not in payload  # the weights are in the shards only

    # DCP's own converter makes one file of it (docs/tutorials/torchrun.md): the whole model, as it was at step 3
    dcp_to_torch_save(newest, tmp_path / "full.pt")
    whole, at_3 = (torch.load(tmp_path / name, weights_only=True)["model"] for name in ("full.pt", "at_3.pt"))
    assert whole.keys() == at_3.keys() and all(torch.equal(whole[k], v) for k, v in at_3.items())

    damaged = tmp_path / "damaged" / "step-00000004.dcp"
    shutil.copytree(newest, damaged)
    shard = damaged / "__1_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(checkpointing.Damaged, match="checksum mismatch in __1_0.distcp"):
        resume.load_verified(damaged)
    shard.unlink()
    with pytest.raises(checkpointing.Damaged, match="__1_0.distcp is missing"):
        resume.load_verified(damaged)

    with tmpfs(tmp_path / "small-disk", size="4m"):
        procs, results = _spawn(tmp_path, "resume")
        got = _results(procs, results)
        for proc in procs:
            proc.join(timeout=60)
    # async: the call returned with the write still under way; what it wrote is step 3's state (the copy DCP's
    # stager took), not the next step's, which had changed the weights before the write was waited for
    assert wrote[0]["pending_after_save"] and wrote[1]["pending_after_save"]
    assert wrote[0]["committed_by_poll"] and wrote[1]["committed_by_poll"]
    assert got[0]["step"] == got[1]["step"] == 3 and got[0]["differed"] and got[0]["best"] and got[1]["best"]
    assert got[0]["keys"] and got[0]["model_equal"] and got[0]["optimizer_equal"]
    assert not [p for p in run_dir.iterdir() if p.name.startswith(".")]  # the killed job's hidden folder: removed
    assert [p.name for p in checkpointing.checkpoints(run_dir)] == ["step-00000003.dcp", "step-00000006.dcp"]
    assert len(got[0]["warned"]) == 2 and all("No space left on device" in w and "training goes on" in w
                                               for w in got[0]["warned"]), "\n".join(got[0]["warned"])
    assert "step-00000007.dcp" in got[0]["warned"][0] and "step-00000008.dcp" in got[0]["warned"][1]
    assert got[1]["warned"] == [] and got[0]["on_small_disk"] == [] and got[0]["went_on"] == got[1]["went_on"] == 2

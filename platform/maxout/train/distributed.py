"""One job, several processes: the process group torchrun's processes share, who this process is in it, the few
collectives the trainer needs, and which rank broke a job that failed.

- ``session(cfg, device)`` initialises the process group from torchrun's environment (RANK, WORLD_SIZE,
  LOCAL_RANK, MASTER_ADDR/PORT: torchrun, ``maxout train --nproc-per-node N`` and any launcher that sets them),
  NCCL on CUDA and gloo on CPU, with ``distributed.timeout_s`` on every collective, and destroys it at the end.
  Without WORLD_SIZE (or with 1) it gives a World of one: no process group, and every collective below returns
  its input, so a single process runs exactly the code it always ran.
- ``World``: rank, local rank, sizes, nodes, backend; the all-reduces (evaluation counts, the loss at each log
  step, the agreed micro-batch), the broadcast of rank 0's choices (the run id, the checkpoint to resume) and the
  gather of each rank's results (throughput summed, memory maxed: ``combine_results``).
- ``reporting_failures(world)`` wraps the tracked run on every rank. A rank that fails leaves its outcome in the
  job's key-value store (torchrun's c10d store) before it exits; rank 0, whose own collective then breaks (or
  whom torchrun stops with SIGTERM), reads the others' outcomes and ends the run FAILED naming the rank that
  failed and its error, or the rank that never answered: lost (SIGKILL, the out-of-memory killer, a node gone).
  Collectives time out after ``distributed.timeout_s``, so no rank waits forever.

Every rank runs the same ``maxout train`` command, so every rank computes the same config and run key; rank 0
alone opens the MLflow run and tells the others its id.

A process that ran a process group ends through ``end_process`` (cli.main calls it), not through the interpreter's
finalization: see its docstring.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, NoReturn, Optional, Sequence

import torch
import torch.distributed as dist

from ..config import DistributedConfig, TrackingConfig
from ..errors import RUNTIME, ConfigError, HardwareError, MaxoutError, Terminated, first_line
from ..hardware import DeviceInfo, nvml_index
from ..tracking.store import resolve_uri

REPORT_WAIT_S = 10.0  # how long rank 0 waits for the other ranks' outcomes before it calls a silent rank lost
# ... when a launcher or scheduler stopped rank 0 itself with SIGTERM (torchrun once a rank failed, scancel, a
# requeue or pre-emption, Kubernetes), which signals every rank at once and SIGKILLs what is left after its grace:
# a rank that can still report does so within moments, and a rank that failed first left its word before it exited
# (its exit is what made torchrun stop the rest). A rank silent by then was killed with the job (srun SIGKILLs a
# step's tasks) or sits in a collective rank 0 has left, and only rank 0's exit frees it: waiting longer changes no
# verdict and holds the whole job. A scancel'd or requeued Slurm job was seen ended at ~5 s when it took under
# 10 s, and at 21 s when it took rank 0's full 10 s (issue 36). Ctrl-C keeps the full wait: a person is watching,
# and a rank deep in a long CPU step answers its SIGINT only when the step's kernel returns.
STOPPED_WAIT_S = 2.0
RUN_FILE_ENV = "MAXOUT_RUN_FILE"  # set by `maxout train --nproc-per-node`: rank 0 writes its run id there (launch.py)
# Throughput adds up over the ranks; per-step rates (it/s) and the step count are the same on every rank.
SUMMED = ("perf/samples_per_s", "perf/tokens_per_s", "perf/steady_samples_per_s", "perf/steady_tokens_per_s",
          "perf/window_samples_per_s", "perf/window_tokens_per_s", "train/samples", "train/real_tokens")


class RankFailed(MaxoutError):
    """The job failed on some rank; the message names it."""


def env_world_size() -> int:
    """Processes in the job as the launcher says (1 outside torchrun); readable before any process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


@dataclass(frozen=True)
class World:
    rank: int = 0
    local_rank: int = 0
    size: int = 1
    local_size: int = 1  # processes on this node
    nodes: int = 1
    backend: Optional[str] = None  # None: no process group (one process)

    @classmethod
    def from_env(cls, backend: Optional[str]) -> "World":
        size, local_size = env_world_size(), env_local_world_size()
        return cls(rank=int(os.environ.get("RANK", "0")), local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                   size=size, local_size=local_size,
                   nodes=int(os.environ.get("GROUP_WORLD_SIZE", str(max(1, size // local_size)))), backend=backend)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def initialized(self) -> bool:
        return self.backend is not None

    @property
    def nvml_index(self) -> int:
        """This rank's GPU as NVML numbers it (for utilization sampling): CUDA's index is the local rank."""
        return nvml_index(self.local_rank)

    @property
    def _device(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"  # NCCL reduces device tensors, gloo host tensors

    # -- collectives (each a no-op in a World of one)
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``tensor`` reduced over the ranks (sum, max or min), on the device it came from."""
        if not self.initialized:
            return tensor
        work = tensor.to(self._device)
        dist.all_reduce(work, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        return work.to(tensor.device)

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` of any rank (the micro-batch every rank's device can take)."""
        return int(self.all_reduce(torch.tensor([value], dtype=torch.int64), "min").item())

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (any picklable object)."""
        if not self.initialized:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value: Any) -> list:
        """Every rank's ``value``, in rank order, on every rank."""
        if not self.initialized:
            return [value]
        out: list = [None] * self.size
        dist.all_gather_object(out, value)
        return out

    def log_point(self, loss_sum: float, steps: int, rates: dict) -> tuple[float, dict]:
        """The mean loss over the last ``steps`` steps (``loss_sum``: this rank's, read at the loop's one host sync
        per log interval) and the window rates, over all ranks: one small all-reduce (samples and tokens per second
        add up; it/s does not)."""
        if not self.initialized:
            return loss_sum / steps, rates
        keys = list(rates)
        vector = torch.tensor([loss_sum, *(rates[k] for k in keys)], dtype=torch.float64)
        total = self.all_reduce(vector).tolist()
        return total[0] / self.size / steps, {k: v if k in SUMMED else v / self.size for k, v in zip(keys, total[1:])}

    def combine(self, results: dict) -> dict:
        """This rank's results merged with every other rank's (see :func:`combine_results`)."""
        return combine_results(self.gather(results)) if self.initialized else results

    def params(self, micro_batch: int, accum_steps: int, imbalance: float) -> dict[str, str]:
        """The ``dist.*`` params: logged by every run, so one-process and N-process runs line up in MLflow."""
        return {"dist.world_size": str(self.size), "dist.nodes": str(self.nodes),
                "dist.local_world_size": str(self.local_size), "dist.backend": self.backend or "none",
                "dist.micro_batch_per_rank": str(micro_batch),
                "dist.global_effective_batch": str(micro_batch * accum_steps * self.size),
                "dist.token_imbalance": f"{imbalance:.4f}"}

    # -- outcomes, through the job's key-value store
    def _store(self) -> Any:
        try:
            return dist.distributed_c10d._get_default_store()  # torchrun's c10d store, shared by every rank
        except (RuntimeError, ValueError, AttributeError):
            return None

    def _key(self, rank: int) -> str:
        return f"maxout/outcome/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{rank}"

    def report(self, outcome: str, store: Any = None) -> None:
        """Leave this rank's outcome (``kind|text``) where rank 0 can read it; best effort."""
        store = store or self._store()
        if store is None:
            return
        try:
            store.set(self._key(self.rank), outcome)
        except Exception:  # noqa: BLE001 - the store's host may be gone with its node; rank 0 then says "lost"
            pass

    def outcomes(self, wait_s: float, store: Any = None) -> dict[int, Optional[str]]:
        """The other ranks' outcomes, waiting up to ``wait_s`` for all of them; None for a rank that left none."""
        store = store or self._store()
        found: dict[int, Optional[str]] = {r: None for r in range(self.size) if r != self.rank}
        deadline = time.monotonic() + wait_s
        while store is not None:
            for rank in [r for r, v in found.items() if v is None]:
                with contextlib.suppress(Exception):
                    if store.check([self._key(rank)]):
                        found[rank] = store.get(self._key(rank)).decode()
            if all(v is not None for v in found.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        return found


SINGLE = World()


def combine_results(per_rank: Sequence[dict]) -> dict:
    """One job's results from each rank's (rank 0 first): samples/s and tokens/s summed, peak memory and times the
    max over ranks, padding efficiency over all tokens, GPU utilization averaged plus each device's own."""
    out = dict(per_rank[0])
    if len(per_rank) == 1:
        return out
    for key in out:
        values = [r[key] for r in per_rank if r.get(key) is not None]
        if not values:
            continue
        if key in SUMMED:
            out[key] = sum(values)
        elif key.startswith(("mem/", "time/")) or key == "gpu/utilization_max":
            out[key] = max(values)
        elif key.startswith(("gpu/", "perf/it_per_s", "perf/steady_it_per_s")):
            out[key] = sum(values) / len(values)
    processed = [r["train/real_tokens"] / r["perf/padding_efficiency"] for r in per_rank
                 if r.get("perf/padding_efficiency") and r.get("train/real_tokens")]
    if processed and len(processed) == len(per_rank):
        out["perf/padding_efficiency"] = out["train/real_tokens"] / sum(processed)
    for rank, r in enumerate(per_rank):
        out.update({f"gpu/rank_{rank}/{k.split('/', 1)[1]}": v for k, v in r.items() if k.startswith("gpu/")})
    return out


def pick_backend(requested: str, device: DeviceInfo) -> str:
    if requested == "auto":
        return "nccl" if device.is_cuda else "gloo"
    if requested == "nccl" and not device.is_cuda:
        raise ConfigError("distributed.backend=nccl needs CUDA devices and none is visible; use "
                          "distributed.backend=gloo (or auto)")
    return requested


@contextlib.contextmanager
def session(cfg: DistributedConfig, device: DeviceInfo) -> Iterator[World]:
    """The process group for this job (see the module docstring), or a World of one."""
    if env_world_size() <= 1:
        yield SINGLE
        return
    if cfg.strategy == "none":
        raise ConfigError(f"distributed.strategy=none with {env_world_size()} processes: each would train a copy of "
                          f"its own on its share of the data; use auto, ddp or fsdp, or start one process")
    if dist.is_initialized():  # a caller that set up its own process group keeps it
        yield World.from_env(dist.get_backend())
        return
    backend = pick_backend(cfg.backend, device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device_id = None
    if device.is_cuda:
        if local_rank >= device.count:
            raise HardwareError(f"LOCAL_RANK={local_rank} but this node has {device.count} visible GPU(s): start at "
                                f"most {device.count} processes per node (torchrun --nproc-per-node)")
        torch.cuda.set_device(local_rank)  # from here on "cuda" is this rank's own GPU
        device_id = torch.device("cuda", local_rank)
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.timeout_s), device_id=device_id)
    global _ran_process_group
    _ran_process_group = True
    ok = False
    try:
        yield World.from_env(backend)
        ok = True
    finally:
        if ok or backend == "gloo":  # NCCL after a broken collective can hang in teardown: the exit frees it
            dist.destroy_process_group()


_ran_process_group = False  # session() initialised a process group in this process
_kept: list = []  # what holds this job's process group, alive until end_process (keep_until_exit)


def ran_process_group() -> bool:
    return _ran_process_group


def keep_until_exit(module: Optional[Any]) -> None:
    """Hold ``module`` (the DDP or FSDP wrapper, which holds the process group) until end_process, in a rank that
    session() started: its destructors then never run. A fresh clone's suite (2026-11-27) had a DDP rank on gloo
    hang for good as its train command returned: freeing DDP's Reducer destroyed its ProcessGroupGloo, and the
    destructor blocked on a mutex (py-spy: ~Reducer -> ~ProcessGroupGloo -> pthread_mutex_lock, the other node's rank
    already gone). The process exits through os._exit anyway; nothing is left for those destructors to do."""
    if module is not None and _ran_process_group:
        _kept.append(module)


def end_process(code: int) -> NoReturn:
    """Exit now, with ``code``, skipping the interpreter's finalization (a rank of a multi-process job, once its work
    and its process group are done: cli.main).

    Gloo's worker threads release each finished collective (its Work, holding the tensors it read and wrote) on
    their own, shortly after the caller's wait() returned. Where Python had already dropped those tensors, that
    release takes the GIL; if the interpreter has begun finalizing by then, taking the GIL ends the thread from
    inside a C++ destructor, and the process dies with SIGABRT, "terminate called without an active exception"
    (pytorch/pytorch#117762, open). A rank that has nothing left to do after its last collective exits within
    milliseconds, so on a busy machine the worker thread is often late: issue 36 saw it at random on FSDP jobs
    (core dump: Py_FinalizeEx in the main thread, ~AsyncAllgatherCoalescedWork -> take_gil -> pthread_exit in
    pt_gloo_runloop). destroy_process_group() does not stop those threads (gloo has no shutdown).
    Everything the job writes is closed before this (the run, its artifacts, the checkpoints); what is left is
    freed here in the open, then the process exits without finalizing."""
    gc.collect()  # data loaders' worker processes, held in cycles, are shut down by their finalizers
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


# ------------------------------------------------------------------------------------------ failures


def outcome(err: Optional[BaseException]) -> str:
    """``kind|text`` for the store: done, failed (this rank's own error), broken (a collective with a rank that
    went away), stopped (SIGTERM or Ctrl-C: the launcher stopping the job)."""
    if err is None:
        return "done|"
    if isinstance(err, (Terminated, KeyboardInterrupt)):
        return f"stopped|{'SIGTERM' if isinstance(err, Terminated) else 'interrupted'}"
    kind = "broken" if is_collective_error(err) else "failed"
    # gloo's messages go on about where to look ("This is typically caused by ..."): the first sentence says it
    return f"{kind}|{type(err).__name__}: {first_line(err).split('. This is typically')[0]}"[:1000]


def is_collective_error(err: BaseException) -> bool:
    """A collective that broke because another rank went away (gloo raises a plain RuntimeError for it)."""
    text = str(err)
    return isinstance(err, dist.DistError) or (isinstance(err, RuntimeError) and any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "gloo", "NCCL", "timed out")))


def verdict(own: str, others: dict[int, Optional[str]], wait_s: float = REPORT_WAIT_S) -> tuple[str, str]:
    """(run status, reason) for a job whose rank 0 ended with ``own`` while the other ranks left ``others``."""
    own_kind, own_text = own.split("|", 1)
    parsed = {r: v.split("|", 1) if v else None for r, v in others.items()}
    failed = {r: v[1] for r, v in parsed.items() if v and v[0] == "failed"}
    lost = sorted(r for r, v in parsed.items() if v is None)
    if own_kind == "failed":
        return "FAILED", f"rank 0 failed: {own_text}" + _also(failed)
    if failed:
        first, *rest = sorted(failed)
        return "FAILED", f"rank {first} failed: {failed[first]}" + _also({r: failed[r] for r in rest})
    if lost:
        ranks = ", ".join(map(str, lost))
        return "FAILED", (f"rank{'s' if len(lost) > 1 else ''} {ranks} lost: no word from "
                          f"{'them' if len(lost) > 1 else 'it'} within {wait_s:g} s after the job broke (killed, "
                          f"e.g. SIGKILL or the out-of-memory killer, or its node went down); rank 0 saw: {own_text}")
    if own_kind == "stopped" and all(v[0] in ("stopped", "done") for v in parsed.values() if v):
        return "KILLED", f"stopped: {own_text}"
    broken = sorted(r for r, v in parsed.items() if v and v[0] == "broken")
    return "FAILED", f"a collective broke off (rank 0: {own_text}; also on ranks {broken or 'none'})"


def _also(failed: dict[int, str]) -> str:
    return "".join(f"; rank {r} failed too: {t}" for r, t in sorted(failed.items()))


def _ignore_sigterm() -> None:
    """Rank 0's report must finish: torchrun SIGTERMs every rank once one has failed (then SIGKILLs after 30 s)."""
    with contextlib.suppress(ValueError):  # not the main thread: nothing to change
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


@contextlib.contextmanager
def reporting_failures(world: World, wait_s: float = REPORT_WAIT_S) -> Iterator[None]:
    """See the module docstring. Rank 0 re-raises a job's failure as :class:`RankFailed` naming the rank (the
    caller's ``tracking.closing`` then ends the run FAILED with it), and a job that was stopped as it was."""
    if not world.initialized:
        yield
        return
    try:
        yield
    except BaseException as err:
        _ignore_sigterm()
        store, own = world._store(), outcome(err)
        world.report(own, store)
        if not world.is_main:
            raise
        # Rank 0's own error needs no one else's word; as a bystander it waits for the rank that broke the job.
        if isinstance(err, Terminated):
            wait_s = min(wait_s, STOPPED_WAIT_S)
        others = {} if own.startswith("failed|") else world.outcomes(wait_s, store)
        status, reason = verdict(own, others, wait_s)
        if status == "KILLED":
            raise
        raise RankFailed(reason, exit_code=getattr(err, "exit_code", RUNTIME)) from err
    else:
        world.report(outcome(None))


def announce_run(run_id: Optional[str], tracking: TrackingConfig) -> None:
    """For `maxout train --nproc-per-node`'s launcher (launch.py): which run this job logs to, so that it can end
    the run FAILED if rank 0 itself dies before it can."""
    path = os.environ.get(RUN_FILE_ENV)
    if path and run_id:
        with open(path, "w") as f:
            json.dump({"run_id": run_id, "tracking_uri": resolve_uri(tracking)[0]}, f)

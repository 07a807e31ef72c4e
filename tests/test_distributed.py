"""Data parallelism, piece by piece: each rank's share of the epoch (disjoint, equal, the same rows per step as one
process with the whole batch), sharded evaluation, the strategy decision, accumulation over ranks, the merged
results, who broke a job (the verdict rank 0 writes into the run), per-rank RNG in checkpoints, the GPU topology
check-hardware reads from NVML (a fake NVML here), the launcher's messages, and the collectives with two real
gloo processes (slow). End to end under torchrun: tests/test_distributed_e2e.py."""

from __future__ import annotations

import os
import random
import signal
import socket
import types

import pytest
import torch

from maxout import hardware, loading
from maxout.errors import DataError, Terminated
from maxout.insight import hardware_report
from maxout.optimizations import accumulation, bucketing, data_parallel
from maxout.train import checkpointing, distributed
from maxout.train.callbacks import TrainState
from maxout.train.distributed import World, combine_results, outcome, verdict

from .conftest import TINY, rank_processes
from .store_template import new_store


def demo_lengths(rows: int = 203, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(5, 200) for _ in range(rows)]


# ------------------------------------------------------------------------------------------ the data


@pytest.mark.parametrize("bucketed", [True, False])
def test_each_rank_takes_its_share_of_the_batches_one_process_would_take_with_the_whole_batch(bucketed):
    lengths = demo_lengths()
    for epoch in (0, 1, 5):
        one = bucketing.apply(lengths, 16, seed=3, enabled=bucketed)
        ranks = [bucketing.apply(lengths, 8, seed=3, enabled=bucketed, rank=r, world_size=2) for r in range(2)]
        for sampler in (one, *ranks):
            sampler.set_epoch(epoch)
        shares = [r.batches() for r in ranks]
        assert len(shares[0]) == len(shares[1]) == len(ranks[0]) == len(ranks[1]) == len(one)
        for step, (whole, first, second) in enumerate(zip(one.batches(), *shares)):
            # the same rows in the same step (what makes 2 x B equal 1 x 2B), each rank a contiguous half; which
            # rank takes the longer half alternates
            assert whole == (first + second if step % 2 == 0 else second + first)
        flat = [i for share in shares for batch in share for i in batch]
        assert sorted(flat) == list(range(len(lengths)))  # disjoint, and the whole epoch


def test_a_ranks_order_is_a_pure_function_of_seed_epoch_and_rank_and_resume_skips_its_own_batches():
    lengths = demo_lengths()

    def rank_batches(seed, epoch, rank, skip=0):
        sampler = bucketing.apply(lengths, 4, seed=seed, rank=rank, world_size=4)
        sampler.set_epoch(epoch, skip_batches=skip)
        return list(sampler)

    assert rank_batches(1, 2, 3) == rank_batches(1, 2, 3)
    assert rank_batches(1, 2, 3) != rank_batches(1, 2, 2) != rank_batches(1, 3, 2) != rank_batches(2, 3, 2)
    assert rank_batches(1, 2, 3, skip=5) == rank_batches(1, 2, 3)[5:]


def test_a_global_batch_smaller_than_the_world_is_left_out_so_every_rank_steps_alike():
    lengths = list(range(10, 27))  # 17 rows; batches of 4 x 2 ranks: 8, 8, then 1 row for 2 ranks
    ranks = [bucketing.apply(lengths, 4, seed=0, rank=r, world_size=2) for r in range(2)]
    assert [len(r) for r in ranks] == [2, 2] and [len(r.batches()) for r in ranks] == [2, 2]
    assert sum(len(b) for r in ranks for b in r.batches()) == 16
    last_uneven = [bucketing.apply(list(range(10, 29)), 4, seed=0, rank=r, world_size=2) for r in range(2)]
    assert [len(r) for r in last_uneven] == [3, 3]  # 19 rows: the last global batch has 3, split 2 + 1
    assert sorted(len(b) for r in last_uneven for b in r.batches())[:2] == [1, 2]


def test_token_imbalance_is_one_for_one_process_or_equal_rows_and_grows_with_uneven_work():
    lengths = demo_lengths()
    assert bucketing.token_imbalance(bucketing.apply(lengths, 8, seed=0)) == 1.0
    assert bucketing.token_imbalance(bucketing.apply([50] * 64, 8, seed=0, rank=0, world_size=2)) == 1.0
    bucketed = bucketing.token_imbalance(bucketing.apply(lengths, 8, seed=0, rank=0, world_size=2))
    assert 1.0 < bucketed < 1.2  # whole length-sorted neighbours: close, not equal
    skewed = [10] * 32 + [200] * 32  # sorted: every step pairs 200-token rows with 10-token rows somewhere
    assert bucketing.token_imbalance(bucketing.apply(skewed, 32, seed=0, rank=0, world_size=2), group=1) > 1.05
    # summed over an optimizer step's micro-batches the work evens out
    assert bucketing.token_imbalance(bucketing.apply(lengths, 8, seed=0, rank=0, world_size=2), group=4) < bucketed


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_evaluation_shares_cover_the_set_once_with_the_same_number_of_batches_on_every_rank(world):
    lengths = demo_lengths()
    shares = [bucketing.eval_batches(lengths, 32, rank, world) for rank in range(world)]
    assert sorted(i for share in shares for batch in share for i in batch) == list(range(len(lengths)))
    assert len({len(share) for share in shares}) == 1  # FSDP gathers in every forward: no rank may have fewer
    if world == 1:
        assert max(len(b) for b in shares[0]) <= 32
    with pytest.raises(DataError, match="3 rows, fewer than the 4 processes"):
        bucketing.eval_batches([5, 6, 7], 32, 0, 4)


# ------------------------------------------------------------------------------------- the decisions


@pytest.mark.parametrize("requested, world, initialized, precision, effective, reason", [
    ("auto", 1, False, "bf16", "none", "one process"),
    ("ddp", 1, False, "bf16", "none", "one process"),
    ("none", 4, True, "bf16", "none", ""),
    ("auto", 4, True, "bf16", "ddp", "auto: ddp"),
    ("ddp", 4, True, "bf16", "ddp", ""),
    ("fsdp", 4, True, "bf16", "fsdp", ""),
    ("fsdp", 4, True, "fp16", "ddp", "use bf16"),
    ("fsdp", 4, False, "bf16", "none", "no process group"),
])
def test_the_data_parallel_decision(requested, world, initialized, precision, effective, reason):
    decision = data_parallel.resolve(requested, world, initialized, precision)
    assert (decision.requested, decision.effective) == (requested, effective)
    assert reason in decision.reason and (decision.reason == "") == (reason == "")
    assert decision.params()["opt.data_parallel.effective"] == effective


def test_fsdp_shards_every_transformer_block_bottom_up_but_not_the_root(cpu_device):
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(BertConfig(hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                                                     intermediate_size=32, vocab_size=100))
    units = data_parallel.shard_units(model)
    assert [type(u).__name__ for u in units] == ["BertLayer"] * 3 + ["BertEmbeddings"]
    assert units[:3] == list(reversed(model.bert.encoder.layer)) and model not in units


def test_accumulation_counts_every_process_s_micro_batch():
    assert accumulation.plan(32, 8, world_size=2)[0] == 2
    steps, decision = accumulation.plan(64, 12, world_size=2)
    assert (steps, decision.effective) == (3, 72)
    assert decision.reason == "target 64 is not a multiple of the micro-batch 12 x 2 processes: 3 x 12 x 2 = 72 " \
                              "samples per step"
    assert "below the micro-batch 16 x 2 processes" in accumulation.plan(16, 16, world_size=2)[1].reason


# ------------------------------------------------------------------------------------ results, verdicts


def test_results_of_the_ranks_merge_into_the_job_s():
    ranks = [{"perf/samples_per_s": 10.0, "perf/steady_tokens_per_s": 100.0, "perf/it_per_s": 2.0,
              "mem/peak_rss_gb": 1.0, "time/wall_s": 5.0, "train/real_tokens": 90.0, "perf/padding_efficiency": 0.9,
              "eval/accuracy": 0.5, "gpu/utilization_mean": 80.0},
             {"perf/samples_per_s": 12.0, "perf/steady_tokens_per_s": 110.0, "perf/it_per_s": 2.2,
              "mem/peak_rss_gb": 1.5, "time/wall_s": 4.0, "train/real_tokens": 60.0, "perf/padding_efficiency": 0.6,
              "eval/accuracy": 0.5, "gpu/utilization_mean": 60.0}]
    job = combine_results(ranks)
    assert job["perf/samples_per_s"] == 22.0 and job["perf/steady_tokens_per_s"] == 210.0
    assert job["perf/it_per_s"] == pytest.approx(2.1) and job["train/real_tokens"] == 150.0
    assert job["mem/peak_rss_gb"] == 1.5 and job["time/wall_s"] == 5.0 and job["eval/accuracy"] == 0.5
    assert job["perf/padding_efficiency"] == pytest.approx(150 / 200)  # over all tokens: 90/100 and 60/100
    assert job["gpu/utilization_mean"] == 70.0 and job["gpu/rank_1/utilization_mean"] == 60.0
    assert combine_results(ranks[:1]) == ranks[0]


def test_one_process_world_passes_values_through():
    world = World()
    assert not world.initialized and world.is_main
    tensor = torch.tensor([1.0, 2.0])
    assert world.all_reduce(tensor) is tensor and world.agree_min(7) == 7 and world.broadcast("x") == "x"
    assert world.gather({"a": 1}) == [{"a": 1}] and world.combine({"a": 1}) == {"a": 1}
    assert world.log_point(3.0, 2, {"perf/window_samples_per_s": 5.0}) == (
        1.5, {"perf/window_samples_per_s": 5.0})
    assert world.params(8, 2, 1.0)["dist.global_effective_batch"] == "16"


def test_a_rank_s_outcome_says_whether_it_failed_broke_off_or_was_stopped():
    assert outcome(None) == "done|"
    assert outcome(Terminated()) == "stopped|SIGTERM"
    assert outcome(ValueError("bad row\nmore")) == "failed|ValueError: bad row"
    gloo = RuntimeError("[pair.cc:537] Read error [127.0.0.1]:744: Connection reset by peer. This is typically "
                        "caused by a remote worker hanging")
    assert outcome(gloo) == "broken|RuntimeError: [pair.cc:537] Read error [127.0.0.1]:744: Connection reset by peer"


@pytest.mark.parametrize("own, others, status, fragment", [
    ("broken|RuntimeError: reset", {1: None, 2: "broken|RuntimeError: reset"}, "FAILED",
     "rank 1 lost: no word from it within 10 s"),
    ("stopped|SIGTERM", {1: None, 2: None}, "FAILED", "ranks 1, 2 lost"),
    ("stopped|SIGTERM", {1: "failed|ValueError: bad", 2: None}, "FAILED", "rank 1 failed: ValueError: bad"),
    ("broken|RuntimeError: reset", {1: "failed|OutOfMemory: x", 2: "failed|KeyError: y"}, "FAILED",
     "rank 1 failed: OutOfMemory: x; rank 2 failed too: KeyError: y"),
    ("failed|MaxoutError: store down", {}, "FAILED", "rank 0 failed: MaxoutError: store down"),
    ("stopped|SIGTERM", {1: "stopped|SIGTERM", 2: "done|"}, "KILLED", "stopped: SIGTERM"),
    ("broken|RuntimeError: timed out", {1: "broken|RuntimeError: timed out"}, "FAILED", "a collective broke off"),
])
def test_rank_0_names_the_rank_that_broke_the_job(own, others, status, fragment):
    got_status, reason = verdict(own, others, wait_s=10)
    assert got_status == status and fragment in reason, reason


class _RankZeroOfTwo(World):
    """Rank 0 of a two-rank job whose rank 1 never leaves a word (SIGKILLed): records how long rank 0 waited."""

    waits: list = []

    def _store(self):
        return object()

    def report(self, outcome, store=None):
        pass

    def outcomes(self, wait_s, store=None):
        self.waits.append(wait_s)
        return {1: None}


@pytest.mark.parametrize("error, waited", [
    (RuntimeError("[pair.cc:537] Read error: Connection reset by peer"), distributed.REPORT_WAIT_S),
    (KeyboardInterrupt(), distributed.REPORT_WAIT_S),
    (Terminated(), distributed.STOPPED_WAIT_S),
])
def test_rank_0_stopped_by_the_launcher_waits_moments_for_a_silent_rank_and_a_broken_one_waits_longer(error,
                                                                                                       waited):
    """A launcher's SIGTERM (scancel, pre-emption, torchrun stopping the job after a rank died) reaches every rank
    at once: the ranks that can still report do so at once, so rank 0 ends the run in ~2 s and not 10 (Slurm then
    sees the job end in its first check). A collective that broke off still waits the full time for the rank that
    broke it, and so does Ctrl-C, where a person is watching."""
    world, handler = _RankZeroOfTwo(size=2, backend="gloo"), signal.getsignal(signal.SIGTERM)
    _RankZeroOfTwo.waits = []
    try:
        with pytest.raises(distributed.RankFailed, match=f"rank 1 lost: no word from it within {waited:g} s"):
            with distributed.reporting_failures(world):
                raise error
    finally:
        signal.signal(signal.SIGTERM, handler)  # rank 0 ignores SIGTERM while it reports
    assert _RankZeroOfTwo.waits == [waited] and distributed.STOPPED_WAIT_S < distributed.REPORT_WAIT_S


def test_a_checkpoint_holds_every_rank_s_rng_and_each_rank_restores_its_own(tmp_path, cpu_device):
    """Each rank's dropout draws differ, and so do the samples and tokens it trained: the checkpoint rank 0 writes
    holds them all (gathered), and a rank restores its own entry. A stand-in world of two (no process group) gathers
    a second, different state."""
    from maxout import data, modeling
    from maxout.train.setup import build

    torch.manual_seed(123)
    other = checkpointing.rng_states()  # another rank's generators: another seed
    other_measured = {"meter": {"samples": 40, "real_tokens": 999, "tokens": 1200, "steps": 5, "elapsed": 2.5,
                                "steady_base": None}}

    class TwoRanks(World):
        def gather(self, value):
            theirs = {"rng": other, "measured": other_measured}
            return [value, theirs] if self.rank == 0 else [theirs, value]

    cfg = loading.load([*TINY, "train.batch_size=4"], device=cpu_device)
    dataset, tokenizer = data.load(cfg.data), modeling.load_tokenizer(cfg.model)
    rank0 = build(cfg, cpu_device, dataset, tokenizer, world=TwoRanks(rank=0, size=2))
    assert rank0.decision("data_parallel").reason.startswith("WORLD_SIZE=2 but no process group")
    payload = checkpointing.capture(rank0, TrainState(rank0.total_steps, step=1), (0, 1), {})
    assert len(payload["rng_ranks"]) == 2 and torch.equal(payload["rng_ranks"][1]["torch"], other["torch"])
    rank1 = build(cfg, cpu_device, dataset, tokenizer, world=TwoRanks(rank=1, size=2))
    resumed = checkpointing.restore(rank1, payload)
    assert torch.equal(torch.get_rng_state(), other["torch"]) and resumed.measured == other_measured
    resumed = checkpointing.restore(rank0, payload)
    assert torch.equal(torch.get_rng_state(), payload["rng"]["torch"])
    assert resumed.measured == payload["measured_ranks"][0] == payload["state"]["measured"] != other_measured


# -------------------------------------------------------------------------------- GPUs, links, commands


class FakeNVML(types.SimpleNamespace):
    """NVML's functions over a described machine: GPUs 0-1 and 2-3 joined by NVLink, the pairs across on PCIe."""

    NVML_NVLINK_MAX_LINKS, NVML_FEATURE_ENABLED = 18, 1
    NVML_P2P_CAPS_INDEX_NVLINK, NVML_P2P_STATUS_OK = 2, 0

    class NVMLError(Exception):
        pass

    def __init__(self, count=4, nvlink_pairs=((0, 1), (2, 3)), links_per_gpu=4, fail_init=False):
        super().__init__(count=count, pairs={frozenset(p) for p in nvlink_pairs}, links=links_per_gpu,
                         fail_init=fail_init)

    def nvmlInit(self):
        if self.fail_init:
            raise self.NVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(total=80 * 2**30)

    def nvmlDeviceGetNvLinkState(self, h, link):
        if link >= self.links:
            raise self.NVMLError("invalid argument")
        return self.NVML_FEATURE_ENABLED if any(h in p for p in self.pairs) else 0

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        return self.NVML_P2P_STATUS_OK if frozenset((a, b)) in self.pairs else 4

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return 30  # NVML_TOPOLOGY_HOSTBRIDGE


def test_topology_lists_every_gpu_and_how_each_pair_is_linked(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    topo = hardware.topology(FakeNVML())
    assert [g["index"] for g in topo.gpus] == [0, 1, 2, 3] and topo.gpus[0]["nvlinks"] == 4
    kinds = {(link.a, link.b): link.kind for link in topo.links}
    assert kinds[(0, 1)] == kinds[(2, 3)] == "NVLink" and kinds[(0, 2)] == "PCIe host bridge" and len(kinds) == 6
    assert not topo.all_nvlink
    advice = hardware_report.scale_out(topo)
    assert advice["commands"][0] == "maxout train --nproc-per-node 4 hardware=auto ..."
    assert "torchrun --nproc-per-node=4 -m maxout train" in advice["commands"][1]
    assert "--nnodes=NODES" in advice["commands"][2] and "PCIe host bridge" in advice["notes"][0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    pinned = hardware.topology(FakeNVML())
    assert [g["index"] for g in pinned.gpus] == [2, 3] and pinned.all_nvlink
    assert "NVLink" in hardware_report.scale_out(pinned)["notes"][0]


def test_no_nvml_means_no_gpu_and_a_one_process_command():
    topo = hardware.topology(FakeNVML(fail_init=True))
    assert topo.gpus == [] and "NVML not available" in topo.error
    assert hardware_report.scale_out(topo)["commands"] == ["maxout train hardware=cpu ..."]
    one = hardware.topology(FakeNVML(count=1, nvlink_pairs=()))
    assert hardware_report.scale_out(one)["notes"] == ["one GPU: one process, no torchrun needed"]


def test_check_hardware_reports_the_gpus_of_this_cpu_machine(cpu_device):
    cfg = loading.load([*TINY], device=cpu_device)
    rep = hardware_report.report(cfg, cpu_device, search=False)
    assert rep["gpus"]["gpus"] == [] and rep["gpus"]["commands"] == ["maxout train hardware=cpu ..."]


# ------------------------------------------------------------------------------------------- launcher


def test_the_launcher_is_torchrun_for_one_node_and_names_the_rank_that_failed(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    from maxout.train import launch

    assert launch.torchrun_args(4, ["model=tiny", "--no-progress"], log_dir="/x/torchrun") == [
        "--standalone", "--nproc-per-node=4", "--log-dir=/x/torchrun", "--module", "maxout", "train", "model=tiny",
        "--no-progress"]
    killed = ChildFailedError("maxout", {1: ProcessFailure(local_rank=1, pid=4242, exitcode=-9, error_file="<N/A>")})
    reason, code = launch.failure_reason(killed)
    assert reason.startswith("rank 1 (local rank 1, pid 4242) failed first: killed by SIGKILL") and code == 1
    usage = ChildFailedError("maxout", {0: ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file="<N/A>"),
                                        1: ProcessFailure(local_rank=1, pid=2, exitcode=2, error_file="<N/A>")})
    reason, code = launch.failure_reason(usage)
    assert "exit code 2; 1 more rank(s) failed" in reason and code == 2


def test_the_launcher_ends_a_run_its_rank_0_left_running(tmp_path):
    import json

    import mlflow

    from maxout.train import launch

    uri = new_store(tmp_path / "mlflow.db")
    client = mlflow.MlflowClient(uri)
    run = client.create_run(client.create_experiment("orphans"))
    (tmp_path / "run.json").write_text(json.dumps({"run_id": run.info.run_id, "tracking_uri": uri}))
    launch.end_orphan_run(tmp_path / "run.json", "job failed: rank 0 (local rank 0, pid 7) failed first: killed "
                                                 "by SIGKILL")
    ended = client.get_run(run.info.run_id)
    assert ended.info.status == "FAILED" and "rank 0" in ended.data.tags["maxout.status_reason"]
    launch.end_orphan_run(tmp_path / "run.json", "another reason")  # closed already: left as it is
    assert "rank 0" in client.get_run(run.info.run_id).data.tags["maxout.status_reason"]
    launch.end_orphan_run(tmp_path / "missing.json", "no run announced")  # rank 0 never got that far: nothing


# ---------------------------------------------------------------- two real processes, gloo (collectives)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, results) -> None:
    """One of two processes: the collectives, then a job where rank 1 fails and rank 0 names it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    import torch.distributed as dist

    from maxout.config import DistributedConfig
    from maxout.hardware import DeviceInfo
    from maxout.train import distributed as d

    out = {}
    with d.session(DistributedConfig(timeout_s=30), DeviceInfo(kind="cpu", name="cpu")) as world:
        out["world"] = (world.rank, world.size, world.nodes, world.backend)
        out["sum"] = world.all_reduce(torch.tensor([rank + 1.0])).item()
        out["min"] = world.agree_min(8 + 8 * rank)
        out["broadcast"] = world.broadcast(f"run-of-rank-{rank}")
        out["log_point"] = world.log_point(2.0 * (rank + 1), 2, {"perf/window_samples_per_s": 10.0,
                                                                            "perf/window_it_per_s": 4.0})
        with d.reporting_failures(world):
            out["job"] = "finished"
        try:
            with d.reporting_failures(world, wait_s=20):
                if rank == 1:
                    raise ValueError("bad batch on rank 1")
                dist.barrier()  # rank 0 waits here until rank 1's failure breaks the collective
        except BaseException as err:  # noqa: BLE001 - recorded for the test
            out["error"] = f"{type(err).__name__}: {err}"
    results.put((rank, out))


@pytest.mark.slow
def test_two_gloo_processes_reduce_agree_and_name_the_rank_that_failed():
    context = rank_processes("tests.test_distributed")
    results, port = context.Queue(), _free_port()
    procs = [context.Process(target=_rank_main, args=(rank, port, results)) for rank in range(2)]
    for proc in procs:
        proc.start()
    got = dict(results.get(timeout=300) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    assert got[0]["world"] == (0, 2, 1, "gloo") and got[1]["world"] == (1, 2, 1, "gloo")
    assert got[0]["sum"] == got[1]["sum"] == 3.0 and got[0]["min"] == got[1]["min"] == 8
    assert got[0]["broadcast"] == got[1]["broadcast"] == "run-of-rank-0"
    # mean loss over ranks and steps ((2 + 4) / 2 / 2); samples/s add up, it/s does not
    assert got[0]["log_point"] == (1.5, {"perf/window_samples_per_s": 20.0, "perf/window_it_per_s": 4.0})
    assert got[1]["error"] == "ValueError: bad batch on rank 1"
    assert got[0]["error"].startswith("RankFailed: rank 1 failed: ValueError: bad batch on rank 1"), got[0]["error"]


def test_a_checkpoint_resumes_only_with_the_number_of_processes_that_wrote_it(tmp_path):
    from maxout.errors import MaxoutError
    from maxout.train import resume

    plan = resume.Plan(cfg=None, run_key="k", run_id="r", checkpoint=tmp_path / "step-00000004.pt",
                       payload={"micro_batch": 4, "accum_steps": 2, "world_size": 2})
    plan.check_batch(4, 2, world_size=2)
    with pytest.raises(MaxoutError, match="saved by 2 process\\(es\\), this job has 1: .* resume with 2 process"):
        plan.check_batch(4, 2, world_size=1)
    old = resume.Plan(cfg=None, run_key="k", payload={"micro_batch": 4, "accum_steps": 2})  # before world_size
    old.check_batch(4, 2)


def test_each_process_samples_its_own_gpu_and_shares_the_node_s_cores(monkeypatch, cpu_device):
    from maxout.config import HardwareConfig
    from maxout.optimizations import dataloader

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")  # e.g. an HPO worker pinned to GPUs 4 and 5
    assert World(local_rank=1).nvml_index == 5 and World().nvml_index == 4
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-3f1c")  # UUIDs: NVML's own order
    assert World(local_rank=1).nvml_index == 1
    node = types.SimpleNamespace(cpu_count=64, is_cuda=True)
    settings, decisions = dataloader.resolve(HardwareConfig(num_workers="auto"), node, processes=8)
    assert settings.num_workers == 6 and "64 cores / 8 processes = 8 - 2" in decisions[0].reason
    assert dataloader.resolve(HardwareConfig(num_workers="auto"), node)[0].num_workers == 62


def test_a_ranks_parallel_wrapper_outlives_its_train_command_until_the_process_exits(monkeypatch):
    """keep_until_exit: in a rank that session() started, the DDP/FSDP wrapper (which holds the process group) stays
    referenced after the command's frames are gone, so no destructor tears the group down before end_process's
    os._exit (a DDP rank on gloo hung for good in ~ProcessGroupGloo as its command returned). Elsewhere (one process,
    or a caller's own process group) nothing is kept."""
    import weakref

    import torch

    from maxout.train import distributed

    monkeypatch.setattr(distributed, "_kept", [])
    for ran, kept in ((False, False), (True, True)):
        monkeypatch.setattr(distributed, "_ran_process_group", ran)
        module = torch.nn.Linear(2, 2)
        alive = weakref.ref(module)
        distributed.keep_until_exit(module)
        del module
        assert (alive() is not None) is kept
    distributed.keep_until_exit(None)  # one process: no wrapper at all
    assert len(distributed._kept) == 1

"""Data-parallel training end to end on CPU with gloo: real torchrun processes (two, on this machine's 2 cores, so
a tiny model and few steps), real MLflow stores, the logged models read back.

The equivalence behind every comparison: in deterministic mode with dropout off, 2 processes with micro-batch B
see, at each step, exactly the rows 1 process with micro-batch 2B sees (each rank takes its half of the global
batch: optimizations/bucketing.py), and DDP and FSDP average the two halves' gradients, which is the gradient of
the mean over the 2B rows. Only the order of floating-point sums differs: two half-batch products plus an
all-reduce instead of one product, and each half padded to its own longest row. Measured here: per-step losses
equal to 3e-8 and final weights to 4e-9 after 8 steps (float32's epsilon is 1.2e-7). TOL = 1e-6 leaves ~30x
headroom and stays far below what a real difference costs: the per-step losses differ from each other, and the
weights from their initial values, by more than 1000 x TOL (asserted), so a rank that trained on other rows, or
gradients summed instead of averaged, fail by orders of magnitude.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pandas as pd
import psutil
import pytest
import torch

from maxout import data, hardware, loading, modeling
from maxout.tracking.tracker import NullTracker
from maxout.train import train
from maxout.train.setup import build

from . import warm_maxout
from .conftest import ROOT, runs_in
from .test_checkpointing import history
from .test_reliability_e2e import logged_weights

pytestmark = pytest.mark.slow
TOL = 1e-6
TIMEOUT_S = 60  # distributed.timeout_s of these jobs: a lost rank must not keep the others longer
STEPS = 24  # 64 rows, 16 per optimizer step: 4 steps per epoch, 6 epochs
STEP_KEYS = ("train/loss", "train/lr", "train/epoch", "perf/window_samples_per_s")


def equivalence(directory: Path, *extra: str, checkpoint_every: int = 8) -> list[str]:
    """Deterministic, dropout off, fp32, 16 samples per optimizer step (24 steps), a checkpoint every
    ``checkpoint_every`` steps: 8 (three saves a job, each one a save of every rank under FSDP) unless a test resumes
    from mid-epoch, which needs one every 2 (every 2 everywhere: the LoRA FSDP test took 36.4 s instead of 34.4)."""
    rows = pd.read_csv(ROOT / "projects/nli_demo/data/train.csv")
    rows.iloc[:64].to_csv(directory / "train.csv", index=False)
    rows.iloc[64:96].to_csv(directory / "validation.csv", index=False)
    return ["hardware=cpu", "model=tiny", "model.dropout=0.0", "hardware.precision=fp32", "train.deterministic=true",
            "train.epochs=6", "train.log_every=1", "train.target_effective_batch=16", "tracking.system_metrics=false",
            f"data.train_path={directory / 'train.csv'}", f"data.validation_path={directory / 'validation.csv'}",
            "train.select_best=last",  # the last step's weights: what the processes must agree on
            f"checkpoint.every_n_steps={checkpoint_every}", f"checkpoint.dir={directory / 'ckpt'}",
            f"distributed.timeout_s={TIMEOUT_S}",
            *extra]


@dataclass
class Reference:
    losses: list  # [(step, loss)]
    weights: dict
    eval_metrics: dict
    real_tokens: float  # every row's tokens, once per epoch: the same however the rows are batched or sharded


def one_process(directory: Path, batch_size: int) -> Reference:
    cfg = loading.load(equivalence(directory, f"train.batch_size={batch_size}", "tracking=none"))
    device = hardware.detect()
    initial = build(cfg, device, data.load(cfg.data), modeling.load_tokenizer(cfg.model)).model.state_dict()
    tracker = NullTracker()
    result = train(cfg, tracker=tracker, progress=False, verbose=False)
    losses = tracker.metrics["train/loss"]
    weights = {k: v.detach().clone() for k, v in result.setup.model.state_dict().items()}
    # The comparisons below are sharp: steps differ from each other and training moved the weights, far past TOL.
    assert len(losses) == STEPS and max(v for _, v in losses) - min(v for _, v in losses) > 1000 * TOL
    assert max((weights[k] - initial[k]).abs().max().item() for k in weights) > 1000 * TOL
    return Reference(losses, weights, {k: v for k, v in result.metrics.items() if k.startswith("eval/")},
                     result.metrics["train/real_tokens"])


@pytest.fixture(scope="module")
def micro_8_x_2(tmp_path_factory):
    """One process, micro-batch 8 x accumulation 2: what 2 processes x micro-batch 4 x accumulation 2 must equal."""
    return one_process(tmp_path_factory.mktemp("one-8x2"), 8)


@pytest.fixture(scope="module")
def micro_16(tmp_path_factory):
    """One process, micro-batch 16, no accumulation: what 2 processes x micro-batch 8 must equal."""
    return one_process(tmp_path_factory.mktemp("one-16"), 16)


def torchrun(*args: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "maxout", "train", *args, "--no-progress"]


def run(command: list[str], timeout: float = 900, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def warm(torchrun_command: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    """``run(torchrun_command)`` with torchrun and its workers forked from tests/warm_maxout.py's server: the same
    launcher and worker processes, without three interpreters' imports (~18 CPU-s). The rank-kill test below keeps
    them fresh: it finds its victim among torchrun's own children."""
    assert torchrun_command[:3] == [sys.executable, "-m", "torch.distributed.run"], torchrun_command
    return warm_maxout.run(torchrun_command[3:], program="torch.distributed.run", timeout=timeout)


def the_run(uri: str):
    runs = runs_in(uri)
    assert len(runs) == 1, [(r.info.run_id, r.info.status) for r in runs]
    return runs[0]


def assert_trained_like(uri: str, run, reference: Reference) -> None:
    """Every step metric once, and the same per-step losses, final weights and evaluation as ``reference``."""
    for key in STEP_KEYS:
        assert [s for s, _ in history(uri, run.info.run_id, key)] == list(range(1, STEPS + 1)), key
    losses = history(uri, run.info.run_id, "train/loss")
    assert max(abs(a - b) for (_, a), (_, b) in zip(losses, reference.losses)) < TOL
    weights = logged_weights(uri, run)
    assert set(weights) == set(reference.weights)
    assert max((weights[k] - reference.weights[k]).abs().max().item() for k in weights) < TOL
    for key, value in reference.eval_metrics.items():  # evaluation sharded over the ranks, counts all-reduced
        assert abs(run.data.metrics[key] - value) < TOL, key


def test_torchrun_two_processes_one_finished_run_trained_like_one_process_with_twice_the_batch(
        tmp_path, mlflow_store, micro_8_x_2):
    uri = mlflow_store["uri"]
    job = warm(torchrun(*equivalence(tmp_path, "train.batch_size=4"), *mlflow_store["overrides"]))
    assert job.returncode == 0, job.stderr[-3000:]
    assert job.stdout.count("maxout: done") == 1  # one report per job: rank 0's
    run_ = the_run(uri)
    params = run_.data.params
    assert run_.info.status == "FINISHED"
    assert (params["dist.world_size"], params["dist.backend"], params["dist.nodes"]) == ("2", "gloo", "1")
    assert (params["dist.micro_batch_per_rank"], params["derived.accumulation_steps"],
            params["dist.global_effective_batch"], params["derived.effective_batch"]) == ("4", "2", "16", "16")
    assert params["opt.data_parallel.effective"] == "ddp" and params["opt.accumulation.effective"] == "16"
    assert 1.0 <= float(params["dist.token_imbalance"]) < 1.5
    assert run_.data.metrics["perf/samples_per_s"] > 0 and run_.data.metrics["mem/peak_rss_gb"] > 0
    assert_trained_like(uri, run_, micro_8_x_2)
    assert not list((tmp_path / "ckpt").rglob("step-*.pt"))  # a finished run keeps no checkpoints


def test_fsdp_on_cpu_trains_like_ddp_and_logs_the_same_model(tmp_path, mlflow_store, micro_8_x_2):
    """FSDP2's fully_shard over gloo (torch 2.13 runs it on CPU), started by maxout's own launcher. The job leaves
    nothing in the temporary folder (torchrun's own default would leave a torchelastic_* folder per job)."""
    uri, scratch = mlflow_store["uri"], tmp_path / "tmp"
    scratch.mkdir()
    job = warm_maxout.run(["train", "--nproc-per-node", "2", "--no-progress",  # the launcher forked warm
                           *equivalence(tmp_path, "train.batch_size=4", "distributed.strategy=fsdp"),
                           *mlflow_store["overrides"]], env={**os.environ, "TMPDIR": str(scratch)}, timeout=900)
    assert job.returncode == 0, job.stderr[-3000:]
    assert list(scratch.iterdir()) == []
    run_ = the_run(uri)
    assert run_.info.status == "FINISHED" and run_.data.params["opt.data_parallel.effective"] == "fsdp"
    assert_trained_like(uri, run_, micro_8_x_2)  # the logged model: the full state dict gathered from the shards


def test_packed_batches_and_model_selection_under_fsdp_give_ddps_model(tmp_path, mlflow_store):
    """Packing (token-budget batches dealt out by rank), per-sample pooling under FSDP's root, and the selected
    evaluation's weights kept from the shards: the same run as under DDP, which holds whole weights."""
    uri, models = mlflow_store["uri"], {}
    for strategy in ("ddp", "fsdp"):
        folder = tmp_path / strategy
        folder.mkdir()
        args = [*equivalence(folder, "train.batch_size=4", f"distributed.strategy={strategy}",
                             "data.padding=packed", "data.max_tokens_per_batch=auto", "train.select_best=eval/loss",
                             "train.eval_every_epochs=0.5", "train.lr=1e-3", f"tracking.run_name={strategy}")]
        job = warm_maxout.run(["train", "--nproc-per-node", "2", "--no-progress", *args, *mlflow_store["overrides"]],
                              timeout=900)
        assert job.returncode == 0, job.stderr[-3000:]
        (run_,) = [r for r in runs_in(uri) if r.info.run_name == strategy]
        params, metrics = run_.data.params, run_.data.metrics
        assert run_.info.status == "FINISHED" and params["opt.data_parallel.effective"] == strategy
        assert params["opt.padding.effective"] == "packed" and params["derived.pooling"]
        losses = history(uri, run_.info.run_id, "eval/loss")
        best_step, best_loss = min(((s, v) for s, v in losses), key=lambda sv: sv[1])
        assert metrics["best/step"] == best_step and abs(metrics["best/eval/loss"] - best_loss) < TOL
        models[strategy] = (best_step, logged_weights(uri, run_))
    assert models["ddp"][0] == models["fsdp"][0]
    ddp, fsdp = models["ddp"][1], models["fsdp"][1]
    assert set(ddp) == set(fsdp) and max((ddp[k] - fsdp[k]).abs().max().item() for k in ddp) < 1e-5


def test_a_lora_decoder_with_last_token_pooling_under_fsdp_gives_ddps_model(tmp_path, mlflow_store):
    """FSDP over a peft model (frozen base weights and trainable adapters in the same shards) with a decoder's
    last-token pooling: the adapters and the head it logs are DDP's, and the frozen weights did not move."""
    uri, models = mlflow_store["uri"], {}
    for strategy in ("ddp", "fsdp"):
        folder = tmp_path / strategy
        folder.mkdir()
        args = [*equivalence(folder, "train.batch_size=4", f"distributed.strategy={strategy}", "model=tiny_qwen3",
                             "model.adapter=lora", "model.lora_dropout=0.0", "train.epochs=2", "train.lr=1e-2",
                             f"tracking.run_name={strategy}")]
        job = warm_maxout.run(["train", "--nproc-per-node", "2", "--no-progress", *args, *mlflow_store["overrides"]],
                              timeout=900)
        assert job.returncode == 0, job.stderr[-3000:]
        (run_,) = [r for r in runs_in(uri) if r.info.run_name == strategy]
        params = run_.data.params
        assert run_.info.status == "FINISHED" and params["opt.data_parallel.effective"] == strategy
        assert params["opt.adapter.effective"] == "lora" and params["derived.pooling"] == "last"
        models[strategy] = logged_weights(uri, run_)
    ddp, fsdp = models["ddp"], models["fsdp"]
    assert set(ddp) == set(fsdp)
    assert max((ddp[k] - fsdp[k]).abs().max().item() for k in ddp) < 1e-5
    # The logged model has its adapters merged. The comparison is sharp: the merged projections moved from the
    # random start far past the tolerance, and the weights LoRA does not touch (the embeddings) did not move.
    cfg = loading.load(equivalence(tmp_path / "ddp", "model=tiny_qwen3", "tracking=none"))
    start = build(cfg, hardware.detect(), data.load(cfg.data), modeling.load_tokenizer(cfg.model)).model.state_dict()
    projections = [k for k in ddp if k.endswith("q_proj.weight")]
    assert projections and all(k in start for k in projections)
    assert min((ddp[k] - start[k]).abs().max().item() for k in projections) > 1e-3
    assert torch.equal(ddp["model.embed_tokens.weight"], start["model.embed_tokens.weight"])


def _checkpoint_at(root: Path, job: subprocess.Popen, min_step: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if [p for p in root.glob("*/*/step-*") if int(p.stem.split("-")[1]) >= min_step]:  # .pt, or FSDP's .dcp/
            return
        assert job.poll() is None, f"the job ended (rc {job.returncode}) first: {job.stdout.read()[-3000:]}"
        time.sleep(0.02)
    pytest.fail(f"no checkpoint at step >= {min_step} within {timeout_s} s")


def _rank_pid(job: subprocess.Popen, rank: int) -> int:
    for child in psutil.Process(job.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "maxout" in " ".join(child.cmdline()):
                return child.pid
        except psutil.Error:
            continue
    pytest.fail(f"no process of rank {rank} under torchrun {job.pid}")


def test_a_rank_killed_mid_epoch_fails_the_run_naming_it_and_resume_auto_finishes_the_same_run(
        tmp_path, mlflow_store, micro_8_x_2):
    """FSDP, so the checkpoint that resumes it is each rank's shard (torch.distributed.checkpoint), read back by each
    rank; plain torchrun, so rank 0 alone finds out which rank was lost."""
    uri = mlflow_store["uri"]
    args = [*equivalence(tmp_path, "train.batch_size=4", "distributed.strategy=fsdp", checkpoint_every=2),
            *mlflow_store["overrides"], f"tracking.spool_dir={tmp_path / 'spool'}"]
    job = subprocess.Popen(torchrun(*args), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        _checkpoint_at(tmp_path / "ckpt", job, min_step=2)  # step 2 of epoch 1's 4: mid-epoch
        os.kill(_rank_pid(job, 1), signal.SIGKILL)
        killed = time.monotonic()
        out = job.communicate(timeout=TIMEOUT_S + 120)[0]
        took = time.monotonic() - killed
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode != 0 and took < TIMEOUT_S, (took, out[-3000:])
    failed = the_run(uri)
    reason = failed.data.tags["maxout.status_reason"]
    assert failed.info.status == "FAILED" and reason.startswith("RankFailed: rank 1 lost: no word from it"), reason

    resumed = warm(torchrun(*args, "resume=auto"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "maxout: resuming from step" in resumed.stderr
    finished = the_run(uri)
    assert finished.info.run_id == failed.info.run_id and finished.info.status == "FINISHED"
    assert int(finished.data.tags["maxout.resumed_from_step"]) >= 2
    assert_trained_like(uri, finished, micro_8_x_2)  # exactly where it stopped: each rank's data and RNG
    # Each rank went on from its own counters: the job's real tokens are every row's, once per epoch (rank 0's
    # counters restored on both ranks would count its share twice; the ranks' rows differ in length).
    assert finished.data.metrics["train/real_tokens"] == micro_8_x_2.real_tokens
    assert finished.data.metrics["train/samples"] == 64 * 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_agents_as_two_nodes_on_loopback_train_one_job(tmp_path, mlflow_store, micro_16):
    uri, port = mlflow_store["uri"], _free_port()
    node = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=maxout-{port}", "-m", "maxout", "train", *equivalence(tmp_path, "train.batch_size=8"),
            *mlflow_store["overrides"], "--no-progress"]
    # torchrun's two agents and their workers forked warm (tests/warm_maxout.py): real processes, rendezvous on
    # loopback, without four interpreters' imports
    agents = [warm_maxout.popen(node, program="torch.distributed.run", stdout=warm_maxout.PIPE,
                                stderr=warm_maxout.PIPE) for _ in range(2)]
    outputs = [agent.communicate(timeout=900) for agent in agents]
    assert [a.returncode for a in agents] == [0, 0], [err[-2000:] for _, err in outputs]
    run_ = the_run(uri)
    params = run_.data.params
    assert run_.info.status == "FINISHED"
    assert (params["dist.world_size"], params["dist.nodes"], params["dist.local_world_size"]) == ("2", "2", "1")
    assert params["derived.accumulation_steps"] == "1" and params["dist.global_effective_batch"] == "16"
    assert_trained_like(uri, run_, micro_16)


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_nccl_on_two_gpus(tmp_path, mlflow_store, strategy):
    """The GPU path: NCCL, one GPU per rank, bf16 (fp16 on pre-Ampere GPUs). Runs where two GPUs are visible."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, {torch.cuda.device_count()} visible")
    uri = mlflow_store["uri"]
    job = run(torchrun("hardware=auto", "model=tiny", "train.max_steps=6", "train.epochs=1", "train.log_every=1",
                       "train.batch_size=8", "train.target_effective_batch=32", f"distributed.strategy={strategy}",
                       f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every_n_steps=2",
                       *mlflow_store["overrides"]))
    assert job.returncode == 0, job.stderr[-3000:]
    run_ = the_run(uri)
    params, metrics = run_.data.params, run_.data.metrics
    assert run_.info.status == "FINISHED" and params["dist.backend"] == "nccl"
    assert params["opt.data_parallel.effective"] == strategy and params["derived.accumulation_steps"] == "2"
    assert metrics["mem/peak_allocated_gb"] > 0
    assert [s for s, _ in history(uri, run_.info.run_id, "train/loss")] == list(range(1, 7))

"""Shared fixtures: the real config composed with CPU/tiny overrides, a temporary MLflow store, fake devices
for the pure support checks, the `gpu` marker (runs only where a CUDA device is visible), and no Hub: every test
runs with HF_HUB_OFFLINE=1 unless it opts out (tests/test_hub.py)."""

from __future__ import annotations

import os
from pathlib import Path

# No test reaches the real Hugging Face Hub. maxout downloads a model by name when the cache lacks it, so every test
# runs offline (HF_HUB_OFFLINE=1, set per test below: a missing model is the one-line "not available offline"
# error), and huggingface_hub's default endpoint, read once at its import, is a loopback port where nothing
# listens. The Hub tests (tests/test_hub.py) unset HF_HUB_OFFLINE and point HF_ENDPOINT at a server of their own
# (tests/hub_server.py).
DEAD_HUB = "http://127.0.0.1:9"  # the discard port: connections are refused at once
os.environ["HF_ENDPOINT"] = DEAD_HUB
os.environ.pop("HF_HUB_OFFLINE", None)  # per test instead: read at huggingface_hub's import, it could not be undone
os.environ.pop("TRANSFORMERS_OFFLINE", None)
os.environ.pop("HF_TOKEN", None)  # a developer's own token stays out of the tests

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MLFLOW_VARS = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID")

# Tiny, fast, CPU: what most tests train with.
TINY = ["hardware=cpu", "model=tiny", "tracking=none", "train.max_steps=3", "train.epochs=1", "train.log_every=1"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none visible)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolate(monkeypatch):
    """Run from the repo root (relative data paths), with no MLflow variables leaking in, and restore the
    process-wide torch switches that optimizations flip."""
    from maxout import hub

    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("MAXOUT_ROOT", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", DEAD_HUB)
    hub.forget()
    for var in MLFLOW_VARS:
        monkeypatch.delenv(var, raising=False)
    yield
    import mlflow

    while mlflow.active_run():
        mlflow.end_run()
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False
    torch.backends.cudnn.benchmark = False


@pytest.fixture
def mlflow_store(tmp_path):
    """A temporary embedded store: overrides that point tracking at it, plus the URI for queries."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = ["tracking=local", f"tracking.uri={uri}", f"tracking.artifact_location={(tmp_path / 'art').as_uri()}",
                 "tracking.system_metrics=false"]
    return {"uri": uri, "overrides": overrides, "dir": tmp_path}


def runs_in(uri: str):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(exps) if exps else []


@pytest.fixture(scope="session")
def cpu_device():
    from maxout import hardware

    return hardware.detect()


def fake_cuda(name="NVIDIA GeForce RTX 3090", memory_gb=24.0, cc=(8, 6), flash=False):
    """A CUDA DeviceInfo for the pure support checks and profile picking (no GPU needed)."""
    from maxout.hardware import DeviceInfo

    return DeviceInfo(kind="cuda", name=name, count=1, total_memory_gb=memory_gb, compute_capability=cc,
                      bf16=cc >= (8, 0), tf32=cc >= (8, 0), flash_attention=flash,
                      flash_attention_reason="" if flash else "the flash_attn package is not installed",
                      torch_version=torch.__version__, cpu_count=os.cpu_count() or 1, compiler="/usr/bin/cc")


@pytest.fixture
def one_torch_thread():
    """One intra-op thread for tiny-model steps: on a machine shared with other jobs, OpenMP threads spinning against
    other processes make a step up to ten times slower. Nothing asserted depends on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

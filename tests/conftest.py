"""Shared fixtures: the real config composed with CPU/tiny overrides, a temporary MLflow store, fake devices
for the pure support checks, the `gpu` marker (runs only where a CUDA device is visible), and no Hub: every test
runs with HF_HUB_OFFLINE=1 unless it opts out (tests/test_hub.py)."""

from __future__ import annotations

import collections
import gc
import os
import sys
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

# make test runs the suite in two pytest-xdist workers on the two cores. Each worker's torch (and every process it
# starts, which inherit the variable) gets one intra-op thread: OpenMP threads spinning against the other worker's
# make a tiny model's step up to ten times slower (the one_torch_thread fixture below). A process that sets its
# own (hpo workers: hpo/placement.py) still does.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from maxout.errors import exit_without_collecting  # noqa: E402
from tests import warm_maxout  # noqa: E402

# The warm server's commands run with the environment a test's body has (_isolate below), whichever fixture or test
# starts the server first
warm_maxout.SERVER_ENVIRONMENT.update(HF_HUB_OFFLINE="1", HF_ENDPOINT=DEAD_HUB)

# Each pytest process (the two xdist workers and their controller) holds millions of objects by the end of a
# session: skip the interpreter's last garbage collection over them at exit, as every maxout process does.
exit_without_collecting()

ROOT = Path(__file__).resolve().parents[1]
MLFLOW_VARS = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID")

# Tiny, fast, CPU: what most tests train with.
TINY = ["hardware=cpu", "model=tiny", "tracking=none", "train.max_steps=3", "train.epochs=1", "train.log_every=1"]
# `python -c HEAVY_IMPORTS_PROBE COMMAND ARGS...`: runs one maxout command in a fresh interpreter, then prints which
# of torch, transformers and mlflow it imported (a sorted list) and exits with the command's code
HEAVY_IMPORTS_PROBE = ("import sys; from maxout import cli; code = cli.main(sys.argv[1:]); "
                       "print(sorted(m for m in ('torch', 'transformers', 'mlflow') if m in sys.modules)); "
                       "sys.exit(code)")


# pytest-xdist (make test: -n 2 --dist loadgroup) runs each group's tests on one worker. The groups: the Docker
# tests (one engine, and the image they wait for), and the modules whose module-scoped fixtures start servers or
# train, which two workers would otherwise each pay for.
XDIST_GROUPS = {"tests/test_mlflow_run.py": "docker", "tests/test_platform.py": "platform-stack",
                "tests/test_registry_e2e.py": "registry-server", "tests/test_registry_race.py": "registry-race",
                "tests/test_distributed_e2e.py": "torchrun", "tests/test_slurm.py": "slurm-cluster"}
LATE_GROUPS = ("docker",)
# Tests grouped by node id. The cases that compile with inductor on this CPU: on one worker the later ones find the
# first one's compiled code in the process (0.4 s); dealt to both, one waited 11.7 s on inductor's cache lock while
# the other compiled (a fresh-clone run, 2026-11-27), then compiled again from the cache.
NODE_GROUPS = {"tests/test_optimizations.py::test_optimization_support_apply_and_params[compile": "inductor",
               "tests/test_optimizations.py::test_optimization_support_apply_and_params[inductor_tuning": "inductor"}


def xdist_group(nodeid: str) -> str:
    """The unit of work a test belongs to under --dist loadgroup: its module's group, its node id's, or itself."""
    return XDIST_GROUPS.get(nodeid.split("::")[0]) or next(
        (group for prefix, group in NODE_GROUPS.items() if nodeid.startswith(prefix)), nodeid)


def queue_order(items: list) -> list:
    """The queue xdist deals from, the same in every worker (xdist requires it). Modules stay whole (their
    module-scoped fixtures are set up once); the modules with slow end-to-end tests come first, so that the many
    short tests fill the gaps at the end and both workers finish together. The Docker group waits on an image that
    builds in the background for minutes on a new machine: it goes in after most of the slow modules, with short
    tests still queued behind it for the other worker."""
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    slow = [m for m, its in modules.items() if any(i.get_closest_marker("slow") for i in its)]
    late = [m for m in slow if XDIST_GROUPS.get(m) in LATE_GROUPS]
    slow = [m for m in slow if m not in late]
    rest = [m for m in modules if m not in slow and m not in late]
    cut = len(slow) * 3 // 4
    order = slow[:cut] + late + slow[cut:] + rest
    return [item for m in order for item in modules[m]]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist controller, --dist loadgroup: XDIST_GROUPS by file, NODE_GROUPS by node id. xdist's own loadgroup
    reads xdist_group marks through a node id suffix that pytest 9 no longer lets it write (Node.nodeid is derived),
    so every test was dealt on its own."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    items[:] = queue_order(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none visible)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Where tests that need the Docker engine were collected, start it and build its image now, in the
    background, so that the minutes of downloads overlap the tests that run before them. Under pytest-xdist the
    controller does it instead (pytest_xdist_node_collection_finished): a worker only checks that the controller,
    which sees test ids and not fixtures, knows every file that uses the engine."""
    from . import docker_engine  # lazy: it imports this module

    users = {item.nodeid.split("::")[0] for item in session.items if "engine" in getattr(item, "fixturenames", ())}
    if session.config.option.collectonly:
        return  # nothing runs: no engine (it made --collect-only wait minutes for an image build at its end)
    if XDIST_WORKER:
        unknown = users - set(docker_engine.ENGINE_TEST_FILES)
        if unknown:
            raise pytest.UsageError(f"{sorted(unknown)} use the Docker engine: add them to "
                                    f"tests/docker_engine.py's ENGINE_TEST_FILES")
    elif users:
        docker_engine.prepare_in_background()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist controller: tell each worker where the controller hands over the Docker engine."""
    node.workerinput["maxout_engine_handoff"] = str(_engine_handoff())


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """xdist controller: start the Docker engine and its image build as soon as a worker collected a test that
    uses it. The controller outlives every worker, so the engine is there for whichever worker runs those tests."""
    from . import docker_engine  # lazy: it imports this module

    if not node.config.option.collectonly and any(i.split("::")[0] in docker_engine.ENGINE_TEST_FILES for i in ids):
        docker_engine.HANDOFF = _engine_handoff()
        docker_engine.prepare_in_background(docker_engine.HANDOFF)


def _engine_handoff() -> Path:
    from . import docker_engine  # lazy: it imports this module

    return docker_engine.ENGINE_DIR / f"handoff-{os.getpid()}.json"


_FROZEN_FOR: list = [None]  # the module whose first test froze the heap last


def pytest_runtest_setup(item):
    """At each module's first test, the heap is collected once and frozen (gc.freeze): what is alive then (the
    libraries, the test modules, session fixtures and caches) outlives the module, and the automatic full
    collections during its tests then traverse only what they made, not the ~1.3 million objects before them.
    Six modules' in-process tests: 12.0 CPU-s of full collections, 7.7 with this (measured 2026-11-28). The previous
    module's fixtures are finalized by then, so none of their cycles is frozen; objects frozen here that die later
    stay until the process ends, as every object alive at exit does (conftest's exit_without_collecting)."""
    if item.module is not _FROZEN_FOR[0]:
        _FROZEN_FOR[0] = item.module
        gc.collect()
        gc.freeze()


def pytest_configure(config):
    handoff = getattr(config, "workerinput", {}).get("maxout_engine_handoff")
    if handoff:
        from . import docker_engine  # lazy: it imports this module

        docker_engine.HANDOFF = Path(handoff)


def pytest_sessionfinish(session):
    from . import docker_engine  # lazy: it imports this module

    docker_engine.stop_background()


@pytest.fixture(autouse=True)
def _isolate(monkeypatch):
    """Run from the repo root (relative data paths), with no MLflow variables leaking in, and restore the
    process-wide torch switches that optimizations flip, the environment, and sys.path: loading a model in-process
    puts its code/ folder first on sys.path (MLflow's pyfunc code paths), and a process spawned later inherits it.
    A fresh clone's run (-n 3) failed test_sharded_checkpoint that way: its spawned ranks imported maxout from
    tests/data/pickled_model/code, which test_pyfunc had loaded on the same worker."""
    from maxout import hub

    environ = dict(os.environ)  # restored after the test, whatever it set (tests/warm_maxout.py compares its own)
    monkeypatch.setattr(sys, "path", list(sys.path))  # restored after the test, whatever it prepended
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
    if dict(os.environ) != environ:  # e.g. the GPU report's runner, built in-process, sets its compile threads
        os.environ.clear()
        os.environ.update(environ)


@pytest.fixture
def mlflow_store(tmp_path):
    """A temporary embedded store, empty: overrides that point tracking at it, plus the URI for queries. The file
    is a copy of a migrated one (tests/store_template.py): MLflow's migrations cost seconds per new store."""
    from .store_template import new_store

    new_store(tmp_path / "mlflow.db")
    return _store(tmp_path)


@pytest.fixture
def no_mlflow_store(tmp_path):
    """Like mlflow_store, but no file exists yet: for tests whose point is that nothing creates it."""
    return _store(tmp_path)


def _store(folder: Path) -> dict:
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    overrides = ["tracking=local", f"tracking.uri={uri}", f"tracking.artifact_location={(folder / 'art').as_uri()}",
                 "tracking.system_metrics=false"]
    return {"uri": uri, "overrides": overrides, "dir": folder}


def runs_in(uri: str):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(exps) if exps else []


def two_invocations_shared_one_study(study, logs: list, parent_id: str) -> None:
    """What is certain when two ``maxout hpo`` invocations (hpo.parent=shared) run one study: every trial ran in one
    of them, the trial lines they printed add up to its COMPLETE trials, and one created the parent run that the
    other joined. Not that each ran a trial: the one that starts seconds later (its Python start-up, or the study's
    lock for the parent run, on a loaded machine) may find every trial taken."""
    from optuna.trial import TrialState

    workers = {t.user_attrs["worker"] for t in study.trials}
    assert 1 <= len(workers) <= 2, workers
    done = sum(t.state == TrialState.COMPLETE for t in study.trials)
    assert sum(log.count(" COMPLETE after ") for log in logs) == done >= 4, logs
    said = [[verb for verb in ("created", "joined") if f"{verb} its shared parent run {parent_id}" in log]
            for log in logs]
    assert sorted(said) == [["created"], ["joined"]], logs


def load_pyfunc(uri: str):
    """mlflow.pyfunc.load_model(uri) with its files in a folder removed when this process ends: without dst_path,
    MLflow downloads a model into a new temporary folder that nothing removes (a model copy in /tmp per call). Not
    removed sooner: the pyfunc's code folder stays on sys.path while the caller predicts."""
    import atexit
    import shutil
    import tempfile

    import mlflow

    folder = tempfile.mkdtemp(prefix="maxout-test-model-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return mlflow.pyfunc.load_model(uri, dst_path=folder)


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
def graphs(monkeypatch):
    """Every graph dynamo compiles from here on, through compile.apply (the trainer's only way to compile), counted
    by dynamo's eager backend standing in for inductor: the same graphs and guards, no kernels generated."""
    import functools

    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    from maxout.optimizations import compile as compile_opt

    counter = CompileCounterWithBackend("eager")
    monkeypatch.setattr(compile_opt, "apply", functools.partial(compile_opt.apply, backend=counter))
    torch._dynamo.reset()
    yield counter
    torch._dynamo.reset()


@pytest.fixture
def warm_starts(monkeypatch) -> list:
    """Every train.warm.WarmStart the test's process makes, in order: a caller that shares one between its runs
    makes one, and its ``hits`` count the tokenized tables the later runs reused."""
    from maxout.train import warm

    made, real = [], warm.WarmStart.__init__
    monkeypatch.setattr(warm.WarmStart, "__init__", lambda self: (real(self), made.append(self))[0])
    return made


@pytest.fixture
def tokenized_rows(monkeypatch) -> collections.Counter:
    """How often the test's process tokenized a table of each size: {rows: calls}, from every tokenizer's __call__
    with a list of texts (data.encode's call). A table tokenized twice for one run counts 2 at its size."""
    from transformers import PreTrainedTokenizerBase

    calls, tokenize = collections.Counter(), PreTrainedTokenizerBase.__call__

    def counted(self, text=None, *args, **kwargs):
        if isinstance(text, list):
            calls[len(text)] += 1
        return tokenize(self, text, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", counted)
    return calls


@pytest.fixture
def one_torch_thread():
    """One intra-op thread for tiny-model steps: on a machine shared with other jobs, OpenMP threads spinning against
    other processes make a step up to ten times slower. Nothing asserted depends on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rank_processes(module: str):
    """The multiprocessing context of the tests that start their ranks as Python functions (gloo collectives, FSDP
    shards): forkserver. Like spawn, which they used, each rank is a process that shares no thread or state with this
    one (an xdist worker runs execnet's threads, so a plain fork could inherit a held lock), and gets this process's
    sys.path and folder at its start; unlike spawn, the ranks are forked from one server process that imported torch,
    maxout's training modules and the test's ``module`` once (its first use in this process), not each rank itself:
    ~5-7 CPU-s a rank on the 2-core test machines. The server keeps the environment it started with: the ranks set
    their own variables (MASTER_ADDR, RANK, ...)."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "maxout.train", module])
    return context

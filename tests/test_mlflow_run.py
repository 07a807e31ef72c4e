"""`mlflow run .` through a real Docker engine, as a user starts it from a fresh clone (docs/tutorials/gpu-box.md,
"`mlflow run` in the CUDA image"), against the three stores:

- (a) the embedded store (mlflow.db and mlruns/ in the project folder: what `make ui` opens), with no `-A`: as an
  ordinary user, as root, and as a user of rootless Docker (issue 38);
- (b) a tracking server with proxied artifacts, with `-A network=host`;
- (c) a tracking server whose artifacts go to S3 directly (moto), with `-A network=host`;

and a model by name from a Hub on loopback (tests/hub_server.py: olah behind an nginx gate that wants HF_TOKEN),
downloaded inside the container into the cache volume once, with HF_TOKEN and HF_ENDPOINT passed by name.

The image is `make image-cpu` (tests/docker_engine.py builds it once per session), the CPU stand-in of the CUDA
image from the same Dockerfile. Each run is checked in its store: FINISHED, the params and metrics maxout logs, and
a model that loads and predicts. Each missing `-A` gets a one-line error that names it, and a FAILED run. The job
runs as the store's owner (or uid 10001 without a local store): the image's entrypoint starts as root to hand
folders over, then drops to that user, unless the owner is root (root's own store, or rootless Docker's user).
"""

from __future__ import annotations

import pwd
import shutil
import tempfile
from pathlib import Path

import mlflow
import pandas as pd
import pytest

from . import docker_engine, hub_server, rootless_engine, services
from .conftest import load_pyfunc

pytestmark = pytest.mark.slow

OVERRIDES = "model=tiny train.max_steps=4 train.epochs=1 train.log_every=1"
EXAMPLE = pd.DataFrame({"post": ["I lie awake every night.", "We painted the fence."],
                        "criterion": ["Sleep disturbance", "Fatigue"]})
CORE_METRICS = {"train/loss", "eval/loss", "eval/accuracy", "eval/macro_f1", "perf/samples_per_s", "perf/tokens_per_s"}


@pytest.fixture(scope="module")
def engine():
    with docker_engine.engine() as running:
        yield running


@pytest.fixture(scope="module", autouse=True)
def rootless(request, engine):
    """The test user's rootless engine for test_rootless_docker, the module's last test: started, and the image
    loaded into it, in the background from the module's first test on, while the tests before it mostly wait on
    their containers (tests/rootless_engine.py). None where that test is not selected."""
    if not any(item.name == "test_rootless_docker" for item in request.session.items):
        yield None
        return
    with rootless_engine.ready_in_background(engine) as ready:
        yield ready


@pytest.fixture
def project(engine):
    """A copy of the tree the test user owns, outside pytest's private temporary folder (see project_copy)."""
    folder = Path(tempfile.mkdtemp(prefix="maxout-clone-"))
    folder.chmod(0o755)
    yield docker_engine.project_copy(folder)
    shutil.rmtree(folder, ignore_errors=True)  # 14 MB a test


def run(engine, project, *args, env=None, hardware="cpu"):
    params = (["-P", f"hardware={hardware}"] if hardware else []) + ["-P", f"overrides={OVERRIDES}"]
    return docker_engine.mlflow_run(engine, project, [*params, *args], env=env)


def the_only_run(tracking_uri: str):
    client = mlflow.MlflowClient(tracking_uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1, [(r.info.run_id, r.info.status) for r in runs]
    return runs[0]


def assert_trained_and_logged(run, tracking_uri: str, hardware: str = "cpu") -> None:
    assert run.info.status == "FINISHED"
    params, tags = run.data.params, run.data.tags
    assert params["cfg.model.name"] == "tiny" and params["cfg.hardware.name"] == "cpu"
    assert params["hardware"] == hardware  # MLproject's parameter, logged by mlflow run itself
    assert params["opt.precision.effective"] in ("bf16", "fp32") and params["device.kind"] == "cpu"
    assert CORE_METRICS <= set(run.data.metrics), CORE_METRICS - set(run.data.metrics)
    assert tags["mlflow.project.env"] == "docker" and tags["mlflow.docker.image.uri"] == docker_engine.IMAGE
    mlflow.set_tracking_uri(tracking_uri)
    predictions = load_pyfunc(tags["maxout.model_uri"]).predict(EXAMPLE)
    assert list(predictions.columns) == ["label", "prob_0", "prob_1"] and len(predictions) == 2
    assert all(abs(p0 + p1 - 1) < 1e-4 for p0, p1 in zip(predictions["prob_0"], predictions["prob_1"]))


def assert_one_line_error(result, fix: str) -> None:
    errors = [line for line in result.stderr.splitlines() if line.startswith("maxout: error:")]
    assert result.returncode != 0 and len(errors) == 1, result.stderr[-3000:]
    assert fix in errors[0], errors[0]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def test_the_embedded_store(engine, project):
    """(a): `mlflow run . -P hardware=cpu` as written, no `-A`. The store is the user's mlflow.db and mlruns/; the
    container starts as root only to hand the folders Docker created for the run back to the user, and trains as
    the user. Nothing in the store is left root's, and the last line names the store as the user sees it."""
    store = f"sqlite:///{project / 'mlflow.db'}"
    result = run(engine, project, env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    last = [line for line in result.stdout.splitlines() if line.startswith("maxout: MLflow run ")][-1]
    assert last.endswith(f"(tracking URI: {store})"), last  # not the container's /mlflow/tmp/mlruns
    assert_store_is_owned_by(project, pwd.getpwnam(docker_engine.USER).pw_uid)
    run_ = the_only_run(store)
    assert_trained_and_logged(run_, store)
    # The thread cap of the shell `mlflow run` starts in reached the job (MLproject passes it by name); torch would
    # otherwise take one thread per core the container sees, two here
    assert run_.data.params["device.torch_threads"] == "1"


def assert_store_is_owned_by(project: Path, uid: int) -> None:
    """Every file of the store, the run's artifacts and the model's files among them, is ``uid``'s on the host.
    Checked before this (root) process loads the model: MLflow writes a file into a local model's folder when it
    does."""
    owners = {path: path.stat().st_uid for path in [project / "mlflow.db", *(project / "mlruns").rglob("*")]}
    assert {p: o for p, o in owners.items() if o != uid} == {}
    assert any(p.name == "MLmodel" for p in owners)


def test_the_embedded_store_as_root(engine, tmp_path):
    """Issue 38: root's own clone (a GPU cloud container's shell, Colab, a CI runner), `mlflow run .` with no `-P`
    and no `-A` (MLproject's default: hardware=auto). The store is root's, so the job runs as root: FINISHED, the
    model logged, every file the run added root's, and the last line names the host's store."""
    project = docker_engine.project_copy(tmp_path / "clone", owner="root")
    store = f"sqlite:///{project / 'mlflow.db'}"
    result = docker_engine.mlflow_run(engine, project, ["-P", f"overrides={OVERRIDES}"], as_user="root")
    assert result.returncode == 0, result.stderr[-4000:]
    last = [line for line in result.stdout.splitlines() if line.startswith("maxout: MLflow run ")][-1]
    assert last.endswith(f"(tracking URI: {store})"), last
    assert_store_is_owned_by(project, 0)
    assert_trained_and_logged(the_only_run(store), store, hardware="auto")


def test_a_gpu_profile_without_gpus_all_says_what_to_add(engine, project):
    """The `-A` a GPU needs: without it no GPU reaches the container, and a GPU profile stops in one line."""
    result = run(engine, project, hardware="rtx3090")
    assert_one_line_error(result, "Inside a container, pass -A gpus=all to mlflow run.")
    (failed,) = mlflow.MlflowClient(f"sqlite:///{project / 'mlflow.db'}").search_runs(["0"])
    assert failed.info.status == "FAILED"


def test_a_tracking_server_with_proxied_artifacts(engine, project, tmp_path):
    """(b): the container reaches the server on the host's network and sends artifacts through it."""
    with services.mlflow_server(f"sqlite:///{tmp_path / 'server.db'}",
                                artifacts_destination=str(tmp_path / "artifacts")) as url:
        missing = run(engine, project, env={"MLFLOW_TRACKING_URI": url}, hardware="auto")
        assert_one_line_error(missing, "pass -A network=host to mlflow run")
        result = run(engine, project, "-A", "network=host", env={"MLFLOW_TRACKING_URI": url})
        assert result.returncode == 0, result.stderr[-4000:]
        client = mlflow.MlflowClient(url)
        runs = client.search_runs(["0"], order_by=["attributes.start_time DESC"])
        assert [r.info.status for r in runs] == ["FINISHED", "FAILED"]
        assert runs[0].info.artifact_uri.startswith("mlflow-artifacts:")
        assert_trained_and_logged(runs[0], url)
    assert list((tmp_path / "artifacts").rglob("MLmodel"))  # the server stored the model
    assert not (project / "mlruns").exists() and not (project / "mlflow.db").exists()


def test_a_tracking_server_with_direct_s3_artifacts(engine, project, tmp_path, monkeypatch):
    """(c): the container uploads to the bucket itself, with the keys mlflow run forwards for s3:// roots."""
    with services.moto_s3("maxout") as s3:
        server_env = {**services.S3_ENV, "MLFLOW_S3_ENDPOINT_URL": s3}
        with services.mlflow_server(f"sqlite:///{tmp_path / 'server.db'}", env=server_env,
                                    extra_args=["--default-artifact-root", "s3://maxout/direct",
                                                "--no-serve-artifacts"]) as url:
            env = {"MLFLOW_TRACKING_URI": url, "MLFLOW_S3_ENDPOINT_URL": s3,
                   "AWS_ACCESS_KEY_ID": services.S3_ENV["AWS_ACCESS_KEY_ID"],
                   "AWS_SECRET_ACCESS_KEY": services.S3_ENV["AWS_SECRET_ACCESS_KEY"]}
            result = run(engine, project, "-A", "network=host", env=env)
            assert result.returncode == 0, result.stderr[-4000:]
            for key, value in server_env.items():
                monkeypatch.setenv(key, value)
            finished = the_only_run(url)
            assert finished.info.artifact_uri.startswith("s3://maxout/direct/")
            assert_trained_and_logged(finished, url)
        assert any(k.endswith("/MLmodel") for k in services.s3_keys(s3, "maxout"))


FINGERPRINT = ("import hashlib, pathlib, maxout; root = pathlib.Path(maxout.__file__).parent; "
               "print(hashlib.sha256(b''.join(str(p.relative_to(root)).encode() + p.read_bytes() "
               "for p in sorted(root.rglob('*.py')))).hexdigest())")


def test_the_image_runs_this_checkouts_code_as_the_stores_owner(engine, tmp_path):
    """What the runs above tested is this checkout's maxout, not a stale image. The image starts as root, and its
    entrypoint runs every command as the store's owner (as `mlflow run` mounts it): another user stays that user,
    root stays root; without a local store, uid 10001."""
    import os
    import subprocess
    import sys

    inside = engine.docker("run", "--rm", docker_engine.IMAGE, "python", "-c", FINGERPRINT).stdout.strip()
    here = subprocess.run([sys.executable, "-c", FINGERPRINT], capture_output=True, text=True, check=True).stdout
    assert inside == here.strip()
    assert engine.docker("image", "inspect", "-f", "{{.Config.User}}", docker_engine.IMAGE).stdout.strip() in ("",
                                                                                                          "root")
    assert engine.docker("run", "--rm", docker_engine.IMAGE, "id", "-u").stdout.strip() == "10001"
    user = pwd.getpwnam(docker_engine.USER)
    store = tmp_path / "mlflow.db"
    store.write_bytes(b"")
    mount = f"{store}:/mlflow/tmp/mlruns"
    os.chown(store, user.pw_uid, user.pw_gid)
    ids = engine.docker("run", "--rm", "-v", mount, docker_engine.IMAGE, "sh", "-c", "id -u; id -g").stdout.split()
    assert ids == [str(user.pw_uid), str(user.pw_gid)]
    os.chown(store, 0, 0)
    assert engine.docker("run", "--rm", "-v", mount, docker_engine.IMAGE, "id", "-u").stdout.strip() == "0"


HUB_TOKEN = "hf_" + "Ct7" * 11  # the form of a real token; the gate in front of the loopback Hub wants it
HUB_OVERRIDES = ("model=bert_base model.name_or_path=maxout-test/tiny-bert train.max_steps=2 train.epochs=1 "
                 "train.log_every=1 data.max_length=64")


def weight_downloads(gate_log: Path) -> int:
    """GETs of a weights file that the Hub answered with its content (nginx's access log of the gate)."""
    lines = gate_log.read_text().splitlines() if gate_log.is_file() else []
    return sum(1 for line in lines if '"GET ' in line and ".safetensors" in line and '" 200 ' in line)


def test_a_hub_model_downloads_inside_the_container_once_with_the_token_passed_by_name(engine, project, tmp_path):
    """Issue 27 (3): a model by name downloads inside the container from a loopback Hub (olah, behind an nginx gate
    that wants HF_TOKEN, as a gated repo does) into the named cache volume; the second run downloads nothing.
    HF_ENDPOINT and HF_TOKEN reach the job by name: the token is on no command line, in no param or tag."""
    root = tmp_path / "hub"
    commit = hub_server.make_model_repo(root, "maxout-test/tiny-bert")["main"]
    engine.docker("volume", "rm", "-f", "maxout-hf-cache")  # an empty cache: the first run must download
    store = f"sqlite:///{project / 'mlflow.db'}"
    args = ["-P", "hardware=cpu", "-P", f"overrides={HUB_OVERRIDES}", "-A", "network=host"]  # the Hub on loopback
    with hub_server.hub_server(root) as olah, hub_server.gated(olah, HUB_TOKEN, root) as gate:
        gate_log = root / f"nginx-{gate.rsplit(':', 1)[1]}" / "access.log"
        env = {"HF_ENDPOINT": gate, "HF_TOKEN": HUB_TOKEN}
        first = docker_engine.mlflow_run(engine, project, args, env=env)
        assert first.returncode == 0, first.stderr[-4000:]
        downloaded = weight_downloads(gate_log)
        assert downloaded >= 1
        second = docker_engine.mlflow_run(engine, project, args, env=env)
        assert second.returncode == 0, second.stderr[-4000:]
        assert weight_downloads(gate_log) == downloaded  # served from the volume
    runs = mlflow.MlflowClient(store).search_runs(["0"])
    assert [r.info.status for r in runs] == ["FINISHED", "FINISHED"]
    for result, finished in zip((first, second), runs):
        assert HUB_TOKEN not in result.stdout + result.stderr  # mlflow run prints the docker command
        assert "-e HF_TOKEN -e HF_ENDPOINT" in result.stderr  # by name: docker copies the values
        assert HUB_TOKEN not in str(finished.data.params) + str(finished.data.tags)
        assert finished.data.params["derived.model_commit"] == commit  # the weights the run downloaded


def test_rootless_docker(rootless, project):
    """Issue 38: the user's own rootless engine (tests/rootless_engine.py), `mlflow run . -P hardware=cpu` with no
    `-A`. Inside the container the user's store is uid 0's and the job runs as that root, which is the user on the
    host: FINISHED, the model logged, every file the run added the user's, the last line naming the host's store."""
    store = f"sqlite:///{project / 'mlflow.db'}"
    own = rootless.result()  # made ready in the background since the module's first test (the rootless fixture above)
    assert "rootless" in own.docker("info", "-f", "{{.SecurityOptions}}").stdout
    result = run(own, project)
    assert result.returncode == 0, result.stderr[-4000:]
    last = [line for line in result.stdout.splitlines() if line.startswith("maxout: MLflow run ")][-1]
    assert last.endswith(f"(tracking URI: {store})"), last
    assert_store_is_owned_by(project, pwd.getpwnam(docker_engine.USER).pw_uid)
    assert_trained_and_logged(the_only_run(store), store)

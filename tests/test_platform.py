"""The platform end to end, with real processes on loopback: PostgreSQL, moto's S3 server in MinIO's place, and
the `mlflow server` of docker/compose.yaml (tests/stack.py). `maxout train` runs against it as a real process,
proxied (the client holds no S3 credential) and direct (the client uploads with its own boto3 keys); MLproject's
entry points run exactly as `mlflow run` would start them in the container; nothing the runs leave behind may
contain a credential; and each platform mistake fails fast, in one line, with no RUNNING run."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import mlflow
import pandas as pd
import pytest
import sqlalchemy

from maxout import cli
from maxout.errors import MaxoutError
from maxout.train import Callback

from . import services, warm_maxout
from .conftest import ROOT, load_pyfunc
from .stack import create_bucket, platform, s3_process

# The tiny random BERT on CPU: what every run here trains.
TINY = ["hardware=cpu", "model=tiny", "train.max_steps=2", "train.epochs=1", "train.log_every=1"]
TRAIN = [*TINY, "tracking=server", "tracking.system_metrics=false"]
EXAMPLE = pd.DataFrame({"post": ["I lie awake every night.", "We painted the fence."],
                        "criterion": ["Sleep disturbance", "Fatigue"]})


# ----------------------------------------------------------------------------------------------------- helpers


class Database:
    """What the tracking server wrote, read straight from PostgreSQL (not through MLflow's API)."""

    def __init__(self, url: str):
        self.engine = sqlalchemy.create_engine(url)

    def rows(self, sql: str, **params) -> list[dict]:
        with self.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(sqlalchemy.text(sql), params)]

    def run(self, run_id: str) -> dict:
        (row,) = self.rows("SELECT run_uuid, status, artifact_uri, experiment_id FROM runs WHERE run_uuid = :id",
                           id=run_id)
        row["params"] = {r["key"]: r["value"] for r in self.rows(
            "SELECT key, value FROM params WHERE run_uuid = :id", id=run_id)}
        row["tags"] = {r["key"]: r["value"] for r in self.rows(
            "SELECT key, value FROM tags WHERE run_uuid = :id", id=run_id)}
        row["metrics"] = {r["key"] for r in self.rows("SELECT key FROM latest_metrics WHERE run_uuid = :id",
                                                      id=run_id)}
        return row

    def runs(self, experiment: str) -> list[dict]:
        """Every run of an experiment with its parent (nested runs: HPO trials under their study run)."""
        return self.rows(
            "SELECT r.run_uuid AS run_id, r.status, t.value AS parent FROM runs r "
            "JOIN experiments e ON e.experiment_id = r.experiment_id "
            "LEFT JOIN tags t ON t.run_uuid = r.run_uuid AND t.key = 'mlflow.parentRunId' WHERE e.name = :name",
            name=experiment)

    def count(self, status: str | None = None) -> int:
        sql = "SELECT count(*) AS n FROM runs" + (" WHERE status = :status" if status else "")
        return self.rows(sql, status=status)[0]["n"]

    def dump(self) -> str:
        """Every row of every table, as text (for the credential scan)."""
        meta = sqlalchemy.MetaData()
        meta.reflect(self.engine)
        with self.engine.connect() as conn:
            return "\n".join(repr(tuple(row)) for table in meta.sorted_tables
                             for row in conn.execute(table.select()))


def run_maxout(stack, args: list[str], env: dict, label: str) -> subprocess.CompletedProcess:
    proc = warm_maxout.run(args, env=env, timeout=900)  # a process of its own, forked warm
    stack.transcripts.append((label, proc.stdout + proc.stderr))
    return proc


def use_client(monkeypatch, stack, user: str, direct: bool = False) -> None:
    """This process as a client shell: only what stack.client_env gives a subprocess."""
    for var in [v for v in os.environ if v.startswith(("MLFLOW_", "AWS_"))]:
        monkeypatch.delenv(var)
    for key, value in stack.client_env(user, direct=direct).items():
        if key.startswith(("MLFLOW_", "AWS_")):
            monkeypatch.setenv(key, value)
    mlflow.set_tracking_uri(stack.uri)


# ----------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with platform(tmp_path_factory.mktemp("stack")) as running:
        running.transcripts.append(("mlflow server", running.server_log))
        yield running


@pytest.fixture(scope="module")
def db(stack):
    database = Database(stack.db_url)
    yield database
    database.engine.dispose()


@pytest.fixture(scope="module")
def direct_run(stack):
    """`maxout train` uploading to the bucket itself: an s3:// experiment, MLFLOW_S3_ENDPOINT_URL and AWS keys.
    (The proxied run is MLproject's `main` entry point, started as `mlflow run` starts it: mlproject_runs.)"""
    proc = run_maxout(stack, ["train", *TRAIN, "tracking.experiment_name=platform-direct",
                              f"tracking.artifact_location=s3://{stack.bucket}/direct", "--no-progress"],
                      stack.client_env("trainer", direct=True), "maxout train (direct)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return re.search(r"maxout: MLflow run ([0-9a-f]{32})", proc.stdout).group(1)


# ------------------------------------------------------------------------------------------ train, both modes


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["proxied", "direct"])
def test_train_logs_to_postgres_and_the_bucket_and_the_registry_pull_predicts(mode, stack, db, request,
                                                                              monkeypatch):
    """proxied: `mlflow run`'s main entry point, whose container holds no S3 endpoint or key; direct: `maxout
    train` with an s3:// experiment, uploading with its own keys."""
    if mode == "proxied":
        run_id, experiment = request.getfixturevalue("mlproject_runs")["main"].run_id, "platform-mlproject-main"
    else:
        run_id, experiment = request.getfixturevalue("direct_run"), "platform-direct"
    # Runs: in PostgreSQL, finished, one top-level run in the experiment (HPO trials would have a parent).
    assert db.runs(experiment) == [{"run_id": run_id, "status": "FINISHED", "parent": None}]
    run = db.run(run_id)
    assert run["params"]["cfg.model.name"] == "tiny"
    assert {"eval/accuracy", "train/loss", "perf/samples_per_s"} <= run["metrics"]
    # Artifacts: objects in the bucket, under the server's destination (proxied) or the experiment's s3:// root.
    (location,) = [r["artifact_location"] for r in db.rows(
        "SELECT artifact_location FROM experiments WHERE name = :n", n=experiment)]
    if mode == "proxied":
        assert location.startswith("mlflow-artifacts:/")
        root = f"{stack.prefix}/{location.removeprefix('mlflow-artifacts:/')}"
    else:
        assert location == f"s3://{stack.bucket}/direct"
        root = "direct"
    assert run["artifact_uri"] == f"{location}/{run_id}/artifacts"
    keys = services.s3_keys(stack.s3, stack.bucket)
    assert f"{root}/{run_id}/artifacts/config.yaml" in keys
    model_uri = run["tags"]["maxout.model_uri"]
    model_keys = [k for k in keys if k.startswith(f"{root}/models/{model_uri.removeprefix('models:/')}/artifacts/")]
    assert any(k.endswith("/MLmodel") for k in model_keys), model_keys
    assert any(k.endswith("/model.safetensors") for k in model_keys), model_keys
    # The registry, through the server: register, alias, pull by alias, predict. Proxied: no S3 key here either.
    use_client(monkeypatch, stack, "trainer", direct=mode == "direct")
    name = f"maxout-platform-{mode}"
    version = mlflow.register_model(model_uri, name)
    mlflow.MlflowClient().set_registered_model_alias(name, "champion", version.version)
    assert db.rows("SELECT run_id FROM model_versions WHERE name = :n", n=name) == [{"run_id": run_id}]
    model = load_pyfunc(f"models:/{name}@champion")
    out = model.predict(EXAMPLE)
    assert list(out.columns) == ["label", "prob_0", "prob_1"] and len(out) == 2
    assert (out[["prob_0", "prob_1"]].sum(axis=1) - 1).abs().max() < 1e-5


# --------------------------------------------------------------------------------------------------- MLproject

# A value for each declared MLproject parameter: the documented ones, with hardware=cpu because this machine has
# no GPU (the command renders and runs the same way for rtx3090). A new entry point with a new parameter fails
# below until it gets a value here.
PARAMETER_VALUES = {"hardware": "cpu", "nproc_per_node": "1",
                    "overrides": "model=tiny train.max_steps=2 train.epochs=1 train.log_every=1"}
# The `mlflow run` flags of docs/how-to/platform.md: GPUs in, the tracking server on the host, the login passed by name only.
DOCKER_ARGS = ["gpus=all", "network=host", "env-file=docker/run.env"]
HF_TOKEN = "hf_platformTestTokenByName"  # set in the shell of `mlflow run`: MLproject passes it by name


def image_environment() -> dict[str, str]:
    """The training image's environment (runtime stage ENV), with its venv mapped to this process's venv."""
    from dockerfile_parse import DockerfileParser

    base_path = "/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    envs = DockerfileParser(str(ROOT / "docker" / "Dockerfile"), env_replace=True,
                            parent_env={"PATH": base_path}).envs
    return {k: v.replace("/opt/venv", sys.prefix) for k, v in envs.items()}


def bash_words(command: list[str], host_env: dict) -> list[str]:
    """The words bash makes of MLflow's command (it joins the parts with spaces and runs `bash -c`): ${PWD}
    expanded, and MLproject's environment values split where they hold more than one word."""
    out = subprocess.run(["bash", "-c", "printf '%s\\0' " + " ".join(command)], cwd=ROOT, env=host_env,
                         capture_output=True, text=True, check=True).stdout
    return out.split("\0")[:-1]


def container_environment(docker_command: list[str], host_env: dict) -> dict[str, str]:
    """The variables `docker run` would set: `-e NAME=value`, `--env-file FILE` lines, and a name without a value
    (`--env NAME`, a bare line in the file) copied from the environment of `mlflow run` when set there (docker's
    rule)."""
    settings: list[str] = []
    for flag, value in zip(docker_command, docker_command[1:]):
        if flag in ("-e", "--env"):
            settings.append(value)
        elif flag == "--env-file":
            lines = (ROOT / value).read_text().splitlines()
            settings += [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    env: dict[str, str] = {}
    for setting in settings:
        name, sep, val = setting.partition("=")
        if sep:
            env[name] = val
        elif name in host_env:
            env[name] = host_env[name]
    return env


@pytest.fixture(scope="module")
def mlproject_runs(stack, tmp_path_factory):
    """Each MLproject entry point, started the way `mlflow run . -e NAME -P ... -A ...` starts it: MLflow's own
    project loader renders the command, MLflow creates the run and logs the parameters, MLflow builds the
    `docker run` line; then that command runs here with exactly the container's environment."""
    from mlflow.cli import _user_args_to_dict
    from mlflow.projects._project_spec import load_project
    from mlflow.projects.backend.local import _get_docker_command
    from mlflow.projects.utils import _create_run, get_entry_point_command

    project = load_project(str(ROOT))
    # The shell's thread cap, as a user sharing the host sets it (and the suite's own: its other worker shares the
    # cores): MLproject passes it by name, like HF_TOKEN
    host_env = {**stack.client_env("trainer"), "AWS_DEFAULT_REGION": "us-east-1", "HF_TOKEN": HF_TOKEN,
                "OMP_NUM_THREADS": "1"}
    host_env.pop("HF_ENDPOINT", None)  # unset in this shell (conftest sets one): docker must then pass none
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(host_env)  # the shell `mlflow run` is typed in
    results = {}
    try:
        mlflow.set_tracking_uri(stack.uri)
        for name, entry_point in project._entry_points.items():
            missing = set(entry_point.parameters) - set(PARAMETER_VALUES)
            assert not missing, f"entry point {name!r}: add test values for {sorted(missing)} to PARAMETER_VALUES"
            params = {p: PARAMETER_VALUES[p] for p in entry_point.parameters}
            if name == "hpo":  # two trials, in a study of this test's own (the journal would outlive the test)
                journal = tmp_path_factory.mktemp("hpo") / "optuna.journal"
                params["overrides"] += f" hpo.n_trials=2 hpo.study_name=platform hpo.storage={journal}"
            experiment_id = mlflow.create_experiment(f"platform-mlproject-{name}")
            run = _create_run(str(ROOT), experiment_id, str(ROOT), None, name, params)
            storage = tmp_path_factory.mktemp(f"mlproject-{name}")
            (command,) = get_entry_point_command(project, name, params, str(storage))
            parts = _get_docker_command(SimpleNamespace(tags=[project.docker_env["image"]]), run,
                                        docker_args=_user_args_to_dict(DOCKER_ARGS, argument_type="A"),
                                        volumes=project.docker_env.get("volumes"),
                                        user_env_vars=project.docker_env.get("environment"))
            logged = " ".join([*parts, command])  # what `mlflow run` prints ("=== Running command ...")
            docker = bash_words(parts, host_env)  # what docker gets
            stack.transcripts.append((f"mlflow run -e {name}: command line", logged))
            # The image's home and state volume are folders of this test's own.
            home, state = tmp_path_factory.mktemp(f"home-{name}"), tmp_path_factory.mktemp(f"state-{name}")
            env = {**image_environment(), "HOME": str(home), "MAXOUT_STATE_DIR": str(state),
                   **container_environment(docker, host_env)}
            # The container's argv is the host shell's split of the command after the image: exec it alike.
            proc = subprocess.run(["bash", "-c", f"exec {command}"], cwd=ROOT, env=env, capture_output=True,
                                  text=True, timeout=900)
            stack.transcripts.append((f"mlflow run -e {name}: output", proc.stdout + proc.stderr))
            results[name] = SimpleNamespace(run_id=run.info.run_id, command=command, docker=docker, logged=logged,
                                            env=env, proc=proc, params=params)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return results


@pytest.mark.slow
def test_every_mlproject_entry_point_runs_as_the_container_would_run_it(mlproject_runs, stack, db):
    from mlflow.projects._project_spec import load_project

    assert set(mlproject_runs) == set(load_project(str(ROOT))._entry_points)
    main = mlproject_runs["main"]
    assert main.command == ("maxout train hardware=cpu --nproc-per-node 1 --overrides "
                            + shlex.quote(PARAMETER_VALUES["overrides"]))
    for name, result in mlproject_runs.items():
        assert result.proc.returncode == 0, (name, result.proc.stderr[-3000:])
        docker = " ".join(result.docker)
        assert docker.startswith("docker run --rm --gpus all --network host --env-file docker/run.env ")
        # Only MLproject's volumes: no store is mounted (a server), the state volume, the Hugging Face cache, and
        # the project folder at its own path.
        mounts = [v for flag, v in zip(result.docker, result.docker[1:]) if flag == "-v"]
        assert mounts == ["maxout-state:/var/lib/maxout", "maxout-hf-cache:/var/cache/huggingface", f"{ROOT}:{ROOT}"]
        assert result.docker[-1] == "maxout:latest"
        # What the container gets: the run and the server from MLflow, no S3 key (proxied), the login and the
        # region by name only (docker/run.env), HF_TOKEN by name (MLproject) and HF_ENDPOINT not at all (unset
        # here): no value on the command line.
        assert result.env["MLFLOW_RUN_ID"] == result.run_id and result.env["MLFLOW_TRACKING_URI"] == stack.uri
        assert result.env["AWS_DEFAULT_REGION"] == "us-east-1" and result.env["MAXOUT_HOST_DIR"] == str(ROOT)
        assert result.env["MLFLOW_TRACKING_USERNAME"] == "trainer"
        assert result.env["MLFLOW_TRACKING_PASSWORD"] == stack.users["trainer"]
        assert result.env["HF_TOKEN"] == HF_TOKEN and "HF_ENDPOINT" not in result.env
        assert result.env["OMP_NUM_THREADS"] == "1"
        assert stack.users["trainer"] not in docker and HF_TOKEN not in docker + result.logged
        assert not [k for k in result.env if k.startswith(("AWS_ACCESS", "AWS_SECRET")) or k == "MLFLOW_S3_ENDPOINT_URL"]
        # The run MLflow created is the one maxout logged to: MLflow's parameters and maxout's side by side.
        run = db.run(result.run_id)
        assert run["status"] == "FINISHED" and run["tags"]["mlflow.project.entryPoint"] == name
        # MLflow logs each value as it put it on the command line: shell-quoted.
        assert {k: shlex.split(run["params"][k]) for k in result.params} == {k: [v] for k, v in result.params.items()}
        if name == "hpo":  # MLflow's run is the study's parent; each trial is a nested child run
            children = [db.run(r["run_id"]) for r in db.runs("platform-mlproject-hpo")
                        if r["parent"] == result.run_id]
            assert len(children) == 2 and all(c["status"] == "FINISHED" for c in children), children
            assert all(c["params"]["cfg.model.name"] == "tiny" and "eval/accuracy" in c["metrics"] for c in children)
            assert "hpo/best_value" in run["metrics"], run
            continue
        assert run["params"]["cfg.model.name"] == "tiny" and "eval/accuracy" in run["metrics"]
        assert run["params"]["device.torch_threads"] == "1"  # the cap held in the job


# ------------------------------------------------------------------------------------------ credential scan


def find_credentials(text: str | bytes, credentials: dict[str, str]) -> list[str]:
    data = text if isinstance(text, bytes) else text.encode()
    return [name for name, value in credentials.items() if value.encode() in data]


@pytest.mark.slow
def test_no_credential_in_any_param_tag_artifact_or_log_line(stack, db, direct_run, mlproject_runs):
    import boto3

    credentials = stack.credentials()
    assert {"POSTGRES_PASSWORD", "MLFLOW_S3_ACCESS_KEY", "MLFLOW_S3_SECRET_KEY", "MLFLOW_ADMIN_PASSWORD",
            "MLFLOW_FLASK_SERVER_SECRET_KEY", "user trainer"} <= set(credentials)
    # The scanner finds what it looks for (the settings file holds every credential)...
    env_file = "\n".join(f"{k}={v}" for k, v in stack.settings.items())
    assert set(find_credentials(env_file, credentials)) == set(credentials) - {"user trainer"}
    leaks: list[str] = []
    # ... in every row the server wrote: runs, params, tags, metrics, experiments, registry, logged models, users
    for name in ("mlflow", "mlflow_auth"):
        dump = Database(stack.db_url.rsplit("/", 1)[0] + f"/{name}").dump()
        assert name != "mlflow" or all(run_id in dump for run_id in (mlproject_runs["main"].run_id, direct_run))
        leaks += [f"database {name}: {c}" for c in find_credentials(dump, credentials)]
    # ... in every artifact object in the bucket (configs, versions.json, the models with their code) ...
    s3 = boto3.client("s3", endpoint_url=stack.s3, **services._boto_kwargs())
    keys = services.s3_keys(stack.s3, stack.bucket)
    assert len(keys) > 20
    for key in keys:
        body = s3.get_object(Bucket=stack.bucket, Key=key)["Body"].read()
        leaks += [f"s3://{stack.bucket}/{key}: {c}" for c in find_credentials(body, credentials)]
    # ... and in every process output and logged command line: the trainers, `mlflow run`'s docker line, the server.
    assert len(stack.transcripts) >= 4
    for label, text in stack.transcripts:
        text = text.read_text() if isinstance(text, Path) else text
        assert text, label
        leaks += [f"{label}: {c}" for c in find_credentials(text, credentials)]
    assert not leaks, leaks


# -------------------------------------------------------------------------------------------------- bad input


def one_line_failure(argv: list[str], capsys) -> tuple[int, str, float]:
    start = time.perf_counter()
    code = cli.main(argv)
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err.strip().splitlines()[-1:]  # libraries may warn above; the verdict is the last
    return code, err[0] if err else "", elapsed


def test_an_unreachable_tracking_server_fails_fast_with_the_uri_and_a_hint(monkeypatch, capsys):
    uri = f"http://127.0.0.1:{services.free_port()}"  # nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    code, err, elapsed = one_line_failure(["train", *TRAIN, "--no-progress"], capsys)
    assert code == 1
    assert err == (f"maxout: error: MLflow tracking server unreachable at {uri} (ConnectionError); start it "
                   f"(make platform-up) or use tracking=local")
    assert elapsed < 60  # MLflow's own retries would take minutes (7 with exponential back-off)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["wrong_password", "missing_bucket_direct", "s3_down_direct"])
def test_a_platform_mistake_fails_fast_in_one_line_and_leaves_no_run(case, stack, db, monkeypatch, capsys):
    use_client(monkeypatch, stack, "trainer", direct=case != "wrong_password")
    args = ["train", *TRAIN, f"tracking.experiment_name=platform-bad-{case}"]
    if case == "wrong_password":
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "not-the-password")
        expected = (f"MLflow tracking server at {stack.uri} rejected the login of user 'trainer' (HTTP 401): set "
                    f"MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD to an account on that server")
    elif case == "missing_bucket_direct":
        args.append("tracking.artifact_location=s3://no-such-bucket/runs")
        expected = (f"S3 bucket 'no-such-bucket' does not exist at {stack.s3} (artifact location "
                    f"s3://no-such-bucket/runs): create it, or set tracking.artifact_location to an existing bucket")
    else:
        down = f"http://127.0.0.1:{services.free_port()}"
        monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", down)
        args.append(f"tracking.artifact_location=s3://{stack.bucket}/down")
        expected = (f"S3 endpoint {down} is unreachable (artifact location s3://{stack.bucket}/down): check "
                    f"MLFLOW_S3_ENDPOINT_URL and that the object store is up (make platform-up)")
    runs_before = db.count()
    code, err, elapsed = one_line_failure([*args, "--no-progress"], capsys)
    assert (code, err) == (1, f"maxout: error: {expected}")
    assert elapsed < 60
    assert db.count() == runs_before and db.count("RUNNING") == 0


@pytest.mark.slow
def test_proxied_mode_a_missing_bucket_or_a_dead_s3_endpoint_fails_before_the_run(stack, db, tmp_path,
                                                                                   monkeypatch, capsys):
    """The server's artifact store is wrong, not the client: the client learns it from the server, in one line,
    before a run exists. A second server on the same databases stores into an S3 endpoint where minio-init never
    created the bucket; then that endpoint goes down."""
    with s3_process() as (s3_url, s3_proc), stack.another_server(s3_url, tmp_path) as (uri, server_log):
        use_client(monkeypatch, stack, "trainer")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        runs_before = db.count()
        args = ["train", *TRAIN, "tracking.experiment_name=platform-bad-proxied", "--no-progress"]
        code, err, elapsed = one_line_failure(args, capsys)
        assert code == 1 and elapsed < 60
        assert err.startswith(f"maxout: error: the tracking server at {uri} cannot store artifacts for "
                              f"mlflow-artifacts:/"), err
        assert "The specified bucket does not exist" in err and "check the bucket of its --artifacts-destination" in err
        services.stop(s3_proc, timeout_s=5)  # now the object store is down altogether
        code, err, elapsed = one_line_failure(args, capsys)
        assert code == 1 and elapsed < 120, (err, elapsed)
        assert err.startswith(f"maxout: error: the tracking server at {uri} cannot store artifacts for "
                              f"mlflow-artifacts:/"), err
        assert "(HTTP 500: " in err and err.endswith("and its S3 endpoint (make platform-up creates both)"), err
        assert f'Could not connect to the endpoint URL: "{s3_url}/' in server_log.read_text()  # the cause
        assert db.count() == runs_before and db.count("RUNNING") == 0


class StopS3(Callback):
    """The object store goes away after training, just before the model upload."""

    def __init__(self, proc):
        self.proc = proc

    def on_train_end(self, state):
        services.stop(self.proc, timeout_s=5)


@pytest.mark.slow
def test_an_upload_failure_after_the_run_started_ends_it_failed_with_one_line(stack, db, monkeypatch):
    from maxout import loading
    from maxout.train import train

    use_client(monkeypatch, stack, "trainer", direct=True)
    with s3_process() as (endpoint, proc):
        create_bucket(endpoint, "shortlived")
        monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", endpoint)
        cfg = loading.load([*TRAIN, "tracking.experiment_name=platform-upload-fails",
                            "tracking.artifact_location=s3://shortlived/runs", "tracking.upload_retry_s=0"])
        with pytest.raises(MaxoutError) as failure:
            train(cfg, callbacks=[StopS3(proc)], progress=False, verbose=False)
    message = str(failure.value)
    assert "\n" not in message and message.startswith("storing artifacts of run ")
    assert "at s3://shortlived/runs/" in message and "Could not connect to the endpoint URL" in message
    (run,) = db.runs("platform-upload-fails")
    assert run["status"] == "FAILED"
    assert db.run(run["run_id"])["tags"]["maxout.status_reason"].startswith("MaxoutError: storing artifacts")

"""maxout's Kubernetes manifests (maxout.launch.kubernetes), checked offline against what an API server checks:

- the core objects (Job, Service) against Kubernetes' own OpenAPI schemas, strict (no unknown field), as
  `kubernetes-validate` ships them for KUBE_VERSION (no cluster, no network);
- the TrainJob against the openAPIV3Schema of Kubeflow Trainer's CRD (tests/data/kubeflow-trainer/SOURCE.md);
- every container command through the real parsers (torchrun's, maxout's) and the overrides through maxout's own
  pre-run checks (loading.precheck, what `maxout train` runs before torch loads);
- credentials: only ``secretKeyRef`` references, and no value from the environment written anywhere.

The MLflow backend's template is rendered by MLflow's own functions from the real MLproject: `mlflow run --backend
kubernetes` goes no further without a Docker engine and an image registry (test_mlflow_run_backend_stops_...).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from maxout import cli, loading
from maxout.errors import ConfigError
from maxout.launch import kubernetes as k8s

from .conftest import ROOT

KUBE_VERSION = "1.37.0"  # the newest schemas kubernetes-validate 1.37.0 ships
CRD = Path(__file__).parent / "data" / "kubeflow-trainer" / "trainer.kubeflow.org_trainjobs.yaml"
JOB = k8s.ClusterJob(name="nli-demo", image="registry.example.com/maxout:1.0", nodes=2, gpus_per_node=8,
                     overrides=("model=tiny", "hardware=cpu", "train.epochs=1", "train.lr=3e-5"), hpo_workers=3)
SECRET_NAME = re.compile(r"TOKEN|PASSWORD|SECRET|_KEY|TRACKING_URI|USERNAME|STORAGE")


def trainjob_schema() -> dict:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return version["schema"]["openAPIV3Schema"]


def core_objects(job: k8s.ClusterJob) -> list[dict]:
    return [*k8s.indexed_job(job), k8s.hpo_job(job)]


def rendered_mlflow_job(job: k8s.ClusterJob, params: dict, tmp_path: Path) -> dict:
    """The Job MLflow's Kubernetes backend submits: our two files read by MLflow's own parser, MLproject's entry
    point command, and MLflow's template rendering (what run_kubernetes_job does before calling the API)."""
    import mlflow.projects as projects
    from mlflow.projects import _project_spec, kubernetes as kb, utils

    k8s.write(job, tmp_path)
    config = json.loads((tmp_path / "kubernetes_config.json").read_text())
    config["kube-job-template-path"] = str(tmp_path / config["kube-job-template-path"])
    parsed = projects._parse_kubernetes_config(config)
    project = _project_spec.load_project(str(ROOT))
    command = utils.get_entry_point_command(project, "main", params, None)
    env = utils.get_run_env_vars(run_id="0" * 32, experiment_id="1")
    os.environ["KUBE_MLFLOW_TRACKING_URI"] = "http://mlflow.maxout.svc:5000"  # what the docs tell users to set
    try:
        return kb._get_kubernetes_job_definition(project.name, parsed["repository-uri"], "sha256:" + "ab" * 32,
                                                 kb._get_run_command(command), env, parsed["kube-job-template"])
    finally:
        del os.environ["KUBE_MLFLOW_TRACKING_URI"]


def containers(obj: dict) -> list[dict]:
    if obj["kind"] == "TrainJob":
        return [obj["spec"]["trainer"]]
    return obj["spec"]["template"]["spec"]["containers"] if obj["kind"] == "Job" else []


def maxout_argv(container: dict) -> list[str]:
    """The container's command + args, through torchrun's own parser when torchrun starts it: maxout's argv."""
    argv = [*container.get("command", []), *container.get("args", [])]
    if argv[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        launch = get_args_parser().parse_args(argv[1:])
        assert launch.module and launch.training_script == "maxout"
        return list(launch.training_script_args)
    assert argv[0] == "maxout", argv
    return argv[1:]


def prechecked(argv: list[str], monkeypatch) -> list:
    """What `maxout <command>` does with argv before it loads torch: its real parser, then the config's checks,
    with the variables the Secrets give the pod (placeholders: the checks need them set, not real)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    monkeypatch.setenv("MAXOUT_HPO_STORAGE", "postgresql+psycopg2://u@db.example:5432/optuna")
    args = cli.build_parser().parse_args(argv)
    overrides = cli.split_overrides(args.overrides, args.overrides_string)
    if args.command == "hpo":
        overrides.insert(0, "hpo=default")  # as cmd_hpo does
    return [str(p) for p in loading.precheck(overrides)]


# ---- schemas


@pytest.mark.parametrize("index", range(3))
def test_core_objects_are_valid_against_the_kubernetes_api_schemas(index):
    obj = core_objects(JOB)[index]
    kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)  # raises on any violation or unknown field


def test_a_core_object_the_api_would_refuse_fails_validation():
    service, job = k8s.indexed_job(JOB)
    job["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["mountPth"] = "/dev/shm"  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, KUBE_VERSION, strict=True)
    service["spec"]["ports"][0]["port"] = "rendezvous"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, KUBE_VERSION, strict=True)


def test_trainjob_is_valid_against_the_kubeflow_trainer_crd_schema():
    schema = trainjob_schema()
    job = k8s.trainjob(JOB)
    jsonschema.Draft7Validator(schema).validate(job)
    assert job["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and job["spec"]["trainer"]["numNodes"] == 2
    # the schema bites: a missing runtimeRef, a string node count, an unknown pod-spec field in the patch
    broken = [json.loads(json.dumps(job)) for _ in range(3)]
    del broken[0]["spec"]["runtimeRef"]
    broken[1]["spec"]["trainer"]["numNodes"] = "2"
    pod = broken[2]["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    pod["template"]["spec"]["template"]["spec"]["volumes"][0]["emptyDir"]["medium"] = ["Memory"]
    for bad in broken:
        assert list(jsonschema.Draft7Validator(schema).iter_errors(bad)), bad


def test_mlflow_backend_job_rendered_by_mlflow_is_a_valid_job(tmp_path):
    job = rendered_mlflow_job(JOB, {"hardware": "cpu", "nproc_per_node": "8"}, tmp_path)
    kubernetes_validate.validate(job, KUBE_VERSION, strict=True)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example.com/maxout@sha256:" + "ab" * 32
    assert job["metadata"]["name"].startswith("maxout-") and container["name"] == "maxout"
    env = {e["name"]: e for e in container["env"]}
    assert env["MLFLOW_RUN_ID"]["value"] == "0" * 32  # MLflow's own, appended to ours
    assert env["MLFLOW_TRACKING_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "maxout-tracking"
    # MLFLOW_TRACKING_URI is MLflow's alone (KUBE_MLFLOW_TRACKING_URI): one entry, no shadowed Secret reference
    assert [e["name"] for e in container["env"]].count("MLFLOW_TRACKING_URI") == 1
    assert env["MLFLOW_TRACKING_URI"]["value"] == "http://mlflow.maxout.svc:5000"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8


# ---- what each pod gets


@pytest.mark.parametrize("kind", ["mlflow", "trainjob", "indexed", "hpo"])
def test_every_pod_has_gpus_a_memory_backed_shm_and_the_hf_cache_on_a_volume(kind, tmp_path):
    if kind == "trainjob":
        obj = k8s.trainjob(JOB)
        pod = obj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
        pod = pod["template"]["spec"]["template"]["spec"]
        container = {**pod["containers"][0], **obj["spec"]["trainer"], "resources": obj["spec"]["trainer"][
            "resourcesPerNode"]}
    else:
        obj = {"mlflow": lambda: rendered_mlflow_job(JOB, {"hardware": "cpu"}, tmp_path),
               "indexed": lambda: k8s.indexed_job(JOB)[1], "hpo": lambda: k8s.hpo_job(JOB)}[kind]()
        pod = obj["spec"]["template"]["spec"]
        container = pod["containers"][0]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert volumes[mounts[k8s.HF_HOME]]["persistentVolumeClaim"]["claimName"] == "maxout-hf-cache"
    assert volumes[mounts[k8s.STATE_DIR]]["persistentVolumeClaim"]["claimName"] == "maxout-state"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 8
    assert {"name": "HF_HOME", "value": k8s.HF_HOME} in container["env"]


def test_a_cpu_job_asks_for_no_gpu_and_runs_one_process_per_pod():
    job = k8s.ClusterJob(gpus_per_node=0, overrides=("hardware=cpu",))
    kubernetes_validate.validate(k8s.indexed_job(job)[1], KUBE_VERSION, strict=True)
    assert "nvidia.com/gpu" not in k8s.indexed_job(job)[1]["spec"]["template"]["spec"]["containers"][0][
        "resources"]["limits"]
    assert k8s.trainjob(job)["spec"]["trainer"]["numProcPerNode"] == 1


def test_indexed_job_agents_meet_on_pod_0_through_the_headless_service():
    service, job = k8s.indexed_job(JOB)
    assert service["spec"]["clusterIP"] == "None" and service["metadata"]["name"] == "nli-demo"
    pod = job["spec"]["template"]
    assert pod["spec"]["subdomain"] == service["metadata"]["name"]
    assert set(service["spec"]["selector"].items()) == {("batch.kubernetes.io/job-name", "nli-demo")}
    assert (job["spec"]["completionMode"], job["spec"]["completions"], job["spec"]["parallelism"]) == (
        "Indexed", 2, 2)
    from torch.distributed.run import get_args_parser

    container = pod["spec"]["containers"][0]
    launch = get_args_parser().parse_args([*container["command"][1:], *container["args"]])
    assert (launch.nnodes, launch.nproc_per_node, launch.rdzv_backend) == ("2", "8", "c10d")
    assert launch.rdzv_endpoint == "nli-demo-0.nli-demo:29500"  # pod 0's hostname in the Service's domain


def test_hpo_job_runs_n_workers_on_one_postgresql_study_from_a_secret():
    job = k8s.hpo_job(JOB)
    assert job["spec"]["parallelism"] == 3 == job["spec"]["completions"]
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["MAXOUT_HPO_STORAGE"]["valueFrom"]["secretKeyRef"] == {"name": "maxout-hpo",
                                                                      "key": "MAXOUT_HPO_STORAGE"}
    # the study's storage is what hpo/default.yaml reads: ${oc.env:MAXOUT_HPO_STORAGE,null}
    assert "MAXOUT_HPO_STORAGE" in (ROOT / "platform/maxout/conf/hpo/default.yaml").read_text()


# ---- the command each container runs


@pytest.mark.parametrize("kind", ["trainjob", "indexed", "hpo"])
def test_container_command_is_what_maxout_accepts_and_passes_its_pre_run_checks(kind, monkeypatch):
    obj = {"trainjob": lambda: k8s.trainjob(JOB), "indexed": lambda: k8s.indexed_job(JOB)[1],
           "hpo": lambda: k8s.hpo_job(JOB)}[kind]()
    (container,) = containers(obj)
    argv = maxout_argv(container)
    assert argv[0] == ("hpo" if kind == "hpo" else "train")
    shared = ["hpo.parent=shared"] if kind == "hpo" else []  # the pods share one parent run
    assert argv[1:-1] == ["tracking=server", *JOB.overrides, *shared] and argv[-1] == "--no-progress"
    assert prechecked(argv, monkeypatch) == []


def test_a_bad_override_in_a_manifest_is_caught_by_the_pre_run_checks(monkeypatch):
    job = k8s.ClusterJob(overrides=("model=tiny", "train.lr=fast", "trian.epochs=1"))
    problems = prechecked(maxout_argv(containers(k8s.indexed_job(job)[1])[0]), monkeypatch)
    assert any("train.lr" in p for p in problems) and any("trian" in p for p in problems), problems


def test_mlflow_backend_command_reaches_maxout_with_its_overrides(tmp_path, monkeypatch):
    """MLflow's Kubernetes backend shell-quotes each token of MLproject's command and hands the list to the
    container as its exec-form command (no shell): the `overrides` parameter arrives wrapped in its quotes.
    maxout's --overrides unwraps it, so the pod trains with the overrides the user gave."""
    job = rendered_mlflow_job(JOB, {"hardware": "cpu", "overrides": "model=tiny train.epochs=1"}, tmp_path)
    argv = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert argv[-1] == "'model=tiny train.epochs=1'"  # MLflow's quoting, literal in an exec-form command
    assert argv[0] == "maxout"
    args = cli.build_parser().parse_args(argv[1:])
    assert cli.split_overrides(args.overrides, args.overrides_string) == ["hardware=cpu", "model=tiny",
                                                                          "train.epochs=1"]
    assert prechecked(argv[1:], monkeypatch) == []
    empty = rendered_mlflow_job(JOB, {"hardware": "cpu"}, tmp_path / "empty")  # the default: overrides=""
    args = cli.build_parser().parse_args(empty["spec"]["template"]["spec"]["containers"][0]["command"][1:])
    assert cli.split_overrides(args.overrides, args.overrides_string) == ["hardware=cpu"]


# ---- credentials


def all_env(obj) -> list[dict]:
    if isinstance(obj, dict):
        found = list(obj["env"]) if isinstance(obj.get("env"), list) else []
        return found + [e for v in obj.values() for e in all_env(v)]
    return [e for v in obj for e in all_env(v)] if isinstance(obj, list) else []


def test_credentials_come_only_from_secrets_and_no_value_is_written(tmp_path, monkeypatch):
    secrets = {"MLFLOW_TRACKING_URI": "http://alice:pw-tracking-8842@mlflow.internal:5000",
               "MLFLOW_TRACKING_PASSWORD": "pw-tracking-8842", "MLFLOW_TRACKING_TOKEN": "tok-3141-tracking",
               "HF_TOKEN": "hf_secret_2718", "MAXOUT_HPO_STORAGE": "postgresql://bob:pw-db-1618@db:5432/optuna",
               "AWS_SECRET_ACCESS_KEY": "aws-secret-5772"}
    for key, value in secrets.items():
        monkeypatch.setenv(key, value)
    files = k8s.write(JOB, tmp_path)
    text = "".join(f.read_text() for f in files)
    for value in secrets.values():
        assert value not in text
    docs = [d for f in files for d in (yaml.safe_load_all(f.read_text()) if f.suffix == ".yaml"
                                       else [json.loads(f.read_text())])]
    entries = all_env(docs)
    assert len(entries) > 20
    for entry in entries:
        if SECRET_NAME.search(entry["name"]):
            assert "value" not in entry and set(entry["valueFrom"]) == {"secretKeyRef"}, entry
    refs = {(e["name"], e["valueFrom"]["secretKeyRef"]["name"]) for e in entries if "valueFrom" in e}
    assert refs == {("MLFLOW_TRACKING_URI", "maxout-tracking"), ("MLFLOW_TRACKING_USERNAME", "maxout-tracking"),
                    ("MLFLOW_TRACKING_PASSWORD", "maxout-tracking"), ("MLFLOW_TRACKING_TOKEN", "maxout-tracking"),
                    ("HF_TOKEN", "maxout-hub"), ("MAXOUT_HPO_STORAGE", "maxout-hpo")}


def test_a_tracking_uri_or_storage_override_is_refused_it_would_put_a_credential_in_a_manifest():
    for override in ("tracking.uri=http://u:p@h:5000", "hpo.storage=postgresql://u:p@db/optuna"):
        with pytest.raises(ConfigError, match="Secrets"):
            k8s.ClusterJob(overrides=(override,))


@pytest.mark.parametrize("bad, message", [
    ({"name": "NLI_demo"}, "name='NLI_demo' is invalid"), ({"nodes": 0}, "nodes=0 is invalid"),
    ({"gpus_per_node": -1}, "gpus_per_node=-1"), ({"memory": "64 GB"}, "memory='64 GB' is not a Kubernetes quantity"),
    ({"hpo_workers": 0}, "hpo_workers=0"), ({"rdzv_port": 70000}, "rdzv_port=70000")])
def test_bad_settings_are_refused_naming_the_value(bad, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        k8s.ClusterJob(**bad)


# ---- mlflow run --backend kubernetes


def test_mlflow_run_backend_stops_at_the_docker_engine_check_before_building_the_image(tmp_path):
    """How far `mlflow run --backend kubernetes` goes here: it reads our kubernetes_config.json only after its
    Docker checks; without a Docker engine it stops at `docker info` (then it would build the image, push it to
    `repository-uri` and create the Job through the API server: neither registry nor cluster is reachable)."""
    k8s.write(JOB, tmp_path)
    config = tmp_path / "kubernetes_config.json"
    config.write_text(config.read_text().replace('"kubernetes_job_template.yaml"',
                                                 json.dumps(str(tmp_path / "kubernetes_job_template.yaml"))))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
           "DOCKER_HOST": f"unix://{tmp_path / 'no-engine.sock'}"}
    done = subprocess.run([sys.executable, "-m", "mlflow", "run", str(ROOT), "--backend", "kubernetes",
                           "--backend-config", str(config), "-P", "hardware=cpu"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode != 0
    assert "Ran `docker info` to ensure docker daemon is running but it failed" in done.stderr, done.stderr[-2000:]


# ---- maxout launch kubernetes


def test_maxout_launch_kubernetes_writes_the_manifests_and_refuses_a_bad_override(tmp_path, capsys):
    out = tmp_path / "k8s"
    assert cli.main(["launch", "kubernetes", "model=tiny", "--out", str(out), "--name", "nli", "--nodes", "3",
                     "--gpus-per-node", "4", "--image", "registry.example.com/maxout:2"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["hpo-job.yaml", "indexed-job.yaml", "kubernetes_config.json",
                                                     "kubernetes_job_template.yaml", "trainjob.yaml"]
    service, job = yaml.safe_load_all((out / "indexed-job.yaml").read_text())
    for obj in (service, job, yaml.safe_load((out / "hpo-job.yaml").read_text())):
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    trainjob = yaml.safe_load((out / "trainjob.yaml").read_text())
    jsonschema.Draft7Validator(trainjob_schema()).validate(trainjob)
    assert (trainjob["spec"]["trainer"]["numNodes"], trainjob["spec"]["trainer"]["numProcPerNode"]) == (3, 4)
    assert job["spec"]["completions"] == 3 and "model=tiny" in job["spec"]["template"]["spec"]["containers"][0]["args"]
    capsys.readouterr()
    assert cli.main(["launch", "kubernetes", "model=tiny", "trian.epochs=1", "--out", str(tmp_path / "bad")]) == 2
    assert "unknown config key 'trian.epochs'" in capsys.readouterr().err and not (tmp_path / "bad").exists()

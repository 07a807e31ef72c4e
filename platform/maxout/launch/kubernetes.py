"""Kubernetes manifests for maxout's jobs, in the formats the cluster's own engines read:

- ``mlflow_backend``: the MLflow Projects Kubernetes backend's two files, ``kubernetes_config.json`` and the Job
  template it names (``mlflow run . --backend kubernetes --backend-config kubernetes_config.json``). MLflow fills
  the ``{replaced with ...}`` fields: the Job's name, the image it built and pushed, the entry point's command and
  its own environment (MLFLOW_RUN_ID, ...).
- ``trainjob``: a multi-node training job as a Kubeflow Trainer ``TrainJob`` (trainer.kubeflow.org/v1alpha1) on
  the ``torch-distributed`` runtime: the operator starts one pod per node and gives torchrun its PET_* variables
  (nodes, processes per node, node rank, master address), so the command is ``torchrun -m maxout train ...``.
- ``indexed_job``: the same job without the operator: a headless Service and an Indexed Job of ``nodes`` pods;
  each pod runs one torchrun agent and the agents meet through c10d rendezvous on pod 0 (``NAME-0.NAME``).
- ``hpo_job``: HPO workers as a Job with ``parallelism: N``, each pod one ``maxout hpo`` worker on one PostgreSQL
  study (MAXOUT_HPO_STORAGE from a Secret), every trial nested under one parent run (``hpo.parent=shared``).

Every pod gets the GPUs asked for (``nvidia.com/gpu``), a memory-backed ``/dev/shm`` (NCCL and DataLoader workers
need more than the container runtime's 64 MB), the Hugging Face cache (HF_HOME in the image) and maxout's state
folder (MAXOUT_STATE_DIR: checkpoints, so ``resume=auto`` finds them after a restart) on PersistentVolumeClaims,
and the tracking and Hub credentials from Secrets through ``secretKeyRef``: no credential is ever written here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError

# What the image sets (docker/Dockerfile): the Hugging Face cache and maxout's state folder.
HF_HOME = "/var/cache/huggingface"
STATE_DIR = "/var/lib/maxout"
# MLflow's placeholders in a Kubernetes job template (mlflow/projects/kubernetes.py fills them).
MLFLOW_NAME = "{replaced with MLflow Project name}"
MLFLOW_IMAGE = "{replaced with URI of Docker image created during Project execution}"
MLFLOW_COMMAND = "{replaced with MLflow Project entry point command}"
TRAINJOB_API = "trainer.kubeflow.org/v1alpha1"
TORCH_RUNTIME = "torch-distributed"  # Kubeflow Trainer's ClusterTrainingRuntime for torchrun jobs
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?$")
# Secrets, by key: (env variable, Secret key, optional). The Secret's names are ClusterJob's.
TRACKING_KEYS = (("MLFLOW_TRACKING_URI", False), ("MLFLOW_TRACKING_USERNAME", True),
                 ("MLFLOW_TRACKING_PASSWORD", True), ("MLFLOW_TRACKING_TOKEN", True))
HUB_KEYS = (("HF_TOKEN", True),)
HPO_KEYS = (("MAXOUT_HPO_STORAGE", False),)


@dataclass(frozen=True)
class ClusterJob:
    """One job as the cluster sees it. ``overrides``: Hydra overrides, as ``maxout train`` takes them."""

    name: str = "maxout"
    image: str = "maxout:latest"
    overrides: tuple[str, ...] = ()
    namespace: str = "default"
    nodes: int = 2
    gpus_per_node: int = 1
    cpu: str = "8"
    memory: str = "64Gi"
    shm_size: str = "16Gi"
    hf_cache_claim: str = "maxout-hf-cache"  # PersistentVolumeClaims (ReadWriteMany for several nodes)
    state_claim: str = "maxout-state"
    tracking_secret: str = "maxout-tracking"  # keys: MLFLOW_TRACKING_URI (+ _USERNAME, _PASSWORD or _TOKEN)
    hub_secret: str = "maxout-hub"  # key: HF_TOKEN (optional: only gated models need it)
    hpo_secret: str = "maxout-hpo"  # key: MAXOUT_HPO_STORAGE, the study's PostgreSQL URL
    hpo_workers: int = 4
    rdzv_port: int = 29500
    extra_env: dict = field(default_factory=dict)  # plain settings (never credentials): name -> value

    def __post_init__(self) -> None:
        # The Indexed Job's pods are NAME-<index>, reached as NAME-0.NAME: a DNS label with room for the index.
        if not DNS_LABEL.match(self.name) or len(self.name) > 50:
            raise ConfigError(f"name={self.name!r} is invalid: use a DNS label (lower-case letters, digits, '-', "
                              f"starting with a letter) of at most 50 characters")
        if not DNS_LABEL.match(self.namespace) or len(self.namespace) > 63:
            raise ConfigError(f"namespace={self.namespace!r} is invalid: use a DNS label of at most 63 characters")
        for key in ("nodes", "hpo_workers"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)} is invalid: use 1 or more")
        if self.gpus_per_node < 0:
            raise ConfigError(f"gpus_per_node={self.gpus_per_node} is invalid: use 0 (CPU) or more")
        for key in ("cpu", "memory", "shm_size"):
            if not QUANTITY.match(str(getattr(self, key))):
                raise ConfigError(f"{key}={getattr(self, key)!r} is not a Kubernetes quantity (e.g. 8, 500m, 64Gi)")
        if not 1 <= self.rdzv_port <= 65535:
            raise ConfigError(f"rdzv_port={self.rdzv_port} is invalid: use a port from 1 to 65535")
        for override in self.overrides:
            if override.split("=", 1)[0].lstrip("+~") in ("tracking.uri", "hpo.storage"):
                raise ConfigError(f"override {override!r}: the tracking URI and the study's storage come from the "
                                  f"Secrets {self.tracking_secret!r} and {self.hpo_secret!r}, never from a manifest")

    @property
    def procs_per_node(self) -> int:
        return max(1, self.gpus_per_node)


def maxout_args(command: str, job: ClusterJob, *extra: str) -> list[str]:
    """``maxout <command>``'s own arguments: the job's overrides on the tracking server (MLFLOW_TRACKING_URI), then
    the command's ``extra`` overrides."""
    return [command, "tracking=server", *job.overrides, *extra, "--no-progress"]


def _secret_env(secret: str, keys: tuple) -> list[dict]:
    return [{"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, **({"optional": True}
                                                                                        if optional else {})}}}
            for key, optional in keys]


def env(job: ClusterJob, hpo: bool = False, tracking_uri: bool = True) -> list[dict]:
    """The container's environment: credentials by reference only. ``tracking_uri=False``: MLflow's backend sets
    MLFLOW_TRACKING_URI itself (see mlflow_backend)."""
    plain = {"HF_HOME": HF_HOME, "MAXOUT_STATE_DIR": STATE_DIR, "HF_HUB_DISABLE_TELEMETRY": "1",
             "PYTHONUNBUFFERED": "1", **job.extra_env}
    tracking = [k for k in TRACKING_KEYS if tracking_uri or k[0] != "MLFLOW_TRACKING_URI"]
    return ([{"name": k, "value": str(v)} for k, v in plain.items()] + _secret_env(job.tracking_secret, tracking)
            + _secret_env(job.hub_secret, HUB_KEYS) + (_secret_env(job.hpo_secret, HPO_KEYS) if hpo else []))


def resources(job: ClusterJob) -> dict:
    gpus = {"nvidia.com/gpu": job.gpus_per_node} if job.gpus_per_node else {}
    return {"requests": {"cpu": job.cpu, "memory": job.memory, **gpus},
            "limits": {"memory": job.memory, **gpus}}  # GPUs: requests must equal limits


def volumes(job: ClusterJob) -> list[dict]:
    return [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": job.shm_size}},
            {"name": "hf-cache", "persistentVolumeClaim": {"claimName": job.hf_cache_claim}},
            {"name": "state", "persistentVolumeClaim": {"claimName": job.state_claim}}]


def volume_mounts() -> list[dict]:
    return [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "hf-cache", "mountPath": HF_HOME},
            {"name": "state", "mountPath": STATE_DIR}]


def _labels(job: ClusterJob, role: str) -> dict:
    return {"app.kubernetes.io/name": "maxout", "app.kubernetes.io/instance": job.name,
            "app.kubernetes.io/component": role}


def mlflow_backend(job: ClusterJob, kube_context: str, repository_uri: str,
                   template_path: str = "kubernetes_job_template.yaml") -> tuple[dict, dict]:
    """(kubernetes_config.json, the Job template): one pod running MLproject's entry point (``--nproc-per-node``
    = the GPUs: DDP on one node). MLflow appends MLFLOW_RUN_ID, MLFLOW_EXPERIMENT_ID and MLFLOW_TRACKING_URI to
    the template's environment, the last as a literal value: KUBE_MLFLOW_TRACKING_URI where `mlflow run` has it set,
    else `mlflow run`'s own tracking URI. Kubernetes takes the last of two entries of one name, so the template
    leaves MLFLOW_TRACKING_URI to MLflow (set KUBE_MLFLOW_TRACKING_URI to the server's in-cluster address, without a
    login in it) and takes the login from the tracking Secret (MLFLOW_TRACKING_USERNAME / _PASSWORD / _TOKEN)."""
    config = {"kube-context": kube_context, "repository-uri": repository_uri, "kube-job-template-path": template_path}
    template = {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": MLFLOW_NAME, "namespace": job.namespace, "labels": _labels(job, "mlflow-run")},
        "spec": {"ttlSecondsAfterFinished": 3600, "backoffLimit": 0, "template": {
            "metadata": {"labels": _labels(job, "mlflow-run")},
            "spec": {"restartPolicy": "Never", "volumes": volumes(job), "containers": [{
                "name": MLFLOW_NAME, "image": MLFLOW_IMAGE, "command": [MLFLOW_COMMAND],
                "env": env(job, tracking_uri=False), "resources": resources(job),
                "volumeMounts": volume_mounts()}]}}}}
    return config, template


def torchrun_agent_args(job: ClusterJob) -> list[str]:
    """One torchrun agent per pod of the Indexed Job; c10d rendezvous on pod 0 through the headless Service."""
    return [f"--nnodes={job.nodes}", f"--nproc-per-node={job.procs_per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={job.name}-0.{job.name}:{job.rdzv_port}", f"--rdzv-id={job.name}",
            "--max-restarts=0"]


def trainjob(job: ClusterJob) -> dict:
    """Kubeflow Trainer's TrainJob on the torch-distributed runtime. The runtime's node container is ``node``;
    runtimePatches add the volumes and mounts the runtime lacks."""
    return {
        "apiVersion": TRAINJOB_API, "kind": "TrainJob",
        "metadata": {"name": job.name, "namespace": job.namespace, "labels": _labels(job, "train")},
        "spec": {
            "runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                           "name": TORCH_RUNTIME},
            "trainer": {"image": job.image, "command": ["torchrun", "-m", "maxout"],
                        "args": maxout_args("train", job), "numNodes": job.nodes,
                        "numProcPerNode": job.procs_per_node, "resourcesPerNode": resources(job),
                        "env": env(job)},
            "runtimePatches": [{"manager": "maxout.launch", "trainingRuntimeSpec": {"template": {"spec": {
                "replicatedJobs": [{"name": "node", "template": {"spec": {"template": {"spec": {
                    "volumes": volumes(job),
                    "containers": [{"name": "node", "volumeMounts": volume_mounts()}]}}}}}]}}}}]}}


def indexed_job(job: ClusterJob) -> list[dict]:
    """[headless Service, Indexed Job]: the training job for clusters without Kubeflow Trainer."""
    selector = {"batch.kubernetes.io/job-name": job.name}
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": job.name, "namespace": job.namespace, "labels": _labels(job, "train")},
               "spec": {"clusterIP": "None", "selector": selector, "publishNotReadyAddresses": True,
                        "ports": [{"name": "rendezvous", "port": job.rdzv_port, "targetPort": job.rdzv_port}]}}
    pods = {"metadata": {"labels": _labels(job, "train")},
            "spec": {"subdomain": job.name, "restartPolicy": "Never", "volumes": volumes(job), "containers": [{
                "name": "node", "image": job.image,
                "command": ["torchrun", *torchrun_agent_args(job), "-m", "maxout"], "args": maxout_args("train", job),
                "ports": [{"containerPort": job.rdzv_port, "name": "rendezvous"}],
                "env": env(job), "resources": resources(job), "volumeMounts": volume_mounts()}]}}
    batch = {"apiVersion": "batch/v1", "kind": "Job",
             "metadata": {"name": job.name, "namespace": job.namespace, "labels": _labels(job, "train")},
             "spec": {"completionMode": "Indexed", "completions": job.nodes, "parallelism": job.nodes,
                      "backoffLimit": 0, "template": pods}}
    return [service, batch]


def hpo_job(job: ClusterJob) -> dict:
    """N ``maxout hpo`` workers on one study: each pod one worker, one GPU's share of the job's resources; the pods
    share one parent run (hpo.parent=shared: the first creates it, the last to leave ends it)."""
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{job.name}-hpo", "namespace": job.namespace, "labels": _labels(job, "hpo")},
            "spec": {"parallelism": job.hpo_workers, "completions": job.hpo_workers, "backoffLimit": job.hpo_workers,
                     "template": {"metadata": {"labels": _labels(job, "hpo")}, "spec": {
                         "restartPolicy": "OnFailure", "volumes": volumes(job), "containers": [{
                             "name": "worker", "image": job.image, "command": ["maxout"],
                             "args": maxout_args("hpo", job, "hpo.parent=shared"), "env": env(job, hpo=True),
                             "resources": resources(job), "volumeMounts": volume_mounts()}]}}}}


def manifests(job: ClusterJob, kube_context: str = "my-cluster",
              repository_uri: str = "registry.example.com/maxout") -> dict[str, Any]:
    """File name -> content (a dict, or a list of documents for a multi-document YAML file)."""
    config, template = mlflow_backend(job, kube_context, repository_uri)
    return {"kubernetes_config.json": config, "kubernetes_job_template.yaml": template,
            "trainjob.yaml": trainjob(job), "indexed-job.yaml": indexed_job(job), "hpo-job.yaml": hpo_job(job)}


def write(job: ClusterJob, out: Path, **kwargs: str) -> list[Path]:
    """Write ``manifests`` into ``out``; returns the files."""
    import yaml  # lazy: only writing needs it

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in manifests(job, **kwargs).items():
        path = out / name
        if name.endswith(".json"):
            path.write_text(json.dumps(content, indent=2) + "\n")
        else:
            docs = content if isinstance(content, list) else [content]
            path.write_text(yaml.safe_dump_all(docs, sort_keys=False, width=120))
        written.append(path)
    return written
